"""Checkpointer, PendingSave, SaveInfo, and the one-shot ``save`` / ``load`` over them.

A save has two phases. *Capture* runs on the caller's thread (eager) or a capture thread (lazy):
the state is flattened and its bytes copied into pooled staging slabs (capture.py). Everything
after runs on the Checkpointer's single background writer thread, one version after the other
in the order they were saved: hash, write the packed data file, fsync, manifest, commit record.
``save`` returns a :class:`PendingSave` as soon as the state is captured (eager) or at once
(lazy); ``PendingSave.result()`` returns the :class:`SaveInfo` once the version is durable.

Failures in the background are kept: ``result()`` of that version raises them, and the next
``save()``, ``wait()`` or ``close()`` raises the first one the caller has not received yet. A
failed version is never visible: its commit record is never written.

With ``scratch`` tiers, the writer commits each version on scratch (node-local, fast) and a
flusher thread (flush.py) copies it to the persistent tier behind it; ``result()`` waits for
both, ``result(tier="scratch")`` for the first only. Restores read from the fastest tier that
holds a complete copy.

One writer per run: opening a Checkpointer takes the run's write lock (lock.py) on every tier.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from . import engine
from ._gc import paused_gc
from .capture import Batch, CaptureTracker, StagingPool, capture_to_slabs, direct_batches
from .chunks import validate_chunk_bytes
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    LockLostError,
    StorageTimeoutError,
)
from .flush import Flusher, SourceDamagedError, flush_keys
from .lock import RunLock, acquire_run_lock
from .manifest import MAX_STEP, commit_key, manifest_key
from .policy import KeepLast, RetentionPolicy, SavePolicy, as_retention
from .progress import Progress, human_bytes
from .storage import DEFAULT_TIMEOUT_SECONDS, Store, open_store, unwrap
from .storage.tiers import Placement, StripedStore, Tier
from .tree import FlatState, flatten

__all__ = ["Checkpointer", "PendingSave", "SaveInfo", "Status", "load", "save"]

SCRATCH, PERSISTENT = "scratch", "persistent"

log = logging.getLogger("cryosnap")

PathLike = str | os.PathLike[str] | Store

_END = object()
# The longest a flush pauses for one capture in progress.
_YIELD_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class SaveInfo:
    """What one version cost this process (this rank).

    ``written_bytes`` counts the data this rank wrote to its first tier; ``stall_seconds`` is how
    long the program was blocked by the save (the ``save`` call, plus any optimizer step that
    waited for a lazy capture); ``seconds`` runs from the ``save`` call until the version was
    durable; ``tiers`` names the tiers the version reached.
    """

    step: int
    logical_bytes: int
    written_bytes: int
    chunks: int
    new_chunks: int
    stall_seconds: float
    seconds: float
    incremental: bool
    tiers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Status:
    """Where a run's versions are (``Checkpointer.status()``).

    ``steps`` lists the complete versions per tier (``"scratch"``, ``"persistent"``);
    ``not_persistent`` the versions committed on scratch and not yet flushed, oldest first;
    ``flush_error`` the last failure of the flush in progress while it is being retried.
    """

    steps: dict[str, tuple[int, ...]]
    not_persistent: tuple[int, ...]
    flush_error: BaseException | None


def validate_step(step: object, name: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"{name} must be an int, got {type(step).__name__}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"{name}={step} is out of range: allowed are 0 to {MAX_STEP}")
    return step


def _positive(value: object, name: str, allowed: str = "a positive int") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid: allowed is {allowed}")
    return value


def _positive_or_none(value: object, name: str) -> int | None:
    return None if value is None else _positive(value, name, "a positive int or None")


class PendingSave:
    """A version being saved: captured first, durable later."""

    def __init__(self, step: int, tracker: CaptureTracker, t0: float) -> None:
        self.step = step
        self._tracker = tracker
        self._t0 = t0
        self._done = threading.Event()
        self._first = threading.Event()  # durable on the first tier (or failed)
        self._first_info: SaveInfo | None = None
        self._info: SaveInfo | None = None
        self._error: BaseException | None = None
        self._delivered = False
        self._stall = 0.0

    def __repr__(self) -> str:
        state = "done" if self.done() else "captured" if self.captured() else "capturing"
        return f"<PendingSave step={self.step} {state}>"

    def captured(self) -> bool:
        """Whether every byte of the state has been copied out (it may now change)."""
        return self._tracker.captured()

    def wait_captured(self, timeout: float | None = None) -> None:
        """Block until the state is captured; mutate non-optimizer leaves only after this."""
        t0 = time.perf_counter()
        if not self._tracker.wait_all(timeout):
            raise CheckpointTimeoutError(f"step {self.step} not captured after {timeout} s")
        self._stall += time.perf_counter() - t0
        if self._tracker.error is not None:
            self._delivered = True
            raise self._tracker.error

    def done(self) -> bool:
        """Whether the version is durable or has failed."""
        return self._done.is_set()

    def result(self, timeout: float | None = None, *, tier: str | None = None) -> SaveInfo:
        """The :class:`SaveInfo` once durable on every tier; re-raises the failure of this
        version. ``tier="scratch"`` returns as soon as it is durable on scratch."""
        if tier == SCRATCH:
            if not self._first.wait(timeout):
                raise CheckpointTimeoutError(f"step {self.step} not on scratch after {timeout} s")
            if self._first_info is not None:
                return self._first_info
        elif tier not in (None, PERSISTENT):
            raise ValueError(f"tier={tier!r} is invalid: allowed are None, 'scratch', 'persistent'")
        if not self._done.wait(timeout):
            raise CheckpointTimeoutError(f"step {self.step} not durable after {timeout} s")
        if self._error is not None:
            self._delivered = True
            raise self._error
        assert self._info is not None
        return self._info

    def _undelivered_error(self) -> BaseException | None:
        if self._done.is_set() and self._error is not None and not self._delivered:
            self._delivered = True
            return self._error
        return None

    def _finish_first(self, info: SaveInfo) -> None:
        self._first_info = info
        self._first.set()

    def _finish(self, info: SaveInfo | None, error: BaseException | None) -> None:
        self._info, self._error = info, error
        self._first.set()
        self._done.set()


@dataclass(slots=True)
class _Job:
    step: int
    flat: FlatState
    pending: PendingSave
    batches: queue.SimpleQueue[Any]
    metrics: dict[str, float] | None = None
    stall_seconds: float = 0.0
    # The same two figures on the policy's clock (``Checkpointer(clock=)``): the policy is told
    # time and durations by one clock, so a test's fake clock makes it deterministic.
    clock0: float = 0.0
    stall_clock: float = 0.0


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
    clock
        The monotonic clock (seconds) the save policy is told the time by; tests pass a fake.
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.chunk_bytes = validate_chunk_bytes(chunk_bytes)
        budget = _positive_or_none(staging_bytes, "staging_bytes")
        if budget is not None and budget < self.chunk_bytes:
            raise ValueError(
                f"staging_bytes={budget} is smaller than one chunk (chunk_bytes={chunk_bytes})"
            )
        self.max_inflight = _positive(max_inflight, "max_inflight")
        self.keep = as_retention(keep)
        if policy is not None and not isinstance(policy, SavePolicy):
            raise TypeError(
                f"policy must be a save policy (cryosnap.policy.EveryNSteps, EveryNSeconds, "
                f"Adaptive or an object with should_save/saved/durable), got {policy!r}"
            )
        self.policy = policy
        self._policy_lock = threading.Lock()
        signals = _signals(handle_signals)
        if keep_scratch is not None and scratch is None:
            raise ValueError(
                f"keep_scratch={keep_scratch!r} needs scratch=: without scratch tiers every "
                "version goes to the persistent tier, whose retention is keep="
            )
        self.keep_scratch = 2 if keep_scratch is None else _positive(keep_scratch, "keep_scratch")
        if isinstance(flush_retry_seconds, bool) or not isinstance(
            flush_retry_seconds, (int, float)
        ):
            raise TypeError("flush_retry_seconds must be a number of seconds")
        if not flush_retry_seconds >= 0:
            raise ValueError(f"flush_retry_seconds={flush_retry_seconds!r} must be >= 0")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        timeout = _timeout(storage_timeout_seconds)
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self._clock = clock
        devices = _scratch_tiers(scratch)
        self.full_every = _positive(full_every, "full_every")
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental must be a bool, got {type(incremental).__name__}")
        self.incremental = incremental
        # The previous version, resolved, and where each chunk of kept content lies: the base
        # of the next incremental version. Loaded from the run on the first save.
        self._base: engine.ResolvedPart | engine.PartResult | None = None
        self._index: dict[bytes, tuple[str, int]] = {}
        self._base_loaded = False
        self.allow_pickle = bool(allow_pickle)
        self.persistent = open_store(path, timeout_seconds=timeout, **(storage_options or {}))
        self.scratch: StripedStore | None = None
        self._placement: Placement | None = None
        self._locks: list[RunLock] = []
        stores = [open_store(t.path, timeout_seconds=timeout) for t in devices]
        _check_distinct(self.persistent, stores)
        try:
            self._locks.append(acquire_run_lock(self.persistent))
            if devices:
                for dev in stores:
                    self._locks.append(acquire_run_lock(dev))
                self.scratch = StripedStore(stores, [t.capacity_bytes for t in devices])
                self._placement = Placement(self.scratch)
        except BaseException:
            for lock in self._locks:
                lock.release()
            raise
        # The store versions are written to first: scratch when there is one.
        self.store: Store = self.scratch if self.scratch is not None else self.persistent
        slab = 64 << 20 if budget is None else max(budget // 4, self.chunk_bytes)
        slab = max(slab // self.chunk_bytes, 1) * self.chunk_bytes
        torch = sys.modules.get("torch")
        pin = bool(torch is not None and torch.cuda.is_available())
        self._pool = StagingPool(slab_bytes=slab, budget_bytes=budget, pin=pin)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._inflight = threading.BoundedSemaphore(self.max_inflight)
        self._pending: list[PendingSave] = []
        # Versions on scratch waiting for their flush: their PendingSave and scratch SaveInfo.
        self._flush_pending: dict[int, tuple[PendingSave, SaveInfo | None]] = {}
        self._flush_lock = threading.Lock()
        self._reset_base = False  # set by the flusher: the next version must be full
        # Captures in progress; the flusher pauses between pieces while there is one, so that
        # copying to the persistent tier never competes with the program's stall.
        self._captures = 0
        self._capture_cond = threading.Condition()
        self._spent_hooks: list[Any] = []
        self._hooks_lock = threading.Lock()
        self._closed = False
        self._flusher: Flusher | None = None
        self._flushed_ever: set[int] = set()  # versions that reached the persistent tier
        self._flush_failed: set[int] = set()  # on scratch only: scratch retention keeps them
        # Steps whose commit record write timed out on the first tier (it may land late), with
        # the files it names; and the files of versions whose flush failed (its commit record
        # may land late on the persistent tier). Retention never deletes these.
        self._in_doubt: dict[int, set[str]] = {}
        self._flush_in_doubt: set[str] = set()
        self.preempted = False
        # Set once a lock check finds this writer no longer holds the run: it stops saving.
        self._lock_lost: LockLostError | None = None
        self._signals: list[int] = []
        self._flush_retry_seconds = float(flush_retry_seconds)
        try:
            self._start_flusher()
            for signum in signals:
                _signal_subscribe(signum, self)
                self._signals.append(signum)
        except BaseException:
            self._abandon_flusher()
            self._restore_handlers()
            for lock in self._locks:
                lock.release()
            raise
        self._worker = threading.Thread(target=self._run, name="cryosnap-writer", daemon=True)
        self._worker.start()

    def _abandon_flusher(self) -> None:
        if self._flusher is not None:
            self._flusher.abandon()
            self._flusher.close()

    def _start_flusher(self) -> None:
        if self.scratch is None:
            return
        self._flusher = Flusher(
            self.scratch,
            self.persistent,
            retry_seconds=self._flush_retry_seconds,
            on_done=self._flushed,
            yield_to=self._wait_no_capture,
            fence=self._fence,
        )
        # A crash between a scratch commit and its flush: flush those versions now (those
        # that persistent retention would keep).
        on_persistent = engine.list_steps(self.persistent)
        self._flushed_ever.update(on_persistent)
        missing = [s for s in engine.list_steps(self.scratch) if s not in self._flushed_ever]
        if isinstance(self.keep, KeepLast):
            wanted = set(sorted({*on_persistent, *missing})[-self.keep.n :])
            missing = [s for s in missing if s in wanted]
        for step in missing:
            tracker = CaptureTracker(0)
            tracker.finish()
            pending = PendingSave(step, tracker, time.perf_counter())
            self._pending.append(pending)
            self._flush_pending[step] = (pending, None)
            self._flusher.submit(step)
        if missing:
            log.info("flushing %d version(s) left on scratch: %s", len(missing), missing)

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
        else:
            # Drain and release, but do not mask the exception already propagating, and do
            # not keep retrying flushes to an unreachable persistent tier meanwhile.
            if self._flusher is not None:
                self._flusher.abandon()
            try:
                self.close()
            except CheckpointError as err:
                log.error("background checkpoint failure during exception exit: %s", err)

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.url!r})"

    # policies and preemption ----------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: asks the save policy (call once per iteration); always
        true once the run is preempted."""
        validate_step(step)
        if self.policy is None:
            if self.preempted:
                return True
            raise ValueError(
                "should_save needs a save policy: Checkpointer(..., policy=cryosnap.policy."
                "EveryNSteps(n) / EveryNSeconds(s) / Adaptive(max_overhead))"
            )
        with self._policy_lock:
            due = self.policy.should_save(step, now=self._clock())
        return due or self.preempted

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.preempted = True
        log.warning("received %s: the run is preempted, save and exit", signal.Signals(signum).name)

    def _restore_handlers(self) -> None:
        signals, self._signals = self._signals, []
        for signum in signals:
            _signal_unsubscribe(signum, self)

    def _policy_event(self, event: str, step: int, **figures: float) -> None:
        policy = self.policy
        if policy is None:
            return
        with self._policy_lock:
            method = getattr(policy, event, None)
            if method is not None:
                method(step, now=self._clock(), **figures)

    # saving --------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        lazy: bool = False,
        metrics: dict[str, float] | None = None,
    ) -> PendingSave:
        """Capture ``state`` as version ``step`` and write it in the background.

        Returns once the state is captured (``lazy=False``) or at once (``lazy=True``: the copy
        runs in the background; the next ``step()`` of an optimizer in the state waits for the
        leaves it mutates, and other leaves may be mutated only after ``wait_captured()``).
        ``metrics`` (name -> finite number, e.g. ``{"loss": 0.31}``) are stored with the version
        for retention policies such as ``KeepBest``.
        """
        t0 = time.perf_counter()
        job = self._start(step, state, t0, _metrics(metrics))
        try:
            return self._save_started(job, lazy, t0)
        except KeyboardInterrupt as exc:
            # Ctrl-C: say whether this version is lost or will still commit in the background.
            if job.pending._tracker.captured() and job.pending._tracker.error is None:
                what = (
                    f"cryosnap: step {job.step} was captured before the interrupt and is still "
                    "being written: it commits unless the process exits first (wait() or "
                    "close() waits for it)"
                )
            else:
                what = f"cryosnap: step {job.step} was interrupted during capture and is not saved"
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(what)
            else:
                log.error("%s", what)
            raise

    def _save_started(self, job: _Job, lazy: bool, t0: float) -> PendingSave:
        step = job.step
        tracker = job.pending._tracker
        if lazy:
            hooks = self._install_optimizer_hooks(job)
            # Set before the capture can end: the writer reads it once the batches are done.
            job.stall_seconds = time.perf_counter() - t0
            job.stall_clock = self._clock() - job.clock0
            thread = threading.Thread(
                target=self._capture,
                args=(job, hooks, True),
                name=f"cryosnap-capture-{step}",
                daemon=True,
            )
            thread.start()
        else:
            self._capture(job, [], False)
            if tracker.error is not None:
                job.pending._delivered = True
                raise tracker.error
        self._policy_event("saved", step, stall_seconds=job.stall_clock)
        return job.pending

    def _save_durable(self, step: int, state: Any) -> SaveInfo:
        """Save without staging: the writer reads the live memory while the caller waits."""
        t0 = time.perf_counter()
        job = self._start(step, state, t0)
        try:
            with paused_gc():
                for batch in direct_batches(job.flat, batch_bytes=engine.IO_BATCH_BYTES):
                    job.batches.put(batch)
        finally:
            job.batches.put(_END)
            job.pending._tracker.finish()
        info = job.pending.result()
        return info

    def _remove_spent_hooks(self) -> None:
        with self._hooks_lock:
            spent, self._spent_hooks = self._spent_hooks, []
        for h in spent:
            h.remove()

    def _start(
        self, step: int, state: Any, t0: float, metrics: dict[str, float] | None = None
    ) -> _Job:
        clock0 = self._clock()
        self._check_open()
        self._remove_spent_hooks()
        validate_step(step)
        self._raise_undelivered()
        if self._lock_lost is not None:
            raise LockLostError(f"this writer stopped saving: {self._lock_lost}")
        if step in self._in_doubt:
            raise CheckpointExistsError(
                f"step {step}: the commit record of an earlier save timed out and may still "
                f"appear in {self.store.url}; save under another step"
            )
        if any(p.step == step and not p.done() for p in self._pending):
            raise CheckpointExistsError(f"step {step} is already being saved in {self!r}")
        for store in self._tiers():
            if store.exists(commit_key(step)):
                raise CheckpointExistsError(f"step {step} already exists in {store.url}")
        flat = flatten(state, allow_pickle=self.allow_pickle)
        self._inflight.acquire()
        # Forget finished versions, but keep failed ones the caller has not received yet.
        self._pending = [
            p for p in self._pending if not p.done() or (p._error is not None and not p._delivered)
        ]
        tracker = CaptureTracker(len(flat.blobs))
        job = _Job(step, flat, PendingSave(step, tracker, t0), queue.SimpleQueue(), metrics)
        job.clock0 = clock0
        self._pending.append(job.pending)
        self._jobs.put(job)
        return job

    def _wait_no_capture(self) -> None:
        with self._capture_cond:
            # Bounded: a lazy capture may wait on an optimizer step that never comes.
            self._capture_cond.wait_for(lambda: self._captures == 0, timeout=_YIELD_SECONDS)

    def _capture(self, job: _Job, hooks: list[Any], lazy: bool) -> None:
        tracker = job.pending._tracker
        error: BaseException | None = None
        with self._capture_cond:
            self._captures += 1
        try:
            torch = sys.modules.get("torch")
            if lazy and torch is not None and torch.cuda.is_available():
                # Lazy capture overlaps the program's kernels: copy on a stream of our own.
                with torch.cuda.stream(torch.cuda.Stream()):
                    self._copy(job)
            else:
                self._copy(job)
        except BaseException as exc:
            error = exc
            job.batches.put(exc)
        finally:
            if not lazy:
                # Eager: the caller was blocked until here (set before _END: the writer reads
                # it once the batches are done).
                job.stall_seconds = time.perf_counter() - job.pending._t0
                job.stall_clock = self._clock() - job.clock0
            with self._capture_cond:
                self._captures -= 1
                self._capture_cond.notify_all()
            job.batches.put(_END)
            tracker.finish(error)
            # The hooks are not removed here: optimizer.step() may be iterating over them on
            # another thread. Once capture is done they return at once; the caller's next
            # save() or close() removes them.
            with self._hooks_lock:
                self._spent_hooks.extend(hooks)

    def _copy(self, job: _Job) -> None:
        def abort() -> BaseException | None:
            return job.pending._error

        capture_to_slabs(
            job.flat,
            self._pool,
            chunk_bytes=self.chunk_bytes,
            emit=job.batches.put,
            tracker=job.pending._tracker,
            abort=abort,
            hold=True,
        )

    def _install_optimizer_hooks(self, job: _Job) -> list[Any]:
        torch = sys.modules.get("torch")
        if torch is None:
            return []
        hooks: list[Any] = []
        by_origin: dict[int, list[int]] = {}
        for i, blob in enumerate(job.flat.blobs):
            if blob.origin:
                by_origin.setdefault(blob.origin, []).append(i)
        tracker, pending = job.pending._tracker, job.pending
        for _path, obj in job.flat.stateful:
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            ptrs = set()
            for group in obj.param_groups:
                for p in group["params"]:
                    ptrs.add(p.untyped_storage().data_ptr())
                    for v in obj.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor):
                            ptrs.add(v.untyped_storage().data_ptr())
            needed = sorted({b for ptr in ptrs for b in by_origin.get(ptr, [])})

            def hook(_opt: Any, _args: Any, _kwargs: Any, needed: list[int] = needed) -> None:
                if tracker.captured():
                    return
                t0 = time.perf_counter()
                tracker.wait_blobs(needed)
                pending._stall += time.perf_counter() - t0

            hooks.append(obj.register_step_pre_hook(hook))
        return hooks

    # background ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            part: engine.PartResult | None = None
            try:
                info, part = self._write(job)
                error = None
            except BaseException as exc:
                info, error = None, exc
                log.error("checkpoint of step %d failed: %s", job.step, exc)
            finally:
                self._inflight.release()
            try:
                if part is not None:
                    # Retention before the version is reported, so that a caller sees the run
                    # as ``keep`` says; SaveInfo.seconds was taken before, it does not count it.
                    self._advance(part)
                if info is None:
                    self._policy_event("failed", job.step)
                else:
                    self._policy_event(
                        "durable",
                        job.step,
                        seconds=self._clock() - job.clock0,
                        stall_seconds=job.stall_clock + job.pending._stall,
                    )
            except Exception:
                # The version is committed; a failing retention or policy must not stop the
                # writer (the next version is full: the base may be half-retired).
                log.exception("after committing step %d", job.step)
                self._forget_base()
            if info is not None and self._flusher is not None:
                # Durable on scratch; durable everywhere once the flusher is done with it.
                with self._flush_lock:
                    self._flush_pending[job.step] = (job.pending, info)
                job.pending._finish_first(info)
                self._flusher.submit(job.step)
            else:
                job.pending._finish(info, error)

    def _flushed(self, step: int, error: BaseException | None) -> None:
        """On the flusher thread: ``step`` is persistent, or its flush failed for good."""
        with self._flush_lock:
            pending, info = self._flush_pending.pop(step)
            if error is not None:
                self._flush_failed.add(step)
            else:
                self._flushed_ever.add(step)
        if error is not None:
            if isinstance(error, SourceDamagedError):
                # Scratch lost files this chain needs: later versions must not build on it.
                self._reset_base = True
            elif self.scratch is not None:
                # Its persistent commit record may still land (a write that timed out).
                self._flush_in_doubt.update(flush_keys(self.scratch, step))
            pending._finish(None, error)
            return
        try:
            if self.keep is not None:
                self._retire(self.persistent, keep=self.keep, protect={step})
        except Exception:
            log.exception("retention on %s after step %d", self.persistent.url, step)
        finally:
            if info is not None:
                seconds = time.perf_counter() - pending._t0
                info = replace(info, tiers=(SCRATCH, PERSISTENT), seconds=seconds)
                log.info("step %d persistent after %.3f s", step, seconds)
            pending._finish(info, None)

    def _fence(self) -> None:
        """Raise :class:`LockLostError` unless this writer still holds every tier's lock;
        runs before each commit record and each retention pass (any thread)."""
        if self._lock_lost is not None:
            raise self._lock_lost
        try:
            for lock in self._locks:
                lock.check()
        except LockLostError as exc:
            self._lock_lost = exc
            log.error("%s; this writer stops saving", exc)
            raise

    def _tiers(self) -> list[Store]:
        """The run's tiers, fastest first."""
        return [self.persistent] if self.scratch is None else [self.scratch, self.persistent]

    def _retire(
        self, store: Store, *, keep: int | RetentionPolicy, protect: set[int] | None = None
    ) -> None:
        # Data files of the store versions are written to leave the content index before they
        # are deleted, so a pass that fails midway never leaves it pointing at a deleted file.
        forget = self._forget_files if store is self.store else engine._ignore_files
        reserved = set(self._flush_in_doubt) if store is self.persistent else set()
        if store is self.store:
            reserved.update(k for keys in self._in_doubt.values() for k in keys)
        try:
            engine.retire(
                store,
                keep=keep,
                protect=protect or (),
                reserved=reserved,
                fence=self._fence,
                before_delete=forget,
            )
        except LockLostError:
            return  # recorded by the fence; nothing was deleted
        except CheckpointError as exc:
            # Versions are committed; a failed clean-up is finished by the next pass.
            log.warning("retention on %s failed: %s", store.url, exc)

    def _forget_files(self, files: Collection[str]) -> None:
        """On the writer thread: no later version may reference these data files."""
        # The base (the version just committed) is protected by retention: its files stay.
        gone = set(files)
        if self._index:
            self._index = {h: loc for h, loc in self._index.items() if loc[0] not in gone}

    def _load_base(self) -> None:
        # First save of this session: continue the run's chain from its newest version.
        self._base_loaded = True
        latest = engine.list_steps(self.store)
        if not latest or not self.incremental:
            return
        try:
            base = engine.resolve_version(self.store, latest[-1])
        except CheckpointError as exc:
            log.warning("step %d cannot be a base, next version is full: %s", latest[-1], exc)
            return
        if base.manifest.chunk_bytes == self.chunk_bytes:
            self._base, self._index = base, base.locations()

    def _write(self, job: _Job) -> tuple[SaveInfo, engine.PartResult]:
        writer: engine.PartWriter | None = None
        ended = False
        progress = Progress(f"cryosnap: saving step {job.step}", job.flat.logical_bytes)
        if self._reset_base:
            self._reset_base = False
            self._forget_base()
        try:
            if not self._base_loaded:
                self._load_base()
            base = self._base if self.incremental else None
            if base is not None:
                if base.depth >= self.full_every:
                    base = None  # the chain is long enough: this version is full
                elif isinstance(base, engine.PartResult):
                    # Resolved only when it is a base: a run that saves once, writes only
                    # full versions or ends a chain here never pays for it.
                    base = self._base = base.resolved()
            writer = engine.PartWriter(
                self.store,
                job.step,
                job.flat,
                chunk_bytes=self.chunk_bytes,
                base=base,
                index=self._index if base is not None else None,
                placement=self._placement,
            )
            while True:
                item = job.batches.get()
                if item is _END:
                    ended = True
                    break
                if isinstance(item, BaseException):
                    raise item
                batch: Batch = item
                writer.add(batch.pieces, batch.release)
                progress.update(batch.nbytes)
            part = writer.finish()
            self._commit(job, part)
        except BaseException as exc:
            if writer is not None:
                writer.abort()
            if not ended:
                # Stop the capture (it polls this) and give every slab of this version back,
                # so a capture blocked on the staging budget can finish.
                job.pending._error = exc
                self._drain(job)
            raise
        finally:
            progress.close()
        seconds = time.perf_counter() - job.pending._t0
        written = human_bytes(part.written_bytes)
        log.info("step %d durable in %.3f s: %s written", job.step, seconds, written)
        info = SaveInfo(
            step=job.step,
            logical_bytes=part.logical_bytes,
            written_bytes=part.written_bytes,
            chunks=part.chunks,
            new_chunks=part.new_chunks,
            stall_seconds=job.stall_seconds + job.pending._stall,
            seconds=seconds,
            incremental=part.incremental,
            tiers=(PERSISTENT if self.scratch is None else SCRATCH,),
        )
        return info, part

    def _commit(self, job: _Job, part: engine.PartResult) -> None:
        try:
            engine.commit_version(
                self.store,
                job.step,
                [part],
                chunk_bytes=self.chunk_bytes,
                metrics=job.metrics,
                fence=self._fence,
            )
        except StorageTimeoutError:
            # The write may still land after we gave up: until then every file it names stays,
            # so a late commit record never makes a broken version visible.
            chain = {manifest_key(s, part.ref.rank) for s in part.chain()}
            self._in_doubt[job.step] = {part.ref.key, *chain, *part.used_files()}
            raise

    def _advance(self, part: engine.PartResult) -> None:
        """After a commit: the version is the next base; apply retention."""
        self._base = part
        if part.incremental:
            self._index.update(part.new_index)
        else:
            # A full version starts a new chain; older content stays referenced only by older
            # versions, so retention can reclaim it.
            self._index = dict(part.new_index)
        # The version just saved is kept even when a higher step exists (a run rolled back):
        # it is the next one's base.
        step = part.manifest.step
        if self.scratch is not None:
            # Scratch keeps every version that is not yet persistent.
            with self._flush_lock:
                protect = set(self._flush_pending) | self._flush_failed | {step}
            self._retire(self.scratch, keep=self.keep_scratch, protect=protect)
        elif self.keep is not None:
            self._retire(self.persistent, keep=self.keep, protect={step})

    def _forget_base(self) -> None:
        """The next version is full: what the base points to may be gone."""
        self._base, self._index = None, {}

    @staticmethod
    def _drain(job: _Job) -> None:
        while True:
            item = job.batches.get()
            if item is _END:
                return
            if isinstance(item, Batch):
                item.release()

    # waiting and reading -----------------------------------------------------------------------
    def _raise_undelivered(self) -> None:
        for p in self._pending:
            err = p._undelivered_error()
            if err is not None:
                raise err

    def wait(self) -> None:
        """Block until every pending save is durable; raise the first undelivered failure."""
        for p in list(self._pending):
            p._done.wait()
        self._raise_undelivered()

    def steps(self) -> list[int]:
        """Versions complete on at least one tier, ascending."""
        return sorted({s for store in self._tiers() for s in engine.list_steps(store)})

    def status(self) -> Status:
        """Which versions each tier holds, and which are not yet persistent."""
        steps = {}
        if self.scratch is not None:
            steps[SCRATCH] = tuple(engine.list_steps(self.scratch))
        steps[PERSISTENT] = tuple(engine.list_steps(self.persistent))
        with self._flush_lock:
            waiting = set(self._flush_pending) | self._flush_failed
        flusher = self._flusher
        return Status(
            steps=steps,
            not_persistent=tuple(sorted(waiting)),
            flush_error=None if flusher is None else flusher.last_error,
        )

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None = None, *, into: Any = None) -> Any:
        """The state of ``step`` (default: the newest version that verifies); see :func:`load`."""
        self._check_open()
        if step is not None:
            validate_step(step)
        return _restore_tiers(
            self._tiers(), step, into=into, rank=0, allow_pickle=self.allow_pickle
        )

    def close(self) -> None:
        """Drain every pending save, stop the writer, release the write lock."""
        if self._closed:
            return
        if self._flusher is not None:
            # Every flush still queued gets flush_retry_seconds in all, not each.
            self._flusher.finish_within(self._flush_retry_seconds)
        try:
            for p in list(self._pending):
                p._done.wait()
        finally:
            self._closed = True
            try:
                self._remove_spent_hooks()
                self._jobs.put(None)
                self._worker.join()
                if self._flusher is not None:
                    self._flusher.close()
                    if self.scratch is not None:
                        # The last versions are persistent now: scratch retention can apply.
                        self._retire(
                            self.scratch, keep=self.keep_scratch, protect=self._flush_failed
                        )
                self._pool.clear()
            finally:
                for lock in self._locks:
                    lock.release()
                self._restore_handlers()
        self._raise_undelivered()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")


