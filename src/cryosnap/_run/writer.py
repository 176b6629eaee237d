"""The writer: a version's write and commit on one level, and the thread that runs them.

:class:`VersionWriter` writes one job and runs the commit protocol, no thread of its own;
:class:`WriterThread` runs it for each saved version in order, then retention, policy events
and the hand-off; :class:`Rewriter` writes a version again with one (distributed scratch).
Runs on the writer thread (a hand-off's for the Rewriter); each VersionWriter on its own channel.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import cryosnap._run.replicated as _replicated
from cryosnap import engine
from cryosnap._format.chunks import merkle_root
from cryosnap._format.commit import CommitRecord, PartSummary
from cryosnap._format.keys import Lineage, commit_key
from cryosnap._format.manifest import Manifest, Replicated
from cryosnap._format.skeleton_text import SkeletonTextCache
from cryosnap._located import located
from cryosnap._run.capture.staging import direct_batches
from cryosnap._run.chain import ChainIndex
from cryosnap._run.job import END, Job
from cryosnap._run.levels.levels import Level, Levels
from cryosnap._run.redundancy.partner import Partners
from cryosnap._run.redundancy.rs import RSParity
from cryosnap._run.redundancy.xor import Parity
from cryosnap._run.results import CaptureTracker, PendingSave, SaveInfo
from cryosnap._state import FlatState
from cryosnap.dist import LEADER, Coordinator, agree
from cryosnap.dist._agree import first_errors
from cryosnap.engine.items import Batch
from cryosnap.errors import (
    CheckpointError,
    CoordinationError,
    SourceDamagedError,
    StorageTimeoutError,
)
from cryosnap.progress import Progress, human_bytes
from cryosnap.storage import Store
from cryosnap.storage.striped import Placement

__all__ = ["Rewriter", "VersionWriter", "WriterThread", "summary_of"]

log = logging.getLogger("cryosnap")

PolicyEvent = Callable[..., None]


def summary_of(part: engine.PartResult) -> PartSummary:
    """What the commit record needs of ``part`` (gathered from every participant)."""
    return PartSummary(
        ref=part.ref,
        data_files=tuple(sorted(part.used_files())),
        logical_bytes=part.logical_bytes,
        written_bytes=part.written_bytes,
        leaves=part.leaves,
        root=part.root.hex(),
        incremental=part.incremental,
        chain=part.chain(),
        chain_keys=part.chain_keys(),
    )


class VersionWriter:
    """Writes one :class:`Job` on ``level`` and commits it with the other participants, on
    the calling thread; ``chain`` is this rank's chain there, collectives go to ``channel``.

    The captured batches are hashed and diffed against the chain's base, new chunks go to the
    level's data file (of replicated state, only this rank's share: replicated.py; with
    several participants they then exchange fingerprints and where their shares lie), then the
    manifest; then every participant's ``PartSummary`` is gathered and
    rank 0 writes the commit record once every part is durable (on a private level each rank
    its own), and tells the others how it went."""

    def __init__(
        self,
        *,
        level: Level,
        chain: ChainIndex,
        coordinator: Coordinator,
        chunk_bytes: int,
        fence: Callable[[], None],
        placement: Placement | None = None,
        run_id: str | None = None,
        channel: str = "writer",
        partners: Partners | None = None,
        parity: Parity | RSParity | None = None,
        stats: bool = True,
    ) -> None:
        self.level = level
        self.chain = chain
        self.coord = coordinator.channel(channel)
        # A private level of a distributed run (node-local scratch): each rank writes its
        # whole part there as a run of its own (rank 0 of a world of one), commits it itself
        # once every rank's part is durable, and copies it to its partner.
        self.private = not level.shared and coordinator.world_size > 1
        self.partners = partners
        # partner="xor" or "rs:K+M": the version's parity before its commit record
        self.parity = parity
        self.chunk_bytes = chunk_bytes
        self.placement = placement
        self.fence = fence
        self.run_id = run_id  # recorded in every commit record this writer writes
        self.stats = stats  # per-leaf statistics in every manifest (Checkpointer(stats=))
        # Steps whose commit record write timed out (it may still land): save them again under
        # another step only. Their files are reserved on the level.
        self.in_doubt: set[int] = set()
        # Set once a collective of the writer's channel failed (a participant died or did not
        # arrive in time): the channel is broken for good (gloo, MPI), so this writer stops
        # saving, as one that lost its lock does.
        self.disagreed: CoordinationError | None = None
        # The last skeleton's text, kept for the next version's manifest (its own: a writer
        # thread's skeletons share nodes version after version, another writer's do not).
        self.skeleton_texts = SkeletonTextCache()

    @property
    def store(self) -> Store:
        return self.level.store

    def plan(self, flat: FlatState, keys: Replicated) -> _replicated.Plan:
        """Who writes which chunks of ``flat``'s replicated blobs on this writer's level (the
        capture copies only this rank's share: it computes the plan before the writer)."""
        world = 1 if self.private else self.coord.world_size
        return _replicated.plan(flat, keys, world, self.chunk_bytes)

    def own_rank(self) -> int:
        """This rank's number in the parts this writer writes (0 on a private level)."""
        return 0 if self.private else self.coord.rank

    def note_disagreement(self, exc: BaseException) -> None:
        """Stop for good when ``exc`` (or its cause) is a failed collective."""
        while exc is not None and self.disagreed is None:
            if isinstance(exc, CoordinationError):
                self.disagreed = exc
                log.error("the run's participants no longer agree (%s); this writer stops", exc)
            exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]

    # -- one version ---------------------------------------------------------------------------

    def fail(self, step: int, exc: BaseException) -> None:
        """This rank cannot write ``step`` at all: take part in the version's collectives,
        saying so, so that every rank fails it alike."""
        if self.disagreed is None and not isinstance(exc, CoordinationError):
            try:
                _replicated.send_failure(self.coord, exc)
                self._agree_commit(step, None, exc)
            except CheckpointError as agree:
                self.note_disagreement(agree)

    def write(self, job: Job) -> tuple[SaveInfo, engine.PartResult]:
        """Write and commit ``job`` on this thread; raises when it is not committed."""
        store = self.store
        writer: engine.PartWriter | None = None
        ended = False
        held: Batch | None = None  # taken from the queue, not yet handed to the part writer
        # Every rank of a distributed save takes part in the replicas' exchange once.
        exchanged = self.coord.world_size == 1
        copied = self.partners is None  # the partner copy, collective like the exchange
        progress = Progress(f"cryosnap: saving step {job.step}", job.flat.logical_bytes)
        with located(step=job.step, path=store.url):
            try:
                if self.disagreed is not None:
                    raise CoordinationError(f"step {job.step} was not saved: {self.disagreed}")
                plan = job.plan if job.plan is not None else self.plan(job.flat, job.replicated)
                # An eager capture's hand-over of live blobs starts (_run/capture/through.py).
                job.begin()
                # The capture decides (before its first batch) whether the version is full or
                # must build on exactly one version: change detection on the device.
                item = job.batches.get()
                if item is END:
                    ended = True
                elif isinstance(item, Batch):
                    held = item
                try:
                    base = self.chain.base_for_next(
                        store,
                        full=job.full,
                        exact=job.diff_base,
                        step=job.step,
                        lineage=job.lineage,
                    )
                except CheckpointError as exc:
                    raise CheckpointError(
                        f"step {job.step}: {exc}", step=job.step, path=store.url
                    ) from exc
                writer = self._part_writer(job, plan, base)
                while item is not END:
                    if isinstance(item, BaseException):
                        raise item
                    batch: Batch = item
                    held = None
                    writer.add(batch.pieces, batch.release)
                    progress.update(batch.nbytes)
                    item = job.batches.get()
                ended = True
                if not exchanged:
                    exchanged = True
                    _replicated.exchange(self.coord, job.step, job.flat, writer, plan)
                part = writer.finish()
                if self.partners is not None:
                    copied = True
                    keys = [*part.used_files(), *part.chain_keys()]
                    self.partners.copy_files(self.coord, store, job.step, [*keys, part.ref.key])
            except BaseException as exc:
                if held is not None:
                    held.release()
                if writer is not None:
                    writer.abort()
                if not ended:
                    # Stop the capture (it polls this) and give every slab of this version back,
                    # so a capture blocked on the staging budget can finish.
                    job.pending.request_abort(exc)
                    job.drain()
                self._tell_failure(job, exc, exchanged=exchanged, copied=copied)
                raise
            finally:
                progress.close()
            self._agree_commit(job.step, part, None, job)
            return self._saved(job, part), part

    def _part_writer(
        self, job: Job, plan: _replicated.Plan, base: engine.ResolvedPart | None
    ) -> engine.PartWriter:
        return engine.PartWriter(
            self.store,
            job.step,
            job.flat,
            chunk_bytes=self.chunk_bytes,
            base=base,
            index=self.chain.index if base is not None else None,
            placement=self.placement,
            rank=self.own_rank(),
            shares=plan.shares,
            replicated=plan.keys,
            lineage=job.lineage,
            # Remnants are copied forward only where retention will drop versions.
            compact=self.level.keep is not None,
            skeleton_texts=self.skeleton_texts,
            stats=self.stats,
            # The persistent level's codec (Checkpointer(codec=)); None on scratch.
            codec=self.level.codec,
        )

    def _tell_failure(self, job: Job, exc: BaseException, *, exchanged: bool, copied: bool) -> None:
        """The others wait for this part in the exchange and the commit: tell them it failed."""
        if self.disagreed is None and not isinstance(exc, CoordinationError):
            try:
                if not exchanged:
                    _replicated.send_failure(self.coord, exc)
                if self.partners is not None and not copied:
                    self.partners.copy_files(self.coord, self.store, job.step, [])
                self._agree_commit(job.step, None, exc, job)
            except CheckpointError as told:
                log.error("step %d: telling the other participants failed: %s", job.step, told)
                self.note_disagreement(told)

    def _saved(self, job: Job, part: engine.PartResult) -> SaveInfo:
        """What the committed ``part`` cost (the SaveInfo of this level)."""
        seconds = time.perf_counter() - job.pending.started
        stall, _ = job.final_stall()
        log.info(
            "step %d durable in %.3f s: %s written",
            job.step,
            seconds,
            human_bytes(part.written_bytes),
        )
        return SaveInfo(
            step=job.step,
            logical_bytes=part.logical_bytes,
            written_bytes=part.written_bytes,
            chunks=part.chunks,
            new_chunks=part.new_chunks,
            stall_seconds=stall,
            seconds=seconds,
            incremental=part.incremental,
            tiers=(self.level.name,),
            captured_bytes=job.captured_bytes,
        )

    # -- the global commit ---------------------------------------------------------------------

    def _agree_commit(
        self,
        step: int,
        part: engine.PartResult | None,
        error: BaseException | None,
        job: Job | None = None,
    ) -> None:
        """Gather every participant's part to the leader; once all are durable the leader
        commits (a private level: every rank commits its own); everyone learns the outcome
        (a broadcast). Raises when this version is not committed."""
        if self.private:
            said = "" if error is None else str(error) or type(error).__name__
            failed = agree(self.coord, said, first_errors)
            self._commit_private(step, part, error, job, failed)
            return
        mine: dict[str, Any] = (
            {"part": summary_of(part).to_json()} if part is not None else {"error": str(error)}
        )
        gathered = self.coord.gather(mine, root=LEADER)
        outcome: dict[str, Any] = {}
        raised: CheckpointError | None = None
        if gathered is not None:
            raised = self._commit(step, job, gathered)
            outcome = {"ok": True} if raised is None else {"error": str(raised)}
        outcome = self.coord.broadcast(outcome, root=LEADER)
        if error is not None:
            return  # the caller re-raises its own failure
        if raised is not None:
            raise raised  # rank 0: the commit's own error, with its type
        if "error" in outcome:
            raise CheckpointError(f"step {step} was not committed: {outcome['error']}")

    def _commit_private(
        self,
        step: int,
        part: engine.PartResult | None,
        error: BaseException | None,
        job: Job | None,
        failed: list[tuple[int, Any]],
    ) -> None:
        """Every rank writes its own commit record (and its partner's copy of it) once every
        part is durable; a second gather tells whether all records landed, and a rank whose
        record landed while another's did not takes it back, so a version is on every rank's
        scratch or on none (a rank killed in between: the ranks agree at the next open).
        ``failed``: ``[rank, error]`` of each rank whose part failed (agreed)."""
        body: bytes | None = None
        problem = ""
        if not failed and part is not None:
            body, problem = self._own_record(step, job, part)
        if self.partners is not None:
            errors = self.partners.copy_record(self.coord, step, body)
            problem = problem or "; ".join(errors)
        bad = agree(self.coord, problem, first_errors)
        if bad:
            self._take_back(commit_key(step, job.lineage if job else None), own=body is not None)
        if error is not None:
            return
        if failed or bad:
            reason = "; ".join(f"rank {r}: {e}" for r, e in [*failed, *bad])
            raise CheckpointError(f"step {step} was not committed: {reason}")
        log.debug("committed step %d in %s", step, self.store.url)

    def _own_record(
        self, step: int, job: Job | None, part: engine.PartResult
    ) -> tuple[bytes | None, str]:
        """Write this rank's commit record of a private level (after its XOR parity, if any:
        collective); the record, or None and what failed."""
        body: bytes | None = None
        key = ""
        problem = ""
        try:
            record = self._record(step, job, [summary_of(part)])
            body, key = record.to_json(), record.key
        except CheckpointError as exc:
            problem = str(exc)
        if self.parity is not None:
            lineage = job.lineage if job is not None else None
            errors = self.parity.encode(self.coord, self.store, part, lineage, body)
            if errors and not problem:
                what = "XOR" if isinstance(self.parity, Parity) else "RS"
                problem = f"{what} parity: {'; '.join(errors)}"
        if problem:
            return None, problem
        assert body is not None
        try:
            self.fence()
            self.store.write(key, body)
        except CheckpointError as exc:
            return None, str(exc)
        return body, ""

    def _take_back(self, key: str, *, own: bool) -> None:
        """Remove this rank's commit record ``key`` (``own``) and those of the copies it
        holds for its partners: another rank's did not land."""
        stores = [self.store] if own else []
        stores += list(self.partners.held.values()) if self.partners is not None else []
        for store in stores:
            try:
                if store.exists(key):
                    store.delete(key)
            except CheckpointError as exc:
                log.error("removing commit record %s on %s failed: %s", key, store.url, exc)

    def _record(self, step: int, job: Job | None, parts: list[PartSummary]) -> CommitRecord:
        return CommitRecord.of_parts(
            step,
            parts,
            chunk_bytes=self.chunk_bytes,
            root=merkle_root([bytes.fromhex(p.root) for p in parts]).hex(),
            metrics=job.metrics if job is not None else None,
            run_id=self.run_id,
            lineage=job.lineage if job is not None else None,
        )

    def _commit(
        self, step: int, job: Job | None, gathered: list[dict[str, Any]]
    ) -> CheckpointError | None:
        """Rank 0: write the commit record if every part is durable; the failure, if any."""
        failed = [(r, g["error"]) for r, g in enumerate(gathered) if "error" in g]
        if failed:
            reason = "; ".join(f"rank {r}: {e}" for r, e in failed)
            return CheckpointError(f"step {step} was not committed: {reason}")
        store = self.store
        where = f"{store.url}: step {step}"
        try:
            parts = [PartSummary.from_json(g["part"], where) for g in gathered]
        except CheckpointError as exc:
            return exc
        try:
            record = self._record(step, job, parts)
            self.fence()
            store.write(record.key, record.to_json())
        except StorageTimeoutError as exc:
            # The write may still land after we gave up: until then every file it names stays,
            # so a late commit record never makes a broken version visible.
            self.in_doubt.add(step)
            keys = {p.ref.key for p in parts} | {f for p in parts for f in p.data_files}
            keys |= {k for p in parts for k in p.chain_keys}
            self.level.reserved.update(keys)
            return exc
        except CheckpointError as exc:
            return exc
        log.debug("committed step %d in %s", step, store.url)
        return None


