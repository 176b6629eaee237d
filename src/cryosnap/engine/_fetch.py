"""Fetch: fill one rank's leaves from the data files of a resolved version, verifying every
chunk's hash as its read lands.

A plan first (:class:`_BlobReader`), vectorized over every chunk of the part: the chunks of a
blob that lie back to back in a data file become *pieces* (whole chunks, at most about
``_BOUNCE_BYTES`` each), sorted by file and offset; pieces that follow each other in a file, or
lie a small gap apart (the gap is read into a scratch buffer), join one *run* (one ``preadv`` of
many buffers), and runs join *tasks* of about ``IO_BATCH_BYTES``, one ``read_ranges`` call (one
open) each. A task hashes its pieces as soon as its read returns, instead of one serial hashing
pass over the whole state after every read. A blob whose chunks are scattered over many small
runs (the end of an incremental chain over sparse updates) is read by windowed gathers instead.
Tasks run on a thread pool of this module's own: copying out of the page cache, faulting in
fresh pages, hashing and a remote store's latencies overlap on every core.

*Direct* blobs (``into=``'s own tensors, :func:`cryosnap.tree.direct_targets`) are filled in
two passes, so that nothing in them changes before every chunk of the part verified: the first
reads their pieces into a per-thread bounce buffer (in tasks of about ``_BOUNCE_BYTES``, which
stay in the CPU's cache between the read, the hash and the copy) and only verifies them; the
second
(:meth:`Fetched.fill`, once the caller is ready) reads them again into the bounce buffer,
verifies each piece again and only then copies it into place. Every byte that lands in
``into=`` was verified; a data file that changes (or disappears) between the passes fails the
second pass, with ``into=`` partly filled with verified bytes. A scattered direct blob is
gathered once into a private buffer and copied from it.

On a store that maps its data files (:class:`Mapped`: a LocalStore on a local file system),
nothing is copied that need not be. A *placed* blob (its chunks back to back in one mapped
file, its leaf built over that memory by :class:`cryosnap.tree.Restorer`) is only hashed where
it lies: the page cache's own pages, mapped copy-on-write. A direct blob's pieces in a mapped
file are hashed there in the first pass, and in the second hashed again and copied into place
if they still match, piece by piece while in the CPU's cache: a file replaced or deleted
meanwhile changes nothing (the mapping holds the file that verified), and bytes overwritten in
place (cryosnap never does that) never reach ``into=`` unless the overwrite lands in the
microseconds between a piece's hash and its copy. Hashing runs at about
three times the speed of a copy out of the page cache here, so a restore of fresh leaves costs
a fraction of a read, and one into existing tensors about one copy plus the hashing.

Errors are deterministic: every task runs to its end; a failed read (in task order) wins over a
mismatch, and of the mismatches the first chunk in blob order is named, as a sequential reader
would. Runs on the caller's thread (the one restoring or verifying) and that pool; no
collectives here.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import _native
from ..chunks import HASH_BYTES, hash_bytes, hash_chunks_released
from ..errors import CheckpointError, CheckpointNotFoundError, IntegrityError
from ..storage import Store
from ..storage.base import TruncatedError
from ._resolved import ResolvedPart

__all__ = ["IO_BATCH_BYTES", "Fetched", "Mapped", "read_blobs"]

# Bytes handed to one read_ranges call (one open: on an object store a request; through a
# TimeoutStore a hand-off to a storage thread): large enough for sequential bandwidth and for
# those costs to be noise.
IO_BATCH_BYTES = 64 << 20
# Bytes of a task that goes through a thread's bounce buffer (into='s own leaves), and of a
# piece: small enough to stay in the CPU's cache (a few in flight within a shared L3) from the
# read to the copy into place.
_BOUNCE_BYTES = 8 << 20
_READ_THREADS = max(2, min(8, os.cpu_count() or 2))
# Pieces of one chunk of at most this many bytes are hashed by one xxhash call each, holding
# the GIL (below chunks' native-call threshold, which releases it).
_INLINE_HASH_BYTES = 64 << 10
# Pieces of a data file at most this far apart are read in one go, the gap thrown away.
_GAP_BYTES = 64 << 10
# A blob whose chunks lie in more runs than this, averaging less than _GAP_BYTES each, is
# read by windowed gathers.
_FRAGMENTED_RUNS = 256
_GATHER_WINDOW_BYTES = 4 << 20

# (file offset, piece ids, gap bytes before each piece): one contiguous preadv.
_Run = tuple[int, list[int], list[int]]
_Task = tuple[int, list[_Run]]  # (file index, runs): one read_ranges call (one open)
_Gather = tuple[int, int, np.ndarray[Any, Any]]  # (blob, file, chunk indices)
_Window = tuple[int, int, int, int]  # (first, end) chunks of a gather, (lo, hi) bytes


def read_blobs(
    store: Store,
    part: ResolvedPart,
    views: Sequence[memoryview],
    *,
    on_bytes: Callable[[int], None] = lambda n: None,
    direct: Sequence[bool] = (),
    mapped: Mapped | None = None,
    placed: Sequence[bool] = (),
) -> Fetched:
    """Fill ``views`` from the data files and verify every chunk as it lands; raise on the first
    damage (in blob order). The views marked in ``direct`` are verified but left untouched:
    the returned :class:`Fetched` fills them. Those marked in ``placed`` are views of
    ``mapped``'s files (:meth:`Mapped.place`) and are only verified."""
    reader = _BlobReader(store, part, views, on_bytes, direct, mapped, placed)
    reader.first_pass()
    return Fetched(reader)