def _restore_tiers(
    tiers: Sequence[Store], step: int | None, *, into: Any, rank: int, allow_pickle: bool
) -> Any:
    """Restore from the fastest tier holding a complete copy of the version (of the newest
    one that verifies, without ``step``); a damaged copy falls back to the next tier."""
    if len(tiers) == 1:
        return _restore(tiers[0], step, into=into, rank=rank, allow_pickle=allow_pickle)
    where = " + ".join(t.url for t in tiers)

    def listed() -> list[int]:
        return sorted({s for store in tiers for s in engine.list_steps(store)})

    def attempt(s: int) -> Any:
        stores = [t for t in tiers if engine.step_exists(t, s)]
        if not stores:
            raise CheckpointNotFoundError(f"step {s} not found on any tier ({where})")
        first: CheckpointError | None = None
        for store in stores:
            try:
                return engine.read_part(store, s, rank=rank, into=into, allow_pickle=allow_pickle)
            except CheckpointError as exc:
                if store is not stores[-1]:
                    log.warning("step %d on %s: %s; reading the next tier", s, store.url, exc)
                first = first or exc
        assert first is not None
        raise first

    if step is not None:
        return _explicit(where, attempt, listed, step)
    return engine.newest_restorable(where, attempt, listed)


def _restore(store: Store, step: int | None, *, into: Any, rank: int, allow_pickle: bool) -> Any:
    def attempt(s: int) -> Any:
        return engine.read_part(store, s, rank=rank, into=into, allow_pickle=allow_pickle)

    def listed() -> list[int]:
        return engine.list_steps(store)

    if step is not None:
        return _explicit(store.url, attempt, listed, step)
    return engine.newest_restorable(store.url, attempt, listed)


