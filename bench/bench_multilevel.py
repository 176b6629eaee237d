"""Per-level frequency with real saves: a MultiLevel policy fed by the Checkpointer's measured
costs, against flushing every version to the persistent level.

A training loop (``--step-ms`` of compute per step, emulated by sleeping) changes a dense
``--mib`` MiB state every step and saves when its policy says so, on a scratch level (tmpfs when
/dev/shm exists) and a persistent level throttled to ``--persistent-mbps`` MB/s (a shared
parallel file system or object store, as seen by one node). Two runs, the same loop:

* ``multilevel``: ``policy.MultiLevel(failures)``: costs measured as the run goes, the plan
  (cryosnap.plan) decides the save interval and which versions go to persistent;
* ``every-version``: the same interval (the one the plan chose), every version to persistent.

The failure model is scaled to the run's length (``--crash-mtbf``: process crashes, scratch
survives; ``--outage-mtbf``: outages only persistent survives). Prints the versions each level
received, the bytes written to persistent, the measured costs, and the expected waste of each
schedule under those costs (first-order model, docs/PLANNING.md).

    .venv/bin/python bench/bench_multilevel.py
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _harness import (
    format_bytes,
    format_table,
    import_cryosnap,
    load_average,
    print_load,
    scratch_dir,
)

cs = import_cryosnap()

import numpy as np  # noqa: E402

from cryosnap.plan import FailureClass, LevelCost, Schedule, first_order_waste  # noqa: E402
from cryosnap.policy import EveryNSeconds, MultiLevel  # noqa: E402
from cryosnap.storage import LocalStore, WrapperStore  # noqa: E402
from cryosnap.storage.base import BlobWriter, BytesLike  # noqa: E402
from cryosnap.testing import FaultyStore  # noqa: E402


class CountingStore(WrapperStore):
    """Counts the bytes written through it (data files and small files)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def write(self, key: str, data: BytesLike) -> None:
        self.add(memoryview(data).nbytes)
        super().write(key, data)

    def open_writer(self, key: str) -> BlobWriter:
        return _CountingWriter(self, super().open_writer(key))


class _CountingWriter:
    def __init__(self, store: CountingStore, inner: BlobWriter) -> None:
        self.key = inner.key
        self._store = store
        self._inner = inner

    def write(self, buffers: Sequence[BytesLike]) -> None:
        self._store.add(sum(memoryview(b).nbytes for b in buffers))
        self._inner.write(buffers)

    def tell(self) -> int:
        return self._inner.tell()

    def commit(self) -> None:
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


def run(name: str, policy: Any, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    throttled = FaultyStore(
        LocalStore(root / name / "p"), bytes_per_second=args.persistent_mbps * 1e6
    )
    persistent = CountingStore(throttled)
    state = {"w": np.random.default_rng(0).standard_normal(args.mib << 18, np.float32)}
    saved = 0
    t_end = time.monotonic() + args.seconds
    with cs.Checkpointer(
        persistent, scratch=root / name / "s", keep=2, keep_scratch=2, policy=policy
    ) as ckpt:
        step = 0
        while time.monotonic() < t_end:
            time.sleep(args.step_ms / 1e3)
            state["w"] += 1e-3  # every byte changes: training updates every weight
            if ckpt.should_save(step):
                ckpt.save(step, state)
                saved += 1
            step += 1
        ckpt.wait()
        on_persistent = sum(
            1 for op, key in throttled.ops if op == "write" and key.endswith("COMMIT.json")
        )
    return {
        "name": name,
        "steps": step,
        "saved": saved,
        "persistent_versions": on_persistent,
        "persistent_bytes": persistent.bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=32, help="state size in MiB (default 32)")
    parser.add_argument("--seconds", type=float, default=40.0, help="run length of each loop")
    parser.add_argument("--step-ms", type=float, default=20.0, help="compute per step, ms")
    parser.add_argument("--persistent-mbps", type=float, default=100.0, help="MB/s (default 100)")
    parser.add_argument("--crash-mtbf", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--outage-mtbf", type=float, default=900.0, help="seconds (default 900)")
    args = parser.parse_args()
    load_before = load_average()
    failures = [
        FailureClass("crash", args.crash_mtbf, "scratch"),
        FailureClass("outage", args.outage_mtbf, "persistent"),
    ]
    shm = Path("/dev/shm")
    with scratch_dir("cryosnap-ml-", shm if shm.is_dir() else None) as base:
        policy = MultiLevel(failures, replan_every=5)
        multi = run("multilevel", policy, args, base)
        plan = policy.plan
        if plan is None:
            print("the plan never formed: run longer (--seconds)", file=sys.stderr)
            return 1
        interval = float(plan.base_interval_seconds)  # type: ignore[attr-defined]
        every = run("every-version", EveryNSeconds(interval), args, base)
    print_load(load_before)
    costs = {n: policy.cost_seconds(n) or 0.0 for n in policy.levels}
    levels = [LevelCost(n, c, c) for n, c in costs.items()]
    k = plan.levels[1].every_versions  # type: ignore[attr-defined]
    waste_plan = first_order_waste(levels, failures, Schedule(interval, (1, k)))
    waste_every = first_order_waste(levels, failures, Schedule(interval, (1, 1)))
    print(
        f"state {args.mib} MiB, dense updates, {args.step_ms:g} ms/step, persistent "
        f"{args.persistent_mbps:g} MB/s; failures: crash MTBF {args.crash_mtbf:g} s (scratch "
        f"survives), outage MTBF {args.outage_mtbf:g} s (persistent survives)"
    )
    print(
        "measured costs: "
        + ", ".join(f"{n} {c:.3f} s" for n, c in costs.items())
        + f"; plan: a version every {interval:.2f} s, persistent every {k}"
    )
    rows = [
        [
            r["name"],
            str(r["saved"]),
            str(r["persistent_versions"]),
            format_bytes(r["persistent_bytes"]),
            f"{w:.2%}",
        ]
        for r, w in ((multi, waste_plan), (every, waste_every))
    ]
    print(
        format_table(
            ["schedule", "versions", "to persistent", "bytes to persistent", "expected waste"],
            rows,
        )
    )
    ratio = every["persistent_bytes"] / max(multi["persistent_bytes"], 1)
    print(
        f"persistent bytes: every-version / multilevel = {ratio:.2f}x; expected waste "
        f"multilevel {waste_plan:.2%} vs every-version {waste_every:.2%} at the same interval "
        f"(plan's own estimate of every-version at its best interval: "
        f"{plan.every_version_waste:.2%})"  # type: ignore[attr-defined]
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
