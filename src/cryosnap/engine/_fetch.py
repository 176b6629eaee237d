"""Fetch: fill one rank's freshly allocated leaves from the data files of a resolved version,
then verify every chunk's hash.

A plan first (:class:`_BlobReader`): per data file, the pieces of leaves that lie back to back
become runs, read in large contiguous ``preadv`` calls (a small gap between two pieces is read
into a scratch buffer rather than split the read); a leaf whose chunks are scattered over many
small runs (the end of an incremental chain over sparse updates) is read by windowed gathers
instead. Several reads are in flight on a thread pool of this module's own. Runs on the
caller's thread (the one restoring or verifying) and that pool; no collectives here.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..chunks import HASH_BYTES, hash_chunks
from ..errors import CheckpointError, CheckpointNotFoundError, IntegrityError
from ..storage import Store
from ..storage.base import TruncatedError
from ._resolved import ResolvedBlob, ResolvedPart

__all__ = ["IO_BATCH_BYTES", "read_blobs"]

# Bytes handed to one writev/preadv call: large enough for sequential bandwidth.
IO_BATCH_BYTES = 64 << 20
_READ_THREADS = max(2, min(8, os.cpu_count() or 2))
# Pieces of a data file at most this far apart are read in one go, the gap thrown away.
_GAP_BYTES = 64 << 10
# A blob whose chunks lie in more runs than this, averaging less than _GAP_BYTES each, is
# read by windowed gathers.
_FRAGMENTED_RUNS = 256
_GATHER_WINDOW_BYTES = 4 << 20

_Piece = tuple[int, int, int, int]  # (offset in its data file, blob, start in blob, nbytes)
# (offset, buffers, the blob of each buffer or -1 for a skipped gap): one contiguous read.
_Run = tuple[int, list[memoryview], list[int]]
_Group = tuple[str, list[_Run]]  # runs of one data file, read by one task (one open)
_Gather = tuple[int, int, np.ndarray[Any, Any]]  # (blob, file, chunk indices)
_Window = tuple[int, int, int, int]  # (first, end) chunks of a gather, (lo, hi) bytes


def read_blobs(
    store: Store,
    part: ResolvedPart,
    views: Sequence[memoryview],
    *,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> None:
    """Fill ``views`` from the data files in large runs, then verify every chunk."""
    _BlobReader(store, part, views, on_bytes).run()


class _BlobReader:
    """The reads that fill the leaves (``views``) of one resolved part."""

    __slots__ = ("cb", "on_bytes", "part", "step", "store", "views")

    def __init__(
        self,
        store: Store,
        part: ResolvedPart,
        views: Sequence[memoryview],
        on_bytes: Callable[[int], None],
    ) -> None:
        self.store = store
        self.part = part
        self.views = views
        self.on_bytes = on_bytes
        self.cb = part.manifest.chunk_bytes
        self.step = part.step

    def run(self) -> None:
        pieces, gathers = self._plan()
        tasks: list[Callable[[], None]] = [
            functools.partial(self._read, g) for g in self._groups(pieces)
        ]
        tasks += [functools.partial(self._gather, t) for t in gathers]
        # Several reads in flight: copying out of the page cache and faulting in fresh pages
        # run on every core, and a remote store overlaps its latencies.
        if len(tasks) > 1:
            with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="cryosnap-read") as pool:
                for _ in pool.map(lambda task: task(), tasks):
                    pass
        else:
            for task in tasks:
                task()
        for b, view in zip(self.part.blobs, self.views, strict=True):
            _verify_blob(self.store, self.step, self.cb, b, view)

    # -- plan

    def _plan(self) -> tuple[dict[int, list[_Piece]], list[_Gather]]:
        """Per data file its pieces, from runs of chunks that lie back to back (so adjacent
        pieces become one preadv of many buffers); and the gathers of scattered blobs."""
        pieces: dict[int, list[_Piece]] = {}
        gathers: list[_Gather] = []
        for i, b in enumerate(self.part.blobs):
            self._plan_blob(i, b, pieces, gathers)
        return pieces, gathers

    def _plan_blob(
        self, i: int, b: ResolvedBlob, pieces: dict[int, list[_Piece]], gathers: list[_Gather]
    ) -> None:
        cb = self.cb
        n = len(b.files)
        if not n:
            return
        breaks = np.flatnonzero(
            (b.files[1:] != b.files[:-1]) | (b.offsets[1:] != b.offsets[:-1] + cb)
        )
        if len(breaks) > _FRAGMENTED_RUNS and b.nbytes < (len(breaks) + 1) * _GAP_BYTES:
            # Scattered chunks (the end of an incremental chain over sparse updates): read
            # windows of each file and copy the chunks out with one vectorized gather each,
            # instead of one Python-level piece per chunk. A short last chunk goes the usual
            # way.
            whole = n if b.nbytes % cb == 0 else n - 1
            for f in np.unique(b.files[:whole]).tolist():
                gathers.append((i, f, np.flatnonzero(b.files[:whole] == f)))
            if whole < n:
                pieces.setdefault(int(b.files[-1]), []).append(
                    (int(b.offsets[-1]), i, whole * cb, b.nbytes - whole * cb)
                )
            return
        starts = [0, *(breaks + 1).tolist()]
        ends = [*(breaks + 1).tolist(), n]
        for s, e in zip(starts, ends, strict=True):
            lo, hi = s * cb, min(e * cb, b.nbytes)
            pieces.setdefault(int(b.files[s]), []).append((int(b.offsets[s]), i, lo, hi - lo))

    def _groups(self, pieces: dict[int, list[_Piece]]) -> list[_Group]:
        """Pieces that follow each other in a file join one run; so do pieces a small gap
        apart (the gap is read into a scratch buffer): a fragmented incremental chain reads its
        old data files in a few large reads instead of one per changed region. Runs of one
        file come in groups of about IO_BATCH_BYTES, each group one task that opens the file
        once."""
        scratch = memoryview(bytearray(_GAP_BYTES))
        groups: list[_Group] = []
        for f, plist in pieces.items():
            plist.sort()
            groups += self._file_groups(self.part.files[f], plist, scratch)
        return groups

    def _file_groups(self, key: str, plist: list[_Piece], scratch: memoryview) -> list[_Group]:
        groups: list[_Group] = []
        runs: list[_Run] = []
        end = -1
        size = 0
        group_bytes = 0
        for offset, blob, start, nbytes in plist:
            view = self.views[blob][start : start + nbytes]
            gap = offset - end
            if runs and 0 <= gap <= _GAP_BYTES and size < IO_BATCH_BYTES:
                if gap:
                    runs[-1][1].append(scratch[:gap])
                    runs[-1][2].append(-1)
                runs[-1][1].append(view)
                runs[-1][2].append(blob)
                size += gap + nbytes
            else:
                # A new run: a far piece, or content stored once and used twice
                # (de-duplicated: the piece starts before the run's end).
                if group_bytes >= IO_BATCH_BYTES:
                    groups.append((key, runs))
                    runs, group_bytes = [], 0
                runs.append((offset, [view], [blob]))
                size = nbytes
            group_bytes += nbytes
            end = offset + nbytes
        if runs:
            groups.append((key, runs))
        return groups

    # -- reads (on the pool's threads)

    def _read(self, group: _Group) -> None:
        key, runs = group
        try:
            self.store.read_ranges(key, [(offset, bufs) for offset, bufs, _ in runs])
        except (TruncatedError, CheckpointNotFoundError) as exc:
            victim = runs[0][2][0]
            if isinstance(exc, TruncatedError):
                victim = self._cut_off(key, runs, victim)
            raise self._unreadable(key, exc, self.part.blobs[victim].path) from exc
        self.on_bytes(sum(v.nbytes for _, bufs, _owners in runs for v in bufs))

    def _cut_off(self, key: str, runs: list[_Run], default: int) -> int:
        """The blob whose bytes the truncated file ``key`` cuts off (not the first one of the
        read), or ``default`` when its size cannot be had."""
        with contextlib.suppress(CheckpointError):
            size = self.store.size(key)
            for offset, bufs, owners in runs:
                at = offset
                for buf, blob in zip(bufs, owners, strict=True):
                    if blob >= 0 and at + buf.nbytes > size:
                        return blob
                    at += buf.nbytes
        return default

    def _unreadable(self, key: str, exc: Exception, leaf: str) -> IntegrityError:
        what = "truncated" if isinstance(exc, TruncatedError) else "missing"
        return IntegrityError(
            f"step {self.step}, tier {self.store.url}: data file {key} is {what}; "
            f"leaf {leaf} cannot be read"
        )

    def _gather(self, task: _Gather) -> None:
        i, f, idx = task
        cb = self.cb
        b, key = self.part.blobs[i], self.part.files[f]
        offs = b.offsets[idx]
        order = np.argsort(offs, kind="stable")
        idx, offs = idx[order], offs[order]
        whole = b.nbytes // cb
        dest = np.frombuffer(self.views[i], np.uint8)[: whole * cb].reshape(whole, cb)
        per_copy = max(_GATHER_WINDOW_BYTES // cb, 1)
        buffer = np.empty(0, np.uint8)  # reused: fresh pages for every batch cost faults
        for batch, size in _window_batches(_gather_windows(offs, cb)):
            if len(buffer) < size:
                buffer = np.empty(size, np.uint8)
            slices, at = [], 0
            for _a, _b, lo, hi in batch:
                slices.append(buffer[at : at + hi - lo])
                at += hi - lo
            try:
                self.store.read_ranges(
                    key, [(win[2], [sl.data]) for win, sl in zip(batch, slices, strict=True)]
                )
            except (TruncatedError, CheckpointNotFoundError) as exc:
                raise self._unreadable(key, exc, b.path) from exc
            for (a, z, lo, _hi), window in zip(batch, slices, strict=True):
                # Every byte offset of the window as the start of a chunk-long row (a view,
                # no copy): the chunks are a fancy index away.
                rows = np.lib.stride_tricks.as_strided(
                    window, shape=(len(window) - cb + 1, cb), strides=(1, 1), writeable=False
                )
                # The fancy index copies through a temporary: a window's bytes bound its
                # reads, not its chunks (de-duplicated chunks share one place), so the copy
                # goes in slices of at most a window's worth.
                for s in range(a, z, per_copy):
                    e = min(s + per_copy, z)
                    dest[idx[s:e]] = rows[offs[s:e] - lo]
                self.on_bytes((z - a) * cb)


def _gather_windows(offs: np.ndarray[Any, Any], cb: int) -> list[_Window]:
    """Windows over the sorted chunk offsets ``offs`` of one file: a window never spans a gap
    wider than _GAP_BYTES (dead chunks of an old file are not read) nor more than
    _GATHER_WINDOW_BYTES."""
    cuts = np.flatnonzero(offs[1:] - offs[:-1] - cb > _GAP_BYTES) + 1
    cluster_end = np.append(cuts, len(offs))
    windows: list[_Window] = []
    lo_i = 0
    while lo_i < len(offs):
        lo = int(offs[lo_i])
        end_i = int(cluster_end[np.searchsorted(cluster_end, lo_i, side="right")])
        hi_i = int(np.searchsorted(offs, lo + _GATHER_WINDOW_BYTES - cb, side="right"))
        hi_i = max(min(hi_i, end_i), lo_i + 1)
        windows.append((lo_i, hi_i, lo, int(offs[hi_i - 1]) + cb))
        lo_i = hi_i
    return windows


def _window_batches(windows: list[_Window]) -> Iterator[tuple[list[_Window], int]]:
    """Several windows per read_ranges call (one open), up to _GATHER_WINDOW_BYTES in all;
    with the bytes of each batch."""
    w = 0
    while w < len(windows):
        batch = [windows[w]]
        size = windows[w][3] - windows[w][2]
        w += 1
        while w < len(windows) and size + windows[w][3] - windows[w][2] <= _GATHER_WINDOW_BYTES:
            size += windows[w][3] - windows[w][2]
            batch.append(windows[w])
            w += 1
        yield batch, size


def _verify_blob(
    store: Store, step: int, chunk_bytes: int, b: ResolvedBlob, view: memoryview
) -> None:
    hashes = hash_chunks(view, chunk_bytes)
    expected = b.hashes.tobytes()
    if hashes == expected:
        return
    for c in range(0, len(hashes), HASH_BYTES):
        if hashes[c : c + HASH_BYTES] != expected[c : c + HASH_BYTES]:
            chunk = c // HASH_BYTES
            lo = chunk * chunk_bytes
            hi = min(lo + chunk_bytes, b.nbytes)
            raise IntegrityError(
                f"step {step}, tier {store.url}: leaf {b.path}: chunk {chunk} "
                f"(bytes {lo}-{hi}) does not match its hash"
            )
    raise IntegrityError(f"step {step}, tier {store.url}: leaf {b.path}: wrong chunk count")
