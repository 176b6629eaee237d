"""The part every framework callback shares: one cryosnap run written by one training.

:class:`RunSaver` owns the run's :class:`~cryosnap.Checkpointer` for the length of a training:
when to save, run identity, and preemption (save, then pass the signal on).
Runs on the training loop's (main) thread; the writes run on the Checkpointer's writer thread.
docs/design/integrations.md has the rules.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import cryosnap._run.signals as _signals
from cryosnap import engine
from cryosnap._validate import positive_int
from cryosnap.checkpointer import Checkpointer, PendingSave, run_id_of
from cryosnap.dist import LocalCoordinator
from cryosnap.errors import CheckpointExistsError
from cryosnap.policy import EveryNSteps, SavePolicy
from cryosnap.storage import open_store

__all__ = ["DEFAULT_SIGNALS", "RunSaver", "rank_zeros", "split_step"]

log = logging.getLogger("cryosnap")

_T = TypeVar("_T")

# Preemption notices: SIGTERM is what schedulers and Kubernetes send before killing a job.
DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM,)


def split_step(target: str) -> tuple[str, int | None]:
    """``"runs/x@40"`` -> ``("runs/x", 40)``; ``"runs/x"`` -> ``("runs/x", None)``."""
    base, at, step = target.rpartition("@")
    if at and step.isdigit() and base:
        return base, int(step)
    return target, None


class _Arrived:
    """Remembers which preemption signal arrived, to pass that one on after the save."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum


