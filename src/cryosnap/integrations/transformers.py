"""Hugging Face ``transformers`` integration: ``Trainer`` checkpoints written by cryosnap.

``Trainer(..., callbacks=[CryosnapCallback("runs/exp1", save_steps=100)])``; resume with
``trainer.train(resume_from_checkpoint=True)`` or :func:`resume`. No pickle, no ``torch.load``.
Runs on the training loop's thread; the writes run on the Checkpointer's writer thread.
docs/design/integrations.md has what is saved, how resume works and the limits.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from cryosnap.checkpointer import load
from cryosnap.errors import CheckpointNotFoundError
from cryosnap.integrations._base import RunSaver, split_step
from cryosnap.integrations.torch import RNGState
from cryosnap.policy import SavePolicy

__all__ = ["CryosnapCallback", "resume"]

log = logging.getLogger("cryosnap")

# The file the Trainer reads its state from when resuming (transformers.trainer.TRAINER_STATE_NAME).
_TRAINER_STATE_NAME = "trainer_state.json"

# The Trainer methods that read a checkpoint directory; resuming feeds them from cryosnap.
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state")

_RESUME_HINT = "pass trainer.train(resume_from_checkpoint=True)"


class CryosnapCallback(TrainerCallback):
    """Save model, optimizer, LR scheduler, trainer state and RNG states into one cryosnap run.

    Parameters
    ----------
    path
        The run: a directory or an fsspec URL.
    save_steps, policy
        When to save: every N optimizer steps, or a save policy from :mod:`cryosnap.policy`
        (``EveryNSteps``, ``EveryNSeconds``, ``Adaptive``); one of the two.
    save_on_train_end
        Also save the final step when training ends (if it is not saved yet).
    handle_signals
        Preemption signals (default ``(signal.SIGTERM,)``; ``()``: none): the step in progress
        is saved when it ends, training stops, and the signal is raised again once the version
        is durable (its previous handler runs; by default that ends the process).
    run_id
        This training's id (default: a new one; the run's own when resuming).
    keep, allow_pickle, checkpointer_options
        Passed to :class:`~cryosnap.Checkpointer` (``chunk_bytes``, ``incremental``,
        ``full_every``, ``staging_bytes``, ``max_inflight``, ``scratch``...).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        save_steps: int | None = None,
        policy: SavePolicy | None = None,
        save_on_train_end: bool = True,
        handle_signals: Sequence[int] | None = None,
        run_id: str | None = None,
        keep: int | None = None,
        allow_pickle: bool = False,
        **checkpointer_options: Any,
    ) -> None:
        self.allow_pickle = bool(allow_pickle)
        self._saver = RunSaver(
            path,
            every_n_steps=save_steps,
            policy=policy,
            save_on_train_end=save_on_train_end,
            handle_signals=handle_signals,
            run_id=run_id,
            resume_hint=_RESUME_HINT,
            checkpointer_options={
                "keep": keep,
                "allow_pickle": self.allow_pickle,
                **checkpointer_options,
            },
            steps_name="save_steps",
        )
        self.path = self._saver.path

    @property
    def preempted_at(self) -> int | None:
        """The step saved on preemption in the last ``train`` (None: not preempted)."""
        return self._saver.preempted_at

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = _constructing_trainer(self)
        if trainer is not None:
            _understand_runs(trainer, self)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.is_world_process_zero:
            self._saver.begin(state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._saver.step_end(state.global_step, lambda: _snapshot(state, control, kwargs)):
            control.should_training_stop = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._saver.end(state.global_step, lambda: _snapshot(state, control, kwargs))

    def close(self) -> None:
        """Wait until every version is durable and release the run; raise the first failure."""
        self._saver.close()

    def _resume_target(self, value: object) -> tuple[str, int | None] | None:
        """The cryosnap version ``train(resume_from_checkpoint=value)`` means, if it is one:
        True (the newest of this run), this run's path, ``path@step``, or any cryosnap run."""
        if value is True:
            return self.path, None
        if not isinstance(value, (str, os.PathLike)):
            return None
        path, step = split_step(os.fspath(value))
        if _same_path(path, self.path) or _holds_versions(path):
            return path, step
        return None


def _snapshot(state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]) -> Any:
    missing = [k for k in ("model", "optimizer", "lr_scheduler") if kwargs.get(k) is None]
    if missing:
        raise TypeError(
            f"cannot checkpoint step {state.global_step}: the Trainer passed no {missing}"
        )
    return {
        "model": kwargs["model"],
        "optimizer": kwargs["optimizer"],
        "lr_scheduler": kwargs["lr_scheduler"],
        "trainer_state": _state_json(state, control),
        "rng": RNGState(),
    }


def _state_json(state: TrainerState, control: TrainerControl) -> str:
    fields = dataclasses.asdict(state)
    # As Trainer._save_checkpoint does: the control flow's state as of this step.
    fields["stateful_callbacks"] = {
        **(fields.get("stateful_callbacks") or {}),
        type(control).__name__: control.state(),
    }
    return json.dumps(fields, sort_keys=True)


