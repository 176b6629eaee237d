"""Where an eager Checkpointer version's time to durable goes: the stall (the capture's copy),
when the data file's first write starts, how long the writes take, and the time to durable,
medians over ``--versions`` versions after an untimed one (286 MiB of fp32 in 16 tensors by
default, or ``--workload many-small``'s 20,000; every byte changed, ``incremental=False``,
keep=1). The writes are timed around the appender's calls (``engine/write/_appender.py``)
on its I/O thread.

Run it per tree, alternating (the disk moves from one minute to the next):
``PYTHONPATH=<tree>/src:bench python bench/bench_eager_timeline.py`` (docs/PERFORMANCE.md,
"Where an eager version's time to durable goes"). Writes under ``$CRYOSNAP_BENCH_DIR``
(default: the system temp dir), which should take direct I/O.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import cryosnap
import cryosnap.engine.write._appender as appender
from cryosnap.bench._workloads import build_state, dense_shapes, many_small_shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=300_000_000, help="bytes (default 300 MB)")
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument(
        "--workload",
        choices=["dense", "many-small"],
        default="dense",
        help="the state of `cryosnap bench --workload` (many-small: 20,000 tensors)",
    )
    args = parser.parse_args()
    writes: list[tuple[float, float]] = []
    write = appender.Appender._write

    def timed(self: appender.Appender, task: Any) -> None:
        t0 = time.perf_counter()
        try:
            write(self, task)
        finally:
            writes.append((t0, time.perf_counter()))

    appender.Appender._write = timed  # type: ignore[method-assign]
    small = args.workload == "many-small"
    state = build_state(many_small_shapes(args.size, 20_000) if small else dense_shapes(args.size))
    root = tempfile.mkdtemp(prefix="eager-timeline-", dir=os.environ.get("CRYOSNAP_BENCH_DIR"))
    figures: dict[str, list[float]] = {
        "stall": [],
        "first write": [],
        "writing": [],
        "last write to durable": [],
        "durable": [],
    }
    try:
        with cryosnap.Checkpointer(
            os.path.join(root, "run"), incremental=False, keep=1, chunk_bytes=1 << 20
        ) as ckpt:
            ckpt.save(0, state).result()  # the staging pool, untimed
            for step in range(1, args.versions + 1):
                for t in state.values():
                    t.add_(1)
                time.sleep(0.3)  # the previous version's retirement done
                writes.clear()
                t0 = time.perf_counter()
                pending = ckpt.save(step, state)
                t1 = time.perf_counter()
                pending.result()
                t2 = time.perf_counter()
                figures["stall"].append(t1 - t0)
                figures["first write"].append(writes[0][0] - t0)
                figures["writing"].append(writes[-1][1] - writes[0][0])
                figures["last write to durable"].append(t2 - writes[-1][1])
                figures["durable"].append(t2 - t0)
    finally:
        appender.Appender._write = write  # type: ignore[method-assign]
        shutil.rmtree(root, ignore_errors=True)
    line = ", ".join(f"{k} {1e3 * statistics.median(v):.1f} ms" for k, v in figures.items())
    print(f"eager, {args.workload}, medians of {args.versions} versions: {line}")


if __name__ == "__main__":
    main()