class Mapped:
    """The data files a part uses, mapped copy-on-write where the store maps them
    (``map_file``: a LocalStore on a local file system, possibly in a TimeoutStore; a wrapper
    that injects faults has none, so its reads stay reads), and where each blob lies in them.

    :meth:`place` hands out the memory of a blob whose chunks lie back to back in one mapped
    file: :class:`cryosnap.tree.Restorer` builds the leaf over it (no allocation, no copy) and
    the reader verifies it there. A file that cannot be mapped is read as before (its errors,
    a missing file for one, come from the read)."""

    def __init__(self, store: Store, part: ResolvedPart) -> None:
        map_file: Callable[[str], memoryview | None] | None = getattr(store, "map_file", None)
        self.views: dict[int, memoryview] = {}
        self.address: dict[int, int] = {}
        chunks = part.chunks()
        files = chunks.files
        n = len(part.blobs)
        self._file: list[int] = [-1] * n
        self._offset: list[int] = [0] * n
        self._nbytes: list[int] = chunks.nbytes.tolist()
        if map_file is None or not len(files):
            return
        for f in np.unique(files).tolist():
            with contextlib.suppress(CheckpointError):
                view = map_file(part.files[f])
                if view is not None:
                    self.views[f] = view
                    self.address[f] = _native.address_of(view)
        if not self.views:
            return
        # A blob lies in one piece of memory when its chunks follow each other in one file.
        cb = part.manifest.chunk_bytes
        offs = chunks.offsets
        new = np.ones(len(files), bool)
        new[1:] = (files[1:] != files[:-1]) | (offs[1:] != offs[:-1] + cb)
        runs = np.cumsum(new)
        starts = chunks.starts
        lo = np.minimum(starts[:-1], len(files) - 1)
        whole = (starts[1:] > starts[:-1]) & (runs[np.maximum(starts[1:] - 1, 0)] == runs[lo])
        whole &= np.isin(files[lo], np.fromiter(self.views, np.int64, len(self.views)))
        whole[whole] &= ~_overlapping(files[lo][whole], offs[lo][whole], chunks.nbytes[whole])
        self._file = np.where(whole, files[lo], -1).tolist()
        self._offset = offs[lo].tolist()

    def alone(self, blob: int) -> bool:
        """Whether ``blob`` lies in one piece of a mapped file that no other blob's bytes
        overlap."""
        return self._file[blob] >= 0

    def place(self, blob: int, alignment: int) -> memoryview | None:
        """The mapped memory holding ``blob``'s bytes, if they lie in one piece of a mapped
        file, inside it, at an address that is a multiple of ``alignment``; else None."""
        f = self._file[blob]
        if f < 0:
            return None
        lo = self._offset[blob]
        hi = lo + self._nbytes[blob]
        view = self.views[f]
        if hi > view.nbytes or (self.address[f] + lo) % alignment:
            return None
        return view[lo:hi]


class Fetched:
    """A part whose every chunk verified; :meth:`fill` puts the direct blobs in place."""

    __slots__ = ("_reader",)

    def __init__(self, reader: _BlobReader) -> None:
        self._reader: _BlobReader | None = reader

    def fill(self) -> None:
        """Read the direct blobs into place (once), each piece verified again before it is
        copied there."""
        reader, self._reader = self._reader, None
        if reader is not None and reader.has_direct:
            reader.second_pass()


