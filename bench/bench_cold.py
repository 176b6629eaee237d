"""Cold restores against the disk's own limit (issue #28 item 3): one version of 512 MiB of
float32 in 8 tensors (``--mib``; ``--tensors N``: ``cryosnap bench``'s many-small state of N
tensors instead), saved by a Checkpointer (``--writer checkpointer``, the
staging slabs' layout) or the one-shot ``cryosnap.save`` (``--writer save``, the tensors'),
then read round-robin, each cold read after the run's files were fsynced and dropped from the
page cache (``POSIX_FADV_DONTNEED``, checked with ``mincore``):

- the raw ``O_DIRECT`` read of the data file into a reused page-aligned buffer, alone and with
  the copy into the tensors (``cryosnap bench``'s direct-read limit);
- ``cryosnap.load`` fresh and ``into=``: cold (fresh: direct reads; ``into=``: its leaves
  through the mapping, as now, staged with direct reads, and without staging memory: read
  twice), cold through the mapped path (every file counted as warm, as before #28 item 3),
  and warm (the file read once first).

``--cases`` picks some of them (and the parts of a fresh cold restore's time: the raw read
into fresh memory, mapping fresh memory in, hashing). Medians of ``--rounds`` after a warm-up
round, wall and CPU seconds; ratios against the raw direct read (fresh) and the raw direct
read + copy (``into=``); the load average before and after.
Usage: ``python bench/bench_cold.py [--dir D] [--mib 512] [--rounds 5] [--writer save]
[--tensors 20000]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import cryosnap
from cryosnap import _native
from cryosnap.bench._probes import drop_file_cache
from cryosnap.bench._workloads import build_state, many_small_shapes
from cryosnap.engine.read import _cold


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _drop(root: Path) -> None:
    share = drop_file_cache(root)
    if share is not None and share > 0.05:
        raise SystemExit(f"{share:.0%} of the pages stayed in the page cache: not cold")


def _warm(root: Path) -> None:
    for path in _files(root):
        path.read_bytes()


class _Raw:
    """The raw O_DIRECT read of the data file, in 64 MiB reads, into a reused aligned buffer."""

    def __init__(self, path: Path, into: dict[str, torch.Tensor]) -> None:
        self.path, self.into = path, into
        size = path.stat().st_size
        self.buffer = mmap.mmap(-1, -(-size // 4096) * 4096)
        self.view = memoryview(self.buffer)
        self.view[:] = bytes(len(self.view))  # its pages faulted in, as the limit's are

    def read(self, copy: bool, fresh: bool = False) -> None:
        """The read (``copy``: then the copy into the tensors; ``fresh``: into fresh memory,
        not mapped in yet, in 8 MiB reads, as a restore's fresh leaves are)."""
        view = memoryview(mmap.mmap(-1, len(self.view))) if fresh else self.view
        step = (8 if fresh else 64) << 20
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            at = 0
            while at < len(view):
                n = os.preadv(fd, [view[at : at + step]], at)
                if not n:
                    break
                at += n
        finally:
            os.close(fd)
        if copy:  # the tensors were laid out back to back by the writer: copy as raw does
            at = 0
            for t in self.into.values():
                b = memoryview(t.numpy()).cast("B")
                b[:] = self.view[at : at + b.nbytes]
                at += b.nbytes


def _mapped(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        saved = _cold.COLD_SHARE
        _cold.COLD_SHARE = 0.0  # every file counts as warm: the mapped path of before
        try:
            return fn()
        finally:
            _cold.COLD_SHARE = saved

    return run


def _staged(fn: Callable[[], object], share: float | None = None) -> Callable[[], object]:
    def run() -> object:
        saved = _cold.MAP_COLD_INTO, _cold.STAGING_SHARE
        _cold.MAP_COLD_INTO = False  # into='s leaves in cold files staged, not mapped
        if share is not None:
            _cold.STAGING_SHARE = share  # 0: no staging memory, read twice with direct I/O
        try:
            return fn()
        finally:
            _cold.MAP_COLD_INTO, _cold.STAGING_SHARE = saved

    return run


# The cases, by the name --cases takes.
_CASES = {
    "raw": "raw O_DIRECT read",
    "raw+copy": "raw O_DIRECT read + copy",
    "raw-fresh": "raw O_DIRECT read, fresh memory",
    "populate": "map in fresh memory (populate)",
    "hash": "XXH3 of the bytes, one thread",
    "fresh": "fresh, cold (direct)",
    "into": "into=, cold (now: mapped)",
    "into-staged": "into=, cold (staged)",
    "into-twice": "into=, cold (direct, twice)",
    "fresh-mapped": "fresh, cold (mapped, before)",
    "into-mapped": "into=, cold (all mapped)",
    "fresh-warm": "fresh, warm",
    "into-warm": "into=, warm",
}
_DEFAULT = [k for k in _CASES if k not in ("raw-fresh", "populate", "hash")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--writer", choices=["checkpointer", "save"], default="checkpointer")
    ap.add_argument("--tensors", type=int, default=0)
    ap.add_argument(
        "--cases",
        default=",".join(_DEFAULT),
        help=f"comma-separated, of {','.join(_CASES)} (default: {','.join(_DEFAULT)})",
    )
    args = ap.parse_args()
    wanted = args.cases.split(",")
    if not wanted or not set(wanted) <= set(_CASES):
        raise SystemExit(f"--cases: of {','.join(_CASES)}")
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-cold-", dir=args.dir))
    try:
        if args.tensors:
            state = build_state(many_small_shapes(args.mib << 20, args.tensors))
        else:
            state = {f"layer{i}": torch.randn((args.mib << 20) // 32) for i in range(8)}
        run = tmp / "run"
        if args.writer == "save":
            cryosnap.save(run, state, step=1)
        else:
            with cryosnap.Checkpointer(run) as ckpt:
                ckpt.save(1, state).result()
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        (data,) = [p for p in _files(run) if p.parent.name == "data"]
        raw = _Raw(data, into)

        def fresh() -> object:
            return cryosnap.load(run)

        def filled() -> object:
            return cryosnap.load(run, into=into)

        def populate() -> None:  # what mapping in fresh memory for the leaves costs
            view = memoryview(mmap.mmap(-1, len(raw.view)))
            _native.populate(_native.address_of(view), len(view))

        every: dict[str, tuple[Callable[[], object], bool | None]] = {
            "raw": (lambda: raw.read(False), True),
            "raw+copy": (lambda: raw.read(True), True),
            "raw-fresh": (lambda: raw.read(False, fresh=True), True),
            "populate": (populate, None),
            "hash": (lambda: _native.hash_chunks(raw.view, 1 << 20, 0), None),
            "fresh": (fresh, True),
            "into": (filled, True),
            "into-staged": (_staged(filled), True),
            "into-twice": (_staged(filled, 0.0), True),
            "fresh-mapped": (_mapped(fresh), True),
            "into-mapped": (_mapped(filled), True),
            "fresh-warm": (fresh, False),
            "into-warm": (filled, False),
        }
        cases = {_CASES[k]: every[k] for k in wanted}
        seconds: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        names = list(cases)
        for r in range(args.rounds + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                fn, cold = cases[name]
                if cold is not None:
                    _drop(run) if cold else _warm(run)
                t0, c0 = time.perf_counter(), time.process_time()
                out = fn()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                del out
                if r:
                    seconds[name].append(dt)
                    cpu[name].append(dc)
        loaded = cryosnap.load(run)
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        med = {k: statistics.median(v) for k, v in seconds.items()}
        print(
            f"{args.mib} MiB in {len(state)} tensors, written by {args.writer}; medians of "
            f"{args.rounds}; "
            f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        for name, v in seconds.items():
            ref = med.get(_CASES["raw+copy" if "into" in name else "raw"])
            ratio = f"x{med[name] / ref:.2f}" if ref else "     "
            samples = " ".join(f"{x:.3f}" for x in v)
            print(
                f"{name:36s} {med[name]:.3f} s  {ratio}  CPU {statistics.median(cpu[name]):.3f} s"
                f"   ({samples})"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
