#!/usr/bin/env bash
# GPU checks for issue #15, made to run once, unattended, on a rented GPU machine:
#
#   bash bench/gpu.sh [OUTDIR]        # default OUTDIR: ./gpu-results
#
# 1. the machine: nvidia-smi, torch / triton versions and the device name;
# 2. the GPU tests: pytest -m gpu tests/gpu (output in OUTDIR/pytest.txt, OUTDIR/pytest.xml);
# 3. bench/bench_gpu.py --out OUTDIR (figures in OUTDIR/gpu.json).
#
# Everything printed also goes to OUTDIR/gpu.log; the stages' exit codes and times are merged
# into OUTDIR/gpu.json ("stages"). Every stage runs under `timeout`; a stage that fails or
# times out is reported and the next one runs; the whole script stays under GPU_TOTAL_S seconds
# (default 285). cryosnap runs from this checkout (PYTHONPATH=src), it need not be installed.
# Exit status: 0 when every stage passed, else 1.
#
# Environment: PYTHON (default python3), GPU_TOTAL_S, GPU_BENCH_ARGS (extra arguments for
# bench_gpu.py, e.g. "--gib 4 8"; a smoke run without a GPU: GPU_BENCH_ARGS="--device cpu
# --gib 0.0625", where the tests of stage 2 skip or fail for lack of CUDA).

set -u -o pipefail

OUT=${1:-./gpu-results}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)

PY=${PYTHON:-python3}
TOTAL=${GPU_TOTAL_S:-285}
BENCH_ARGS=${GPU_BENCH_ARGS:-}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS
DEADLINE=$((START + TOTAL))
STAGES="$OUT/stages.tsv"

log() { echo "[$(date +%H:%M:%S) +$((SECONDS - START))s] $*"; }

# The timeout a stage gets: its own budget, cut to what is left of the total (5 s kept back).
stage_timeout() {
    local want=$1 left=$((DEADLINE - SECONDS - 5))
    if ((want > left)); then echo "$left"; else echo "$want"; fi
}

record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >>"$STAGES"; }

# stage NAME SECONDS CMD...: run CMD under timeout; its output also goes to $STAGE_FILE if set.
stage() {
    local name=$1 budget=$2
    shift 2
    local t
    t=$(stage_timeout "$budget")
    if ((t < 3)); then
        log "SKIP $name: no time left of the ${TOTAL} s total"
        record "$name" skipped 0 "no time left"
        return 0
    fi
    log "START $name (timeout ${t} s): $*"
    local t0=$SECONDS rc
    if [[ -n ${STAGE_FILE:-} ]]; then
        timeout -k 5 "$t" "$@" 2>&1 | tee "$STAGE_FILE"
        rc=${PIPESTATUS[0]}
    else
        timeout -k 5 "$t" "$@" 2>&1
        rc=$?
    fi
    local took=$((SECONDS - t0)) note=""
    case $rc in
        0) note="ok" ;;
        124 | 137) note="TIMED OUT after ${t} s" ;;
        127) note="command not found" ;;
        *) note="FAILED" ;;
    esac
    log "END $name: rc=$rc, ${took} s, $note"
    record "$name" "$rc" "$took" "$note"
    return 0
}

main() {
    : >"$STAGES"
    log "bench/gpu.sh: results in $OUT; checkout $ROOT; python: $(command -v "$PY")"
    log "git: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo 'no git')"

    # -- 1. the machine ----------------------------------------------------------------------
    stage nvidia-smi 5 nvidia-smi
    stage nvidia-smi-query 5 nvidia-smi --format=csv --query-gpu=name,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,clocks.max.sm,power.limit,temperature.gpu
    stage host 5 bash -c 'nproc; free -g; df -h /tmp .'
    # A cold `import torch` plus CUDA initialization can take more than 5 s.
    stage versions 20 "$PY" -c '
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count(),
          "capability", torch.cuda.get_device_capability(0), "memory GiB", round(p.total_memory / 2**30, 1))
