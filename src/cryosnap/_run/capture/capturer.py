"""The capture room: a version's state copied out of the program into the batches of its
:class:`~cryosnap._run.job.Job` (eager on the caller's thread, lazy on a thread of its own).

Runs on the caller's thread and the capture threads; no storage, no collectives.
docs/design/capture.md has the why.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cryosnap import engine
from cryosnap._run.capture.devdiff import DeviceDiff, DiffPlan
from cryosnap._run.capture.priority import BACKGROUND_NICE, lower_priority
from cryosnap._run.capture.snapshot import cuda_bytes, device_room, snapshot, would_allocate
from cryosnap._run.capture.staging import StagingPool, capture_to_slabs, direct_batches
from cryosnap._run.capture.through import Chooser, Rates, WriteThrough, candidates
from cryosnap._run.job import END, Job
from cryosnap._run.results import PendingSave
from cryosnap._state import FlatState
from cryosnap._state.flatten import mutated_storages
from cryosnap._state.gc import paused_gc
from cryosnap.errors import CheckpointError

__all__ = ["Capturer"]

# The longest a flush pauses for one capture in progress.
_YIELD_SECONDS = 5.0
# The lazy capture thread's nice value above the program's (_run/capture/priority.py).
CAPTURE_NICE = BACKGROUND_NICE
# Whether lazy captures hand blobs to the writer too (_run/capture/through.py); False copies
# them all (bench/bench_train_step.py compares the two).
LAZY_THROUGH = True


class Capturer:
    """Captures versions into a staging pool (budgeted, pooled, pinned for CUDA sources).

    CUDA tensors are copied on a stream of the capturer's own, ordered after the caller's
    stream at ``save()`` by an event; with ``diff`` only the chunks that changed on the device
    since the previous version are copied (_devdiff.py). With ``through`` (the first level
    writes with direct I/O) an eager capture hands blobs from the back to the writer, which
    writes them from the program's memory while the capture copies the others (_through.py).
    """

    def __init__(
        self,
        *,
        chunk_bytes: int,
        budget: int | None,
        clock: Callable[[], float],
        diff: DeviceDiff | None = None,
        through: bool = False,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.diff = diff
        self.through = through
        # The copy and write rates of eager and of lazy captures apart: a lazy capture copies
        # beside the program's threads, below them (_run/capture/priority.py), far slower.
        self._rates = Rates()
        self._lazy_rates = Rates()
        self._chooser = Chooser()  # whether an eager capture hands blobs over
        self._stream: Any = None
        self._clock = clock
        slab = 64 << 20 if budget is None else max(budget // 4, chunk_bytes)
        slab = max(slab // chunk_bytes, 1) * chunk_bytes
        torch = sys.modules.get("torch")
        pin = bool(torch is not None and torch.cuda.is_available())
        self.pool = StagingPool(slab_bytes=slab, budget_bytes=budget, pin=pin)
        self._captures = 0
        self.snapshots = 0  # eager captures that went through a snapshot (:meth:`_snapshot`)
        self._cond = threading.Condition()
        self._spent_hooks: list[Any] = []
        self._hooks_lock = threading.Lock()

    # -- the program's side --------------------------------------------------------------------

    def _begin(self, job: Job) -> None:
        """On the caller's thread, in save order: take the capture's turn and mark where the
        caller's CUDA stream is (the copies must see every kernel queued before save())."""
        if self.diff is not None:
            job.ticket = self.diff.ticket()
        torch = sys.modules.get("torch")
        if torch is not None and any(_is_cuda(b.source) for b in job.flat.blobs):
            job.ready = torch.cuda.Event()
            job.ready.record()

    def eager(self, job: Job) -> bool:
        """Copy the state now, on the caller's thread (True); or, where the staging would have
        to be allocated first, snapshot it and copy the snapshot on a thread (False: its
        failure reaches the version's result, as a lazy capture's does; :meth:`_snapshot`)."""
        try:
            self._begin(job)
            snap = self._snapshot(job)
        except BaseException as exc:
            self._never_started(job, exc, [])
            raise
        if snap is None:
            self._capture(job, [], lazy=False)
            return True
        self.snapshots += 1
        try:
            self._start_thread(job, snap=snap)
        except BaseException as exc:
            self._never_started(job, exc, [])
            raise
        return False

    def _snapshot(self, job: Job) -> FlatState | None:
        """The state cloned (_run/capture/snapshot.py) when this capture of CUDA state would first
        allocate its staging (pinned memory is slow to get: the first save of a session) and
        every device has room for the clones; None to capture as usual. The caller's stream
        has the clones queued (and ``job.ready`` recorded after them) when this returns."""
        if job.ready is None or not would_allocate(job.flat, self.pool):
            return None
        torch = sys.modules["torch"]
        need = cuda_bytes(job.flat)
        if not device_room(torch, need):
            return None
        try:
            snap = snapshot(job.flat)
        except torch.cuda.OutOfMemoryError:
            return None  # the clones made so far go back to torch's allocator
        job.ready = torch.cuda.Event()
        job.ready.record()
        return snap

    def lazy(self, job: Job, t0: float) -> None:
        """Start copying on a thread of its own; optimizer steps wait for their leaves."""
        hooks: list[Any] = []
        try:
            self._begin(job)
            hooks = self._optimizer_hooks(job)
            # Set before the capture can end: the writer reads it once the batches are done.
            job.stall_seconds = time.perf_counter() - t0
            job.stall_clock = self._clock() - job.clock0
            self._start_thread(job, hooks)
        except BaseException as exc:
            self._never_started(job, exc, hooks)
            raise

    def _never_started(self, job: Job, exc: BaseException, hooks: list[Any]) -> None:
        """A capture that failed before it began (its turn, the CUDA event, the snapshot, the
        optimizer hooks, its thread): end the job as a failed capture would, so that the
        writer waiting for its batches, the next save waiting for the in-flight permit, the
        next capture's turn and ``close()`` go on. The caller receives ``exc`` itself."""
        error = capture_failed(job.step, exc)
        job.batches.put(error)
        job.pending.mark_delivered()
        self._end(job, error, hooks)

    def _end(self, job: Job, error: BaseException | None, hooks: list[Any]) -> None:
        """A capture is over (``error``: how it failed): the next capture's turn, the
        writer's end of the batches, the tracker, the hooks to remove."""
        if self.diff is not None and job.ticket >= 0:
            self.diff.finish(job.ticket)
        job.batches.put(END)
        job.pending._tracker.finish(error)
        # The hooks are not removed here: optimizer.step() may be iterating over them on
        # another thread. Once capture is done they return at once; the caller's next
        # save() or close() removes them.
        with self._hooks_lock:
            self._spent_hooks.extend(hooks)

    def _start_thread(
        self, job: Job, hooks: list[Any] | None = None, snap: FlatState | None = None
    ) -> None:
        thread = threading.Thread(
            target=self._capture_lazy,
            args=(job, hooks or [], snap),
            name=f"cryosnap-capture-{job.step}",
            daemon=True,
        )
        thread.start()  # a thread that cannot start: the caller ends the job (_never_started)

    def direct(self, job: Job) -> None:
        """No staging: hand the live memory to the writer; returns once the version is durable
        or failed (the caller waits for that anyway: its result is then ready).

        The cyclic GC stays paused until then: the pieces, views, hashes and manifest entries
        of a state of many small leaves (tens of thousands of objects, alive until the version
        is written) would otherwise set off collections that walk every object of the program,
        holding the GIL under the writer, for garbage that is all freed when the save ends."""
        job.captured_bytes = job.flat.logical_bytes
        if self.diff is not None:
            self.diff.skip(self.diff.ticket())
        with paused_gc():
            try:
                for batch in direct_batches(job.flat, batch_bytes=engine.IO_BATCH_BYTES):
                    job.batches.put(batch)
            finally:
                job.batches.put(END)
                job.pending._tracker.finish()
            job.pending._done.wait()

    def remove_spent_hooks(self) -> None:
        """Remove the hooks of finished captures (on the caller's thread: ``optimizer.step()``
        may be iterating over them on another thread while a capture ends)."""
        with self._hooks_lock:
            spent, self._spent_hooks = self._spent_hooks, []
        for h in spent:
            h.remove()

    def wait_no_capture(self) -> None:
        """Block while a capture is in progress (bounded: a lazy capture may wait on an
        optimizer step that never comes)."""
        with self._cond:
            self._cond.wait_for(lambda: self._captures == 0, timeout=_YIELD_SECONDS)

    def clear(self) -> None:
        self.pool.clear()

    # -- capture threads -----------------------------------------------------------------------

    def _capture_lazy(self, job: Job, hooks: list[Any], snap: FlatState | None = None) -> None:
        """A lazy capture's thread (or an eager one's, from its snapshot ``snap``): below the
        program's threads (_run/capture/priority.py), as its copies overlap the forward and backward
        passes; an optimizer step that waits for it leaves the cores to it."""
        lower_priority(CAPTURE_NICE)
        self._capture(job, hooks, lazy=True, flat=snap)
        if snap is not None and self._stream is not None:
            # The clones go back to torch's allocator (for the caller's stream) when ``snap``
            # does: only once every copy out of them on the capture stream is done.
            self._stream.synchronize()

    def _capture(
        self, job: Job, hooks: list[Any], *, lazy: bool, flat: FlatState | None = None
    ) -> None:
        error: BaseException | None = None
        source = job.flat if flat is None else flat
        with self._cond:
            self._captures += 1
        try:
            if job.ready is not None:
                # Copy on a stream of our own (lazy capture overlaps the program's kernels),
                # after everything the caller queued before save().
                torch = sys.modules["torch"]
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(job.ready)
                    self._copy(job, lazy, source)
            else:
                self._copy(job, lazy, source)
        except BaseException as exc:
            error = capture_failed(job.step, exc)
            job.batches.put(error)
        finally:
            if not lazy:
                # Eager: the caller was blocked until here (set before END: the writer reads
                # it once the batches are done).
                job.stall_seconds = time.perf_counter() - job.pending.started
                job.stall_clock = self._clock() - job.clock0
            with self._cond:
                self._captures -= 1
                self._cond.notify_all()
            self._end(job, error, hooks)

    def _copy(self, job: Job, lazy: bool, flat: FlatState) -> None:
        """Capture ``flat`` (``job.flat``, or a snapshot of it) into staging."""
        if flat.deferred is not None:  # a lazy save's packs: their copies are ours
            flat.deferred.fill()
        plan: DiffPlan | None = None
        if self.diff is not None:
            # A lazy capture's optimizer guard orders the step after each blob's copies only,
            # so its fingerprints are computed before them, on the same stream.
            plan = self.diff.plan(job.ticket, flat, overlap=not lazy)
            job.diff_base, job.full = plan.base, plan.full
        through, choice = self._write_through(job, flat, plan, lazy)
        allocated = self.pool.allocated_bytes
        t0 = time.perf_counter()
        job.captured_bytes = capture_to_slabs(
            flat,
            self.pool,
            chunk_bytes=self.chunk_bytes,
            emit=job.batches.put,
            tracker=job.pending._tracker,
            abort=job.pending.abort_requested,
            hold=True,
            changed=plan.changed if plan is not None else None,
            foreign=job.plan.foreign(job.rank) if job.plan is not None else None,
            events=lazy,
            through=through,
        )
        elapsed = time.perf_counter() - t0
        if through is not None:
            job.captured_bytes += through.handed_bytes  # out of the program's memory too
            rates = self._lazy_rates if lazy else self._rates
            copied = job.captured_bytes - through.handed_bytes
            # The copy's own time: not the wait for the writer at the end (counted in, a
            # capture that waited would read as a slow copy, and the next would hand over
            # more, and wait longer).
            rates.observe("copy_bps", copied, elapsed - through.waited_seconds)
            rates.observe("write_bps", through.handed_bytes, through.written_seconds)
        if choice is not None and self.pool.allocated_bytes == allocated:
            # What this way stalled per byte (not a capture that allocated staging: its fresh
            # slabs' first touch is no cost of the way it took).
            self._chooser.observe(choice, job.captured_bytes, elapsed)
        if plan is not None:
            if plan.ready is not None:
                plan.ready.synchronize()  # the caller may change the state once we return
            assert self.diff is not None
            self.diff.adopt(job.step, plan, job.pending)

    def _write_through(
        self, job: Job, flat: FlatState, plan: DiffPlan | None, lazy: bool
    ) -> tuple[WriteThrough | None, bool | None]:
        """The hand-over of a capture (None: every blob is copied), and for an eager capture
        that could hand blobs over, whether the :class:`Chooser` had it do so (None: no
        choice was made). A lazy capture always hands over: the blobs the writer takes are
        never copied, which is CPU the program's threads get back (a handed-over blob counts
        as captured once written, so an optimizer step that mutates it waits for that, as it
        waits for a copy); the stall it would save is not the program's."""
        if not self.through or (lazy and not LAZY_THROUGH):
            return None, None
        skip = [*(job.plan.shares if job.plan is not None else ()), *(plan.changed if plan else ())]
        blobs = candidates(flat, skip=skip)
        if not blobs:
            return None, None
        if not lazy and not self._chooser.use():
            return None, False
        through = WriteThrough(
            flat,
            blobs,
            emit=job.batches.put,
            abort=job.pending.abort_requested,
            rates=self._lazy_rates if lazy else self._rates,
            mark=job.pending._tracker.mark,
        )
        job.attach(through)
        return through, None if lazy else True

    def _optimizer_hooks(self, job: Job) -> list[Any]:
        torch = sys.modules.get("torch")
        if torch is None:
            return []
        origins = [(i, blob.origin) for i, blob in enumerate(job.flat.blobs) if blob.origin]
        deferred = job.flat.deferred
        # Packs the capture thread fills (their tensors' storages), and the storages each
        # optimizer mutates as the flatten found them.
        packs = deferred.packs if deferred is not None else {}
        known = deferred.mutated if deferred is not None else {}
        hooks: list[Any] = []
        for _path, obj in job.flat.stateful:
            if isinstance(obj, torch.optim.Optimizer):
                needed = _blobs_mutated_by(obj, origins, packs, torch, known)
                hooks.append(obj.register_step_pre_hook(_step_guard(job.pending, needed)))
        return hooks