class WriterThread:
    """Runs each saved :class:`Job` through ``version`` (write -> commit) on a thread of its
    own, then retention on level ``index``, the policy's events and the hand-off."""

    def __init__(
        self,
        version: VersionWriter,
        *,
        levels: Levels,
        policy_event: PolicyEvent,
        clock: Callable[[], float],
        inflight: threading.BoundedSemaphore,
        index: int = 0,
        keep_in_memory: Callable[[int, engine.PartResult, Lineage | None], bool] | None = None,
    ) -> None:
        self.version = version
        # The memory level's copy of each committed version (collective: _run/memory.py).
        self.keep_in_memory = keep_in_memory
        self.levels = levels
        self.index = index
        self.policy_event = policy_event
        self.clock = clock
        self.inflight = inflight
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._queued = 0  # jobs submitted and not yet through _run (settle waits for none)
        self._settled = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="cryosnap-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._settled:
            self._queued += 1
        self._jobs.put(job)

    def settle(self) -> None:
        """Block until every submitted job is written, committed or failed, and the retention
        that follows a commit is done (its deletes run after the version is reported)."""
        with self._settled:
            self._settled.wait_for(lambda: self._queued == 0)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self.version.skeleton_texts.clear()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            part: engine.PartResult | None = None
            info: SaveInfo | None = None
            try:
                info, part = self.version.write(job)
            except BaseException as exc:
                text = str(exc)
                if text.startswith(f"step {job.step}:"):  # cryosnap's errors name it already
                    log.error("checkpoint failed: %s", text)
                else:
                    log.error("checkpoint of step %d failed: %s", job.step, text)
                self.version.note_disagreement(exc)
                job.pending.fail(exc)
            finally:
                self.inflight.release()
            try:
                if part is not None and info is not None:
                    self._after_commit(job, part, info)
                else:
                    self._after_failure(job)
            finally:
                with self._settled:
                    self._queued -= 1
                    self._settled.notify_all()
            # Not kept while waiting for the next job: a version's state (its packs of small
            # tensors among them, which the next flatten fills again: _state/reuse.py) is
            # freed once it is written.
            del job, part, info

    def _after_failure(self, job: Job) -> None:
        try:
            # Retention runs after a commit only: what the failed save wrote goes now.
            self.levels.sweep_failed(self.index)
        except Exception:
            log.exception("removing what the failed save of step %d left", job.step)
        self.policy_event("failed", job.step)

    def _after_commit(self, job: Job, part: engine.PartResult, info: SaveInfo) -> None:
        later: list[Callable[[], None]] = []
        chain = self.version.chain
        partners = self.version.partners
        try:
            # Retention before the version is reported, so that a caller sees the run as
            # ``keep`` says; SaveInfo.seconds was taken before, it does not count it.
            chain.advance(part, job.lineage)
            # The commit records of dropped versions go now, their files once the version
            # is reported (below): still before this writer's next write.
            self.levels.retire(self.index, protect={job.step}, later=later)
            if partners is not None:
                # Copies of versions the next level has not committed yet are kept.
                levels = self.levels.levels
                nxt = levels[self.index + 1].store if self.index + 1 < len(levels) else None
                partners.retire(levels[self.index].keep, nxt)
            if self.version.parity is not None:
                self.version.parity.retire(self.version.store)
            self.policy_event(
                "durable",
                job.step,
                seconds=self.clock() - job.clock0,
                stall_seconds=job.final_stall()[1],
            )
        except Exception as exc:
            # The version is committed; a failing retention or policy must not stop the
            # writer (the next version is full: the base may be half-retired), unless the
            # participants no longer agree.
            log.exception("after committing step %d", job.step)
            self.version.note_disagreement(exc)
            chain.forget()
            later.clear()
        self.levels.reached(self.index, job.step, job.pending, info)
        try:
            for finish in later:
                finish()  # logs the failures of the store (Levels.retire)
        except Exception:
            log.exception("retention after step %d", job.step)
            chain.forget()
        if self.keep_in_memory is not None and self.version.disagreed is None:
            try:
                self.keep_in_memory(job.step, part, job.lineage)
            except Exception as exc:
                # The version is durable below; the memory level only misses it.
                log.exception("keeping step %d in memory", job.step)
                self.version.note_disagreement(exc)


