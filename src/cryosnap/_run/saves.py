"""Saves: the versions a run is saving, from ``save()`` to the writer's queue.

Refuses a save that cannot be (a lost lock, participants that stopped agreeing, a step that
exists or may, a step below one saved since the last restore), flattens the state into the
writer's :class:`Job`, keeps each version's :class:`PendingSave` and hands a failure nobody
received to the next ``save``/``wait``/``close``.
Runs on the caller's thread; no collectives here.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import cryosnap._run.replicated as _replicated
from cryosnap._format.keys import Lineage
from cryosnap._run.job import Job
from cryosnap._run.levels.levels import Levels
from cryosnap._run.open import OpenRun
from cryosnap._run.options import RunOptions
from cryosnap._run.results import CaptureTracker, PendingSave
from cryosnap._run.writer import WriterThread
from cryosnap._state import FlatState, FlattenCache, flatten
from cryosnap._validate import step as validate_step
from cryosnap.errors import (
    CheckpointExistsError,
    CoordinationError,
    LockLostError,
    StepOrderError,
)

__all__ = ["Saves"]


class Saves:
    """The pending saves of one run, and the jobs handed to its writer."""

    def __init__(self, run: OpenRun, options: RunOptions) -> None:
        self._levels: Levels = run.levels
        self._writer: WriterThread = run.writer
        self._run = run
        self._options = options
        # Saves not yet done, and failed ones the caller has not received yet.
        self.pending: list[PendingSave] = run.pending
        # The last flatten, reused while the state's structure does not change.
        self.flattened = FlattenCache()
        # The newest step saved since the last restore: a save below it is refused (going
        # back is a rewind, which starts with a restore; the Checkpointer resets it then).
        self.newest: int | None = None

    def start(
        self,
        step: int,
        state: Any,
        t0: float,
        *,
        clock0: float,
        lineage: Lineage | None,
        metrics: dict[str, float] | None = None,
        replicated: object = None,
        returned: threading.Event | None = None,
        reuse: bool = True,
        lazy: bool = False,
    ) -> Job:
        """Flatten ``state`` into the job of version ``step`` and queue it for the writer
        (its capture is the caller's to run); raises when the version cannot be saved.
        ``returned``: set by the caller once its ``save`` returns (:attr:`Job.returned`).
        ``reuse``: the flatten is kept for the next save to reuse (a one-shot save has none:
        what it would keep, each tensor's metadata read again, cost a state of 20,000 small
        tensors ~0.1 s). ``lazy``: a lazy capture's, which fills on its own thread the packs
        of a reused flatten that an optimizer of the state updates every tensor of (their
        copies are no longer the caller's: flatten's ``DeferredPacks``); not with replicated
        state, whose chunks the ranks compare first."""
        self._run.capturer.remove_spent_hooks()
        validate_step(step)
        self.raise_undelivered()
        self._refuse(step, lineage)
        options = self._options
        if reuse:
            flat = self.flattened.flatten(
                state,
                allow_pickle=options.allow_pickle,
                pack_bytes=options.chunk_bytes,
                pack_apart=replicated,
                defer_packs=lazy and not replicated,
            )
        else:
            flat = flatten(
                state,
                allow_pickle=options.allow_pickle,
                pack_bytes=options.chunk_bytes,
                pack_apart=replicated,
            )
        keys = _replicated.replicated_keys(replicated, flat)
        self._writer.inflight.acquire()
        try:
            job = self._job(step, flat, keys, t0, clock0, lineage, metrics, returned)
        except BaseException:
            # Never submitted: the writer, which gives permits back, never sees it.
            self._writer.inflight.release()
            raise
        self.pending.append(job.pending)
        self._writer.submit(job)
        self.newest = step if self.newest is None else max(self.newest, step)
        return job

    def _job(
        self,
        step: int,
        flat: FlatState,
        keys: Any,
        t0: float,
        clock0: float,
        lineage: Lineage | None,
        metrics: dict[str, float] | None,
        returned: threading.Event | None,
    ) -> Job:
        """The job of version ``step`` (its save policy's level asked, its plan made)."""
        # Forget finished versions, but keep failed ones the caller has not received yet.
        self.pending = [p for p in self.pending if not p.done() or p.failed_undelivered()]
        tracker = CaptureTracker(len(flat.blobs))
        names = self._levels.names
        top = self._run.policies.top_level(step, len(names) - 1)
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
            returned=returned,
        )
        version = self._writer.version
        job.plan, job.rank = version.plan(flat, keys), version.own_rank()
        return job

    def _refuse(self, step: int, lineage: Lineage | None) -> None:
        """Raise when version ``step`` (in ``lineage``) cannot be saved now."""
        store = self._levels.first.store
        if self._levels.lock_lost is not None:
            raise LockLostError(f"this writer stopped saving: {self._levels.lock_lost}")
        version = self._writer.version
        if version.disagreed is not None:
            raise CoordinationError(
                f"step {step}: this writer stopped saving: the run's participants no longer "
                f"agree ({version.disagreed}); restart the job (every rank reopens the run)"
            )
        if step in version.in_doubt:
            raise CheckpointExistsError(
                f"step {step}: the commit record of an earlier save timed out and may still "
                f"appear in {store.url}; save under another step"
            )
        if self.newest is not None and step < self.newest:
            raise StepOrderError(
                f"step {step} is below step {self.newest}, which this Checkpointer saved "
                f"in {store.url}: a run's steps go up; to go back, restore(step=...) an "
                "earlier version first (the next save then supersedes the later ones)",
                step=step,
                path=store.url,
            )
        if any(p.step == step and not p.done() for p in self.pending):
            raise CheckpointExistsError(
                f"step {step} is already being saved in Checkpointer({store.url!r})"
            )
        where = self._levels.step_exists(step, lineage)
        if where is not None:
            raise CheckpointExistsError(f"step {step} already exists in {where}", step=step)

    def drain(self) -> None:
        """Block until every pending save is durable on every level or failed."""
        for p in list(self.pending):
            p._done.wait()

    def raise_undelivered(self) -> None:
        """Raise the first failure nobody received yet (once)."""
        for p in self.pending:
            err = p.undelivered_error()
            if err is not None:
                raise err
