"""Paired A/B of two operations: a one-shot save of 20,000 small tensors and a lazy save of
16 x 16 MiB into a Checkpointer (incremental=False, keep=1), 3 rounds, wall and CPU seconds.

Run it once per tree, alternating: ``PYTHONPATH=<tree>/src python bench/ab_oneshot_lazy.py NAME``
(docs/PERFORMANCE.md, "At e3d108c"). Writes under ``$CRYOSNAP_BENCH_DIR`` (default: /tmp).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import torch

import cryosnap


def main(name: str) -> None:
    torch.manual_seed(0)
    small = {f"t{i}": torch.randn(1250) for i in range(20000)}  # 100 MB in 20,000 tensors
    dense = {f"d{i}": torch.randn(4 << 20) for i in range(16)}  # 256 MiB in 16
    root = os.path.join(os.environ.get("CRYOSNAP_BENCH_DIR", "/tmp"), f"ab-{name}")
    rounds = []
    for _ in range(3):
        shutil.rmtree(root, ignore_errors=True)
        t0, c0 = time.perf_counter(), time.process_time()
        cryosnap.save(os.path.join(root, "small"), small, step=0)
        t1, c1 = time.perf_counter(), time.process_time()
        with cryosnap.Checkpointer(os.path.join(root, "lazy"), incremental=False, keep=1) as ck:
            ck.save(0, dense).result()  # allocates the staging pool, untimed
            t2, c2 = time.perf_counter(), time.process_time()
            ck.save(1, dense, lazy=True).result()
            t3, c3 = time.perf_counter(), time.process_time()
        rounds.append(
            f"one-shot small {t1 - t0:.3f} s (CPU {c1 - c0:.3f}); "
            f"lazy dense {t3 - t2:.3f} s (CPU {c3 - c2:.3f})"
        )
    shutil.rmtree(root, ignore_errors=True)
    print(name + ": " + " | ".join(rounds))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tree")
