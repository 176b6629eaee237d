"""CPU seconds of an eager Checkpointer save (the save() call's thread; the process until
durable), of restore(into=) (the calling thread; the process) and of a fresh restore (the
process), for `cryosnap bench`'s
many-small or dense state: figures a shared machine's load moves less than wall times.

Run it per tree and workload, alternating: ``PYTHONPATH=<tree>/src python bench/bench_small.py
many-small`` (docs/PERFORMANCE.md, "Many small tensors at dense speed"); restores from the
page cache (the data files read once first). Writes under
``$CRYOSNAP_BENCH_DIR`` (default: the system temp dir).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import cryosnap
from cryosnap.bench._workloads import build_state, dense_shapes, many_small_shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", choices=["many-small", "dense"])
    parser.add_argument("--size", type=int, default=300_000_000, help="bytes (default 300 MB)")
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    small = args.workload == "many-small"
    shapes = many_small_shapes(args.size, args.tensors) if small else dense_shapes(args.size)
    state = build_state(shapes)
    into = {k: torch.empty_like(v) for k, v in state.items()}
    root = tempfile.mkdtemp(prefix="bench-small-", dir=os.environ.get("CRYOSNAP_BENCH_DIR"))
    figures: dict[str, list[float]] = {"save call": [], "save to durable": [], "into": []}
    figures["into (process)"] = []
    figures["fresh (process)"] = []
    try:
        with cryosnap.Checkpointer(
            os.path.join(root, "run"), incremental=False, keep=1, chunk_bytes=1 << 20
        ) as ckpt:
            ckpt.save(0, state).result()  # the staging pool, untimed
            ckpt.restore(into=into)
            for step in range(1, args.rounds + 1):
                t0, p0 = time.thread_time(), time.process_time()
                pending = ckpt.save(step, state)
                figures["save call"].append(time.thread_time() - t0)
                pending.result()
                figures["save to durable"].append(time.process_time() - p0)
                # Every data file in the page cache (the direct writes and a cold restore's
                # direct reads leave it cold): the restore's own work, not the disk's.
                for path in Path(root).rglob("*.dat"):
                    with contextlib.suppress(FileNotFoundError):  # retired meanwhile (keep=1)
                        path.read_bytes()
                t0, p0 = time.thread_time(), time.process_time()
                ckpt.restore(into=into)
                figures["into"].append(time.thread_time() - t0)
                figures["into (process)"].append(time.process_time() - p0)
                p0 = time.process_time()
                fresh = ckpt.restore()
                figures["fresh (process)"].append(time.process_time() - p0)
                del fresh
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if any(not torch.equal(into[k], state[k]) for k in state):
        raise SystemExit("restore(into=) did not restore the state")
    medians = ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in figures.items())
    load = os.getloadavg()[0]
    print(f"{args.workload}: CPU seconds, medians of {args.rounds}: {medians} (load {load:.1f})")


if __name__ == "__main__":
    main()
