"""The executor: runs a part's :class:`ReadPlan` on a pool of read threads (reads, bounce
buffers, verification as each read lands, the two passes of into='s leaves, the direct reads
of cold files and the staging of into='s leaves they fill) and raises the first failure. Runs
on the caller's thread and the read pool's threads; no collectives here.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cryosnap import _native
from cryosnap.engine._limits import ReadLimits
from cryosnap.engine._resolved import ResolvedPart
from cryosnap.engine.fetch._cold import ColdFiles, aligned_memory, prefaulting
from cryosnap.engine.fetch._gather import Gatherer, unreadable
from cryosnap.engine.fetch._mapped import Mapped, MappedWork
from cryosnap.engine.fetch._plan import (
    Gather,
    PieceLists,
    ReadPlan,
    Run,
    Task,
    plan_reads,
    wrong_chunk_count,
)
from cryosnap.engine.fetch._verify import Outcome, Verifier
from cryosnap.errors import CheckpointError, CheckpointNotFoundError, IntegrityError
from cryosnap.storage import Store, decoded
from cryosnap.storage.base import TruncatedError

__all__ = ["Fetched", "read_blobs"]

# Bytes of staged leaves copied into into= per call (on the pool: every core copies).
_COPY_BYTES = 8 << 20

_Buffer = np.ndarray[Any, Any]


def read_blobs(
    store: Store,
    part: ResolvedPart,
    views: Sequence[memoryview],
    *,
    on_bytes: Callable[[int], None] = lambda n: None,
    direct: Sequence[bool] = (),
    mapped: Mapped | None = None,
    placed: Sequence[bool] = (),
    cold: ColdFiles | None = None,
    on_ready: Callable[[int], None] | None = None,
    limits: ReadLimits | None = None,
) -> Fetched:
    """Fill ``views`` from the data files and verify every chunk as it lands; raise on the first
    damage (in blob order). The views marked in ``direct`` are verified but left untouched:
    the returned :class:`Fetched` fills them. Those marked in ``placed`` are views of
    ``mapped``'s files (:meth:`Mapped.place`) and are only verified. ``cold``'s files are read
    with direct I/O; a direct blob with bytes there is read once into private memory (within
    the staging budget) that :meth:`Fetched.fill` copies into place. ``on_ready(blob)`` is
    called (on a read thread) for each blob that is not direct as soon as every chunk of it
    verified in its view, while the others are still read. ``limits`` cut the read (None:
    :meth:`ReadLimits.current`, taken here, on the caller's thread)."""
    limits = limits if limits is not None else ReadLimits.current()
    # Coded files (a persistent level's codec) are read as their plain bytes; a reader that
    # mapped or read them cold would see frames: it never gets here with them (_read.py).
    store = decoded(store, part.coded)
    cb = part.manifest.chunk_bytes
    wrong = wrong_chunk_count(part.chunks(), cb)
    if wrong >= 0:
        raise IntegrityError(
            f"step {part.step}, tier {store.url}: leaf {part.blobs[wrong].path}: wrong chunk count"
        )
    cold_files = cold.files if cold is not None else frozenset()
    staged: list[tuple[memoryview, memoryview]] = []
    if cold is not None and cold_files and any(direct):
        if mapped is not None and limits.map_cold_into:
            # into='s leaves in cold files take the mapped path: both passes from the page
            # cache the first fills (read-ahead), no fresh memory to fault in for staging.
            mapped.add(cold.direct_files([bool(d) for d in direct]))
        views, direct, staged = _stage_cold(views, direct, cold, mapped, limits.staging_share)
    plan = plan_reads(
        part.chunks(),
        cb,
        view_bytes=[v.nbytes for v in views],
        direct=direct,
        placed=placed,
        mapped_files=mapped.address.keys() if mapped is not None else (),
        cold_files=cold_files,
        limits=limits,
    )
    reader = PartReader(
        store,
        part,
        views,
        plan,
        on_bytes=on_bytes,
        mapped=mapped,
        cold_files=cold_files,
        on_ready=on_ready,
        limits=limits,
    )
    reader.first_pass()
    return Fetched(reader, staged)


def _stage_cold(
    views: Sequence[memoryview],
    direct: Sequence[bool],
    cold: ColdFiles,
    mapped: Mapped | None,
    staging_share: float,
) -> tuple[list[memoryview], list[bool], list[tuple[memoryview, memoryview]]]:
    """The direct blobs with bytes in a cold file that is not mapped (``mapped``), within the
    staging budget (``staging_share`` of the memory available), read into fresh aligned
    memory instead (no longer direct): a copy into place once every chunk verified, instead
    of a second read from the disk. Returns the views, the direct flags and the (staging,
    into='s memory) pairs."""
    unmapped = cold.files - (mapped.address.keys() if mapped is not None else set())
    if not unmapped:
        return list(views), list(direct), []
    budget = cold.staging_budget(staging_share)
    touches = cold.touching(unmapped)
    out, flags = list(views), list(direct)
    staged: list[tuple[memoryview, memoryview]] = []
    for i, (view, is_direct) in enumerate(zip(views, direct, strict=True)):
        if is_direct and view.nbytes and touches[i] and view.nbytes <= budget:
            budget -= view.nbytes
            out[i] = cold.memory(i)
            flags[i] = False
            staged.append((out[i], view))
    return out, flags, staged


class Fetched:
    """A part whose every chunk verified; :meth:`fill` puts the direct (and staged) blobs in
    place."""

    __slots__ = ("_reader", "_staged", "_threads")

    def __init__(
        self, reader: PartReader, staged: Sequence[tuple[memoryview, memoryview]] = ()
    ) -> None:
        self._reader: PartReader | None = reader
        self._staged = list(staged)
        self._threads = reader.limits.read_threads

    def fill(self) -> None:
        """Copy the staged blobs into place and read the direct ones there (once), each piece
        verified again before it is copied there."""
        reader, self._reader = self._reader, None
        staged, self._staged = self._staged, []
        if staged:
            _run([functools.partial(_native.memmove, *c) for c in _copies(staged)], self._threads)
        if reader is not None and reader.plan.has_direct:
            reader.second_pass()


def _copies(staged: Sequence[tuple[memoryview, memoryview]]) -> list[tuple[int, int, int]]:
    """(destination, source, bytes) of the copies of ``staged``, of about _COPY_BYTES each."""
    out = []
    for source, dest in staged:
        to, frm, n = _native.address_of(dest), _native.address_of(source), dest.nbytes
        out += [(to + a, frm + a, min(_COPY_BYTES, n - a)) for a in range(0, n, _COPY_BYTES)]
    return out


@dataclass
class _Layout:
    """Where a task's pieces land: the buffers of each range, each piece's destination (where
    it is hashed) and, for bounced pieces, its address in the bounce buffer."""

    ranges: list[tuple[int, list[memoryview]]] = field(default_factory=list)
    dests: list[memoryview] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    at: int = 0  # bytes of the bounce buffer taken


class PartReader:
    """Runs one part's plan: both passes, on the pool (``limits``: the read's, which the plan
    was cut to; its thread counts and populate minimum)."""

    def __init__(
        self,
        store: Store,
        part: ResolvedPart,
        views: Sequence[memoryview],
        plan: ReadPlan,
        *,
        on_bytes: Callable[[int], None],
        mapped: Mapped | None,
        cold_files: frozenset[int] = frozenset(),
        on_ready: Callable[[int], None] | None = None,
        limits: ReadLimits,
    ) -> None:
        self.store, self.part, self.views, self.plan = store, part, views, plan
        self.limits = limits
        self.on_bytes = on_bytes
        self.on_ready = on_ready
        # With on_ready: the blobs each unit of work of the first pass verifies (by its
        # number), and per blob how many units are still to finish.
        self._units: dict[int, list[int]] = {}
        self._left: list[int] = []
        self._left_lock = threading.Lock()
        self.cold = cold_files
        self.pieces: PieceLists = plan.pieces.lists()
        # The address of each view's first byte, taken once: pieces are hashed and copied by
        # address (no view slices), with the GIL released.
        self.address = [_native.address_of(v) for v in views]
        self.outcome = Outcome()
        self.verifier = Verifier(part, self.pieces, self.address, self.outcome)
        self.mapped = (
            MappedWork(mapped, self.pieces, self.verifier, self.outcome, on_bytes)
            if mapped is not None
            else None
        )
        n = part.manifest.chunk_bytes
        self.staged = {i: np.empty(part.blobs[i].nbytes // n * n, np.uint8) for i in plan.staged}
        self.gatherer = Gatherer(
            store, part, views, self.staged, self.outcome, on_bytes, gap_bytes=limits.gap_bytes
        )
        self.scratch = memoryview(bytearray(limits.gap_bytes))  # gap bytes, shared: never read
        self.tls = threading.local()

    # -- passes

    def first_pass(self) -> None:
        plan = self.plan
        tasks = plan.first.tasks(plan.pieces.offset)
        n = len(tasks)
        gathers = [functools.partial(self._gather, n + i, g) for i, g in enumerate(plan.gathers)]
        hashed: list[Callable[[], object]] = []
        batches: list[list[int]] = []
        if self.mapped is not None:
            at = n + len(gathers)
            batches = plan.first_mapped.lists()
            hashed = [functools.partial(self._hash, at + i, b) for i, b in enumerate(batches)]
        if self.on_ready is not None:
            self._count_units(tasks, batches)
        self._run_tasks(tasks, False, [*gathers, *hashed])

    def _count_units(self, tasks: list[Task], batches: list[list[int]]) -> None:
        """Note which blobs each unit of the first pass verifies (tasks, gathers and mapped
        batches, numbered as they are run), and how many units each blob waits for."""
        p_blob, p_direct = self.pieces.blob, self.pieces.direct
        units: list[list[int]] = [
            list(dict.fromkeys(p_blob[p] for _o, ps, _g in runs for p in ps if not p_direct[p]))
            for _f, runs in tasks
        ]
        units += [[g.blob] for g in self.plan.gathers]
        units += [list(dict.fromkeys(p_blob[p] for p in ps if not p_direct[p])) for ps in batches]
        left = [0] * len(self.part.blobs)
        for blobs in units:
            for b in blobs:
                left[b] += 1
        self._left = left
        self._units = {i: blobs for i, blobs in enumerate(units) if blobs}

    def _finished(self, number: int) -> None:
        """Unit ``number`` of the first pass ran to its end: each blob it verified that no
        other unit still has to, and whose every chunk matched, is ready."""
        blobs = self._units.get(number)
        if blobs is None or self.on_ready is None or number in self.outcome.failed:
            return
        ready = []
        with self._left_lock:
            for b in blobs:
                self._left[b] -= 1
                if not self._left[b]:
                    ready.append(b)
        for b in ready:
            if b not in self.outcome.bad_blobs:
                self.on_ready(b)

    def _gather(self, number: int, task: Gather) -> None:
        self.gatherer.run(number, task)
        self._finished(number)

    def _hash(self, number: int, pids: list[int]) -> None:
        assert self.mapped is not None
        self.mapped.hash(number, pids)
        self._finished(number)

    def second_pass(self) -> None:
        for blob, staged in self.staged.items():
            _native.memmove(self.address[blob], _native.address_of(staged), staged.nbytes)
        plan = self.plan
        tasks = plan.second.tasks(plan.pieces.offset)
        n = len(tasks)
        copies: list[Callable[[], object]] = []
        if self.mapped is not None:
            batches = plan.second_mapped.lists()
            copies = [functools.partial(self.mapped.copy, n + i, b) for i, b in enumerate(batches)]
        self._run_tasks(tasks, True, copies)

    def _run_tasks(
        self, tasks: list[Task], second: bool, extra: Sequence[Callable[[], object]]
    ) -> None:
        """Run ``tasks`` (and ``extra`` work) on the pool; the tasks that read into the bounce
        buffers (into='s own leaves) are read one after the other on this thread, in file
        order, and verified on the pool: one sequential stream of reads keeps the kernel's
        read-ahead going on a cold cache (two readers at alternate offsets took ~25% longer
        here), while hashing still overlaps the reads on other cores. From a warm cache (the
        probe of :meth:`_cold`) every pool thread reads and hashes its own tasks: a single
        reader is then the bottleneck (~35% slower here)."""
        # Cold files are read with direct I/O by the pool (several reads in flight, no
        # read-ahead to keep going); the sequential reader is for the page cache's.
        bounced = [
            i for i, t in enumerate(tasks) if t[0] not in self.cold and self._bounced_bytes(t)
        ]
        if len(bounced) < 2 or not self._cold([tasks[i] for i in bounced]):
            work = [functools.partial(self._task, i, t, second) for i, t in enumerate(tasks)]
            cold = [t for t in tasks if t[0] in self.cold]
            threads = self.limits.cold_threads if cold else self.limits.read_threads
            with prefaulting(self._fresh_ranges(cold)):
                _run([*work, *extra], threads)
        else:
            self._run_sequential(tasks, bounced, second, extra)
        self.outcome.raise_first(self.part, self.store.url)

    def _run_sequential(
        self,
        tasks: list[Task],
        bounced: list[int],
        second: bool,
        extra: Sequence[Callable[[], object]],
    ) -> None:
        set_bounced = set(bounced)
        work: list[Callable[[], object]] = [
            functools.partial(self._task, i, t, second)
            for i, t in enumerate(tasks)
            if i not in set_bounced
        ]
        threads = self.limits.read_threads
        ring: queue.SimpleQueue[_Buffer] = queue.SimpleQueue()
        for _ in range(threads + 1):
            ring.put(np.empty(0, np.uint8))
        with ThreadPoolExecutor(threads, thread_name_prefix="cryosnap-read") as pool:
            futures: list[Future[object]] = [pool.submit(w) for w in [*work, *extra]]
            for i in bounced:
                buf = ring.get()  # at most threads + 1 tasks read and not yet verified
                futures.append(pool.submit(self._task(i, tasks[i], second, buf, ring)))
            for future in futures:
                future.result()

    def _cold(self, tasks: list[Task]) -> bool:
        """Whether most of a few probes (the first byte of the first, middle and last of
        ``tasks``) find their page out of the page cache: only on a store with a local path;
        False wherever it cannot be told."""
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

    def _fresh_ranges(self, tasks: list[Task]) -> list[tuple[int, int]]:
        """(address, bytes) of the large pieces ``tasks`` read into leaves, in task order."""
        p, address, least = self.pieces, self.address, self.limits.populate_min_bytes
        return [
            (address[p.blob[i]] + p.start[i], p.nbytes[i])
            for _f, runs in tasks
            for _o, pids, _g in runs
            for i in pids
            if not p.direct[i] and p.nbytes[i] >= least
        ]

    def _bounced_bytes(self, task: Task) -> int:
        if not self.plan.has_direct:
            return 0
        direct, p_nbytes = self.pieces.direct, self.pieces.nbytes
        return sum(p_nbytes[p] for _o, pids, _g in task[1] for p in pids if direct[p])

    # -- tasks (on the pool's threads)

    def _bounce(self, nbytes: int) -> _Buffer:
        """This thread's bounce buffer, at least ``nbytes`` long (reused: fresh pages cost
        faults)."""
        buf: _Buffer | None = getattr(self.tls, "bounce", None)
        if buf is None or len(buf) < nbytes:
            # Page-aligned: a direct read of a cold file lands there without a copy.
            buf = self.tls.bounce = np.frombuffer(aligned_memory(max(nbytes, 1 << 20)), np.uint8)
        return buf

    def _task(
        self,
        number: int,
        task: Task,
        second: bool,
        buf: _Buffer | None = None,
        ring: queue.SimpleQueue[_Buffer] | None = None,
    ) -> Callable[[], None]:
        """Read ``task`` and verify it. With ``buf`` (and ``ring``, which gets the buffer back
        once it is free) the read lands in ``buf`` and the verification is returned, to run on
        another thread; otherwise it runs here (and a no-op is returned)."""
        f, runs = task
        key = self.part.files[f]
        bounced = self._bounced_bytes(task)
        if buf is not None and bounced and len(buf) < bounced:
            buf = np.empty(max(bounced, 1 << 20), np.uint8)
        if not bounced:
            bounce = self.scratch
        else:
            bounce = (buf if buf is not None else self._bounce(bounced)).data
        cold = f in self.cold
        layout = self._layout(runs, bounced, bounce, populate=not cold)
        # A cold file is read from the disk with direct I/O (into='s own leaves bounced from
        # it, past the staging budget, are read so in both passes).
        read = self.store.read_ranges
        if cold:
            read = getattr(self.store, "read_ranges_cold", read)
        try:
            read(key, layout.ranges)
        except BaseException as exc:
            self._failed(number, key, runs, exc, ring)
            return _nothing
        verify = functools.partial(self._verify, number, runs, layout, second, buf, ring)
        if ring is not None:
            return verify
        verify()
        return _nothing

    def _verify(
        self,
        number: int,
        runs: list[Run],
        layout: _Layout,
        second: bool,
        buf: _Buffer | None,
        ring: queue.SimpleQueue[_Buffer] | None,
    ) -> None:
        try:
            pids = [p for _o, ps, _g in runs for p in ps]
            nbytes = self.verifier.verify(pids, layout.dests, layout.sources if second else None)
        finally:
            if ring is not None and buf is not None:
                ring.put(buf)
        if not second:
            self.on_bytes(nbytes)
            self._finished(number)

    def _failed(
        self,
        number: int,
        key: str,
        runs: list[Run],
        exc: BaseException,
        ring: queue.SimpleQueue[_Buffer] | None,
    ) -> None:
        # A read that failed may still land later (a timed-out call goes on): this thread's
        # bounce buffer (or the ring's) is never used again.
        if ring is not None:
            ring.put(np.empty(0, np.uint8))
        else:
            self.tls.bounce = None
        if isinstance(exc, (TruncatedError, CheckpointNotFoundError)):
            exc = self._unreadable_run(key, runs, exc)
        self.outcome.fail(number, exc)

    def _layout(
        self, runs: list[Run], bounced: int, bounce: memoryview, *, populate: bool = True
    ) -> _Layout:
        """The buffers each run of a task reads into, and where each piece lands (fresh large
        pieces mapped in first, unless ``populate`` is False: a prefault thread does it)."""
        out = _Layout()
        base = _native.address_of(bounce) if bounced else 0
        direct = self.pieces.direct
        for run in runs:
            _offset, pids, gaps = run
            if not bounced and not any(gaps):
                self._into_leaves(run, out, populate)
            elif not any(gaps) and all([direct[p] for p in pids]):
                self._into_bounce(run, out, bounce, base)
            else:
                self._mixed(run, out, bounce, base, populate)
        return out

    def _into_leaves(self, run: Run, out: _Layout, populate: bool) -> None:
        """Pieces back to back into the leaves themselves (a state of many small tensors: most
        runs): one view each, no per-piece bookkeeping."""
        offset, pids, _gaps = run
        views, address, p = self.views, self.address, self.pieces
        p_blob, p_start, p_nbytes, whole = p.blob, p.start, p.nbytes, p.whole
        bufs = [
            views[p_blob[i]]
            if whole[i]
            else views[p_blob[i]][p_start[i] : p_start[i] + p_nbytes[i]]
            for i in pids
        ]
        least = self.limits.populate_min_bytes
        for i in [i for i in pids if populate and p_nbytes[i] >= least]:
            _native.populate(address[p_blob[i]] + p_start[i], p_nbytes[i])
        out.dests += bufs
        out.ranges.append((offset, bufs))

    def _into_bounce(self, run: Run, out: _Layout, bounce: memoryview, base: int) -> None:
        """Into='s own leaves back to back: one buffer for the run, a slice per piece."""
        offset, pids, _gaps = run
        p_nbytes = self.pieces.nbytes
        ends = list(itertools.accumulate([p_nbytes[p] for p in pids], initial=out.at))
        out.dests += [bounce[a:z] for a, z in itertools.pairwise(ends)]
        out.sources += [base + a for a in ends[:-1]]
        out.ranges.append((offset, [bounce[out.at : ends[-1]]]))
        out.at = ends[-1]

    def _mixed(self, run: Run, out: _Layout, bounce: memoryview, base: int, populate: bool) -> None:
        """Gaps (read into scratch), leaves read into and bounced pieces (consecutive ones in
        one buffer) in one run."""
        offset, pids, gaps = run
        p = self.pieces
        bufs: list[memoryview] = []
        merged = -1  # where the bounced pieces that follow each other began (one buffer)
        for pid, gap in zip(pids, gaps, strict=True):
            blob, start, nbytes, direct = p.blob[pid], p.start[pid], p.nbytes[pid], p.direct[pid]
            if gap or not direct:
                if merged >= 0:
                    bufs.append(bounce[merged : out.at])
                    merged = -1
                if gap:
                    bufs.append(self.scratch[:gap])
            if direct:
                out.dests.append(bounce[out.at : out.at + nbytes])
                out.sources.append(base + out.at)
                if merged < 0:
                    merged = out.at
                out.at += nbytes
                continue
            view = self.views[blob]
            if nbytes != view.nbytes:
                view = view[start : start + nbytes]
            if populate and nbytes >= self.limits.populate_min_bytes:
                _native.populate(self.address[blob] + start, nbytes)
            bufs.append(view)
            out.dests.append(view)
        if merged >= 0:
            bufs.append(bounce[merged : out.at])
        out.ranges.append((offset, bufs))

    # -- errors

    def _unreadable_run(self, key: str, runs: list[Run], exc: Exception) -> IntegrityError:
        """The error naming the leaf whose bytes ``key`` lacks: for a truncated file the blob
        the end of the file cuts off (not the first one of the read), when its size can be
        had."""
        victim = self.pieces.blob[runs[0][1][0]]
        if isinstance(exc, TruncatedError):
            victim = self._cut_off(key, runs, victim)
        path = self.part.blobs[victim].path
        return unreadable(self.part, self.store.url, key, exc, path)

    def _cut_off(self, key: str, runs: list[Run], default: int) -> int:
        """The blob whose bytes the truncated file ``key`` cuts off, or ``default`` when its
        size cannot be had."""
        p_nbytes = self.pieces.nbytes
        with contextlib.suppress(CheckpointError):
            size = self.store.size(key)
            for offset, pids, gaps in runs:
                at = offset
                for pid, gap in zip(pids, gaps, strict=True):
                    at += gap
                    if at + p_nbytes[pid] > size:
                        return self.pieces.blob[pid]
                    at += p_nbytes[pid]
        return default


def _run(work: Sequence[Callable[[], object]], threads: int) -> None:
    # Several reads in flight: copying out of the page cache and faulting in fresh pages run on
    # every core, and a remote store overlaps its latencies.
    if len(work) > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="cryosnap-read") as pool:
            for _ in pool.map(lambda task: task(), work):
                pass
    else:
        for task in work:
            task()


def _nothing() -> None:
    return None