class _BlobReader:
    """The reads that fill the leaves (``views``) of one resolved part."""

    def __init__(
        self,
        store: Store,
        part: ResolvedPart,
        views: Sequence[memoryview],
        on_bytes: Callable[[int], None],
        direct: Sequence[bool],
        mapped: Mapped | None = None,
        placed: Sequence[bool] = (),
    ) -> None:
        self.store = store
        self.part = part
        self.views = views
        self.on_bytes = on_bytes
        self.cb = part.manifest.chunk_bytes
        self.step = part.step
        blobs = part.blobs
        self.direct = [bool(d) for d in direct] if direct else [False] * len(blobs)
        self.has_direct = any(self.direct)
        # Mapped files (index -> address, view); placed blobs are only verified there.
        self.maddr: Mapping[int, int] = mapped.address if mapped is not None else {}
        self.mviews: Mapping[int, memoryview] = mapped.views if mapped is not None else {}
        self.mapped = mapped  # the mappings live as long as this reader
        self.placed = [bool(p) for p in placed] if placed else [False] * len(blobs)
        # Per piece (after the plan): whether it is hashed (and copied) from a mapped file.
        self.p_mapped: np.ndarray[Any, Any] = np.zeros(0, bool)
        self.chunks = part.chunks()
        self.first = self.chunks.starts  # first chunk of each blob, and the end
        self.first_list: list[int] = self.first.tolist()
        # Every chunk's expected hash, blob after blob: one bytes object, sliced per piece.
        self.expected = self.chunks.hashes.tobytes()
        self.scratch = memoryview(bytearray(_GAP_BYTES))  # gap bytes, shared: never read
        self.tls = threading.local()
        self.lock = threading.Lock()
        # Pieces, as parallel lists: blob, start in the blob, bytes, offset in the data file.
        self.p_blob: list[int] = []
        self.p_start: list[int] = []
        self.p_nbytes: list[int] = []
        self.p_offset: list[int] = []
        self.p_file: list[int] = []
        self.p_hash: list[int] = []
        self.p_hash_end: list[int] = []
        self.p_whole: list[bool] = []
        empty = np.empty(0, np.int64)
        self.pieces: tuple[np.ndarray[Any, Any], ...] = (empty, empty, empty)
        self.p_direct: np.ndarray[Any, Any] | None = None
        self.gathers: list[_Gather] = []
        self.staged: dict[int, np.ndarray[Any, Any]] = {}  # scattered direct blobs, gathered
        # The address of each view's first byte, taken once: pieces are hashed and copied by
        # address (no view slices), with the GIL released.
        self.address = [_native.address_of(v) for v in views]
        self.failures: list[tuple[int, BaseException]] = []  # (task number, what it raised)
        self.bad: list[tuple[int, int]] = []  # (blob, chunk) that did not match its hash

    # -- passes

    def first_pass(self) -> None:
        self._check_counts()
        self._plan()
        tasks = self._make_tasks(np.flatnonzero(~self.p_mapped))
        n = len(tasks)
        gathers = [functools.partial(self._gather, n + i, g) for i, g in enumerate(self.gathers)]
        hashed = [
            functools.partial(self._hash_mapped, n + len(gathers) + i, pids)
            for i, pids in enumerate(self._mapped_tasks(np.flatnonzero(self.p_mapped)))
        ]
        self._run_tasks(tasks, False, [*gathers, *hashed])

    def second_pass(self) -> None:
        for blob, staged in self.staged.items():
            _native.memmove(self.address[blob], staged.ctypes.data, staged.nbytes)
        if self.p_direct is None:
            return
        tasks = self._make_tasks(np.flatnonzero(self.p_direct & ~self.p_mapped))
        n = len(tasks)
        mapped = self._mapped_tasks(np.flatnonzero(self.p_direct & self.p_mapped))
        copies = [functools.partial(self._copy_mapped, n + i, p) for i, p in enumerate(mapped)]
        self._run_tasks(tasks, True, copies)

    def _run_tasks(
        self, tasks: list[_Task], second: bool, extra: Sequence[Callable[[], object]]
    ) -> None:
        """Run ``tasks`` (and ``extra`` work) on the pool; the tasks that read into the bounce
        buffers (into='s own leaves) are read one after the other on this thread, in file
        order, and verified on the pool: one sequential stream of reads keeps the kernel's
        read-ahead going on a cold cache (two readers at alternate offsets took ~25% longer
        here), while hashing still overlaps the reads on other cores. From a warm cache
        (the probe of :meth:`_cold`) every pool thread reads and hashes its own tasks: a
        single reader is then the bottleneck (~35% slower here)."""
        bounced = [i for i, t in enumerate(tasks) if self._bounced_bytes(t)]
        if len(bounced) < 2 or not self._cold([tasks[i] for i in bounced]):
            self._run(
                [
                    *(functools.partial(self._task, i, t, second) for i, t in enumerate(tasks)),
                    *extra,
                ]
            )
            return
        set_bounced = set(bounced)
        work: list[Callable[[], object]] = [
            functools.partial(self._task, i, t, second)
            for i, t in enumerate(tasks)
            if i not in set_bounced
        ]
        ring: queue.SimpleQueue[np.ndarray[Any, Any]] = queue.SimpleQueue()
        for _ in range(_READ_THREADS + 1):
            ring.put(np.empty(0, np.uint8))
        with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="cryosnap-read") as pool:
            futures: list[Future[object]] = [pool.submit(w) for w in [*work, *extra]]
            for i in bounced:
                buf = ring.get()  # at most _READ_THREADS + 1 tasks read and not yet verified
                futures.append(pool.submit(self._task(i, tasks[i], second, buf, ring)))
            for future in futures:
                future.result()
        self._raise()

    def _cold(self, tasks: list[_Task]) -> bool:
        """Whether most of a few probes (the first byte of the first, middle and last of
        ``tasks``) find their page out of the page cache (:func:`cryosnap._native.page_cached`):
        only on a store with a local path; False wherever it cannot be told."""
        root = self.store.capabilities.local_path
        if root is None:
            return False
        cold = 0
        picks = {0, len(tasks) // 2, len(tasks) - 1}
        for f, runs in (tasks[i] for i in picks):
            cached = _native.page_cached(root / self.part.files[f], runs[0][0])
            if cached is None:
                return False
            cold += not cached
        return 2 * cold > len(picks)

    def _bounced_bytes(self, task: _Task) -> int:
        if not self.has_direct:
            return 0
        direct, p_blob, p_nbytes = self.direct, self.p_blob, self.p_nbytes
        return sum(p_nbytes[p] for _o, pids, _g in task[1] for p in pids if direct[p_blob[p]])

    def _run(self, work: Sequence[Callable[[], object]]) -> None:
        # Several reads in flight: copying out of the page cache and faulting in fresh pages
        # run on every core, and a remote store overlaps its latencies.
        if len(work) > 1:
            with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="cryosnap-read") as pool:
                for _ in pool.map(lambda task: task(), work):
                    pass
        else:
            for task in work:
                task()
        self._raise()

    def _raise(self) -> None:
        if self.failures:
            _n, exc = min(self.failures, key=lambda f: f[0])
            raise exc
        if self.bad:
            blob, chunk = min(self.bad)
            b = self.part.blobs[blob]
            lo = chunk * self.cb
            hi = min(lo + self.cb, b.nbytes)
            raise IntegrityError(
                f"step {self.step}, tier {self.store.url}: leaf {b.path}: chunk {chunk} "
                f"(bytes {lo}-{hi}) does not match its hash"
            )

    # -- plan

    def _plan(self) -> None:
        """Pieces from runs of chunks that lie back to back (vectorized over every chunk of the
        part), tasks of runs of nearby pieces, and the gathers of scattered blobs."""
        blobs = self.part.blobs
        cb = self.cb
        total = self.first_list[-1]
        if not total:
            return
        nb = len(blobs)
        files = self.chunks.files.astype(np.int64)
        offs = self.chunks.offsets.astype(np.int64)
        counts = self.first[1:] - self.first[:-1]
        blob_of = np.repeat(np.arange(nb, dtype=np.int64), counts)
        within = np.arange(total, dtype=np.int64) - np.repeat(self.first[:-1], counts)
        new = np.ones(total, bool)
        new[1:] = (
            (blob_of[1:] != blob_of[:-1]) | (files[1:] != files[:-1]) | (offs[1:] != offs[:-1] + cb)
        )
        starts = np.flatnonzero(new)
        ends = np.append(starts[1:], total)
        sizes = self.chunks.nbytes
        runs = np.bincount(blob_of[starts], minlength=nb)
        scattered = (runs - 1 > _FRAGMENTED_RUNS) & (sizes < runs * _GAP_BYTES)
        keep = ~scattered[blob_of[starts]]
        s, e = starts[keep], ends[keep]
        # Pieces of at most a task's worth of whole chunks: a large blob is read by several
        # tasks in parallel, each hashed while it is in the cache.
        per = max(_BOUNCE_BYTES // cb, 1)
        nsub = -(-(e - s) // per)
        sub = np.repeat(s, nsub) + per * (
            np.arange(int(nsub.sum()), dtype=np.int64) - np.repeat(np.cumsum(nsub) - nsub, nsub)
        )
        sub_end = np.minimum(sub + per, np.repeat(e, nsub))
        p_blob = blob_of[sub]
        p_start = within[sub] * cb
        p_nbytes = np.minimum(within[sub_end - 1] * cb + cb, sizes[p_blob]) - p_start
        p_file = files[sub]
        p_offset = offs[sub]
        for i in np.flatnonzero(scattered).tolist():
            extra = self._plan_gathers(i)
            if extra is not None:  # the short last chunk of a scattered blob: a piece
                p_blob = np.append(p_blob, i)
                p_start = np.append(p_start, extra[0])
                p_nbytes = np.append(p_nbytes, extra[1])
                p_file = np.append(p_file, extra[2])
                p_offset = np.append(p_offset, extra[3])
        # Files in the order the blobs first use them (the order reads fail in), then offsets;
        # pieces at one offset (content stored once, used twice) keep their blob order.
        _u, first_use = np.unique(files, return_index=True)
        rank = np.empty(int(files.max()) + 1, np.int64)
        rank[_u] = np.argsort(np.argsort(first_use))
        order = np.lexsort((p_offset, rank[p_file]))
        p_blob, p_start, p_nbytes = p_blob[order], p_start[order], p_nbytes[order]
        self.p_blob = p_blob.tolist()
        self.p_start = p_start.tolist()
        self.p_nbytes = p_nbytes.tolist()
        self.p_offset = p_offset[order].tolist()
        self.p_file = p_file[order].tolist()
        # The same as arrays, for the tasks (and whether each piece is a direct blob's).
        self.pieces = (p_file[order], p_offset[order], p_nbytes)
        self.p_direct = np.array(self.direct, bool)[p_blob] if self.has_direct else None
        self.p_mapped = np.zeros(len(p_blob), bool)
        if self.maddr:
            # Placed blobs, and direct ones, are hashed (and copied) where their file is mapped.
            use = np.array(self.placed, bool)
            if self.has_direct:
                use |= np.array(self.direct, bool)
            in_map = np.isin(self.pieces[0], np.fromiter(self.maddr, np.int64, len(self.maddr)))
            self.p_mapped = use[p_blob] & in_map
        # Where each piece's hashes are in ``expected`` (bytes), and whether it is its blob's
        # whole view (no slice needed).
        lo = (self.first[:-1][p_blob] + p_start // cb) * HASH_BYTES
        self.p_hash = lo.tolist()
        self.p_hash_end = (lo + -(-p_nbytes // cb) * HASH_BYTES).tolist()
        viewed = np.fromiter((v.nbytes for v in self.views), np.int64, len(self.views))
        self.p_whole = ((p_start == 0) & (p_nbytes == viewed[p_blob])).tolist()

    def _check_counts(self) -> None:
        """Every blob has as many chunk hashes as its bytes make chunks (resolution makes it
        so; the plan relies on it)."""
        wrong = np.flatnonzero(np.diff(self.first) != -(-self.chunks.nbytes // self.cb))
        if len(wrong):
            b = self.part.blobs[int(wrong[0])]
            raise IntegrityError(
                f"step {self.step}, tier {self.store.url}: leaf {b.path}: wrong chunk count"
            )

    def _make_tasks(self, pids: np.ndarray[Any, Any]) -> list[_Task]:
        """Pieces (``pids``, in file and offset order) that follow each other in a file join one
        run; so do pieces a small gap apart (the gap is read into scratch): a fragmented
        incremental chain reads its old data files in a few large reads instead of one per
        changed region. Runs of one file join tasks of about ``IO_BATCH_BYTES`` (a file some
        direct piece is read from: ``_BOUNCE_BYTES``), each one read_ranges call (one open).
        Vectorized: a state of many small leaves has a piece each."""
        n = len(pids)
        if not n:
            return []
        files, offsets, sizes = (a[pids] for a in self.pieces)
        new_file = np.ones(n, bool)
        new_file[1:] = files[1:] != files[:-1]
        # Bytes of the file's pieces before each piece, and the task it starts in.
        before = np.cumsum(sizes) - sizes
        first = np.flatnonzero(new_file)
        segment = np.cumsum(new_file) - 1
        within = before - before[first][segment]
        cap = np.full(len(first), IO_BATCH_BYTES, np.int64)
        if self.p_direct is not None:
            bounced = np.add.reduceat(self.p_direct[pids].astype(np.int64), first) > 0
            cap[bounced] = _BOUNCE_BYTES
        slot = within // cap[segment]
        new_task = new_file.copy()
        new_task[1:] |= slot[1:] != slot[:-1]
        # A new run at a new task, at a piece before the last one's end (content stored once,
        # used twice) or farther than a gap after it.
        gap = np.zeros(n, np.int64)
        gap[1:] = offsets[1:] - offsets[:-1] - sizes[:-1]
        new_run = new_task | (gap < 0) | (gap > _GAP_BYTES)
        gap[new_run] = 0
        run_at = np.flatnonzero(new_run).tolist()
        pid_l, gap_l, off_l = pids.tolist(), gap.tolist(), offsets.tolist()
        bounds = [*run_at, n]
        runs: list[_Run] = [
            (off_l[a], pid_l[a:z], gap_l[a:z]) for a, z in itertools.pairwise(bounds)
        ]
        # Tasks as runs: where each task's first run is among the runs.
        task_at = np.searchsorted(run_at, np.flatnonzero(new_task)).tolist()
        file_l = files[new_task].tolist()
        return [
            (f, runs[a:z])
            for f, (a, z) in zip(file_l, itertools.pairwise([*task_at, len(runs)]), strict=True)
        ]

    def _plan_gathers(self, i: int) -> tuple[int, int, int, int] | None:
        """Scattered chunks (the end of an incremental chain over sparse updates): windows of
        each file are read and the chunks copied out with one vectorized gather each, instead
        of one Python-level piece per chunk. Returns the short last chunk, which goes the usual
        way, as (start, nbytes, file, offset), or None."""
        b = self.part.blobs[i]
        cb = self.cb
        n = len(b.files)
        whole = n if b.nbytes % cb == 0 else n - 1
        for f in np.unique(b.files[:whole]).tolist():
            self.gathers.append((i, f, np.flatnonzero(b.files[:whole] == f)))
        if self.direct[i]:
            # Gathered into a private buffer, verified there, copied into place by the second
            # pass: the destination is into='s own memory.
            self.staged[i] = np.empty(whole * cb, np.uint8)
        if whole == n:
            return None
        return whole * cb, b.nbytes - whole * cb, int(b.files[-1]), int(b.offsets[-1])

    # -- tasks (on the pool's threads)

    def _bounce(self, nbytes: int) -> np.ndarray[Any, Any]:
        """This thread's bounce buffer, at least ``nbytes`` long (reused: fresh pages cost
        faults)."""
        buf: np.ndarray[Any, Any] | None = getattr(self.tls, "bounce", None)
        if buf is None or len(buf) < nbytes:
            buf = self.tls.bounce = np.empty(max(nbytes, 1 << 20), np.uint8)
        return buf

    def _task(
        self,
        number: int,
        task: _Task,
        second: bool,
        buf: np.ndarray[Any, Any] | None = None,
        ring: queue.SimpleQueue[np.ndarray[Any, Any]] | None = None,
    ) -> Callable[[], None]:
        """Read ``task`` and verify it. With ``buf`` (and ``ring``, which gets the buffer back
        once it is free) the read lands in ``buf`` and the verification is returned, to run on
        another thread; otherwise it runs here (and a no-op is returned)."""
        f, runs = task
        key = self.part.files[f]
        direct, p_blob, p_start, p_nbytes = self.direct, self.p_blob, self.p_start, self.p_nbytes
        bounced = self._bounced_bytes(task)
        if buf is not None and bounced and len(buf) < bounced:
            buf = np.empty(max(bounced, 1 << 20), np.uint8)
        if buf is not None:
            bounce = buf.data if bounced else self.scratch
        else:
            bounce = self._bounce(bounced).data if bounced else self.scratch
        base = _native.address_of(bounce) if bounced else 0
        views, address, scratch, whole = self.views, self.address, self.scratch, self.p_whole
        dests: list[memoryview] = []  # where each piece lands
        sources: list[int] = []  # of each bounced piece, its address in the bounce buffer
        ranges: list[tuple[int, list[memoryview]]] = []
        at = 0  # bytes of the bounce buffer taken
        for offset, pids, gaps in runs:
            if not bounced and not any(gaps):
                # Pieces back to back into the leaves themselves (a state of many small
                # tensors: most runs): one view each, no per-piece bookkeeping.
                bufs = [
                    views[p_blob[p]]
                    if whole[p]
                    else views[p_blob[p]][p_start[p] : p_start[p] + p_nbytes[p]]
                    for p in pids
                ]
                for p in [p for p in pids if p_nbytes[p] >= _POPULATE_MIN_BYTES]:
                    _native.populate(address[p_blob[p]] + p_start[p], p_nbytes[p])
                dests += bufs
                ranges.append((offset, bufs))
                continue
            if not any(gaps) and all([direct[p_blob[p]] for p in pids]):
                # Into='s own leaves back to back: one buffer for the run, a slice per piece.
                ends = list(itertools.accumulate([p_nbytes[p] for p in pids], initial=at))
                dests += [bounce[a:z] for a, z in itertools.pairwise(ends)]
                sources += [base + a for a in ends[:-1]]
                ranges.append((offset, [bounce[at : ends[-1]]]))
                at = ends[-1]
                continue
            bufs = []
            merged = -1  # where the bounced pieces that follow each other began (one buffer)
            for pid, gap in zip(pids, gaps, strict=True):
                blob, start, nbytes = p_blob[pid], p_start[pid], p_nbytes[pid]
                if gap or not direct[blob]:
                    if merged >= 0:
                        bufs.append(bounce[merged:at])
                        merged = -1
                    if gap:
                        bufs.append(scratch[:gap])
                if direct[blob]:
                    dests.append(bounce[at : at + nbytes])
                    sources.append(base + at)
                    if merged < 0:
                        merged = at
                    at += nbytes
                    continue
                view = views[blob]
                if nbytes != view.nbytes:
                    view = view[start : start + nbytes]
                if nbytes >= _POPULATE_MIN_BYTES:
                    _native.populate(address[blob] + start, nbytes)
                bufs.append(view)
                dests.append(view)
            if merged >= 0:
                bufs.append(bounce[merged:at])
            ranges.append((offset, bufs))
        try:
            self.store.read_ranges(key, ranges)
        except BaseException as exc:
            # A read that failed may still land later (a timed-out call goes on): this thread's
            # bounce buffer (or the ring's) is never used again.
            if ring is not None:
                ring.put(np.empty(0, np.uint8))
            else:
                self.tls.bounce = None
            if isinstance(exc, (TruncatedError, CheckpointNotFoundError)):
                exc = self._unreadable_run(key, runs, exc)
            with self.lock:
                self.failures.append((number, exc))
            return _nothing

        def verify() -> None:
            try:
                pids = [p for _o, ps, _g in runs for p in ps]
                nbytes = self._verify(pids, dests, sources if second else None)
            finally:
                if ring is not None and buf is not None:
                    ring.put(buf)
            if not second:
                self.on_bytes(nbytes)

        if ring is not None:
            return verify
        verify()
        return _nothing

    def _verify(self, pids: list[int], dests: list[memoryview], sources: list[int] | None) -> int:
        """Hash every piece ``pids`` where it is (``dests``) and compare the lot with the
        expected hashes at once; in the second pass (``sources``: the address of each piece in
        the bounce buffer, all of them direct) copy each that matches into place. Returns the
        bytes of the pieces."""
        # A piece of one chunk too small for the native call is one xxhash call (what
        # hash_chunks_released would do, without its checks).
        cb, small = self.cb, min(self.cb, _INLINE_HASH_BYTES)
        got = [hash_bytes(d) if d.nbytes <= small else hash_chunks_released(d, cb) for d in dests]
        bad = self._compare(pids, got)
        if sources is not None:
            address, p_blob, p_start = self.address, self.p_blob, self.p_start
            for i, (p, src, d) in enumerate(zip(pids, sources, dests, strict=True)):
                if i not in bad:
                    _native.memmove(address[p_blob[p]] + p_start[p], src, d.nbytes)
        return sum(d.nbytes for d in dests)

    def _compare(self, pids: list[int], got: list[bytes]) -> set[int]:
        """Compare the hashes ``got`` of pieces ``pids`` with the expected ones, all at once;
        record and return (as positions in ``pids``) those that differ."""
        cb, expected, hlo, hhi = self.cb, self.expected, self.p_hash, self.p_hash_end
        bad: set[int] = set()
        if b"".join(got) != b"".join([expected[hlo[p] : hhi[p]] for p in pids]):
            for i, p in enumerate(pids):
                want = expected[hlo[p] : hhi[p]]
                if got[i] != want:
                    self._mismatch(self.p_blob[p], self.p_start[p] // cb, got[i], want)
                    bad.add(i)
        return bad

    # -- mapped files (on the pool's threads)

    def _mapped_tasks(self, pids: np.ndarray[Any, Any]) -> list[list[int]]:
        """Pieces of mapped files (``pids``, in file and offset order) in tasks of about
        ``_BOUNCE_BYTES``: a large blob is hashed by every pool thread, a state of many small
        leaves in few calls."""
        if not len(pids):
            return []
        sizes = np.asarray(self.pieces[2])[pids]
        slot = (np.cumsum(sizes) - sizes) // _BOUNCE_BYTES
        cuts = np.flatnonzero(slot[1:] != slot[:-1]) + 1
        return [chunk.tolist() for chunk in np.split(pids, cuts)]

    def _mapped(self, pid: int) -> memoryview:
        offset = self.p_offset[pid]
        return self.mviews[self.p_file[pid]][offset : offset + self.p_nbytes[pid]]

    def _hash_mapped(self, number: int, pids: list[int]) -> None:
        """First pass over pieces of mapped files: hash them where they are (a direct blob's
        pieces are unmapped again: the second pass maps them once more)."""
        try:
            nbytes = self._verify(pids, [self._mapped(p) for p in pids], None)
            self._unmap_direct(pids)
        except BaseException as exc:
            with self.lock:
                self.failures.append((number, exc))
            return
        self.on_bytes(nbytes)

    def _unmap_direct(self, pids: list[int]) -> None:
        """Unmap the pieces of direct blobs that lie alone in their file (no other blob's
        bytes share their pages: a leaf built over those could lose what was written to
        it)."""
        direct, p_blob, maddr, p_file = self.direct, self.p_blob, self.maddr, self.p_file
        alone = self.mapped.alone if self.mapped is not None else None
        for p in pids:
            blob = p_blob[p]
            if direct[blob] and alone is not None and alone(blob):
                _native.dontneed(maddr[p_file[p]] + self.p_offset[p], self.p_nbytes[p])

    def _copy_mapped(self, number: int, pids: list[int]) -> None:
        """Second pass over a direct blob's pieces of mapped files: hash each again where it
        lies (:meth:`_verify`) and copy it into place if it still matches, while it is in the
        CPU's cache."""
        maddr, p_file, p_offset = self.maddr, self.p_file, self.p_offset
        try:
            for p in pids:
                self._verify([p], [self._mapped(p)], [maddr[p_file[p]] + p_offset[p]])
            self._unmap_direct(pids)
        except BaseException as exc:
            with self.lock:
                self.failures.append((number, exc))

    def _mismatch(self, blob: int, chunk: int, got: bytes, want: bytes) -> None:
        """Record the first chunk of a piece (starting at ``chunk``) that does not match."""
        c = 0
        while got[c : c + HASH_BYTES] == want[c : c + HASH_BYTES]:
            c += HASH_BYTES
        with self.lock:
            self.bad.append((blob, chunk + c // HASH_BYTES))

    def _unreadable_run(self, key: str, runs: list[_Run], exc: Exception) -> IntegrityError:
        """The error naming the leaf whose bytes ``key`` lacks: for a truncated file the blob
        the end of the file cuts off (not the first one of the read), when its size can be
        had."""
        victim = self.p_blob[runs[0][1][0]]
        if isinstance(exc, TruncatedError):
            victim = self._cut_off(key, runs, victim)
        return self._unreadable(key, exc, self.part.blobs[victim].path)

    def _cut_off(self, key: str, runs: list[_Run], default: int) -> int:
        """The blob whose bytes the truncated file ``key`` cuts off, or ``default`` when its
        size cannot be had."""
        with contextlib.suppress(CheckpointError):
            size = self.store.size(key)
            for offset, pids, gaps in runs:
                at = offset
                for pid, gap in zip(pids, gaps, strict=True):
                    at += gap
                    if at + self.p_nbytes[pid] > size:
                        return self.p_blob[pid]
                    at += self.p_nbytes[pid]
        return default

    def _unreadable(self, key: str, exc: Exception, leaf: str) -> IntegrityError:
        what = "truncated" if isinstance(exc, TruncatedError) else "missing"
        error = IntegrityError(
            f"step {self.step}, tier {self.store.url}: data file {key} is {what}; "
            f"leaf {leaf} cannot be read"
        )
        error.__cause__ = exc
        return error

    def _gather(self, number: int, task: _Gather) -> None:
        try:
            self._gather_reads(task)
        except BaseException as exc:
            with self.lock:
                self.failures.append((number, exc))
            return
        i, _f, idx = task
        dest = self.staged.get(i)
        view = dest.data if dest is not None else self.views[i]
        cb = self.cb
        hash_one = hash_bytes if cb <= _INLINE_HASH_BYTES else self._hash_chunk
        chunks = idx.tolist()
        got = [hash_one(view[c * cb : (c + 1) * cb]) for c in chunks]
        # Compared all at once; chunk by chunk only when something differs.
        want = self.chunks.hashes[self.first_list[i] + idx].tobytes()
        if b"".join(got) == want:
            return
        for k, c in enumerate(chunks):
            if got[k] != want[k * HASH_BYTES : (k + 1) * HASH_BYTES]:
                with self.lock:
                    self.bad.append((i, c))

    def _hash_chunk(self, chunk: memoryview) -> bytes:
        return hash_chunks_released(chunk, self.cb)

    def _gather_reads(self, task: _Gather) -> None:
        i, f, idx = task
        cb = self.cb
        b, key = self.part.blobs[i], self.part.files[f]
        offs = b.offsets[idx]
        order = np.argsort(offs, kind="stable")
        idx, offs = idx[order], offs[order]
        whole = b.nbytes // cb
        staged = self.staged.get(i)
        flat = staged if staged is not None else np.frombuffer(self.views[i], np.uint8)
        dest = flat[: whole * cb].reshape(whole, cb)
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


def _overlapping(
    files: np.ndarray[Any, Any], lo: np.ndarray[Any, Any], nbytes: np.ndarray[Any, Any]
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Which of the byte ranges ``[lo, lo + nbytes)`` of ``files`` overlap another one: content
    stored once and used by several leaves (two equal optimizer step counters, say). Such
    leaves must not be built over the same memory, or a write to one would change the
    other."""
    out = np.zeros(len(files), bool)
    hi = lo + nbytes
    order = np.lexsort((lo, files))
    f, a, b = files[order], lo[order], hi[order]
    bounds = [0, *(np.flatnonzero(np.diff(f)) + 1).tolist(), len(f)]
    for start, end in itertools.pairwise(bounds):
        ga, gb = a[start:end], b[start:end]
        if len(ga) < 2:
            continue
        before = np.maximum.accumulate(gb)[:-1]  # the furthest end of the ranges before each
        hit = np.zeros(len(ga), bool)
        hit[1:] = ga[1:] < before  # starts inside an earlier range
        hit[:-1] |= ga[1:] < gb[:-1]  # the next range starts inside this one
        out[order[start:end][hit]] = True
    return out


def _nothing() -> None:
    return None


# Pieces of fresh memory smaller than this are left to fault in as the read lands.
_POPULATE_MIN_BYTES = 1 << 20


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
