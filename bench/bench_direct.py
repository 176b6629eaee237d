"""Direct I/O against the page cache: the durable time of a version in steady state, as
training saves (issue #28's table), and how much of each checkpoint stays in the page cache.

512 MiB of float32 in 8 tensors (``--mib``), every byte changed between versions, 2 versions
kept and older ones deleted; one warm-up version, then medians of ``--versions`` versions per
writer, the writers round-robin so the shared disk's drift spreads over all of them:

- ``cryosnap bench``'s own peers (``cryosnap.bench._peers``): raw ``O_DIRECT`` write+fsync of
  the same bytes from a page-aligned copy (the disk's limit), raw buffered write+fsync, and
  ``torch.save`` + fsync;
- ``Checkpointer(keep=2, incremental=False, direct_io=True / False).save(step, s).result()``;
- one-shot ``cryosnap.save`` into a fresh run, direct (from the caller's tensors: the first
  page of each through the bounce buffer), direct from numpy copies of them (16-byte-aligned
  memory: every byte through the bounce buffer) and buffered.

After each writer's last version the fraction of its files' pages in the page cache
(``mincore``). Usage: ``python bench/bench_direct.py [--dir D] [--mib 512] [--versions 3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import cryosnap
from cryosnap import _native
from cryosnap.bench._peers import Peer, RawDirectLimit, RawLimit, TorchSavePeer
from cryosnap.bench._probes import fsync_path, iter_files, median, settle_disk
from cryosnap.storage import LocalStore

State = dict[str, torch.Tensor]


@dataclass
class Writer:
    """``write`` is timed; ``prepare`` (untimed) runs before it, ``close`` once at the end."""

    write: Callable[[int, State], None]
    prepare: Callable[[int, State], None] = lambda step, state: None
    close: Callable[[], None] = lambda: None


def _peer(root: Path, peer: Peer, state: State) -> Writer:
    """One of ``cryosnap bench``'s peers (its raw limits, ``torch.save``), each version in a
    folder of its own, the version before the previous one deleted (keep=2)."""
    root.mkdir()
    peer.setup(root, state)

    def prepare(step: int, state: State) -> None:
        (root / str(step)).mkdir()
        peer.begin(root / str(step), state)  # the raw direct limit's aligned copy: untimed

    def write(step: int, state: State) -> None:
        finish = peer.save(root / str(step), state)
        if finish is not None:
            finish()
        fsync_path(root)
        shutil.rmtree(root / str(step - 2), ignore_errors=True)

    return Writer(write, prepare, peer.close)


def _checkpointer(root: Path, direct: bool) -> Writer:
    ckpt = cryosnap.Checkpointer(root, keep=2, incremental=False, direct_io=direct)

    def write(step: int, state: State) -> None:
        ckpt.save(step, state).result()
        ckpt.wait()  # retention's deletes done too: the next version starts as training's would

    return Writer(write, close=ckpt.close)


def _one_shot(root: Path, direct: bool, arrays: dict[str, object] | None = None) -> Writer:
    """``cryosnap.save`` into a fresh run; ``arrays``: save these instead (numpy copies of the
    state: 16-byte-aligned memory, which goes to a direct file through the bounce buffer)."""
    root.mkdir()

    def write(step: int, state: State) -> None:
        what = state if arrays is None else arrays
        cryosnap.save(LocalStore(root / str(step), direct_io=direct), what, step=step)
        shutil.rmtree(root / str(step - 2), ignore_errors=True)

    return Writer(write)


def _cached(root: Path) -> float:
    cached = total = 0
    for path in iter_files(root):
        if path.stat().st_size:
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
    arrays = {k: v.numpy().copy() for k, v in state.items()}
    work = Path(tempfile.mkdtemp(prefix="bench-direct-", dir=args.dir))
    roots = {
        "raw O_DIRECT write+fsync": "raw-direct",
        "raw buffered write+fsync": "raw-buffered",
        "torch.save + fsync": "torch",
        "Checkpointer direct_io=True": "ckpt-direct",
        "Checkpointer direct_io=False": "ckpt-buffered",
        "cryosnap.save direct": "save-direct",
        "cryosnap.save direct, numpy": "save-numpy",
        "cryosnap.save buffered": "save-buffered",
    }
    writers: dict[str, Writer] = {}
    try:
        for name, make in zip(roots, _makers(state, arrays), strict=True):
            writers[name] = make(work / roots[name])
        times = _rounds(writers, state, arrays, args.versions)
        limit = median(times["raw O_DIRECT write+fsync"])
        print(f"{nbytes / 2**20:.0f} MiB in 8 tensors, keep=2, medians of {args.versions}")
        print(f"{'writer':32} {'durable s':>10} {'x raw direct':>13} {'page cache':>11}")
        for name, samples in times.items():
            med = median(samples)
            print(f"{name:32} {med:10.3f} {med / limit:12.2f}x {_cached(work / roots[name]):10.0%}")
    finally:
        for writer in writers.values():
            writer.close()
        shutil.rmtree(work, ignore_errors=True)


def _makers(state: State, arrays: dict[str, object]) -> list[Callable[[Path], Writer]]:
    """How to open each writer, in the order of ``main``'s names."""
    return [
        lambda root: _peer(root, RawDirectLimit(), state),
        lambda root: _peer(root, RawLimit(), state),
        lambda root: _peer(root, TorchSavePeer(), state),
        lambda root: _checkpointer(root, True),
        lambda root: _checkpointer(root, False),
        lambda root: _one_shot(root, True),
        lambda root: _one_shot(root, True, arrays),
        lambda root: _one_shot(root, False),
    ]


def _rounds(
    writers: dict[str, Writer], state: State, arrays: dict[str, object], versions: int
) -> dict[str, list[float]]:
    """One warm-up version, then ``versions`` timed ones per writer, every byte changed each
    time; the writers round-robin so the shared disk's drift spreads over all of them."""
    times: dict[str, list[float]] = {name: [] for name in writers}
    for step in range(versions + 1):
        for k, t in state.items():
            t.add_(1.0)  # every byte changes
            arrays[k][...] = t.numpy()  # type: ignore[index]
        names = list(writers)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            writers[name].prepare(step, state)
            settle_disk()
            t0 = time.perf_counter()
            writers[name].write(step, state)
            if step:  # the first version is the warm-up
                times[name].append(time.perf_counter() - t0)
    return times


if __name__ == "__main__":
    main()
