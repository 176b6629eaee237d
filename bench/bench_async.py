"""Peak memory of asynchronous saves with ``staging_bytes`` smaller than the state.

The stall and training-loop parts of this script moved into the package: ``cryosnap bench
--workload dense`` (stall of cryosnap eager and lazy against memcpy, DCP ``async_save`` and the
others, in one run) and ``cryosnap bench --workload training`` (checkpoint overhead in a CPU
training loop). What stays here is the one check that needs a fresh process: with
``Checkpointer(staging_bytes=S)``, the peak extra memory over four saves (eager, lazy, eager,
lazy) of a state larger than S stays within S + 10%.

A child process builds the state (16 fp32 tensors of 4096 x 4096 = 1 GiB, rows scaled by
``--size-scale``) and measures VmHWM (reset through /proc/self/clear_refs after the state is
built) and VmRSS sampled every 5 ms by a thread. The check is printed as PASS / FAIL, never
asserted.

Run: ``.venv/bin/python bench/bench_async.py`` (about a minute; ``--quick``: 256 MiB, 64 MiB of
staging).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import _harness as h

StateDict = dict[str, torch.Tensor]

_SEED = 20240611
_MIB = 1 << 20


def build_state(size_scale: float, tensors: int = 16) -> StateDict:
    """16 fp32 tensors of 4096 x 4096 (64 MiB each), rows scaled by ``size_scale``."""
    gen = torch.Generator().manual_seed(_SEED)
    rows = max(1, round(4096 * size_scale))
    return {f"blocks.{i}.weight": torch.randn(rows, 4096, generator=gen) for i in range(tensors)}


def state_bytes(state: StateDict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def nudge(state: StateDict) -> None:
    """Change one element of every tensor so that each version differs from the last."""
    for t in state.values():
        t.view(-1)[0] += 1.0


def _rss_sampler(stop: threading.Event, out: list[int]) -> None:
    peak = 0
    while not stop.is_set():
        peak = max(peak, h.current_rss_bytes())
        stop.wait(0.005)
    out.append(max(peak, h.current_rss_bytes()))


def child_peak_memory(directory: Path, size_scale: float, staging_bytes: int, saves: int) -> None:
    """In a fresh process: peak RSS over ``saves`` saves (eager, lazy, ...) of the state."""
    cryosnap = h.import_cryosnap()
    state = build_state(size_scale)
    gc.collect()
    before = h.current_rss_bytes()
    reset = h.reset_peak_rss()
    stop = threading.Event()
    sampled: list[int] = []
    sampler = threading.Thread(target=_rss_sampler, args=(stop, sampled), daemon=True)
    sampler.start()
    stalls = []
    with cryosnap.Checkpointer(
        directory, staging_bytes=staging_bytes, incremental=False, keep=1
    ) as ckpt:
        for i in range(saves):
            nudge(state)
            t0 = time.perf_counter()
            pending = ckpt.save(i + 1, state, lazy=bool(i % 2))
            stalls.append(time.perf_counter() - t0)
            pending.result()
    stop.set()
    sampler.join()
    result = {
        "rss_before_bytes": before,
        "peak_rss_bytes": h.peak_rss_bytes(),
        "sampled_peak_rss_bytes": sampled[0],
        "hwm_reset": reset,
        "state_bytes": state_bytes(state),
        "staging_bytes": staging_bytes,
        "saves": saves,
        "stalls": stalls,
    }
    print(json.dumps(result))


def measure_memory(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    staging = args.staging_mib * _MIB
    print(
        f"== peak memory of saves with staging_bytes={h.format_bytes(staging)} "
        "(fresh child process) ==",
        flush=True,
    )
    directory = root / "memory"
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child-peak-memory",
        str(directory),
        "--size-scale",
        str(args.size_scale),
        "--staging-mib",
        str(args.staging_mib),
    ]
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        check = h.Check("peak extra memory", False, "child timed out after 600 s")
        print(check.line())
        return {"checks": [check.line()]}
    finally:
        h.rmtree(directory)
        os.sync()
    if completed.returncode != 0:
        print(completed.stderr)
        check = h.Check("peak extra memory", False, f"child exited {completed.returncode}")
        print(check.line())
        return {"checks": [check.line()]}
    fields: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    hwm_delta = fields["peak_rss_bytes"] - fields["rss_before_bytes"]
    sampled_delta = fields["sampled_peak_rss_bytes"] - fields["rss_before_bytes"]
    stalls = ", ".join(f"{s * 1e3:.1f} ms" for s in fields["stalls"])
    print(
        f"state {h.format_bytes(fields['state_bytes'])}, {fields['saves']} saves (eager, lazy, "
        f"...; incremental=False), stall of each: {stalls}"
    )
    print(
        f"RSS before {h.format_bytes(fields['rss_before_bytes'])}; peak extra: "
        f"{h.format_bytes(hwm_delta)} (VmHWM{'' if fields['hwm_reset'] else ', NOT reset'}), "
        f"{h.format_bytes(sampled_delta)} (VmRSS sampled every 5 ms)"
    )
    limit = 1.1 * staging
    peak = max(hwm_delta, sampled_delta) if fields["hwm_reset"] else sampled_delta
    check = h.Check(
        "peak extra memory <= staging_bytes + 10%",
        peak <= limit,
        f"{h.format_bytes(peak)} vs limit {h.format_bytes(limit)} "
        f"(staging_bytes {h.format_bytes(staging)})",
    )
    print(check.line())
    return {**fields, "checks": [check.line()]}


def _scale(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--size-scale must be in (0, 1], got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Peak memory of cryosnap saves with staging_bytes below the state size "
        "(stall and training overhead: `cryosnap bench`).",
    )
    parser.add_argument("--quick", action="store_true", help="256 MiB state, 64 MiB staging")
    parser.add_argument(
        "--size-scale", type=_scale, default=None, help="shrink the 1 GiB state (default 1)"
    )
    parser.add_argument(
        "--staging-mib", type=int, default=None, help="staging_bytes in MiB (default 256)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    parser.add_argument("--child-peak-memory", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size_scale is None:
        args.size_scale = 0.25 if args.quick else 1.0
    if args.staging_mib is None:
        args.staging_mib = 64 if args.quick else 256
    if args.staging_mib < 1:
        parser.error("--staging-mib must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_peak_memory is not None:
        child_peak_memory(args.child_peak_memory, args.size_scale, args.staging_mib * _MIB, saves=4)
        return 0
    env = h.environment()
    print(f"environment: {json.dumps(env)}")
    with h.scratch_dir("cryosnap-bench-async-", args.dir) as root:
        report = measure_memory(root, args)
    h.print_load(env["load_average"])
    h.write_json(args.json, {"environment": env, "memory": report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