def _is_cuda(source: Any) -> bool:
    return not isinstance(source, (bytes, np.ndarray)) and bool(source.is_cuda)


def _blobs_mutated_by(
    opt: Any,
    origins: list[tuple[int, int]],
    packs: dict[int, list[int]],
    torch: Any,
    known: dict[int, set[int]],
) -> list[int]:
    """The captured blobs whose storage ``opt.step()`` writes: its params and their state.
    ``origins``: (blob, the storage it was read from); ``packs``: the storages of each
    deferred pack's tensors, by blob; ``known``: storages by optimizer id, as the flatten
    found them."""
    ptrs = known.get(id(opt))
    if ptrs is None:
        ptrs = mutated_storages(opt, torch)
    needed = [i for i, origin in origins if origin in ptrs]
    needed += [i for i, stores in packs.items() if not ptrs.isdisjoint(stores)]
    return sorted(needed)


def _step_guard(pending: PendingSave, needed: list[int]) -> Callable[..., None]:
    tracker = pending._tracker

    def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
        if tracker.captured():
            return
        t0 = time.perf_counter()
        tracker.wait_blobs(needed)
        pending.add_stall(time.perf_counter() - t0)

    return hook


def capture_failed(step: int, exc: BaseException) -> BaseException:
    """What a save whose capture raised ``exc`` fails with: cryosnap's own errors (an abort, a
    state that changed...) and what is no error of the capture (KeyboardInterrupt,
    SystemExit) as they are; anything else (out of memory for the staging, a CUDA error, an
    OSError) a :class:`CheckpointError` that names the step, with ``exc`` as its cause."""
    if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
        return exc
    error = CheckpointError(
        f"step {step}: copying the state into staging failed ({type(exc).__name__}: "
        f"{exc}); step {step} was not committed, the versions before it are intact"
    )
    error.__cause__ = exc
    return error
