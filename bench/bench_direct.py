"""Direct I/O against the page cache: the durable time of a version in steady state, as
training saves (issue #28's table), and how much of each checkpoint stays in the page cache.

512 MiB of float32 in 8 tensors (``--mib``), every byte changed between versions, 2 versions
kept and older ones deleted; one warm-up version, then medians of ``--versions`` versions per
writer, the writers round-robin so the shared disk's drift spreads over all of them:

- raw ``O_DIRECT`` write+fsync of the same bytes from a page-aligned copy (the disk's limit);
- raw buffered write+fsync; ``torch.save`` + fsync;
- ``Checkpointer(keep=2, incremental=False, direct_io=True / False).save(step, s).result()``;
- one-shot ``cryosnap.save`` into a fresh run, direct (from the caller's tensors: the first
  page of each through the bounce buffer), direct from numpy copies of them (16-byte-aligned
  memory: every byte through the bounce buffer) and buffered.

After each writer's last version the fraction of its files' pages in the page cache
(``mincore``). Usage: ``python bench/bench_direct.py [--dir D] [--mib 512] [--versions 3]``.
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
from cryosnap.storage import LocalStore

Writer = Callable[[int, dict[str, torch.Tensor]], None]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw(root: Path, direct: bool) -> Writer:
    root.mkdir()

    def write(step: int, state: dict[str, torch.Tensor]) -> None:
        path = root / f"{step}.bin"
        flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0)
        nbytes = sum(t.nbytes for t in state.values())
        fd = os.open(path, flags, 0o644)
        try:
            if direct:  # the aligned copy is the caller's memory here: not timed as a write
                os.pwrite(fd, _ALIGNED[0][: -(-nbytes // 4096) * 4096], 0)
                os.ftruncate(fd, nbytes)
            else:
                for t in state.values():
                    os.write(fd, t.numpy().data.cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync(root)
        (root / f"{step - 2}.bin").unlink(missing_ok=True)

    return write


_ALIGNED: list[memoryview] = []


def _torch(root: Path) -> Writer:
    root.mkdir()

    def write(step: int, state: dict[str, torch.Tensor]) -> None:
        with open(root / f"{step}.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync(root)
        (root / f"{step - 2}.pt").unlink(missing_ok=True)

    return write


def _checkpointer(root: Path, direct: bool, opened: list[cryosnap.Checkpointer]) -> Writer:
    ckpt = cryosnap.Checkpointer(root, keep=2, incremental=False, direct_io=direct)
    opened.append(ckpt)

    def write(step: int, state: dict[str, torch.Tensor]) -> None:
        ckpt.save(step, state).result()
        ckpt.wait()  # retention's deletes done too: the next version starts as training's would

    return write


def _one_shot(root: Path, direct: bool, arrays: dict[str, object] | None = None) -> Writer:
    """``cryosnap.save`` into a fresh run; ``arrays``: save these instead (numpy copies of the
    state: 16-byte-aligned memory, which goes to a direct file through the bounce buffer)."""
    root.mkdir()

    def write(step: int, state: dict[str, torch.Tensor]) -> None:
        what = state if arrays is None else arrays
        cryosnap.save(LocalStore(root / str(step), direct_io=direct), what, step=step)
        shutil.rmtree(root / str(step - 2), ignore_errors=True)

    return write


def _cached(root: Path) -> float:
    cached = total = 0
    for path in root.rglob("*"):
        if path.is_file() and path.stat().st_size:
            fd = os.open(path, os.O_RDONLY)
            try:
                counts = _native.cached_pages(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            if counts is not None:
                cached, total = cached + counts[0], total + counts[1]
    return cached / total if total else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--versions", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    state = {f"w{i}": torch.rand(args.mib << 15) for i in range(8)}  # 8 x mib/8 MiB of fp32
    nbytes = sum(t.nbytes for t in state.values())
    buffer = mmap.mmap(-1, -(-nbytes // 4096) * 4096)
    _ALIGNED.append(memoryview(buffer))
    arrays = {k: v.numpy().copy() for k, v in state.items()}
    work = Path(tempfile.mkdtemp(prefix="bench-direct-", dir=args.dir))
    opened: list[cryosnap.Checkpointer] = []
    writers: dict[str, Writer] = {
        "raw O_DIRECT write+fsync": _raw(work / "raw-direct", True),
        "raw buffered write+fsync": _raw(work / "raw-buffered", False),
        "torch.save + fsync": _torch(work / "torch"),
        "Checkpointer direct_io=True": _checkpointer(work / "ckpt-direct", True, opened),
        "Checkpointer direct_io=False": _checkpointer(work / "ckpt-buffered", False, opened),
        "cryosnap.save direct": _one_shot(work / "save-direct", True),
        "cryosnap.save direct, numpy": _one_shot(work / "save-numpy", True, arrays),  # type: ignore[arg-type]
        "cryosnap.save buffered": _one_shot(work / "save-buffered", False),
    }
    times: dict[str, list[float]] = {name: [] for name in writers}
    try:
        for step in range(args.versions + 1):
            for t in state.values():
                t.add_(1.0)  # every byte changes
            for k, t in state.items():
                arrays[k][...] = t.numpy()  # type: ignore[index]
            at = 0
            for t in state.values():
                _ALIGNED[0][at : at + t.nbytes] = t.numpy().data.cast("B")
                at += t.nbytes
            names = list(writers)
            for name in names[step % len(names) :] + names[: step % len(names)]:
                os.sync()
                t0 = time.perf_counter()
                writers[name](step, state)
                if step:  # the first version is the warm-up
                    times[name].append(time.perf_counter() - t0)
        limit = statistics.median(times["raw O_DIRECT write+fsync"])
        print(f"{nbytes / 2**20:.0f} MiB in 8 tensors, keep=2, medians of {args.versions}")
        print(f"{'writer':32} {'durable s':>10} {'x raw direct':>13} {'page cache':>11}")
        roots = ["raw-direct", "raw-buffered", "torch", "ckpt-direct", "ckpt-buffered",
                 "save-direct", "save-numpy", "save-buffered"]  # fmt: skip
        for (name, samples), root in zip(times.items(), roots, strict=True):
            med = statistics.median(samples)
            print(f"{name:32} {med:10.3f} {med / limit:12.2f}x {_cached(work / root):10.0%}")
    finally:
        for ckpt in opened:
            ckpt.close()
        _ALIGNED.clear()
        buffer.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
