#!/usr/bin/env bash
# torchtitan's full Trainer on one GPU with cryosnap's checkpoint manager (issue 51), made to
# run once, unattended, on a machine with a GPU:
#
#   TORCHTITAN_SRC=/path/to/torchtitan bash bench/gpu_torchtitan.sh [OUTDIR]
#
# TORCHTITAN_SRC: a checkout of pytorch/torchtitan at v0.3.0 (the debug model's tokenizer and
# the c4_test data are under its tests/assets), in an environment where torchtitan 0.3.0 is
# installed with all its dependencies (datasets, tensorboard...: `pip install torchtitan==0.3.0`
# in a venv of its own; cryosnap runs from this checkout, PYTHONPATH=src). Stages:
#
# 1. train examples/torchtitan_cryosnap.py's cryosnap_debugmodel for 20 steps (a version every
#    5), the reference; `cryosnap ls` of its run;
# 2. the same training in a new folder, SIGKILLed once step 12 is logged;
# 3. the same command again: it resumes from the newest version (10) and finishes; the loss
#    of each step after the resume is compared with stage 1's (the log lines "step: N loss: X").
#
# Everything goes to OUTDIR (default ./gpu-torchtitan): one log per stage, the runs' folders.
# Exit status: 0 when the resumed losses match the reference's, else 1.

set -u -o pipefail

OUT=${1:-./gpu-torchtitan}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC=${TORCHTITAN_SRC:?set TORCHTITAN_SRC to a torchtitan v0.3.0 checkout}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/examples:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export CRYOSNAP_STEPS=20 SRC PY

train() {  # train DUMP_FOLDER LOG
  (cd "$SRC" && timeout 900 "$PY" -m torch.distributed.run --nproc_per_node=1 \
    -m torchtitan.train --module torchtitan_cryosnap --config cryosnap_debugmodel \
    --dump_folder "$1") >"$2" 2>&1
}

losses() {  # the "step N loss X" pairs of a log, one per line (torchtitan colours its lines)
  sed -E 's/\x1b\[[0-9;]*m//g' "$1" | grep -oE 'step: *[0-9]+ +loss: *[0-9.]+' |
    sed -E 's/step: *([0-9]+) +loss: *([0-9.]+)/\1 \2/'
}

echo "stage 1: the reference"
train "$OUT/reference" "$OUT/reference.log" || { echo "stage 1 failed"; tail -30 "$OUT/reference.log"; exit 1; }
"$PY" -m cryosnap ls "$OUT/reference/cryosnap" | tee "$OUT/reference-ls.txt"

echo "stage 2: killed once step 12 is logged"
export -f train
setsid bash -c 'train "$0" "$1"' "$OUT/resumed" "$OUT/killed.log" &
PID=$!  # the leader of a process group of its own: the training and nothing else
for _ in $(seq 1 600); do
  if losses "$OUT/killed.log" 2>/dev/null | grep -q '^12 '; then break; fi
  sleep 1
done
kill -KILL -- "-$PID" 2>/dev/null; wait "$PID" 2>/dev/null
"$PY" -m cryosnap ls "$OUT/resumed/cryosnap" | tee "$OUT/killed-ls.txt"

echo "stage 3: resumed"
train "$OUT/resumed" "$OUT/resumed.log" || { echo "stage 3 failed"; tail -30 "$OUT/resumed.log"; exit 1; }
losses "$OUT/reference.log" | sort -k1,1 >"$OUT/reference-losses.txt"
losses "$OUT/resumed.log" | sort -k1,1 >"$OUT/resumed-losses.txt"
if [ -s "$OUT/resumed-losses.txt" ] && join "$OUT/resumed-losses.txt" "$OUT/reference-losses.txt" | awk '$2 != $3 {bad=1} END {exit bad}'; then
  echo "PASS: the resumed run's losses match the reference's"
  exit 0
fi
echo "FAIL: the resumed run's losses differ from the reference's"
join "$OUT/resumed-losses.txt" "$OUT/reference-losses.txt"
exit 1