def _same_path(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def _holds_versions(path: str) -> bool:
    from cryosnap import engine
    from cryosnap.storage import open_store

    try:
        return bool(engine.list_steps(open_store(path)))
    except (OSError, ValueError):
        return False


def _constructing_trainer(callback: CryosnapCallback) -> Trainer | None:
    """The Trainer whose constructor is running ``on_init_end`` for ``callback``: the callback
    API passes no trainer, and ``train(resume_from_checkpoint=<run>)`` needs one."""
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if isinstance(candidate, Trainer) and callback in getattr(handler, "callbacks", ()):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def _understand_runs(trainer: Trainer, callback: CryosnapCallback) -> None:
    """Make ``trainer.train(resume_from_checkpoint=...)`` resume from cryosnap runs."""
    original = trainer.train
    if getattr(original, "_cryosnap", False):
        return

    @functools.wraps(original)
    def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            target = callback._resume_target(resume_from_checkpoint)
            if target is None:
                return original(resume_from_checkpoint, *args, **kwargs)
            path, step = target
            return _train_from(trainer, original, path, step, callback.allow_pickle, **kwargs)
        except BaseException:
            callback._saver.abort()  # the Trainer has no failure hook: release the run here
            raise

    train._cryosnap = True  # type: ignore[attr-defined]
    trainer.train = train  # type: ignore[method-assign]


def resume(
    trainer: Trainer,
    path: str | os.PathLike[str] | None = None,
    *,
    step: int | None = None,
    allow_pickle: bool = False,
    **train_kwargs: Any,
) -> Any:
    """``trainer.train(**train_kwargs)``, continuing from a version of the cryosnap run.

    ``path`` defaults to the run of the trainer's :class:`CryosnapCallback`; ``step`` None
    takes the newest version that verifies (a run without versions trains from the start).
    Returns what ``trainer.train`` returns. The same as
    ``trainer.train(resume_from_checkpoint=True)`` / ``="path@step"`` with the callback.
    """
    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError("resume() sets resume_from_checkpoint itself; do not pass it")
    if path is None:
        ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, CryosnapCallback)]
        if not ours:
            raise TypeError("resume() needs path= or a CryosnapCallback in the trainer's callbacks")
        path = ours[0].path
    train = getattr(trainer.train, "__wrapped__", trainer.train)
    return _train_from(trainer, train, os.fspath(path), step, allow_pickle, **train_kwargs)


def _train_from(
    trainer: Trainer,
    train: Callable[..., Any],
    path: str,
    step: int | None,
    allow_pickle: bool,
    **train_kwargs: Any,
) -> Any:
    """``train(resume_from_checkpoint=...)`` continuing from version ``step`` of ``path``
    (``step`` None: the newest; a run without versions trains from the start)."""
    missing = [name for name in _LOADERS if not callable(getattr(trainer, name, None))]
    if missing:
        raise TypeError(
            f"cannot resume through this transformers version: Trainer has no {missing}"
        )
    try:
        saved = load(path, step=step, allow_pickle=allow_pickle)
    except CheckpointNotFoundError:
        if step is not None:
            raise
        log.info("cryosnap: %s holds no version yet, training from the start", path)
        return train(**train_kwargs)
    log.info(
        "cryosnap: resuming from step %s of %s",
        json.loads(saved["trainer_state"])["global_step"],
        path,
    )
    with tempfile.TemporaryDirectory(prefix="cryosnap-resume-") as tmp:
        with open(os.path.join(tmp, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(saved["trainer_state"])
        with _loading_from(trainer, saved):
            return train(resume_from_checkpoint=tmp, **train_kwargs)


def _part(obj: Any, name: str) -> Any:
    if obj is None:
        raise TypeError(f"cannot resume: the Trainer has no {name} yet")
    return obj


@contextmanager
def _loading_from(trainer: Trainer, saved: dict[str, Any]) -> Iterator[None]:
    """Make ``trainer``'s checkpoint loaders read ``saved`` while the block runs."""

    def load_model(_checkpoint: str, model: Any = None) -> None:
        _part(trainer.model, "model").load_state_dict(saved["model"])

    def load_optimizer_and_scheduler(_checkpoint: str | None) -> None:
        _part(trainer.optimizer, "optimizer").load_state_dict(saved["optimizer"])
        _part(trainer.lr_scheduler, "lr_scheduler").load_state_dict(saved["lr_scheduler"])

    def load_rng(_checkpoint: str | None) -> None:
        RNGState().load_state_dict(saved["rng"])

    loaders: dict[str, Callable[..., None]] = {
        "_load_from_checkpoint": load_model,
        "_load_optimizer_and_scheduler": load_optimizer_and_scheduler,
        "_load_rng_state": load_rng,
    }
    before = {name: trainer.__dict__.get(name) for name in loaders}
    for name, fn in loaders.items():
        setattr(trainer, name, fn)
    try:
        yield
    finally:
        for name, previous in before.items():
            if previous is None:
                delattr(trainer, name)
            else:
                setattr(trainer, name, previous)
