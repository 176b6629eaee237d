"""Checkpointer: the facade of a managed run, and the one-shot ``save`` / ``load`` over it.

A save has two phases. *Capture* (the capture room, _capturing.py) runs on the caller's thread
(eager) or a capture thread (lazy) and copies the state into pooled staging slabs. Everything
after runs in the background: the writer (_writer.py) hashes, writes and commits each version on
the first storage level, one after the other, with the participants agreeing through the
run's :class:`~cryosnap.dist.Coordinator`; hand-offs (levels.py) copy it to the next levels.
``save`` returns a :class:`PendingSave` as soon as the state is captured (eager) or at once
(lazy); ``PendingSave.result()`` returns the :class:`SaveInfo` once the version is durable on
every level (``result(tier="scratch")``: on that one).

This module validates arguments, wires the rooms together and keeps what the caller sees: the
pending saves, failures not yet received (raised once more by the next ``save``, ``wait`` or
``close``), restores from the fastest level holding a complete copy. docs/ARCHITECTURE.md draws
the rooms and which thread runs what. Runs on the caller's thread.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from . import _replicated, _signals, _validate, engine
from ._capturing import Capturer, Job
from ._chain import ChainIndex
from ._devcopy import target_device
from ._devdiff import DeviceDiff
from ._partner import Partners, rebuild
from ._policy_room import PolicyRoom
from ._results import PendingSave, SaveInfo, Status
from ._validate import step as validate_step
from ._writer import Rewriter, Writer
from .capture import CaptureTracker
from .chunks import validate_chunk_bytes
from .dist import Coordinator, LocalCoordinator
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CoordinationError,
    IntegrityError,
    LockLostError,
    WorldSizeError,
)
from .levels import Level, Levels
from .lock import RunLock, acquire_run_lock
from .manifest import (
    RUN_ID_PATTERN,
    CommitRecord,
    Lineage,
    commit_key,
    max_generation,
    version_prefix,
    visible_versions,
)
from .policy import RetentionPolicy, SavePolicy, as_retention
from .progress import Progress
from .storage import DEFAULT_TIMEOUT_SECONDS, Store, join_location, open_store, unwrap
from .storage.tiers import Placement, StripedStore, Tier
from .tree import flatten

__all__ = ["Checkpointer", "PendingSave", "SaveInfo", "Status", "load", "run_id_of", "save"]

SCRATCH, PERSISTENT = "scratch", "persistent"

log = logging.getLogger("cryosnap")

PathLike = str | os.PathLike[str] | Store


class Checkpointer:
    """A managed run: versions by step, saved in the background, restored on demand.

    Parameters
    ----------
    path
        The run's persistent tier: a directory or an fsspec URL (``s3://bucket/run``).
    scratch
        Node-local tiers, fastest first: a path, a :class:`~cryosnap.Tier`, or a list of them
        (several devices: each version's data is split across them by measured throughput).
        Versions land there first and are flushed to ``path`` in the background.
    keep
        Versions to keep on the persistent tier: an int (the newest N), a retention policy from
        :mod:`cryosnap.policy` (``KeepEvery``, ``KeepBest`` by a metric given to ``save``,
        ``KeepAny`` of several), or None (all). The newest version is always kept. Others are
        deleted after each commit; a data file or manifest goes only when no kept version
        needs it.
    keep_scratch
        Versions to keep on scratch (default 2; only with ``scratch``); a version leaves
        scratch only once it is persistent.
    incremental
        Write only chunks whose content is new since the previous version (True), or every
        version in full (False).
    full_every
        With ``incremental``, a full (self-contained) version at least every N versions, which
        bounds the chain a restore has to resolve.
    chunk_bytes
        Chunk size for hashing and verification, 4 KiB to 64 MiB.
    staging_bytes
        Host memory budget for captured state (None: as much as the state needs, kept for reuse).
        With less than the state, capture streams and blocks until the writer frees buffers.
    max_inflight
        Versions that may be captured but not yet durable; a further ``save`` waits.
    allow_pickle
        Pickle leaves of unsupported types on save, and allow unpickling them on restore.
    policy
        When to save: a save policy from :mod:`cryosnap.policy` (``EveryNSteps``,
        ``EveryNSeconds``, ``Adaptive``), asked by :meth:`should_save` and told what each save
        cost.
    handle_signals
        Signals (e.g. ``(signal.SIGTERM, signal.SIGUSR1)``) that mark the run as preempted
        instead of killing it: :attr:`preempted` becomes true, :meth:`should_save` says yes,
        and the loop saves and exits. Handlers are installed on open and restored on close
        (main thread only).
    storage_options
        Options for fsspec when ``path`` is a URL (endpoint, credentials); the usual
        ``AWS_*`` environment variables work too.
    flush_retry_seconds
        How long a failing flush to the persistent tier is retried (with backoff) before the
        version's ``result()`` and the next ``wait()`` raise; it stays on scratch meanwhile.
    storage_timeout_seconds
        The longest one storage call (a read, a write of one batch, a listing, an fsync) may
        take before it fails with :class:`~cryosnap.StorageTimeoutError`: a stalled tier (a hung
        NFS mount, an endpoint that accepts connections and never answers) becomes an error
        instead of a hang. None: no bound. With it, :meth:`close` returns within about
        ``flush_retry_seconds`` plus a few storage calls, whatever the tiers do.
    comm
        The run's participants: None (the torch.distributed job when it is initialized with
        several processes, through a ``TorchCoordinator``; else a world of one), or a
        :class:`cryosnap.dist.Coordinator` (``TorchCoordinator``, ``MPICoordinator``)
        (e.g. one rank of :class:`cryosnap.dist.InProcessGroup`). Every participant saves its
        own part of each version; rank 0 takes the write lock and commits once every part is
        durable. With ``scratch`` each participant keeps its whole part on its node's scratch
        (under ``<scratch>/rank-<r>``), and the persistent level gets each version written
        again from there, its replicated state split across the participants
        (docs/DISTRIBUTED.md).
    partner
        With several participants and ``scratch``: also copy each participant's scratch part
        to the scratch of a participant on another node (node: the host name, or
        ``$CRYOSNAP_NODE``), as part of the scratch commit. A participant whose scratch lost
        versions its partner holds gets them back when the run is opened again.
    clock
        The monotonic clock (seconds) the save policy is told the time by; tests pass a fake.
    run_id
        Which training this is (1 to 128 of ``A-Z a-z 0-9 . _ : -``), recorded with every
        version it saves. When the run's newest version was saved by another training (another
        run id, or none), opening raises :class:`~cryosnap.CheckpointError`: a new training
        goes to a new path; resuming one passes its id (:func:`run_id_of`). None: no check,
        versions carry no id.
    device_diff
        Find the chunks that changed since the previous version where the tensors live
        (128-bit fingerprints computed on the device, kept there), and copy only those to the
        host: for GPU state, only changed chunks cross PCIe. None (default): for CUDA tensors
        of 4 MiB or more, when CUDA is available; True: for torch tensors on any device,
        the CPU included; False: never. Needs ``incremental`` and a ``chunk_bytes`` of whole
        32-bit words. Such a version builds on exactly the previous one: the first version of
        a session and one every ``full_every`` are full, and if a version fails, one captured
        against it meanwhile fails too (the next is captured in full).
    """

    def __init__(
        self,
        path: PathLike,
        *,
        scratch: PathLike | Tier | Sequence[PathLike | Tier] | None = None,
        keep: int | RetentionPolicy | None = None,
        keep_scratch: int | None = None,
        incremental: bool = True,
        full_every: int = 16,
        chunk_bytes: int = 1 << 20,
        staging_bytes: int | None = None,
        max_inflight: int = 1,
        allow_pickle: bool = False,
        policy: SavePolicy | None = None,
        handle_signals: Sequence[int] = (),
        storage_options: dict[str, Any] | None = None,
        flush_retry_seconds: float = 300.0,
        storage_timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
        comm: Coordinator | None = None,
        clock: Callable[[], float] = time.monotonic,
        run_id: str | None = None,
        device_diff: bool | None = None,
        partner: bool = False,
    ) -> None:
        self._run_id = _validate_run_id(run_id)
        self.chunk_bytes = validate_chunk_bytes(chunk_bytes)
        budget = _validate.positive_int_or_none(staging_bytes, "staging_bytes")
        if budget is not None and budget < self.chunk_bytes:
            raise ValueError(
                f"staging_bytes={budget} is smaller than one chunk (chunk_bytes={chunk_bytes})"
            )
        self.max_inflight = _validate.positive_int(max_inflight, "max_inflight")
        self.keep = as_retention(keep)
        policy = _policy(policy)
        signals = _signals.parse_signals(handle_signals)
        if keep_scratch is not None and scratch is None:
            raise ValueError(
                f"keep_scratch={keep_scratch!r} needs scratch=: without scratch tiers every "
                "version goes to the persistent tier, whose retention is keep="
            )
        self.keep_scratch = (
            2 if keep_scratch is None else _validate.positive_int(keep_scratch, "keep_scratch")
        )
        retry = _validate.seconds(flush_retry_seconds, "flush_retry_seconds", allow_zero=True)
        timeout = _validate.seconds(
            storage_timeout_seconds, "storage_timeout_seconds", allow_none=True
        )
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self._clock = clock
        self.coordinator = _coordinator(comm)
        # One channel per thread that issues collectives: the caller's (policy, restore),
        # the writer's and the hand-offs' never interleave.
        self._policies = PolicyRoom(policy, clock=clock, coordinator=self.coordinator)
        self._restore_channel = self.coordinator.channel("restore")
        self.full_every = _validate.positive_int(full_every, "full_every")
        self.incremental = _validate.boolean(incremental, "incremental")
        self.allow_pickle = bool(allow_pickle)
        partner = _validate.boolean(partner, "partner")
        if partner and (scratch is None or self.coordinator.world_size == 1):
            raise ValueError(
                "partner=True copies each participant's scratch to another node's: it needs "
                "scratch= and several participants (comm=)"
            )
        self.persistent, self.scratch = _open_stores(
            path, scratch, storage_options, timeout, self.coordinator
        )
        if self._run_id is not None:
            stores = [self.persistent] if self.scratch is None else [self.scratch, self.persistent]
            _check_run_id(stores, self._run_id)
        self._placement = Placement(self.scratch) if self.scratch is not None else None
        chain = ChainIndex(
            incremental=self.incremental,
            full_every=self.full_every,
            chunk_bytes=self.chunk_bytes,
            # A distributed run's scratch holds each rank's part as a run of its own (rank 0).
            rank=self.coordinator.rank if self.scratch is None else 0,
        )
        self._levels = _open_levels(self, chain)
        self._partners = _open_partners(self, scratch, timeout) if partner else None
        self._levels.observe = self._policies.reached
        self.store: Store = self._levels.first.store  # where versions are written first
        self._chain = chain
        # The lineage new versions are committed in: the run's newest generation, or a new one
        # once a restore rewound the run (docs/FORMAT.md, "Superseding").
        self._lineage = _current_lineage(self._levels.records())
        self._restored: int | None = None
        self._capturer = Capturer(
            chunk_bytes=self.chunk_bytes,
            budget=budget,
            clock=clock,
            diff=_device_diff(device_diff, self.incremental, self.chunk_bytes, self.full_every),
        )
        self._inflight = threading.BoundedSemaphore(self.max_inflight)
        self._pending: list[PendingSave] = []
        self._closed = False
        self._signals: list[int] = []
        self._retry_seconds = retry
        _start_background(self, signals)
        self._writer = Writer(
            levels=self._levels,
            chain=self._chain,
            coordinator=self.coordinator,
            chunk_bytes=self.chunk_bytes,
            placement=self._placement,
            fence=self._levels.fence,
            policy_event=self._policies.event,
            clock=clock,
            inflight=self._inflight,
            run_id=self._run_id,
            partners=self._partners,
        )

    # context manager ---------------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        # Drain and release, but do not mask the exception already propagating, and do not
        # keep retrying flushes to an unreachable persistent tier meanwhile.
        self._levels.abandon()
        try:
            self.close()
        except CheckpointError as err:
            log.error("background checkpoint failure during exception exit: %s", err)

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.url!r})"

    @property
    def run_id(self) -> str | None:
        """The run id recorded with each version this Checkpointer saves (None: none)."""
        return self._run_id

    # policies and preemption ----------------------------------------------------------------
    @property
    def policy(self) -> SavePolicy | None:
        """The save policy :meth:`should_save` asks (None: saves only when called)."""
        return self._policies.policy

    @property
    def preempted(self) -> bool:
        """Whether a preemption signal arrived (``handle_signals``); settable by the program."""
        return self._policies.preempted

    @preempted.setter
    def preempted(self, value: bool) -> None:
        self._policies.preempted = bool(value)

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: asks the save policy (call once per iteration); always
        true once the run is preempted. Every participant gets the same answer: rank 0's
        policy, or yes when any participant is preempted."""
        return self._policies.should_save(validate_step(step))

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._policies.on_signal(signum)

    def _restore_handlers(self) -> None:
        signals, self._signals = self._signals, []
        for signum in signals:
            _signals.unsubscribe(signum, self)

    # saving --------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        lazy: bool = False,
        metrics: dict[str, float] | None = None,
        replicated: bool | Sequence[str | int] | None = None,
    ) -> PendingSave:
        """Capture ``state`` as version ``step`` and write it in the background.

        Returns once the state is captured (``lazy=False``) or at once (``lazy=True``: the copy
        runs in the background; the next ``step()`` of an optimizer in the state waits for the
        leaves it mutates, and other leaves may be mutated only after ``wait_captured()``).
        ``metrics`` (name -> finite number, e.g. ``{"loss": 0.31}``) are stored with the version
        for retention policies such as ``KeepBest``. Every participant saves the same steps.
        ``replicated`` (a list of top-level keys of ``state``, or True for all of it) names
        state identical on every participant (data-parallel model and optimizer): it is
        written once in total, each participant writing its share of the new chunks, after
        the participants checked it is identical (else :class:`~cryosnap.ReplicaDivergenceError`
        on every one, nothing committed); it restores on any number of participants
        (``restore(replicated_only=True)``). In a world of one it changes nothing but the record.
        """
        t0 = time.perf_counter()
        job = self._start(step, state, t0, _metrics(metrics), replicated)
        try:
            if lazy:
                self._capturer.lazy(job, t0)
            else:
                self._capturer.eager(job)
                error = job.pending._tracker.error
                if error is not None:
                    job.pending.mark_delivered()
                    raise error
            self._policies.event("saved", step, stall_seconds=job.stall_clock)
        except KeyboardInterrupt as exc:
            _note_interrupt(exc, job)
            raise
        return job.pending

    def _save_durable(self, step: int, state: Any) -> SaveInfo:
        """Save without staging: the writer reads the live memory while the caller waits."""
        job = self._start(step, state, time.perf_counter())
        self._capturer.direct(job)
        return job.pending.result()

    def _start(
        self,
        step: int,
        state: Any,
        t0: float,
        metrics: dict[str, float] | None = None,
        replicated: object = None,
    ) -> Job:
        clock0 = self._clock()
        self._check_open()
        self._capturer.remove_spent_hooks()
        validate_step(step)
        self._raise_undelivered()
        if self._levels.lock_lost is not None:
            raise LockLostError(f"this writer stopped saving: {self._levels.lock_lost}")
        if self._writer.disagreed is not None:
            raise CoordinationError(
                f"step {step}: this writer stopped saving: the run's participants no longer "
                f"agree ({self._writer.disagreed}); restart the job (every rank reopens the run)"
            )
        if step in self._writer.in_doubt:
            raise CheckpointExistsError(
                f"step {step}: the commit record of an earlier save timed out and may still "
                f"appear in {self.store.url}; save under another step"
            )
        if any(p.step == step and not p.done() for p in self._pending):
            raise CheckpointExistsError(f"step {step} is already being saved in {self!r}")
        lineage = self._lineage
        where = self._levels.step_exists(step, lineage)
        if where is not None:
            raise CheckpointExistsError(f"step {step} already exists in {where}")
        flat = flatten(
            state,
            allow_pickle=self.allow_pickle,
            pack_bytes=self.chunk_bytes,
            pack_apart=replicated,
        )
        keys = _replicated.replicated_keys(replicated, flat)
        self._inflight.acquire()
        # Forget finished versions, but keep failed ones the caller has not received yet.
        self._pending = [p for p in self._pending if not p.done() or p.failed_undelivered()]
        tracker = CaptureTracker(len(flat.blobs))
        names = self._levels.names
        top = self._policies.top_level(step, len(names) - 1)
        pending = PendingSave(step, tracker, t0, names[: top + 1], names)
        job = Job(
            step,
            flat,
            pending,
            queue.SimpleQueue(),
            metrics,
            clock0=clock0,
            replicated=keys,
            lineage=lineage,
        )
        job.plan, job.rank = self._writer.plan(flat, keys), self._writer.own_rank()
        self._pending.append(pending)
        self._writer.submit(job)
        return job

    # waiting and reading -----------------------------------------------------------------------
    def _raise_undelivered(self) -> None:
        for p in self._pending:
            err = p.undelivered_error()
            if err is not None:
                raise err

    def wait(self) -> None:
        """Block until every pending save is durable and the writer is done with it (the
        files that retention drops are deleted after a version is reported: once this returns
        the run's folder holds what ``keep`` says); raise the first undelivered failure."""
        for p in list(self._pending):
            p._done.wait()
        self._writer.settle()
        self._raise_undelivered()

    def steps(self) -> list[int]:
        """Versions complete on at least one tier and superseded on none, ascending."""
        return sorted(self._levels.versions())

    def status(self) -> Status:
        """Which versions each tier holds, and which are not yet on the last one."""
        return self._levels.status()

    def latest_step(self) -> int | None:
        """The newest committed version (complete on at least one tier, superseded on none),
        or None. Not necessarily one that verifies: :meth:`restore` without a step falls back
        past damage, and says which step it restored through :meth:`restored_step`."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        keys: Sequence[str | int] | None = None,
        replicated_only: bool = False,
        map_location: Any = None,
    ) -> Any:
        """The state of ``step`` (default: the newest version that verifies, the same on every
        participant); see :func:`load` (``keys`` and ``map_location`` too).

        ``replicated_only``: only the keys saved as replicated (a dict of them; ``into``, a
        dict holding them, gets them filled and its other keys are left alone), on any number
        of participants. Without it, a version saved by another number of ranks than restore
        it (parts left unread, or a participant without a part) is a
        :class:`~cryosnap.WorldSizeError` on every participant, saying what it can do.
        """
        self._check_open()
        if step is not None:
            validate_step(step)
        ask = _Ask(
            ranks=tuple(self._part_ranks()),
            shared=tuple(level.shared for level in self._levels.levels),
            participants=self.coordinator.world_size,
            allow_pickle=self.allow_pickle,
            only=_validate.boolean(replicated_only, "replicated_only"),
            keys=engine.validate_keys(keys),
            device=_map_location(map_location, into),
        )
        stores = self._levels.stores()
        restored: list[int] = []
        if step is not None or self.coordinator.world_size == 1:
            state = _restore_tiers(stores, step, into=into, ask=ask, restored=restored)
        else:
            state = _restore_agreed(
                self._restore_channel, stores, into=into, ask=ask, restored=restored
            )
        self._rewound(restored[-1])
        return state

    @property
    def restored_step(self) -> int | None:
        """The step the last :meth:`restore` returned (None: none yet)."""
        return self._restored

    def _rewound(self, step: int) -> None:
        """After restoring ``step``: when the run holds later versions, the next version
        starts a new generation forked at ``step``, whose first commit supersedes them
        (docs/FORMAT.md, "Superseding"); otherwise saves go on in the run's lineage. Every
        participant restored the same step, and decides the same."""
        self._restored = step
        records = self._levels.records()
        later = any(s > step for s in visible_versions(records))
        newest = max_generation(records)
        private = not all(level.shared for level in self._levels.levels)
        if private and self.coordinator.world_size > 1:
            # Each rank's scratch is its own: they may see different versions, and each
            # commits its own scratch record in the lineage, so they agree on it. (On shared
            # levels only, every rank lists the same records: no collective, and a survivor
            # of a dead peer can still restore.)
            told = self._restore_channel.all_gather([later, newest])
            later, newest = any(t[0] for t in told), max(t[1] for t in told)
        current = self._lineage
        if later:
            self._lineage = Lineage(newest + 1, step)
        else:
            self._lineage = _current_lineage(records)
        if later or self._lineage != current:
            self._chain.restart_from(step)

    def _part_ranks(self) -> list[int]:
        """Per level, the part this participant reads: its rank on a shared level, part 0 of
        its own run on a private one (a distributed run's node-local scratch)."""
        me = self.coordinator.rank
        return [me if level.shared else 0 for level in self._levels.levels]

    def close(self) -> None:
        """Drain every pending save, stop the writer, release the write lock.

        Returns within about ``flush_retry_seconds`` plus a few storage calls (each bounded by
        ``storage_timeout_seconds``) whatever the tiers do.
        """
        if self._closed:
            return
        # Every flush still queued gets flush_retry_seconds in all, not each.
        self._levels.finish_within(self._retry_seconds)
        try:
            for p in list(self._pending):
                p._done.wait()
        finally:
            self._closed = True
            try:
                self._capturer.remove_spent_hooks()
                self._writer.stop()
                self._levels.close_handoffs()
                # The last versions reached the next levels: the faster ones' retention applies.
                self._levels.retire_all_after_close()
                self._capturer.clear()
            finally:
                self._levels.release_locks()
                self._restore_handlers()
        self._raise_undelivered()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")


def _device_diff(
    wanted: object, incremental: bool, chunk_bytes: int, full_every: int
) -> DeviceDiff | None:
    """The change detection on the device that ``Checkpointer(device_diff=...)`` asks for."""
    if wanted is not None and not isinstance(wanted, bool):
        raise TypeError(f"device_diff must be None, True or False, got {wanted!r}")
    if wanted is None:
        torch = sys.modules.get("torch")
        cuda = torch is not None and torch.cuda.is_available()
        if not (cuda and incremental and DeviceDiff.usable(chunk_bytes)):
            return None
    elif not wanted:
        return None
    elif not incremental:
        raise ValueError("device_diff=True needs incremental=True (it skips unchanged chunks)")
    elif not DeviceDiff.usable(chunk_bytes):
        raise ValueError(
            f"device_diff=True needs chunk_bytes of whole 32-bit words, got {chunk_bytes}"
        )
    return DeviceDiff(chunk_bytes, full_every=full_every, cpu=wanted is True)


def _note_interrupt(exc: KeyboardInterrupt, job: Job) -> None:
    """Ctrl-C during ``save()``: say whether the version is lost or will still commit."""
    tracker = job.pending._tracker
    if tracker.captured() and tracker.error is None:
        what = (
            f"cryosnap: step {job.step} was captured before the interrupt and is still being "
            "written: it commits unless the process exits first (wait() or close() waits for it)"
        )
    else:
        what = f"cryosnap: step {job.step} was interrupted during capture and is not saved"
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(what)
    else:
        log.error("%s", what)


def _start_background(ckpt: Checkpointer, signals: list[int]) -> None:
    """Start the hand-offs (resuming flushes a crash interrupted) and the signal handlers;
    on failure undo what was started and release the locks."""
    levels = ckpt._levels
    try:
        if ckpt.scratch is not None and ckpt.coordinator.world_size > 1:
            _drop_partial_scratch(ckpt)
        levels.start_handoffs(
            retry_seconds=ckpt._retry_seconds,
            yield_to=ckpt._capturer.wait_no_capture,
            rewrite=lambda index: _rewriter(ckpt, index),
        )
        ckpt._pending.extend(levels.resume_unflushed(ckpt.keep))
        for signum in signals:
            _signals.subscribe(signum, ckpt)
            ckpt._signals.append(signum)
    except BaseException:
        levels.abandon()
        levels.close_handoffs()
        ckpt._restore_handlers()
        levels.release_locks()
        raise


def _rewriter(ckpt: Checkpointer, index: int) -> Rewriter:
    """The flush into level ``index`` when every rank writes it again (levels.py)."""
    chain = ChainIndex(
        incremental=ckpt.incremental,
        full_every=ckpt.full_every,
        chunk_bytes=ckpt.chunk_bytes,
        rank=ckpt.coordinator.rank,
    )
    ckpt._levels.chains[index] = chain
    writer = Writer(
        levels=ckpt._levels,
        chain=chain,
        coordinator=ckpt.coordinator,
        chunk_bytes=ckpt.chunk_bytes,
        placement=None,
        fence=ckpt._levels.fence,
        policy_event=_ignore_event,
        clock=ckpt._clock,
        inflight=threading.BoundedSemaphore(1),
        run_id=ckpt._run_id,
        level=index,
        channel=f"flush-{index}",
        thread=False,
    )
    return Rewriter(writer, chain)


def _ignore_event(event: str, step: int, **figures: float) -> None:
    return None


def _drop_partial_scratch(ckpt: Checkpointer) -> None:
    """At open (collective): a version committed on some ranks' scratch only (a rank was
    killed between the commit records) exists for no restore; unless the persistent level
    has it, its commit record goes from this rank's scratch (and from the partner copies this
    rank holds), so it is saved again normally."""
    coord = ckpt.coordinator
    scratch = ckpt._levels.first.store
    own = engine.list_steps(scratch)
    told = coord.all_gather(own)
    common = set.intersection(*(set(t) for t in told))
    persistent = set(engine.list_steps(ckpt.persistent))
    stores = [scratch, *(ckpt._partners.held.values() if ckpt._partners is not None else ())]
    for store in stores:
        for step, lineage in engine.list_versions(store).items():
            if step in common or step in persistent:
                continue
            log.warning(
                "step %d is on %s but not on every rank's scratch: a rank stopped while it was "
                "committed; removing it there",
                step,
                store.url,
            )
            store.delete(commit_key(step, lineage))


def _open_stores(
    path: PathLike,
    scratch: object,
    storage_options: object,
    timeout: float | None,
    coord: Coordinator,
) -> tuple[Store, StripedStore | None]:
    """The persistent store and the scratch devices as one striped store (or None)."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    devices = _scratch_tiers(scratch)
    if devices and coord.world_size > 1:
        # Node-local: ranks of one node may share a scratch path, each keeps its own run.
        devices = [Tier(_rank_dir(t, coord.rank), t.capacity_bytes) for t in devices]
    persistent = open_store(path, timeout_seconds=timeout, **(storage_options or {}))
    stores = [open_store(t.path, timeout_seconds=timeout) for t in devices]
    _check_distinct(persistent, stores)
    if not stores:
        return persistent, None
    return persistent, StripedStore(stores, [t.capacity_bytes for t in devices])


def _rank_dir(tier: Tier, rank: int) -> str:
    """``<tier>/rank-<r>``: where rank ``r`` keeps its scratch part."""
    if isinstance(tier.path, Store):
        raise ValueError(
            f"scratch={tier.path!r}: with several participants give scratch as a path or URL "
            "(each rank keeps its part under <scratch>/rank-<r>), not a Store"
        )
    return join_location(os.fspath(tier.path), _rank_name(rank))


def _rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _open_partners(ckpt: Checkpointer, scratch: object, timeout: float | None) -> Partners:
    """Agree on the partners, open the copies this rank holds (their locks go with the
    scratch level's), and get back from the partner what this rank's scratch lost."""
    root = _scratch_tiers(scratch)[0].path
    assert not isinstance(root, Store)  # refused by _rank_dir
    levels = ckpt._levels
    try:
        partners = Partners.open(
            ckpt.coordinator, os.fspath(root), open_store=open_store, timeout=timeout
        )
        levels.first.locks.extend(partners.locks)
        partners.locks = []
        rebuild(ckpt.coordinator, levels.first.store, partners)
    except BaseException:
        levels.release_locks()
        raise
    return partners


def _open_levels(ckpt: Checkpointer, chain: ChainIndex) -> Levels:
    """The levels, fastest first, each with its write lock (the shared persistent level's is
    taken by rank 0 for every participant)."""
    levels: list[Level] = []
    if ckpt.scratch is not None:
        levels.append(Level(SCRATCH, ckpt.scratch, ckpt.keep_scratch, shared=False))
    levels.append(Level(PERSISTENT, ckpt.persistent, ckpt.keep, shared=True))
    opened = Levels(levels, chain=chain, coordinator=ckpt.coordinator)
    try:
        levels[-1].locks.extend(_shared_lock(ckpt.persistent, ckpt.coordinator))
        for dev in ckpt.scratch.devices if ckpt.scratch is not None else ():
            levels[0].locks.append(acquire_run_lock(dev))
    except BaseException:
        opened.release_locks()
        raise
    return opened


def _shared_lock(store: Store, coord: Coordinator) -> list[RunLock]:
    """Rank 0 takes the shared level's write lock for every participant; all of them learn
    whether it could, so a second writer fails on every rank alike."""
    lock: RunLock | None = None
    error = ""
    if coord.rank == 0:
        try:
            lock = acquire_run_lock(store)
        except CheckpointError as exc:
            if coord.world_size == 1:
                raise
            error = str(exc)
    if coord.world_size > 1:
        error = coord.broadcast(error)
        if error:
            if lock is not None:
                lock.release()
            raise CheckpointError(f"rank {coord.rank}: the run's write lock: {error}")
    return [lock] if lock is not None else []


def _current_lineage(records: Sequence[tuple[int, Lineage | None]]) -> Lineage | None:
    """The lineage of the run's newest generation (None: the run never rewound)."""
    newest = max_generation(records)
    forks = [lin.fork for _s, lin in records if lin is not None and lin.generation == newest]
    return Lineage(newest, min(forks)) if forks else None


@dataclass(frozen=True, slots=True)
class _Ask:
    """What a restore reads: per tier, the part (``ranks``) and whether every participant
    shares the tier (``shared``: its commit records say how many ranks saved a version);
    ``participants``: how many restore together (None: no world-size check, ``load``);
    ``only``, ``keys``, ``device``: engine.read_part's ``replicated_only``, ``keys``,
    ``device``."""

    ranks: tuple[int, ...]
    shared: tuple[bool, ...]
    participants: int | None
    allow_pickle: bool
    only: bool = False
    keys: tuple[str | int, ...] | None = None
    device: Any = None


def _restore_tiers(
    tiers: Sequence[Store],
    step: int | None,
    *,
    into: Any,
    ask: _Ask,
    restored: list[int] | None = None,
) -> Any:
    """Restore from the fastest tier holding a complete copy of the version (of the newest
    one that verifies, without ``step``); a damaged copy falls back to the next tier. A
    version saved by another number of ranks than ``ask.participants`` is a
    :class:`WorldSizeError` before any tier is read (:func:`_check_world`). The versions are
    those of every tier's records together (a rewind on one supersedes on all); the step
    restored is appended to ``restored``."""
    where = " + ".join(t.url for t in tiers)
    readers = [_reader(rank=r, into=into, ask=ask) for r in ask.ranks]

    def listed() -> list[int]:
        return sorted(_versions(tiers))

    def attempt(s: int) -> Any:
        _check_world(tiers, ask, s, where)
        # Only the tiers holding the version itself: another may hold a record it superseded.
        versions = _versions(tiers)
        if s not in versions:
            raise CheckpointNotFoundError(f"step {s} not found on any tier ({where})")
        held = [set(engine.list_records(t, version_prefix(s))) for t in tiers]
        stores = [
            (t, read)
            for t, read, have in zip(tiers, readers, held, strict=True)
            if (s, versions[s]) in have
        ]
        first: CheckpointError | None = None
        for store, read in stores:
            try:
                state = read(store, s)
                if restored is not None:
                    restored.append(s)
                return state
            except CheckpointError as exc:
                if store is not stores[-1][0]:
                    log.warning("step %d on %s: %s; reading the next tier", s, store.url, exc)
                first = first or exc
        assert first is not None
        raise first

    if step is not None:
        return _explicit(where, attempt, listed, step)
    return engine.newest_restorable(where, attempt, listed)


def _versions(tiers: Sequence[Store]) -> dict[int, Lineage | None]:
    """The versions of a run over its tiers: a record one tier holds may be superseded by
    one another tier holds (a rewind not flushed yet)."""
    return visible_versions([r for t in tiers for r in engine.list_records(t)])


def _check_world(tiers: Sequence[Store], ask: _Ask, step: int, where: str) -> None:
    """Refuse a version saved by another number of ranks than restore it (unless only its
    replicated keys are asked for). The saved number is a shared tier's commit record's: a
    private tier (a distributed run's scratch) holds each rank's part as a run of one."""
    if ask.participants is None or ask.only:
        return
    for tier, shared in zip(tiers, ask.shared, strict=True):
        if shared and engine.step_exists(tier, step):
            saved = engine.read_commit(tier, step).world_size
            if saved != ask.participants:
                raise _world_size_error(where, step, saved, ask.participants)
            return


def _world_size_error(where: str, step: int, saved: int, participants: int) -> WorldSizeError:
    if participants < saved:
        what = f"the part(s) of saved {_ranks(participants, saved)} would be left unread"
    else:
        what = f"{_ranks(saved, participants)} would have no part of it"
    return WorldSizeError(
        f"step {step} of {where} was saved by {saved} rank(s) and {participants} "
        f"participant(s) restore it: {what}. Ways on: restore(replicated_only=True) (the keys "
        f"saved as replicated, at any world size); cryosnap.load(path, step={step}, rank=k) "
        f"reads saved rank k's part (0..{saved - 1}) to reshard it yourself; or restart at "
        f"{saved} ranks"
    )


def _ranks(lo: int, hi: int) -> str:
    """Ranks ``lo..hi-1`` for a message."""
    return f"rank {lo}" if hi == lo + 1 else f"ranks {lo}..{hi - 1}"


def _restore(store: Store, step: int | None, *, into: Any, ask: _Ask) -> Any:
    return _restore_tiers([store], step, into=into, ask=ask)


def _reader(*, rank: int, into: Any, ask: _Ask) -> Callable[[Store, int], Any]:
    """``read(store, step)``: one rank's part of a version from one store, as asked."""

    def read(store: Store, step: int) -> Any:
        return engine.read_part(
            store,
            step,
            rank=rank,
            into=into,
            allow_pickle=ask.allow_pickle,
            replicated_only=ask.only,
            device=ask.device,
            keys=ask.keys,
            progress=Progress,
        )

    return read


def _explicit(
    where: str, attempt: Callable[[int], Any], listed: Callable[[], list[int]], step: int
) -> Any:
    """``attempt(step)``; a version the writer retired while it was read is reported as such.
    A step that is no version (never committed, or superseded) is not found."""
    if step not in listed():
        raise CheckpointNotFoundError(f"step {step} not found in {where}")
    try:
        return attempt(step)
    except CheckpointError as exc:
        if isinstance(exc, CheckpointNotFoundError) or step in listed():
            raise
        raise CheckpointNotFoundError(
            f"step {step} of {where} was deleted by the run's retention while it was read"
        ) from exc


def save(
    path: PathLike,
    state: Any,
    *,
    step: int = 0,
    chunk_bytes: int = 1 << 20,
    allow_pickle: bool = False,
) -> SaveInfo:
    """Save ``state`` as version ``step`` of the run at ``path``; durable when it returns.

    ``path`` is a directory or an fsspec URL. A step that already exists is an error
    (:class:`~cryosnap.CheckpointExistsError`): versions are never overwritten in place. No
    staging copy is made: the caller waits while the bytes go to storage.
    """
    validate_step(step)
    with Checkpointer(path, chunk_bytes=chunk_bytes, allow_pickle=allow_pickle) as ckpt:
        return ckpt._save_durable(step, state)


def load(
    path: PathLike,
    *,
    step: int | None = None,
    into: Any = None,
    keys: Sequence[str | int] | None = None,
    rank: int | None = None,
    allow_pickle: bool = False,
    map_location: Any = None,
) -> Any:
    """Load version ``step`` (default: the newest that verifies) of the run at ``path``.

    Without ``into`` the saved tree comes back (torch tensors on the CPU, numpy arrays, stateful
    objects as their state dicts). With ``into`` tensors and arrays are filled in place (on
    their own devices) and ``load_state_dict`` is called; a mismatch or damaged data raises
    before anything changes. ``keys`` (a list or tuple of top-level keys of a dict state):
    only those keys are read and verified (damage elsewhere does not matter) and a dict of
    them comes back; ``into`` gets only those keys filled. ``map_location`` (a str or
    ``torch.device``: ``"cuda"``, ``"cuda:1"``) puts every torch tensor of the returned tree
    on that device, once every chunk verified (not with ``into``). ``rank`` reads another
    rank's part of a distributed version (default: part 0). Takes no lock.
    """
    if step is not None:
        validate_step(step)
    part = 0 if rank is None else validate_step(rank, "rank")
    ask = _Ask(
        ranks=(part,),
        shared=(True,),
        participants=None,
        allow_pickle=allow_pickle,
        keys=engine.validate_keys(keys),
        device=_map_location(map_location, into),
    )
    return _restore(open_store(path), step, into=into, ask=ask)


def _map_location(map_location: object, into: Any) -> Any:
    """The ``torch.device`` restored tensors go to (None: the CPU); refused with ``into``."""
    device = target_device(map_location, "map_location")
    if device is not None and into is not None:
        raise ValueError(
            f"map_location={map_location!r} cannot be combined with into=: the tensors of "
            "into= are filled where they are, on their own devices"
        )
    return device


def run_id_of(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The run id of the newest version of the run at ``path`` (None: saved without one).

    Read-only, takes no lock. Raises :class:`~cryosnap.CheckpointNotFoundError` when the run
    holds no version. Resume a training with ``Checkpointer(path, run_id=run_id_of(path))``.
    """
    store = path if isinstance(path, Store) else open_store(path, **(storage_options or {}))
    newest = _newest_record(store)
    if newest is None:
        raise CheckpointNotFoundError(f"{store.url} holds no version")
    return newest.run_id


def _newest_record(*stores: Store) -> CommitRecord | None:
    """The commit record of the newest version on any of ``stores`` that reads (a damaged
    record is skipped, as restore skips it)."""
    steps = sorted({(s, i) for i, st in enumerate(stores) for s in engine.list_steps(st)})
    for step, i in reversed(steps):
        try:
            return engine.read_commit(stores[i], step)
        except (CheckpointFormatError, CheckpointNotFoundError) as exc:
            log.warning("step %d of %s: %s; looking at the previous one", step, stores[i].url, exc)
    return None


def _check_run_id(stores: Sequence[Store], run_id: str) -> None:
    """Refuse to open a run whose newest version another training saved."""
    newest = _newest_record(*stores)
    if newest is None or newest.run_id == run_id:
        return
    where = stores[-1].url
    if newest.run_id is None:
        theirs, resume = "no run id", "open it without run_id"
    else:
        theirs = f"run id {newest.run_id!r}"
        resume = f"pass run_id={newest.run_id!r} (cryosnap.run_id_of(path))"
    raise CheckpointError(
        f"{where}: its newest version (step {newest.step}) was saved by another training "
        f"({theirs}), not by run_id={run_id!r}: start a new training in a new path, or, to "
        f"resume that one, {resume}"
    )


def _validate_run_id(run_id: object) -> str | None:
    if run_id is None:
        return None
    if not isinstance(run_id, str):
        raise TypeError(f"run_id must be a str or None, got {type(run_id).__name__}")
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(
            f"run_id={run_id!r:.160} is invalid: allowed are 1 to 128 of A-Z a-z 0-9 . _ : -"
        )
    return run_id


def _check_distinct(persistent: Store, scratch: Sequence[Store]) -> None:
    """A scratch device that is the persistent directory itself would be one run opened twice
    (its own lock would report this very process as the other writer)."""
    for device in scratch:
        if unwrap(device) == unwrap(persistent):
            raise ValueError(
                f"scratch={device.url!r} is the persistent path itself: a scratch tier must be "
                "another directory (node-local: tmpfs, NVMe)"
            )


def _scratch_tiers(scratch: object) -> list[Tier]:
    if scratch is None:
        return []
    items = list(scratch) if isinstance(scratch, (list, tuple)) else [scratch]
    if not items:
        raise ValueError("scratch=[] is invalid: give None or at least one path or Tier")
    return [t if isinstance(t, Tier) else Tier(t) for t in items]  # type: ignore[arg-type]


def _metrics(metrics: object) -> dict[str, float] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise TypeError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metrics: names must be str, got {name!r}")
        if hasattr(value, "item") and callable(value.item):
            value = value.item()  # a 0-d tensor or numpy scalar
        out[name] = _validate.number(value, f"metrics[{name!r}]")
    return out


def _restore_agreed(
    coord: Coordinator,
    stores: Sequence[Store],
    *,
    into: Any,
    ask: _Ask,
    restored: list[int] | None = None,
) -> Any:
    """The newest version every participant can restore: the steps complete for all of them,
    tried newest first until every participant read its part (damage on any one falls back
    for all, so they resume from the same step). A version saved by another number of ranks
    is a :class:`WorldSizeError` on every participant alike (none resumes alone); every
    version damaged an :class:`IntegrityError`, none at all a CheckpointNotFoundError."""
    listed = coord.all_gather(sorted(_versions(stores)))
    common = sorted(set.intersection(*(set(steps) for steps in listed)))
    where = " + ".join(st.url for st in stores)
    damaged: dict[int, str] = {}
    for step in reversed(common):
        try:
            state = _restore_tiers(stores, step, into=None, ask=ask)
            error, kind = "", ""
        except WorldSizeError as exc:
            state, error, kind = None, str(exc), "world"
        except (IntegrityError, CheckpointFormatError) as exc:
            state, error, kind = None, str(exc), "damage"
        except CheckpointNotFoundError as exc:
            state, error, kind = None, str(exc), "missing"
        told = coord.all_gather([error, kind])
        world = [e for e, k in told if k == "world"]
        if world:
            raise WorldSizeError(world[0])
        errors = [(e, k) for e, k in told if e]
        if not errors:
            if restored is not None:
                restored.append(step)
            if into is None:
                return state
            return _restore_tiers(stores, step, into=into, ask=ask)
        if any(k == "damage" for _e, k in errors):
            damaged[step] = next(e for e, k in errors if k == "damage")
        log.warning("step %d of %s cannot be restored by every rank: %s", step, where, errors[0][0])
    if not common:
        raise CheckpointNotFoundError(
            f"no version of {where} is committed for all {coord.world_size} participants"
        )
    if len(damaged) == len(common):
        raise engine.every_version_damaged(where, damaged)
    raise CheckpointNotFoundError(
        f"no version of {where} can be restored by all {coord.world_size} participants"
    )


def _policy(policy: object) -> SavePolicy | None:
    if policy is not None and not isinstance(policy, SavePolicy):
        raise TypeError(
            f"policy must be a save policy (cryosnap.policy.EveryNSteps, EveryNSeconds, "
            f"Adaptive or an object with should_save/saved/durable), got {policy!r}"
        )
    return policy


def _coordinator(comm: object) -> Coordinator:
    """``comm``, or without one the job this process is part of: a TorchCoordinator when
    torch.distributed is initialized with several processes (each Checkpointer gets gloo groups
    of its own, created collectively), else a world of one."""
    if comm is None:
        from .dist._torch import TorchCoordinator, initialized_world

        return TorchCoordinator() if initialized_world() else LocalCoordinator()
    if not isinstance(comm, Coordinator):
        raise TypeError(
            f"comm must be None or a cryosnap.dist.Coordinator (e.g. a rank of "
            f"cryosnap.dist.InProcessGroup), got {comm!r}"
        )
    return comm
