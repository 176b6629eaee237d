"""The writer: the Checkpointer's one background thread that makes versions durable.

Versions are written one after the other, in the order they were saved: the captured batches
are hashed and diffed against the base (:class:`~cryosnap._chain.ChainIndex`), new chunks go to
the first level's data file (of replicated state, only this rank's share: _replicated.py;
with several participants they then exchange fingerprints and where their shares lie), then
the manifest; then the participants agree on the commit
(each one's :class:`~cryosnap.manifest.PartSummary` is gathered, rank 0 writes the commit record
once every part is durable and tells the others how it went), retention runs on the first
level, the policy is told what the version cost, and the version is reported durable on the
first level and handed to the next (levels.py).

Runs on the writer thread; its collectives use the coordinator's ``"writer"`` channel, so they
never interleave with a hand-off's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _replicated, engine
from ._capturing import END, Job
from ._chain import ChainIndex
from ._results import SaveInfo
from .capture import Batch
from .chunks import merkle_root
from .dist import Coordinator
from .errors import CheckpointError, CoordinationError, StorageTimeoutError
from .levels import Levels
from .manifest import CommitRecord, PartSummary, commit_key, manifest_key
from .progress import Progress, human_bytes
from .storage.tiers import Placement

__all__ = ["Writer", "summary_of"]

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
    )


class Writer:
    """Runs each saved :class:`Job` through write -> commit -> retention -> hand-off."""

    def __init__(
        self,
        *,
        levels: Levels,
        chain: ChainIndex,
        coordinator: Coordinator,
        chunk_bytes: int,
        placement: Placement | None,
        fence: Callable[[], None],
        policy_event: PolicyEvent,
        clock: Callable[[], float],
        inflight: threading.BoundedSemaphore,
        run_id: str | None = None,
    ) -> None:
        self.levels = levels
        self.chain = chain
        self.coord = coordinator.channel("writer")
        self.chunk_bytes = chunk_bytes
        self.placement = placement
        self.fence = fence
        self.policy_event = policy_event
        self.clock = clock
        self.inflight = inflight
        self.run_id = run_id  # recorded in every commit record this writer writes
        # Steps whose commit record write timed out (it may still land): save them again under
        # another step only. Their files are reserved on the first level.
        self.in_doubt: set[int] = set()
        # Set once a collective of the writer channel failed (a participant died or did not
        # arrive in time): the channel is broken for good (gloo, MPI), so this writer stops
        # saving, as one that lost its lock does.
        self.disagreed: CoordinationError | None = None
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cryosnap-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            part: engine.PartResult | None = None
            info: SaveInfo | None = None
            try:
                info, part = self._write(job)
            except BaseException as exc:
                log.error("checkpoint of step %d failed: %s", job.step, exc)
                self._note_disagreement(exc)
                job.pending.fail(exc)
            finally:
                self.inflight.release()
            if part is not None and info is not None:
                self._after_commit(job, part, info)
            else:
                self._tell_policy("failed", job.step)

    def _after_commit(self, job: Job, part: engine.PartResult, info: SaveInfo) -> None:
        try:
            # Retention before the version is reported, so that a caller sees the run as
            # ``keep`` says; SaveInfo.seconds was taken before, it does not count it.
            self.chain.advance(part)
            self.levels.retire(0, protect={job.step})
            self._tell_policy(
                "durable",
                job.step,
                seconds=self.clock() - job.clock0,
                stall_seconds=job.stall_clock + job.pending.stall_seconds,
            )
        except Exception as exc:
            # The version is committed; a failing retention or policy must not stop the
            # writer (the next version is full: the base may be half-retired), unless the
            # participants no longer agree.
            log.exception("after committing step %d", job.step)
            self._note_disagreement(exc)
            self.chain.forget()
        self.levels.reached(0, job.step, job.pending, info)

    def _note_disagreement(self, exc: BaseException) -> None:
        while exc is not None and self.disagreed is None:
            if isinstance(exc, CoordinationError):
                self.disagreed = exc
                log.error("the run's participants no longer agree (%s); this writer stops", exc)
            exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]

    def _tell_policy(self, event: str, step: int, **figures: float) -> None:
        self.policy_event(event, step, **figures)

    # -- one version ---------------------------------------------------------------------------

    def _write(self, job: Job) -> tuple[SaveInfo, engine.PartResult]:
        store = self.levels.first.store
        writer: engine.PartWriter | None = None
        ended = False
        held: Batch | None = None  # taken from the queue, not yet handed to the part writer
        # Every rank of a distributed save takes part in the replicas' exchange once.
        exchanged = self.coord.world_size == 1
        progress = Progress(f"cryosnap: saving step {job.step}", job.flat.logical_bytes)
        try:
            if self.disagreed is not None:
                raise CoordinationError(f"step {job.step} was not saved: {self.disagreed}")
            world = self.coord.world_size
            plan = _replicated.plan(job.flat, job.replicated, world, self.chunk_bytes)
            # The capture decides (before its first batch) whether the version is full or
            # must build on exactly one version: change detection on the device.
            item = job.batches.get()
            if item is END:
                ended = True
            elif isinstance(item, Batch):
                held = item
            try:
                base = self.chain.base_for_next(store, full=job.full, exact=job.diff_base)
            except CheckpointError as exc:
                raise CheckpointError(f"step {job.step}: {exc}") from exc
            writer = engine.PartWriter(
                store,
                job.step,
                job.flat,
                chunk_bytes=self.chunk_bytes,
                base=base,
                index=self.chain.index if base is not None else None,
                placement=self.placement,
                rank=self.coord.rank,
                shares=plan.shares,
                replicated=plan.keys,
            )
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
            # The others wait for this part in the exchange and the commit: tell them it failed.
            if self.disagreed is None and not isinstance(exc, CoordinationError):
                try:
                    if not exchanged:
                        _replicated.send_failure(self.coord, exc)
                    self._agree_commit(job, None, exc)
                except CheckpointError as agree:
                    log.error("step %d: telling the other participants failed: %s", job.step, agree)
                    self._note_disagreement(agree)
            raise
        finally:
            progress.close()
        self._agree_commit(job, part, None)
        seconds = time.perf_counter() - job.pending.started
        log.info(
            "step %d durable in %.3f s: %s written",
            job.step,
            seconds,
            human_bytes(part.written_bytes),
        )
        info = SaveInfo(
            step=job.step,
            logical_bytes=part.logical_bytes,
            written_bytes=part.written_bytes,
            chunks=part.chunks,
            new_chunks=part.new_chunks,
            stall_seconds=job.stall_seconds + job.pending.stall_seconds,
            seconds=seconds,
            incremental=part.incremental,
            tiers=(self.levels.first.name,),
            captured_bytes=job.captured_bytes,
        )
        return info, part

    # -- the global commit ---------------------------------------------------------------------

    def _agree_commit(
        self, job: Job, part: engine.PartResult | None, error: BaseException | None
    ) -> None:
        """Gather every participant's part; rank 0 commits once all are durable; everyone
        learns the outcome. Raises when this version is not committed."""
        mine: dict[str, Any] = (
            {"part": summary_of(part).to_json()} if part is not None else {"error": str(error)}
        )
        gathered = self.coord.all_gather(mine)
        outcome: dict[str, Any] = {}
        raised: CheckpointError | None = None
        if self.coord.rank == 0:
            raised = self._commit(job, gathered)
            outcome = {"ok": True} if raised is None else {"error": str(raised)}
        outcome = self.coord.broadcast(outcome)
        if error is not None:
            return  # the caller re-raises its own failure
        if raised is not None:
            raise raised  # rank 0: the commit's own error, with its type
        if "error" in outcome:
            raise CheckpointError(f"step {job.step} was not committed: {outcome['error']}")

    def _commit(self, job: Job, gathered: list[dict[str, Any]]) -> CheckpointError | None:
        """Rank 0: write the commit record if every part is durable; the failure, if any."""
        failed = [(r, g["error"]) for r, g in enumerate(gathered) if "error" in g]
        if failed:
            reason = "; ".join(f"rank {r}: {e}" for r, e in failed)
            return CheckpointError(f"step {job.step} was not committed: {reason}")
        store = self.levels.first.store
        where = f"{store.url}: step {job.step}"
        try:
            parts = [PartSummary.from_json(g["part"], where) for g in gathered]
        except CheckpointError as exc:
            return exc
        try:
            record = CommitRecord.of_parts(
                job.step,
                parts,
                chunk_bytes=self.chunk_bytes,
                root=merkle_root([bytes.fromhex(p.root) for p in parts]).hex(),
                metrics=job.metrics,
                run_id=self.run_id,
            )
            self.fence()
            store.write(commit_key(job.step), record.to_json())
        except StorageTimeoutError as exc:
            # The write may still land after we gave up: until then every file it names stays,
            # so a late commit record never makes a broken version visible.
            self.in_doubt.add(job.step)
            keys = {p.ref.key for p in parts} | {f for p in parts for f in p.data_files}
            keys |= {manifest_key(s, p.ref.rank) for p in parts for s in p.chain}
            self.levels.first.reserved.update(keys)
            return exc
        except CheckpointError as exc:
            return exc
        log.debug("committed step %d in %s", job.step, store.url)
        return None
