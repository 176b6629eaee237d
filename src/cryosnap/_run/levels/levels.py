"""Storage levels: the ordered list a version travels through, fastest first.

Each :class:`Level` has its own store, write lock and retention; a :class:`Handoff` copies a
version to the next level. Retention never drops a version that has not reached the next one.
Runs on the writer thread (first level) and the hand-off threads (the next ones).
docs/design/levels.md has the why.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from cryosnap import engine
from cryosnap._format.keys import (
    Lineage,
    data_writers,
    supersedes,
    visible_versions,
    written_by,
)
from cryosnap._run.chain import ChainIndex
from cryosnap._run.levels.codec import LevelCodec
from cryosnap._run.levels.flush import (
    CollectiveFlush,
    Flushed,
    Flusher,
    flush_keys,
    flush_version,
)
from cryosnap._run.lock import RunLock
from cryosnap._run.results import CaptureTracker, PendingSave, SaveInfo, Status
from cryosnap.dist import Coordinator
from cryosnap.errors import (
    CheckpointError,
    CoordinationError,
    LockLostError,
    SourceDamagedError,
)
from cryosnap.policy import KeepLast, RetentionPolicy
from cryosnap.storage import Store

__all__ = ["Handoff", "Level", "Levels"]

log = logging.getLogger("cryosnap")


@dataclass(slots=True)
class Level:
    """One storage level: its store, lock, retention, and whether every participant shares it
    (the persistent level) or it is this participant's own (node-local scratch)."""

    name: str
    store: Store
    keep: int | RetentionPolicy | None
    shared: bool
    locks: list[RunLock] = field(default_factory=list)
    # Files retention must not delete: versions whose commit record may still land.
    reserved: set[str] = field(default_factory=set)
    # The codec of the data files written here, by a flush or the write path
    # (Checkpointer(codec=), the persistent level only), or None.
    codec: LevelCodec | None = None

    def steps(self) -> list[int]:
        return engine.list_steps(self.store)


def _ignore_reached(step: int, level: str, seconds: float) -> None:
    return None


class Handoff:
    """Copies committed versions from ``src`` to ``dst`` on a thread of its own, in order."""

    def __init__(
        self,
        levels: Levels,
        index: int,
        *,
        retry_seconds: float,
        yield_to: Callable[[], None],
        flush: CollectiveFlush | None = None,
    ) -> None:
        self._levels = levels
        # A flush made of collectives (every rank rewrites its part: see Levels.rewrite) is
        # retried only when every rank agrees to, and the versions to resume at open are agreed.
        self.collective = flush is not None
        self.src = levels.levels[index]
        self.dst = levels.levels[index + 1]
        self.index = index
        self._lock = threading.Lock()
        # Versions on src waiting for this hand-off: their PendingSave and src SaveInfo.
        self.pending: dict[int, tuple[PendingSave, SaveInfo | None]] = {}
        self.delivered: set[int] = set()  # versions that reached dst
        self.failed: set[int] = set()  # hand-off failed for good: src retention keeps them
        # What the flush of each resumed version (one this session did not save, so without
        # a SaveInfo) cost: bounded by the versions resumed at open.
        self.resumed: dict[int, Flushed] = {}
        plain = functools.partial(flush_version, codec=self.dst.codec)
        self.flusher = Flusher(
            self.src.store,
            self.dst.store,
            retry_seconds=retry_seconds,
            on_done=self._done,
            yield_to=yield_to,
            fence=levels.fence,
            flush=flush if flush is not None else plain,
            agree=flush.agree if flush is not None else None,
        )

    def submit(self, step: int, pending: PendingSave, info: SaveInfo | None) -> None:
        with self._lock:
            self.pending[step] = (pending, info)
        self.flusher.submit(step)

    def unfinished(self) -> set[int]:
        """Versions src must keep: not on dst yet, or failed to get there."""
        with self._lock:
            return set(self.pending) | self.failed

    def _done(self, step: int, outcome: Flushed | BaseException) -> None:
        """On the flusher thread: ``step`` reached dst, or its hand-off failed for good."""
        error = outcome if isinstance(outcome, BaseException) else None
        with self._lock:
            pending, info = self.pending.pop(step)
            (self.failed if error is not None else self.delivered).add(step)
            if isinstance(outcome, Flushed) and info is None:
                self.resumed[step] = outcome
        if error is not None:
            if isinstance(error, SourceDamagedError) and self.index == 0:
                # The first level lost files this chain needs: no version may build on it.
                self._levels.chain.request_full()
            elif not isinstance(error, SourceDamagedError):
                # Its commit record may still land on dst (a write that timed out).
                self.dst.reserved.update(flush_keys(self.src.store, step))
            pending.fail(error)
            return
        if info is not None:
            seconds = time.perf_counter() - pending.started
            info = replace(info, tiers=(*info.tiers, self.dst.name), seconds=seconds)
            log.info("step %d on %s after %.3f s", step, self.dst.name, seconds)
        try:
            self._levels.retire(self.index + 1, protect={step})
        finally:
            self._levels.reached(self.index + 1, step, pending, info)