for name in ("triton", "numpy", "xxhash", "fsspec", "safetensors", "pytest", "hypothesis", "pytest_timeout"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "NOT AVAILABLE:", type(exc).__name__, exc)
import cryosnap
print("cryosnap from", cryosnap.__file__)
'

    # -- 2. the GPU tests --------------------------------------------------------------------
    if [[ ! -d tests/gpu ]]; then
        log "SKIP pytest: tests/gpu is missing in this checkout"
        record pytest skipped 0 "tests/gpu missing"
    else
        local popts=(-p no:cacheprovider)
        # pyproject sets filterwarnings=error and timeout=300: without pytest-timeout, the
        # unknown option is a PytestConfigWarning, which that filter turns into an INTERNALERROR.
        if ! "$PY" -c 'import pytest_timeout' 2>/dev/null; then
            log "note: pytest-timeout is not installed: ignoring PytestConfigWarning (timeout=300)"
            popts+=(-W "ignore::pytest.PytestConfigWarning")
        fi
        # tests/conftest.py imports hypothesis (for its settings profile only).
        if ! "$PY" -c 'import hypothesis' 2>/dev/null; then
            log "note: hypothesis is not installed: --confcutdir=tests/gpu skips tests/conftest.py"
            popts+=(--confcutdir=tests/gpu)
        fi
        # --strict-markers: -m gpu is an error unless the marker is registered somewhere.
        local markers
        markers=$(timeout 60 "$PY" -m pytest "${popts[@]}" --markers tests/gpu 2>&1)
        if ! grep -q '^@pytest.mark.gpu' <<<"$markers"; then
            log "note: the gpu marker is not registered: adding it with -o markers=..."
            local list
            list=$("$PY" - <<'EOF'
try:
    import tomllib
    with open("pyproject.toml", "rb") as f:
        cfg = tomllib.load(f)
    marks = cfg.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("markers", [])
except Exception:
    marks = ["slow: takes more than a few seconds"]
print("\n".join([*marks, "gpu: needs a CUDA device (registered by bench/gpu.sh)"]))
EOF
            )
            popts+=(-o "markers=$list")
        fi
        STAGE_FILE="$OUT/pytest.txt" stage pytest 150 "$PY" -m pytest -m gpu -q -x \
            "${popts[@]}" -o faulthandler_timeout=120 --durations=15 \
            --junitxml="$OUT/pytest.xml" tests/gpu
    fi

    # -- 3. the benchmark --------------------------------------------------------------------
    local t
    t=$(stage_timeout 150)
    # shellcheck disable=SC2086  # GPU_BENCH_ARGS is split on purpose
    stage bench 150 "$PY" bench/bench_gpu.py --out "$OUT" --budget $((t > 40 ? t - 15 : 25)) \
        $BENCH_ARGS

    # -- the stages, into gpu.json -----------------------------------------------------------
    timeout 20 "$PY" - "$OUT" "$((SECONDS - START))" <<'EOF'
import json, sys
from pathlib import Path

out, total = Path(sys.argv[1]), int(sys.argv[2])
stages = []
for line in (out / "stages.tsv").read_text().splitlines():
    name, rc, seconds, note = (line.split("\t") + [""] * 4)[:4]
    stages.append({"name": name, "rc": rc, "seconds": int(seconds or 0), "note": note})
path = out / "gpu.json"
try:
    data = json.loads(path.read_text())
except Exception as exc:
    data = {"bench_missing": f"{type(exc).__name__}: {exc}"}
data["stages"] = stages
data["gpu_sh_seconds"] = total
pytest_out = out / "pytest.txt"
if pytest_out.exists():
    lines = [l for l in pytest_out.read_text(errors="replace").splitlines() if l.strip()]
    data["pytest_summary"] = lines[-1] if lines else ""
path.write_text(json.dumps(data, indent=2) + "\n")
print("stages:")
for s in stages:
    print(f"  {s['name']:<18} rc={s['rc']:<8} {s['seconds']:>4} s  {s['note']}")
if "pytest_summary" in data:
    print("pytest:", data["pytest_summary"])
EOF
    log "done in $((SECONDS - START)) s; files in $OUT:"
    ls -la "$OUT"
    # Every stage passed?
    ! cut -f2 "$STAGES" | grep -qv '^0$'
}

main 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
