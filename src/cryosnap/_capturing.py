"""The capture room: a version's state copied out of the program, and the :class:`Job` that
carries it to the writer.

Eager capture runs on the caller's thread (the program's only stall); lazy capture on a thread
of its own, with a one-shot step pre-hook on every ``torch.optim.Optimizer`` of the state that
makes its next ``step()`` wait until the leaves it mutates are captured. Captured bytes go to
pooled staging slabs (capture.py) and, batch by batch, onto the job's queue, which the writer
drains. While any capture is in progress, :meth:`Capturer.wait_no_capture` blocks (flushers
call it between pieces, so copying to slower levels never competes with the stall).

Runs on the caller's thread and the capture threads; no storage, no collectives.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import engine
from ._gc import paused_gc
from ._results import PendingSave
from .capture import Batch, StagingPool, capture_to_slabs, direct_batches
from .manifest import Replicated
from .tree import FlatState

__all__ = ["END", "Capturer", "Job"]

END = object()  # the last item of a job's batch queue
# The longest a flush pauses for one capture in progress.
_YIELD_SECONDS = 5.0


@dataclass(slots=True)
class Job:
    """One version on its way from the caller to the writer."""

    step: int
    flat: FlatState
    pending: PendingSave
    batches: queue.SimpleQueue[Any]
    metrics: dict[str, float] | None = None
    stall_seconds: float = 0.0
    # The same start and stall on the policy's clock (``Checkpointer(clock=)``): the policy is
    # told time and durations by one clock, so a test's fake clock makes it deterministic.
    clock0: float = 0.0
    stall_clock: float = 0.0
    # Top-level keys identical on every rank (save(replicated=...), checked by the facade).
    replicated: Replicated = None

    def drain(self) -> None:
        """Give back every captured batch still queued (the version is abandoned)."""
        while True:
            item = self.batches.get()
            if item is END:
                return
            if isinstance(item, Batch):
                item.release()


class Capturer:
    """Captures versions into a staging pool (budgeted, pooled, pinned for CUDA sources)."""

    def __init__(self, *, chunk_bytes: int, budget: int | None, clock: Callable[[], float]) -> None:
        self.chunk_bytes = chunk_bytes
        self._clock = clock
        slab = 64 << 20 if budget is None else max(budget // 4, chunk_bytes)
        slab = max(slab // chunk_bytes, 1) * chunk_bytes
        torch = sys.modules.get("torch")
        pin = bool(torch is not None and torch.cuda.is_available())
        self.pool = StagingPool(slab_bytes=slab, budget_bytes=budget, pin=pin)
        self._captures = 0
        self._cond = threading.Condition()
        self._spent_hooks: list[Any] = []
        self._hooks_lock = threading.Lock()

    # -- the program's side --------------------------------------------------------------------

    def eager(self, job: Job) -> None:
        """Copy the state now, on the caller's thread."""
        self._capture(job, [], lazy=False)

    def lazy(self, job: Job, t0: float) -> None:
        """Start copying on a thread of its own; optimizer steps wait for their leaves."""
        hooks = self._optimizer_hooks(job)
        # Set before the capture can end: the writer reads it once the batches are done.
        job.stall_seconds = time.perf_counter() - t0
        job.stall_clock = self._clock() - job.clock0
        thread = threading.Thread(
            target=self._capture,
            args=(job, hooks),
            kwargs={"lazy": True},
            name=f"cryosnap-capture-{job.step}",
            daemon=True,
        )
        thread.start()

    def direct(self, job: Job) -> None:
        """No staging: hand the live memory to the writer (the caller waits until durable)."""
        try:
            with paused_gc():
                for batch in direct_batches(job.flat, batch_bytes=engine.IO_BATCH_BYTES):
                    job.batches.put(batch)
        finally:
            job.batches.put(END)
            job.pending._tracker.finish()

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

    def _capture(self, job: Job, hooks: list[Any], *, lazy: bool) -> None:
        tracker = job.pending._tracker
        error: BaseException | None = None
        with self._cond:
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
                # Eager: the caller was blocked until here (set before END: the writer reads
                # it once the batches are done).
                job.stall_seconds = time.perf_counter() - job.pending.started
                job.stall_clock = self._clock() - job.clock0
            with self._cond:
                self._captures -= 1
                self._cond.notify_all()
            job.batches.put(END)
            tracker.finish(error)
            # The hooks are not removed here: optimizer.step() may be iterating over them on
            # another thread. Once capture is done they return at once; the caller's next
            # save() or close() removes them.
            with self._hooks_lock:
                self._spent_hooks.extend(hooks)

    def _copy(self, job: Job) -> None:
        capture_to_slabs(
            job.flat,
            self.pool,
            chunk_bytes=self.chunk_bytes,
            emit=job.batches.put,
            tracker=job.pending._tracker,
            abort=job.pending.abort_requested,
            hold=True,
        )

    def _optimizer_hooks(self, job: Job) -> list[Any]:
        torch = sys.modules.get("torch")
        if torch is None:
            return []
        by_origin: dict[int, list[int]] = {}
        for i, blob in enumerate(job.flat.blobs):
            if blob.origin:
                by_origin.setdefault(blob.origin, []).append(i)
        hooks: list[Any] = []
        for _path, obj in job.flat.stateful:
            if isinstance(obj, torch.optim.Optimizer):
                needed = _blobs_mutated_by(obj, by_origin, torch)
                hooks.append(obj.register_step_pre_hook(_step_guard(job.pending, needed)))
        return hooks


def _blobs_mutated_by(opt: Any, by_origin: dict[int, list[int]], torch: Any) -> list[int]:
    """The captured blobs whose storage ``opt.step()`` writes: its params and their state."""
    ptrs = set()
    for group in opt.param_groups:
        for p in group["params"]:
            ptrs.add(p.untyped_storage().data_ptr())
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    ptrs.add(v.untyped_storage().data_ptr())
    return sorted({b for ptr in ptrs for b in by_origin.get(ptr, [])})


def _step_guard(pending: PendingSave, needed: list[int]) -> Callable[..., None]:
    tracker = pending._tracker

    def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
        if tracker.captured():
            return
        t0 = time.perf_counter()
        tracker.wait_blobs(needed)
        pending.add_stall(time.perf_counter() - t0)

    return hook
