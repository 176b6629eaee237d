"""The cost of per-leaf statistics (issue 56, part 3) on the time to durable of a dense state:
``--size-mib`` (512) of float32 leaves of 16 MiB, saved by a fresh ``Checkpointer`` with
``stats=True`` and with ``stats=False``, interleaved round by round (``--rounds``, 7; the first
untimed), each ``save(...).result()`` timed; medians and their ratio printed. Checked: the cost
is at most 5% (else ``stats=False`` is the way out: docs/PERFORMANCE.md). PASS / FAIL never
fails the script. Run::

    .venv/bin/python bench/bench_stats.py                 # ~1 min on a quiet machine
    .venv/bin/python bench/bench_stats.py --dir /scratch  # where the runs are written
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np

import cryosnap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where the runs are written (default: temp)")
    args = ap.parse_args()
    leaf = 16 << 20
    rng = np.random.default_rng(0)
    state = {
        f"layer{i}": rng.standard_normal(leaf // 4, dtype=np.float32)
        for i in range((args.size_mib << 20) // leaf)
    }
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for stats in (True, False):
            d = tempfile.mkdtemp(dir=args.dir)
            try:
                with cryosnap.Checkpointer(d, stats=stats) as ck:
                    t0 = time.perf_counter()
                    ck.save(1, state).result()
                    seconds = time.perf_counter() - t0
            finally:
                shutil.rmtree(d)
            if r:
                times[stats].append(seconds)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    cost = on / off - 1
    print(f"dense {args.size_mib} MiB, time to durable, median of {args.rounds - 1} rounds:")
    print(f"  stats=True  {on:.3f} s   {[round(t, 3) for t in times[True]]}")
    print(f"  stats=False {off:.3f} s   {[round(t, 3) for t in times[False]]}")
    print(f"  cost {100 * cost:+.1f}%  {'PASS' if cost <= 0.05 else 'FAIL'} (<= 5%)")


if __name__ == "__main__":
    main()
