"""A state of many small numpy arrays (an HPC code's fields, a dict of arrays): an eager
Checkpointer's stall and time to durable, `restore(into=)` and a fresh restore, the data
files in the page cache; wall seconds, medians of ``--rounds`` versions after an untimed one
(``incremental=False``, keep=1, every byte changed); then the CPU time of the calling thread
in ``save()`` and in ``restore(into=)``, minimums (what a busy machine moves least).

Run it per tree, alternating: ``PYTHONPATH=<tree>/src python bench/bench_small_arrays.py``
(docs/PERFORMANCE.md, "Many small tensors: the copies of packs made by the kernel").
Writes under ``$CRYOSNAP_BENCH_DIR`` (default: the system temp dir).
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

import numpy as np

import cryosnap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arrays", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    # float32 arrays of 256 B, 16 KiB and 32 KiB: ~330 MB for 20,000
    sizes = rng.choice([64, 4096, 8192], args.arrays)
    state = {
        f"field{i}": rng.standard_normal(int(n)).astype(np.float32) for i, n in enumerate(sizes)
    }
    into = {k: np.empty_like(v) for k, v in state.items()}
    total = sum(v.nbytes for v in state.values())
    figures: dict[str, list[float]] = {"stall": [], "durable": [], "into": [], "fresh": []}
    cpu: dict[str, list[float]] = {"save() CPU": [], "restore(into=) CPU": []}
    root = tempfile.mkdtemp(prefix="bench-arrays-", dir=os.environ.get("CRYOSNAP_BENCH_DIR"))
    try:
        with cryosnap.Checkpointer(os.path.join(root, "run"), incremental=False, keep=1) as ckpt:
            ckpt.save(0, state).result()  # the staging pool, untimed
            for step in range(1, args.rounds + 1):
                for v in state.values():
                    v += 1
                t0, c0 = time.perf_counter(), time.thread_time()
                pending = ckpt.save(step, state)
                figures["stall"].append(time.perf_counter() - t0)
                cpu["save() CPU"].append(time.thread_time() - c0)
                pending.result()
                figures["durable"].append(time.perf_counter() - t0)
                for path in Path(root).rglob("*.dat"):  # the restore's work, not the disk's
                    with contextlib.suppress(FileNotFoundError):
                        path.read_bytes()
                t0, c0 = time.perf_counter(), time.thread_time()
                ckpt.restore(into=into)
                figures["into"].append(time.perf_counter() - t0)
                cpu["restore(into=) CPU"].append(time.thread_time() - c0)
                t0 = time.perf_counter()
                fresh = ckpt.restore()
                figures["fresh"].append(time.perf_counter() - t0)
                del fresh
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if any(not np.array_equal(into[k], state[k]) for k in state):
        raise SystemExit("restore(into=) did not restore the state")
    line = ", ".join(f"{k} {1e3 * statistics.median(v):.1f} ms" for k, v in figures.items())
    line += "; " + ", ".join(f"{k} {1e3 * min(v):.1f} ms" for k, v in cpu.items())
    print(f"{len(state):,} arrays, {total / 1e6:.0f} MB: {line} (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