def _explicit(
    where: str, attempt: Callable[[int], Any], listed: Callable[[], list[int]], step: int
) -> Any:
    """``attempt(step)``; a version the writer retired while it was read is reported as such."""
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
    rank: int | None = None,
    allow_pickle: bool = False,
) -> Any:
    """Load version ``step`` (default: the newest that verifies) of the run at ``path``.

    Without ``into`` the saved tree comes back (torch tensors on the CPU, numpy arrays, stateful
    objects as their state dicts). With ``into`` tensors and arrays are filled in place and
    ``load_state_dict`` is called; a mismatch or damaged data raises before anything changes.
    ``rank`` reads another rank's part of a distributed version. Takes no lock.
    """
    if step is not None:
        validate_step(step)
    part = 0 if rank is None else validate_step(rank, "rank")
    return _restore(open_store(path), step, into=into, rank=part, allow_pickle=allow_pickle)


def _check_distinct(persistent: Store, scratch: Sequence[Store]) -> None:
    """A scratch device that is the persistent directory itself would be one run opened twice
    (its own lock would report this very process as the other writer)."""
    for device in scratch:
        if unwrap(device) == unwrap(persistent):
            raise ValueError(
                f"scratch={device.url!r} is the persistent path itself: a scratch tier must be "
                "another directory (node-local: tmpfs, NVMe)"
            )