class Rewriter:
    """The flush into the persistent level of a distributed run with node-local scratch.

    Each rank's scratch holds its whole part, so a node restores alone; the persistent level
    must hold the replicated state once in total. So instead of copying files, every rank reads
    its part of the version back from its scratch (every chunk verified) and the ranks write it
    on the persistent level exactly as a distributed save without scratch does: replicated
    state split across them, divergence checked, rank 0 committing once every part is durable.
    ``writer`` is a :class:`VersionWriter` of that level (its channel is the hand-off's), its
    chain this rank's on that level. Runs on the hand-off thread, one
    version after the other in the order every rank committed them on scratch.
    """

    def __init__(self, writer: VersionWriter) -> None:
        self.writer = writer
        self.chain = writer.chain

    def __call__(
        self,
        src: Store,
        dst: Store,
        step: int,
        *,
        yield_to: Callable[[], None],
        fence: Callable[[], None],
    ) -> int:
        yield_to()
        writer = self.writer
        shares: list[tuple[_replicated.Plan, dict[int, np.ndarray[Any, Any]]]] = []

        def others_share(
            flat: FlatState, manifest: Manifest
        ) -> dict[int, np.ndarray[Any, np.dtype[np.bool_]]]:
            # Once the blob sizes are known: the other ranks' chunks of the replicated state
            # are neither read nor verified here; their recorded hashes go to the writer.
            if manifest.chunk_bytes != writer.chunk_bytes:
                return {}  # other chunks on this level: the writer hashes what it reads
            plan = writer.plan(flat, manifest.replicated)
            shares.append((plan, plan.foreign(writer.own_rank())))
            return shares[0][1]

        try:
            got = engine.read_flat(src, step, skip=others_share)
        except CheckpointError as exc:
            writer.fail(step, exc)
            raise SourceDamagedError(f"step {step} on scratch {src.url}: {exc}") from exc
        flat, manifest = got.flat, got.manifest
        tracker = CaptureTracker(0)
        tracker.finish()
        names = (writer.level.name,)
        pending = PendingSave(step, tracker, time.perf_counter(), names, names)
        job = Job(
            step,
            flat,
            pending,
            queue.SimpleQueue(),
            got.record.metrics,
            replicated=manifest.replicated,
            lineage=got.record.lineage,
        )
        foreign: dict[int, np.ndarray[Any, Any]] = {}
        if shares:
            (job.plan, foreign), job.rank = shares[0], writer.own_rank()
        batches = direct_batches(
            flat,
            batch_bytes=engine.IO_BATCH_BYTES,
            chunk_bytes=writer.chunk_bytes,
            foreign=foreign,
            hashes=got.hashes,
        )
        for batch in batches:
            job.batches.put(batch)
        job.batches.put(END)
        _, part = self.writer.write(job)
        self.chain.advance(part, job.lineage)
        return part.written_bytes

    def agree(self, step: int, retry: bool) -> bool:
        """After a failed attempt at ``step`` (collective, on the hand-off's channel): True
        when every rank will try again. A step whose commit record may still land is not
        written again; a broken channel ends the flush on this rank without a collective (the
        others' gather then times out and ends theirs)."""
        writer = self.writer
        if writer.disagreed is not None:
            return False
        return agree(writer.coord, retry and step not in writer.in_doubt, all)