class RunSaver:
    """One training's saves into one cryosnap run, for a framework callback.

    Parameters
    ----------
    path
        The run: a directory or an fsspec URL.
    every_n_steps, policy
        When to save: every N optimizer steps, or a save policy (one of the two).
    save_on_train_end
        Also save the last step when training ends.
    handle_signals
        Preemption signals (default ``(SIGTERM,)``; ``()`` for none).
    run_id
        This training's id (default: a new random one, or the run's when resuming).
    resume_hint
        How to resume in the framework's words, for the error messages.
    checkpointer_options
        Passed to :class:`~cryosnap.Checkpointer` (``keep``, ``allow_pickle``, ``scratch``...).
    scheduled
        Whether a schedule is required (one of ``every_n_steps`` and ``policy``); False: none
        may be given, and the run saves only when :meth:`save` is called.
    lazy
        Saves return before the state is copied (``Checkpointer.save(lazy=True)``): the caller
        waits for :meth:`wait_captured` before it mutates the saved leaves.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        every_n_steps: int | None,
        policy: SavePolicy | None,
        save_on_train_end: bool,
        handle_signals: Sequence[int] | None,
        run_id: str | None,
        resume_hint: str,
        checkpointer_options: dict[str, Any],
        steps_name: str = "every_n_steps",
        scheduled: bool = True,
        lazy: bool = False,
    ) -> None:
        if every_n_steps is not None and policy is not None:
            raise TypeError(f"give one of {steps_name}= and policy= (when to save), not both")
        if scheduled and every_n_steps is None and policy is None:
            raise TypeError(f"give one of {steps_name}= and policy= (when to save)")
        self.path = os.fspath(path)
        self.policy: SavePolicy | None = policy
        if every_n_steps is not None:
            self.policy = EveryNSteps(positive_int(every_n_steps, steps_name))
        self.lazy = bool(lazy)
        self.pending: PendingSave | None = None
        self.chosen: set[int] = set()  # the steps the schedule chose (saved then or before)
        self.save_on_train_end = bool(save_on_train_end)
        self.handle_signals = _signals.parse_signals(
            DEFAULT_SIGNALS if handle_signals is None else handle_signals
        )
        self.run_id = run_id
        self.resume_hint = resume_hint
        self.options = checkpointer_options
        self.ckpt: Checkpointer | None = None
        self.last_saved: int | None = None
        self.replicated: list[str] | None = None
        self.preempted_at: int | None = None
        self._asked: int | None = None
        self._arrived = _Arrived()
        self._subscribed: list[int] = []

    # -- the run on storage ---------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The run's versions on its persistent path (read-only, no lock)."""
        options = self.options.get("storage_options") or {}
        return engine.list_steps(open_store(self.path, **options))

    # -- one training ---------------------------------------------------------------------------

    def begin(
        self,
        start_step: int,
        *,
        distributed: bool = False,
        replicated: Sequence[str] | None = None,
    ) -> None:
        """A training starts at ``start_step`` (0: from scratch; else resumed): check that the
        run is this training's, and open it: in a world of one (the framework's global rank 0
        alone saves), or with ``distributed`` on every rank of the torch.distributed job
        (collective: every rank calls it at the same point; each saves its own part).
        ``replicated``: the top-level keys of every saved state that are the same on every
        rank (``Checkpointer.save(replicated=)``: written 1/N by each)."""
        self.close()
        steps = self.steps()
        if steps and start_step == 0:
            raise CheckpointExistsError(
                f"{self.path} already holds steps {_show(steps)} of another training: a new "
                f"training there would mix with them. To continue that training, "
                f"{self.resume_hint}; to start a new one, give it a new path (or delete "
                f"{self.path})"
            )
        newer = [s for s in steps if s > start_step]
        if newer:
            raise CheckpointExistsError(
                f"resuming from step {start_step}, but {self.path} holds the newer steps "
                f"{_show(newer)}: this training would save those steps again. Resume from "
                f"the newest ({steps[-1]}), or give the callback a new path and resume from "
                f"{self.path}@{start_step} into it"
            )
        if self.run_id is not None:
            run_id: str | None = self.run_id
        elif steps:
            run_id = run_id_of(self.path, storage_options=self.options.get("storage_options"))
        else:
            run_id = uuid.uuid4().hex
            if distributed:  # one id for the job: each rank's scratch records carry it too
                run_id = rank_zeros(run_id)
        signals = self.handle_signals
        if signals and threading.current_thread() is not threading.main_thread():
            log.warning("cryosnap: not on the main thread, preemption signals are not handled")
            signals = []
        # A world of one: rank 0 alone writes. Distributed: the job's ranks (comm=None).
        options = {**({} if distributed else {"comm": LocalCoordinator()}), **self.options}
        self.ckpt = Checkpointer(
            self.path, policy=self.policy, handle_signals=signals, run_id=run_id, **options
        )
        self._arrived = _Arrived()
        for signum in signals:
            _signals.subscribe(signum, self._arrived)
        self._subscribed = list(signals)
        self.last_saved = start_step if start_step in steps else None
        self.replicated = None if replicated is None else list(replicated)
        self.preempted_at = None
        self._asked = start_step

    def step_end(self, step: int, state: Callable[[], Any]) -> bool:
        """An optimizer step ended: save if the policy (or a preemption) says so. Returns True
        when the run was preempted: the step is durable and the signal passed on; the caller
        stops training."""
        ckpt = self.ckpt
        if ckpt is None or step == self._asked:
            return False  # once per optimizer step (several micro-batches may end one)
        self._asked = step
        if not ckpt.should_save(step):
            return False
        self.chosen.add(step)
        if ckpt.preempted:
            self._preempt(step, state)
            return True
        self.save(step, state)
        return False

    def save(self, step: int, state: Callable[[], Any]) -> bool:
        """Save ``step`` (asynchronously) unless this training saved it already; whether it
        did."""
        if self.ckpt is None or step <= 0:
            return False
        if self.last_saved is not None and step <= self.last_saved:
            return False  # this training saved (or resumed from) it: the same state
        self.wait_captured()
        self.pending = self.ckpt.save(step, state(), lazy=self.lazy, replicated=self.replicated)
        self.last_saved = step
        return True

    def wait_captured(self) -> None:
        """Block until the last save's state is copied (a lazy save's leaves may change)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait_captured()

    def end(self, step: int, state: Callable[[], Any]) -> None:
        """Training ended: save the last step (``save_on_train_end``), wait until every
        version is durable, release the run; raise the first failure."""
        if self.ckpt is None:
            return
        try:
            if self.save_on_train_end:
                self.save(step, state)
        finally:
            self.close()

    def abort(self) -> None:
        """Training failed: release the run without masking the training's exception."""
        try:
            self.close()
        except Exception as exc:
            log.error("cryosnap: closing %s after a training failure: %s", self.path, exc)

    def close(self) -> None:
        """Wait until every version is durable and release the run (and the signals)."""
        ckpt, self.ckpt = self.ckpt, None
        if ckpt is None:
            return
        self.pending = None  # close() waits for it
        signals, self._subscribed = self._subscribed, []
        for signum in signals:  # before the Checkpointer puts the previous handlers back
            _signals.unsubscribe(signum, self._arrived)
        ckpt.close()

    def _preempt(self, step: int, state: Callable[[], Any]) -> None:
        self.save(step, state)
        signum = self._arrived.signum
        self.close()  # durable; the handlers from before cryosnap's are back
        self.preempted_at = step
        name = signal.Signals(signum).name if signum is not None else "a preemption signal"
        log.warning(
            "cryosnap: preempted, step %d of %s is durable; passing %s on", step, self.path, name
        )
        if signum is not None:
            signal.raise_signal(signum)


def rank_zeros(value: _T) -> _T:
    """Global rank 0's ``value`` on every rank of the torch.distributed job (collective on its
    default group: every rank calls it at the same point)."""
    import torch.distributed as dist

    told: list[Any] = [value]
    dist.broadcast_object_list(told, src=0)
    agreed: _T = told[0]
    return agreed


def _show(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]} ... {steps[-1]}"