def _timeout(seconds: object) -> float | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(
            f"storage_timeout_seconds must be a number of seconds or None, got {seconds!r}"
        )
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"storage_timeout_seconds={seconds!r} is invalid: allowed is > 0 or None")
    return float(seconds)


def _scratch_tiers(scratch: object) -> list[Tier]:
    if scratch is None:
        return []
    items = list(scratch) if isinstance(scratch, (list, tuple)) else [scratch]
    if not items:
        raise ValueError("scratch=[] is invalid: give None or at least one path or Tier")
    return [t if isinstance(t, Tier) else Tier(t) for t in items]  # type: ignore[arg-type]


def _signals(handle_signals: object) -> list[int]:
    if handle_signals is None:
        return []
    if not isinstance(handle_signals, (list, tuple, set, frozenset)):
        raise TypeError(
            f"handle_signals must be a sequence of signal numbers, got {handle_signals!r}"
        )
    valid = set(signal.valid_signals())
    out = []
    for sig in handle_signals:
        if isinstance(sig, bool) or not isinstance(sig, int) or sig not in valid:
            raise ValueError(f"handle_signals: {sig!r} is not a signal (e.g. signal.SIGTERM)")
        if sig in (signal.SIGKILL, getattr(signal, "SIGSTOP", -1)):
            raise ValueError(f"handle_signals: {signal.Signals(sig).name} cannot be handled")
        out.append(int(sig))
    return out


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
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"metrics[{name!r}] must be a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise ValueError(f"metrics[{name!r}]={value} is invalid: must be finite")
        out[name] = float(value)
    return out


