"""Read-once replicated restore with real gloo ranks: bytes each rank reads, and the time (#52).

Each rank (a process started with torchrun's environment, gloo on ``lo``) saves a replicated
model of ``--mib`` MiB (8 fp32 tensors, the same on every rank) plus a 64 KiB leaf of its own
into one run, closes, and then resumes (``Checkpointer.restore()``, the agreed restore) twice:
with read-once (the default: each rank reads its share of the replicated chunks and sends it to
the others over ``exchange``) and with ``CRYOSNAP_RESTORE_READ_ONCE=0`` (every rank reads the
whole model itself). The run's store is wrapped in a counter of the bytes each rank reads; the
data files are dropped from the page cache before each restore (``POSIX_FADV_DONTNEED``), so
the reads come from the disk. Per world size and mode: the most bytes any rank read, the job's
total, and the slowest rank's restore seconds (the median of ``--repeat`` rounds). Every
restore is checked bit for bit.

Run: ``.venv/bin/python bench/bench_read_once.py --ranks 2 4 --mib 64 --repeat 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve()
MODES = ("read_once", "every_rank")


def _model(mib: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(7)
    per = (mib << 20) // 8 // 4
    return {f"w{i}": rng.standard_normal(per).astype(np.float32) for i in range(8)}


def _drop_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(args: argparse.Namespace) -> None:
    import datetime

    import numpy as np
    import torch.distributed as dist

    cryosnap = h.import_cryosnap()
    from cryosnap.storage import LocalStore, Store
    from cryosnap.storage._wrap import WrapperStore

    class Counting(WrapperStore):
        def __init__(self, inner: Store) -> None:
            super().__init__(inner)
            self.read_bytes = 0
            self._lock = threading.Lock()

        def _add(self, n: int) -> None:
            with self._lock:
                self.read_bytes += n

        def read(self, key: str) -> bytes:
            data = self.inner.read(key)
            self._add(len(data))
            return data

        def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
            self.inner.read_into(key, offset, buffers)
            self._add(sum(memoryview(b).nbytes for b in buffers))

        def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
            self.inner.read_ranges(key, ranges)
            self._add(sum(memoryview(b).nbytes for _, bufs in ranges for b in bufs))

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    root = Path(args.dir) / "run"
    model = _model(args.mib)
    own = np.full(16384, rank, dtype=np.float32)
    state = {"model": model, "own": own}
    store = Counting(LocalStore(root))
    with cryosnap.Checkpointer(store, chunk_bytes=1 << 20) as ckpt:
        ckpt.save(1, state, replicated=["model"]).result()
    out: dict[str, Any] = {"rank": rank, "rounds": []}
    for _ in range(args.repeat):
        for mode in MODES:
            os.environ["CRYOSNAP_RESTORE_READ_ONCE"] = "1" if mode == "read_once" else "0"
            if rank == 0:
                _drop_cache(root)
            dist.barrier()
            store.read_bytes = 0
            with cryosnap.Checkpointer(store, chunk_bytes=1 << 20) as ckpt:
                t0 = time.perf_counter()
                got = ckpt.restore()
                seconds = time.perf_counter() - t0
            same = all(np.array_equal(got["model"][k], v) for k, v in model.items())
            same = same and np.array_equal(got["own"], own)
            if not same:
                raise SystemExit(f"rank {rank}: {mode} restored another state")
            out["rounds"].append({"mode": mode, "read": store.read_bytes, "seconds": seconds})
    (Path(args.out) / f"rank-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    before = h.load_average()
    rows: list[list[str]] = []
    samples: dict[str, Any] = {}
    for world in args.ranks:
        with h.scratch_dir("bench-read-once-") as folder:
            command = [
                sys.executable,
                str(HERE),
                "--worker",
                "--mib",
                str(args.mib),
                "--repeat",
                str(args.repeat),
                "--dir",
                str(folder),
                "--out",
                str(folder / "out"),
            ]
            ranks = h.launch_ranks(command, folder / "out", world=world)
        samples[str(world)] = ranks
        for mode in MODES:
            reads = [[r2["read"] for r2 in r["rounds"] if r2["mode"] == mode] for r in ranks]
            per_round = list(zip(*reads, strict=True))
            most = statistics.median(max(rnd) for rnd in per_round)
            total = statistics.median(sum(rnd) for rnd in per_round)
            secs = [[r2["seconds"] for r2 in r["rounds"] if r2["mode"] == mode] for r in ranks]
            slowest = statistics.median(max(rnd) for rnd in zip(*secs, strict=True))
            rows.append(
                [str(world), mode, h.format_bytes(most), h.format_bytes(total), h.format_s(slowest)]
            )
    print(
        h.format_table(
            ["ranks", "mode", "read, most of any rank", "read, job", "restore (slowest rank)"],
            rows,
        )
    )
    h.print_load(before, h.load_average())
    h.write_json(args.json, {"environment": h.environment(), "samples": samples})


if __name__ == "__main__":
    main()
