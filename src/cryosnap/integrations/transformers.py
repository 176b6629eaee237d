"""Hugging Face ``transformers`` integration: ``Trainer`` checkpoints written by cryosnap.

:class:`CryosnapCallback` saves, every ``save_steps`` optimizer steps, in ``on_step_end`` (the
point where the Trainer saves its own checkpoints: after the optimizer and LR-scheduler step,
``global_step`` already counted) one version of a cryosnap run holding::

    {"model": model.state_dict(), "optimizer": ..., "lr_scheduler": ...,
     "trainer_state": TrainerState as JSON, "rng": cryosnap.RNGState()}

The save returns once this is captured in host memory; the write runs in the background, and
``on_train_end`` waits until every version is durable. No pickle, no ``torch.load``.

:func:`resume` continues training from the newest version (or a chosen ``step``) through the
Trainer's *own* resume logic: it calls ``trainer.train(resume_from_checkpoint=...)`` with a
temporary directory holding only ``trainer_state.json`` (the saved ``TrainerState``), and for
that call makes the Trainer read model weights, optimizer, LR scheduler and RNG states from the
cryosnap version instead of its ``*.safetensors`` / ``*.pt`` / ``*.pth`` files. Everything the
Trainer does on resume happens as usual: ``global_step`` and epoch continue, the batches of the
resumed epoch already trained on are skipped (``ignore_data_skip=False``) and the RNG states are
put back where the Trainer puts them, so a resumed run ends where an uninterrupted one does
(bit for bit on CPU with the same seed and arguments). Without any version in the run it is
a plain ``trainer.train()``.

Limits: one process (the world-process-zero saves; the RNG states are that process's);
DeepSpeed, FSDP and SageMaker MP checkpoints are not handled (they load through their own
engines); the AMP grad scaler state (fp16 on GPU) is not saved; ``TrainerState.total_flos``
lacks the FLOPs counted since the Trainer last logged; of the ``ExportableState`` callbacks only
``TrainerControl`` is saved as of the step (others as recorded when training began). The
Trainer's own ``save_strategy`` checkpoints are independent of this: set ``save_strategy="no"``
to have cryosnap's alone.

Runs on the training loop's thread; the writes run on the Checkpointer's writer thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..checkpointer import Checkpointer, load
from ..errors import CheckpointNotFoundError
from .torch import RNGState

__all__ = ["CryosnapCallback", "resume"]

log = logging.getLogger("cryosnap")

# The file the Trainer reads its state from when resuming (transformers.trainer.TRAINER_STATE_NAME).
_TRAINER_STATE_NAME = "trainer_state.json"

# The Trainer methods that read a checkpoint directory; resume() feeds them from cryosnap.
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state")


class CryosnapCallback(TrainerCallback):
    """Save model, optimizer, LR scheduler, trainer state and RNG states every N steps.

    Parameters
    ----------
    path
        The run: a directory or an fsspec URL.
    save_steps
        Save when ``state.global_step`` is a multiple of this.
    save_on_train_end
        Also save the final step when training ends (if it is not saved yet).
    keep, allow_pickle, checkpointer_options
        Passed to :class:`~cryosnap.Checkpointer` (``chunk_bytes``, ``incremental``,
        ``full_every``, ``staging_bytes``, ``max_inflight``).

    Resume with :func:`resume` (``trainer.train`` continuing from the newest version).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        save_steps: int,
        save_on_train_end: bool = True,
        keep: int | None = None,
        allow_pickle: bool = False,
        **checkpointer_options: Any,
    ) -> None:
        if isinstance(save_steps, bool) or not isinstance(save_steps, int) or save_steps <= 0:
            raise ValueError(f"save_steps={save_steps!r} is invalid: allowed is a positive int")
        self.path = os.fspath(path)
        self.save_steps = save_steps
        self.save_on_train_end = bool(save_on_train_end)
        self.allow_pickle = bool(allow_pickle)
        self._options: dict[str, Any] = {"keep": keep, **checkpointer_options}
        self._ckpt: Checkpointer | None = None
        self._last_saved: int | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        self.close()
        self._ckpt = Checkpointer(self.path, allow_pickle=self.allow_pickle, **self._options)
        self._last_saved = self._ckpt.latest_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step % self.save_steps == 0:
            self._save(state, control, kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._ckpt is None:
            return
        if self.save_on_train_end:
            self._save(state, control, kwargs)
        self.close()

    def close(self) -> None:
        """Wait until every version is durable and release the run; raise the first failure."""
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            ckpt.close()

    def _save(self, state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]) -> None:
        step = state.global_step
        if self._ckpt is None or step <= 0:
            return
        if self._last_saved is not None and step <= self._last_saved:
            return
        missing = [k for k in ("model", "optimizer", "lr_scheduler") if kwargs.get(k) is None]
        if missing:
            raise TypeError(f"cannot checkpoint step {step}: the Trainer passed no {missing}")
        snapshot = {
            "model": kwargs["model"],
            "optimizer": kwargs["optimizer"],
            "lr_scheduler": kwargs["lr_scheduler"],
            "trainer_state": _state_json(state, control),
            "rng": RNGState(),
        }
        self._ckpt.save(step, snapshot)
        self._last_saved = step


def _state_json(state: TrainerState, control: TrainerControl) -> str:
    fields = dataclasses.asdict(state)
    # As Trainer._save_checkpoint does: the control flow's state as of this step.
    fields["stateful_callbacks"] = {
        **(fields.get("stateful_callbacks") or {}),
        type(control).__name__: control.state(),
    }
    return json.dumps(fields, sort_keys=True)


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
    Returns what ``trainer.train`` returns.
    """
    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError("resume() sets resume_from_checkpoint itself; do not pass it")
    if path is None:
        ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, CryosnapCallback)]
        if not ours:
            raise TypeError("resume() needs path= or a CryosnapCallback in the trainer's callbacks")
        path = ours[0].path
    missing = [name for name in _LOADERS if not callable(getattr(trainer, name, None))]
    if missing:
        raise TypeError(
            f"cannot resume through this transformers version: Trainer has no {missing}"
        )
    try:
        saved = load(os.fspath(path), step=step, allow_pickle=allow_pickle)
    except CheckpointNotFoundError:
        if step is not None:
            raise
        log.info("cryosnap: %s holds no version yet, training from the start", os.fspath(path))
        return trainer.train(**train_kwargs)
    log.info(
        "cryosnap: resuming from step %s of %s",
        json.loads(saved["trainer_state"])["global_step"],
        path,
    )
    with tempfile.TemporaryDirectory(prefix="cryosnap-resume-") as tmp:
        with open(os.path.join(tmp, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(saved["trainer_state"])
        with _loading_from(trainer, saved):
            return trainer.train(resume_from_checkpoint=tmp, **train_kwargs)


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