# Preemption signals: one module-level handler per signal, shared by every Checkpointer that
# asked for it (two runs in one process, or one closed while another is open); the program's
# own handler is put back when the last one closes.
_signal_lock = threading.Lock()
_signal_users: dict[int, list[Checkpointer]] = {}
_signal_original: dict[int, Any] = {}


def _dispatch_signal(signum: int, frame: Any) -> None:
    for ckpt in list(_signal_users.get(signum, ())):
        ckpt._on_signal(signum, frame)


def _signal_subscribe(signum: int, ckpt: Checkpointer) -> None:
    with _signal_lock:
        users = _signal_users.get(signum)
        ours = signum in _signal_original and signal.getsignal(signum) is _dispatch_signal
        if not users and not ours:
            try:
                previous = signal.signal(signum, _dispatch_signal)
            except ValueError as exc:  # not the main thread
                raise ValueError(f"handle_signals: {exc}") from exc
            _signal_original[signum] = signal.SIG_DFL if previous is None else previous
        users = _signal_users.setdefault(signum, [])
        users.append(ckpt)


def _signal_unsubscribe(signum: int, ckpt: Checkpointer) -> None:
    with _signal_lock:
        users = _signal_users.get(signum, [])
        if ckpt in users:
            users.remove(ckpt)
        if users or signum not in _signal_original:
            return
        if signal.getsignal(signum) is not _dispatch_signal:
            _signal_original.pop(signum)  # the program replaced it since: leave theirs
            return
        try:
            signal.signal(signum, _signal_original[signum])
        except ValueError:  # not the main thread: ours stays installed, handling nobody
            log.warning("closed off the main thread: %s keeps cryosnap's handler", signum)
            return
        _signal_original.pop(signum)