def _superseded_on(store: Store) -> bool:
    """Whether ``store`` holds commit records of superseded versions (retention reclaims them
    whatever ``keep`` says)."""
    try:
        records = engine.list_records(store)
    except CheckpointError:
        return False
    return len(records) != len(visible_versions(records))


class Levels:
    """The run's levels, fastest first, and the hand-offs between them."""

    def __init__(
        self,
        levels: list[Level],
        *,
        chain: ChainIndex,
        coordinator: Coordinator,
    ) -> None:
        self.levels = levels
        self.chain = chain
        self.coordinator = coordinator
        # Retention's collectives run on the writer thread: a channel of their own, created
        # here at open (creating one is collective on torch.distributed and MPI).
        self._retire_channel = coordinator.channel("retire")
        self.handoffs: list[Handoff] = []
        # Told (step, level, seconds from the level below) when a version reaches a level.
        self.observe: Callable[[int, str, float], None] = _ignore_reached
        # Set once a lock check finds this writer no longer holds the run: it stops saving.
        self.lock_lost: LockLostError | None = None
        # Per level written by a writer of its own, that writer's chain: retention makes it
        # forget files before deleting them (the first level's is ``chain``).
        self.chains: dict[int, ChainIndex] = {0: chain}
        # Held while retention deletes files (its last step removes every file a write in
        # progress leaves, ``Store.remove_incomplete``) and by ``Checkpointer.mark`` while it
        # writes a mark record from the caller's thread: a mark's temporary file is not taken
        # for a killed write's. Taken before the run lock's mutex (fence), never after.
        self.files_lock = threading.Lock()

    def fence(self) -> None:
        """Raise :class:`LockLostError` unless this writer still holds every level's lock;
        runs before each commit record and each retention pass (any thread)."""
        if self.lock_lost is not None:
            raise self.lock_lost
        try:
            for level in self.levels:
                for lock in level.locks:
                    lock.check()
        except LockLostError as exc:
            self.lock_lost = exc
            log.error("%s; this writer stops saving", exc)
            raise

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(level.name for level in self.levels)

    @property
    def first(self) -> Level:
        return self.levels[0]

    def stores(self) -> list[Store]:
        return [level.store for level in self.levels]

    def name_of(self, store: Store) -> str:
        """The name of the level whose store ``store`` is."""
        return next(level.name for level in self.levels if level.store is store)

    def shared(self) -> list[bool]:
        """Per level, fastest first, whether every participant shares it."""
        return [level.shared for level in self.levels]

    def start_handoffs(
        self,
        *,
        retry_seconds: float,
        yield_to: Callable[[], None],
        rewrite: Callable[[int], CollectiveFlush] | None = None,
    ) -> None:
        """One hand-off per pair of levels. ``rewrite(i)``: the flush into level ``i`` when
        the ranks write it again (a shared level after a private one in a distributed run)."""
        for i in range(len(self.levels) - 1):
            flush = None
            if rewrite is not None and self.rewritten(i + 1):
                # The ranks write the level again (writer.Rewriter): its VersionWriter
                # applies the level's codec on the write path.
                flush = rewrite(i + 1)
            self.handoffs.append(
                Handoff(self, i, retry_seconds=retry_seconds, yield_to=yield_to, flush=flush)
            )

    def rewritten(self, index: int) -> bool:
        """Whether versions reach level ``index`` by being written again rather than copied:
        a shared level after a private one with several participants (each rank's scratch
        holds its whole part; the shared level gets the replicated state split)."""
        return (
            self.coordinator.world_size > 1
            and index > 0
            and self.levels[index].shared
            and not self.levels[index - 1].shared
        )

    # -- a version moving up -------------------------------------------------------------------

    def reached(self, index: int, step: int, pending: PendingSave, info: SaveInfo | None) -> None:
        """``step`` is durable on level ``index``: report it, and hand it to the next level
        unless its save policy keeps it below (``pending.levels``)."""
        name = self.levels[index].name
        # Reported before it is queued, so result(tier=...) sees this level first.
        pending.reached(name, info)
        self.observe(step, name, pending.seconds_to(name))
        if index < len(self.handoffs) and index + 1 < len(pending.levels):
            self.handoffs[index].submit(step, pending, info)

    def resume_unflushed(self, keep_persistent: int | RetentionPolicy | None) -> list[PendingSave]:
        """On open: versions committed on a faster level and missing on the next (a crash
        between a commit and its hand-off) are handed off now (those retention would keep)."""
        out: list[PendingSave] = []
        for handoff in self.handoffs:
            there = engine.list_versions(handoff.dst.store)
            # Not those a record on dst supersedes (a rewind saved there after this level
            # was left behind): they are no versions of the run.
            here = engine.versions_among(handoff.src.store, handoff.dst.store)
            on_dst = [s for s, lin in there.items() if s not in here or here[s] == lin]
            handoff.delivered.update(on_dst)
            missing = [s for s in here if s not in handoff.delivered]
            if handoff.collective:
                # Every rank flushes the same versions in the same order: those all still have.
                told = self.coordinator.all_gather(missing)
                missing = sorted(set.intersection(*(set(m) for m in told)))
            if isinstance(handoff.dst.keep, KeepLast):
                wanted = set(sorted({*on_dst, *missing})[-handoff.dst.keep.n :])
                missing = [s for s in missing if s in wanted]
            for step in missing:
                tracker = CaptureTracker(0)
                tracker.finish()
                names = self.names[handoff.index :]
                pending = PendingSave(step, tracker, time.perf_counter(), names, self.names)
                out.append(pending)
                handoff.submit(step, pending, None)
            if missing:
                log.info(
                    "handing %d version(s) left on %s to %s: %s",
                    len(missing),
                    handoff.src.name,
                    handoff.dst.name,
                    missing,
                )
        return out

    # -- retention -----------------------------------------------------------------------------

    def retire(
        self,
        index: int,
        *,
        protect: Collection[int] = (),
        later: list[Callable[[], None]] | None = None,
    ) -> None:
        """Apply level ``index``'s retention; a failure is logged and finished by the next pass.
        ``later``: on an unshared level, the deletes of files are appended to it to run after
        the version is reported (:func:`engine.retire`); wrapped in the same error handling."""
        level = self.levels[index]
        if level.keep is None and not _superseded_on(level.store):
            return
        keep_also = set(protect)
        if index < len(self.handoffs):
            keep_also |= self.handoffs[index].unfinished()
        chain = self.chains.get(index)
        try:
            with self.files_lock:
                self._retire_level(level, keep_also, chain, later)
        except LockLostError:
            return  # recorded by the fence; nothing was deleted
        except CoordinationError:
            raise  # the participants no longer agree: the writer stops (_writer.py)
        except CheckpointError as exc:
            # Versions are committed; a failed clean-up is finished by the next pass.
            log.warning("retention on %s failed: %s", level.store.url, exc)

    def _retire_level(
        self,
        level: Level,
        keep_also: set[int],
        chain: ChainIndex | None,
        later: list[Callable[[], None]] | None,
    ) -> None:
        """One retention pass of ``level`` (under ``files_lock``; see :meth:`retire`)."""
        if level.shared and self.coordinator.world_size > 1:
            self._retire_shared(level, keep_also, chain)
        else:
            forget = chain.forget_files if chain is not None else engine.ignore_files
            deferred: list[Callable[[], None]] | None = [] if later is not None else None
            engine.retire(
                level.store,
                keep=level.keep,
                protect=keep_also,
                reserved=set(level.reserved),
                fence=self.fence,
                before_delete=forget,
                later=deferred,
            )
            if later is not None and deferred:
                later.append(lambda: self._finish_retire(level.store.url, deferred))

    def _finish_retire(self, url: str, deferred: list[Callable[[], None]]) -> None:
        try:
            with self.files_lock:
                for fn in deferred:
                    fn()
        except LockLostError:
            return  # recorded by the fence; nothing more was deleted
        except CheckpointError as exc:
            log.warning("retention on %s failed: %s", url, exc)

    def _retire_shared(self, level: Level, protect: set[int], chain: ChainIndex | None) -> None:
        """Rank 0 plans, every rank forgets the doomed files, then rank 0 deletes while the
        others wait. The doomed files go out as the writers that made them
        (:func:`data_writers`: a few ranges per retired version, not a name per rank), so
        what a rank receives is flat in N; a rank forgets at most a few files more than are
        deleted (a writer's other files), which costs de-duplication, never correctness."""
        coord = self._retire_channel
        plan: engine.RetirePlan | None = None
        decision: dict[str, object]
        if coord.rank == 0:
            try:
                plan = engine.plan_retire(
                    level.store, keep=level.keep, protect=protect, reserved=set(level.reserved)
                )
                runs, other = data_writers(plan.data_files)
                decision = {"writers": runs, "other": other}
            except CheckpointError as exc:
                decision = {"error": str(exc)}
        else:
            decision = {}
        decision = coord.broadcast(decision)
        if "error" in decision:
            raise CheckpointError(f"retention on {level.store.url}: {decision['error']}")
        writers, named = decision["writers"], decision["other"]
        assert isinstance(writers, list) and isinstance(named, list)
        if chain is not None:
            chain.forget_where(written_by(writers, named))
        coord.barrier()
        try:
            if plan is not None:
                engine.apply_retire(level.store, plan, fence=self.fence)
        finally:
            # Nobody writes its next part before the deletes (and the removal of crash
            # leftovers, which a write in progress would look like) are over.
            coord.barrier()

    def sweep(self) -> None:
        """At open (collective), before any save or hand-off: remove what writes that never
        committed left on the levels this participant writes (a killed save's ``.partial``
        file, the data files and manifest of a version whose commit record was never
        written), which no retention pass removes where ``keep`` is None. Nothing else
        writes meanwhile: this participant holds the levels' locks (rank 0 holds
        and sweeps a shared level's for every participant), and no participant goes on
        before every one is done. The files a resumed hand-off reuses (a flush interrupted
        after copying them) stay. A failure is logged; the next pass finishes the work."""
        coord = self.coordinator
        for index, level in enumerate(self.levels):
            if level.shared and coord.rank != 0:
                continue
            chain = self.chains.get(index)
            try:
                engine.retire(
                    level.store,
                    reserved=level.reserved | self._resumable(index),
                    fence=self.fence,
                    before_delete=chain.forget_files if chain is not None else engine.ignore_files,
                )
            except CheckpointError as exc:
                log.warning(
                    "removing what unfinished saves left on %s failed: %s", level.store.url, exc
                )
        if coord.world_size > 1:
            coord.barrier()  # no participant writes before the shared level is swept

    def sweep_failed(self, index: int) -> None:
        """On the writer thread, after a save on level ``index`` failed and before its next
        write: remove what it left (data files, a manifest), unless its commit record may
        still land (``reserved``), so that a disk it failed on is not kept full by it. Not on
        a level every participant writes (its deletes would need them all to stop): the next
        open sweeps it. A failure is logged."""
        level = self.levels[index]
        if level.shared and self.coordinator.world_size > 1:
            return
        chain = self.chains.get(index)
        try:
            with self.files_lock:
                engine.retire(
                    level.store,
                    reserved=set(level.reserved),
                    fence=self.fence,
                    before_delete=chain.forget_files if chain is not None else engine.ignore_files,
                )
        except LockLostError:
            return  # recorded by the fence; nothing was deleted
        except CheckpointError as exc:
            log.warning("removing what a failed save left on %s failed: %s", level.store.url, exc)

    def _resumable(self, index: int) -> set[str]:
        """The files on level ``index`` that the flush of a version on the level below and not
        on this one writes: an interrupted flush left them for the resumed one to reuse."""
        if index == 0:
            return set()
        src = self.levels[index - 1].store
        here = engine.list_versions(self.levels[index].store)
        return {k for s in engine.list_steps(src) if s not in here for k in flush_keys(src, s)}

    def retire_all_after_close(self) -> None:
        """After the hand-offs ended: the faster levels' retention can apply to what reached
        the next level."""
        for i in range(len(self.handoffs)):
            self.retire(i)

    # -- state ---------------------------------------------------------------------------------

    def status(self) -> Status:
        steps = {level.name: tuple(level.steps()) for level in self.levels}
        waiting: set[int] = set()
        error = None
        for handoff in self.handoffs:
            waiting |= handoff.unfinished()
            error = error or handoff.flusher.last_error
        space = {level.name: tuple(engine.version_space(level.store)) for level in self.levels}
        return Status(
            steps=steps, not_persistent=tuple(sorted(waiting)), flush_error=error, space=space
        )

    def step_exists(self, step: int, lineage: Lineage | None = None) -> str | None:
        """The url of a level where ``step`` is a version that a save of ``step`` in
        ``lineage`` would not supersede, if any."""
        for level in self.levels:
            versions = engine.list_versions(level.store)
            if step in versions and not supersedes(lineage, step, versions[step]):
                return level.store.url
        return None

    def records(self) -> list[tuple[int, Lineage | None]]:
        """Every commit record on every level (superseded ones included)."""
        return [r for level in self.levels for r in engine.list_records(level.store)]

    def versions(self) -> dict[int, Lineage | None]:
        """The versions of the run: on at least one level, and superseded on none."""
        return engine.list_versions(*self.stores())

    # -- closing -------------------------------------------------------------------------------

    def finish_within(self, seconds: float) -> None:
        for handoff in self.handoffs:
            handoff.flusher.finish_within(seconds)

    def abandon(self) -> None:
        for handoff in self.handoffs:
            handoff.flusher.abandon()

    def close_handoffs(self) -> None:
        for handoff in self.handoffs:
            handoff.flusher.close()

    def release_locks(self) -> None:
        for level in self.levels:
            for lock in level.locks:
                lock.release()
