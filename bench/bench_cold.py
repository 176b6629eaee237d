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

Medians of ``--rounds`` after a warm-up round; ratios against the raw direct read (fresh) and
the raw direct read + copy (``into=``); the load average before and after.
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

    def read(self, copy: bool) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            at = 0
            while at < len(self.view):
                n = os.preadv(fd, [self.view[at : at + (64 << 20)]], at)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--writer", choices=["checkpointer", "save"], default="checkpointer")
    ap.add_argument("--tensors", type=int, default=0)
    args = ap.parse_args()
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

        cases: dict[str, tuple[Callable[[], object], bool]] = {
            "raw O_DIRECT read": (lambda: raw.read(False), True),
            "raw O_DIRECT read + copy": (lambda: raw.read(True), True),
            "fresh, cold (direct)": (fresh, True),
            "into=, cold (now: mapped)": (filled, True),
            "into=, cold (staged)": (_staged(filled), True),
            "into=, cold (direct, twice)": (_staged(filled, 0.0), True),
            "fresh, cold (mapped, before)": (_mapped(fresh), True),
            "into=, cold (all mapped)": (_mapped(filled), True),
            "fresh, warm": (fresh, False),
            "into=, warm": (filled, False),
        }
        seconds: dict[str, list[float]] = {k: [] for k in cases}
        names = list(cases)
        for r in range(args.rounds + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                fn, cold = cases[name]
                _drop(run) if cold else _warm(run)
                t0 = time.perf_counter()
                out = fn()
                dt = time.perf_counter() - t0
                del out
                if r:
                    seconds[name].append(dt)
        loaded = cryosnap.load(run)
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        med = {k: statistics.median(v) for k, v in seconds.items()}
        print(
            f"{args.mib} MiB in {len(state)} tensors, written by {args.writer}; medians of "
            f"{args.rounds}; "
            f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        for name, v in seconds.items():
            ref = med["raw O_DIRECT read + copy" if "into" in name else "raw O_DIRECT read"]
            samples = " ".join(f"{x:.3f}" for x in v)
            print(f"{name:32s} {med[name]:.3f} s  x{med[name] / ref:.2f}   ({samples})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
