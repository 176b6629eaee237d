"""Lightning integration: checkpoints of a ``lightning.pytorch.Trainer`` written by cryosnap.

Two ways in, both without pickle:

- :class:`CryosnapCheckpointIO`, a ``CheckpointIO`` plugin: ``Trainer(plugins=[...])`` makes
  every checkpoint Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) go
  through cryosnap, and ``trainer.fit(ckpt_path=...)`` read through it. Each checkpoint path
  (``epoch=0-step=100.ckpt``, ``last.ckpt``) becomes a cryosnap *run directory* holding one
  version (the step is the checkpoint's ``global_step``). Saving again to the same path (the
  ``last.ckpt`` of the next step) adds a version and retires the old one only once the new one
  is committed, so the path always holds a complete checkpoint; content that did not change
  since is not written again. With ``async_save=True`` (default) ``save_checkpoint`` returns
  once the checkpoint is *captured* (copied to host buffers: later optimizer steps cannot change
  it, unlike Lightning's ``AsyncCheckpointIO``) and the write finishes in the background;
  reading or removing that path, and ``teardown``, wait for it.
- :class:`CryosnapCallback`, a ``Callback``: every ``every_n_steps`` optimizer steps the full
  Lightning checkpoint goes into one cryosnap run as a new version (asynchronous, incremental,
  ``keep`` newest), and ``fit`` resumes from the newest version that verifies when the run has
  one (``resume=True``): model, optimizers, LR schedulers, loop progress (``global_step``,
  epoch, batch index), callback and precision-plugin state, through Lightning's own restore
  path, exactly as ``trainer.fit(ckpt_path=...)`` restores a ``.ckpt`` file.

Checkpoint contents. Lightning's checkpoint dict is plain data except what users put in it
(``hyper_parameters``, ``on_save_checkpoint``). It is stored as follows: dict subclasses
(``AttributeDict``) as ``dict`` (``OrderedDict`` stays ordered), other mappings as ``dict``,
``pathlib`` paths, ``torch.dtype`` and ``torch.device`` as ``str``; anything else that cryosnap
does not store without pickle (enums, dataclasses, arbitrary objects in ``hyper_parameters``)
is refused with a ``TypeError`` naming its path, unless ``allow_pickle=True``. Tensors come
back on the CPU; Lightning moves model and optimizer state to the device itself.

Not supported: ``LightningModule.load_from_checkpoint`` (it calls ``torch.load`` directly, not
the plugin: use :func:`load_checkpoint` and ``model.load_state_dict(ckpt["state_dict"])``);
strategies whose checkpoints are sharded or written by every rank (FSDP, DeepSpeed): the
plugin and the callback write from global rank 0 only, like ``TorchCheckpointIO``.

Runs on the training loop's thread; the writes run on each Checkpointer's writer thread.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from fsspec.core import url_to_fs
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from .._validate import step as validate_step
from ..checkpointer import Checkpointer, PendingSave, load

__all__ = ["CryosnapCallback", "CryosnapCheckpointIO", "load_checkpoint", "to_plain"]

log = logging.getLogger("cryosnap")

_PLAIN_LEAVES = (torch.Tensor, int, float, bool, complex, str, bytes, bytearray, type(None))


def to_plain(obj: Any, *, allow_pickle: bool = False, _path: str = "") -> Any:
    """``obj`` (a Lightning checkpoint dict) with its parts mapped to what cryosnap stores.

    Dict subclasses and other mappings become ``dict`` (``OrderedDict`` stays), paths, dtypes
    and devices become ``str``. An object cryosnap cannot store without pickle raises a
    ``TypeError`` naming its path, unless ``allow_pickle`` (then it is left for cryosnap to
    pickle). Tensors are not copied.
    """
    if isinstance(obj, _PLAIN_LEAVES):
        return obj
    if isinstance(obj, Mapping):
        items = [
            (k, to_plain(v, allow_pickle=allow_pickle, _path=f"{_path}/{k}"))
            for k, v in obj.items()
        ]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if type(obj) in (list, tuple):
        values = [
            to_plain(v, allow_pickle=allow_pickle, _path=f"{_path}/{i}") for i, v in enumerate(obj)
        ]
        return values if type(obj) is list else tuple(values)
    if isinstance(obj, (pathlib.PurePath, torch.dtype, torch.device)):
        return str(obj)
    if allow_pickle or _is_stored_as_is(obj):
        return obj
    tp = type(obj)
    raise TypeError(
        f"cannot checkpoint {_path or '/'} without pickle: {tp.__module__}.{tp.__qualname__} "
        "(store plain data in hyper_parameters, e.g. save_hyperparameters(ignore=[...]), "
        "or pass allow_pickle=True)"
    )


def _is_stored_as_is(obj: Any) -> bool:
    # numpy arrays and scalars, and stateful objects: cryosnap stores them itself.
    module = type(obj).__module__
    return module == "numpy" or (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))


def load_checkpoint(
    path: str | os.PathLike[str], *, step: int | None = None, allow_pickle: bool = False
) -> dict[str, Any]:
    """The Lightning checkpoint dict stored at ``path`` (a run of either class here).

    ``step`` None: the newest version that verifies. For weights outside a Trainer:
    ``model.load_state_dict(load_checkpoint(path)["state_dict"])``.
    """
    checkpoint = load(os.fspath(path), step=step, allow_pickle=allow_pickle)
    if not isinstance(checkpoint, dict):
        raise TypeError(f"{os.fspath(path)} does not hold a Lightning checkpoint (a dict)")
    return checkpoint


class CryosnapCheckpointIO(CheckpointIO):
    """A ``CheckpointIO`` that writes each Lightning checkpoint path as a cryosnap run.

    Parameters
    ----------
    async_save
        Return from ``save_checkpoint`` once the checkpoint is captured and write it in the
        background (True), or once it is durable (False).
    allow_pickle
        Pickle objects of the checkpoint that cryosnap does not store as data (see the module
        docstring), and unpickle them on load.
    checkpointer_options
        Passed to each :class:`~cryosnap.Checkpointer` (``chunk_bytes``, ``incremental``,
        ``full_every``, ``staging_bytes``); ``keep`` is always 1: a path holds one checkpoint.
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        allow_pickle: bool = False,
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        if "keep" in checkpointer_options:
            raise TypeError("keep is not an option of CryosnapCheckpointIO: a path keeps 1")
        self.async_save = bool(async_save)
        self.allow_pickle = bool(allow_pickle)
        self._options = checkpointer_options
        # Paths whose last save may still be in flight: their Checkpointer holds the run's lock.
        self._open: dict[str, tuple[Checkpointer, PendingSave]] = {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "CryosnapCheckpointIO.save_checkpoint takes no storage_options, got "
                f"{storage_options!r}"
            )
        key = os.fspath(path)
        step = validate_step(checkpoint.get("global_step", 0), "checkpoint['global_step']")
        state = to_plain(checkpoint, allow_pickle=self.allow_pickle)
        self._close_finished()
        self._close(key)
        ckpt = Checkpointer(key, keep=1, allow_pickle=self.allow_pickle, **self._options)
        try:
            latest = ckpt.latest_step()
            if latest is not None and latest >= step:
                # The path is rewritten at an older or equal step: the newest version would
                # win over the new one, so the path starts over (not atomic, like torch.save).
                ckpt.close()
                self._remove_tree(key)
                ckpt = Checkpointer(key, keep=1, allow_pickle=self.allow_pickle, **self._options)
            pending = ckpt.save(step, state)
        except BaseException:
            ckpt.close()
            raise
        if self.async_save:
            self._open[key] = (ckpt, pending)
        else:
            ckpt.close()

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        key = os.fspath(path)
        self._close(key)
        checkpoint = load_checkpoint(key, allow_pickle=self.allow_pickle and not weights_only)
        if isinstance(map_location, (str, torch.device)):
            device = torch.device(map_location)
            if device.type != "cpu":
                moved: dict[str, Any] = _to_device(checkpoint, device)
                return moved
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        key = os.fspath(path)
        self._close(key)
        self._remove_tree(key)

    def teardown(self) -> None:
        """Wait until every checkpoint is durable; raise the first failure."""
        errors: list[BaseException] = []
        for key in list(self._open):
            try:
                self._close(key)
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _close(self, key: str) -> None:
        entry = self._open.pop(key, None)
        if entry is not None:
            entry[0].close()

    def _close_finished(self) -> None:
        for key, (_ckpt, pending) in list(self._open.items()):
            if pending.done():
                self._close(key)

    @staticmethod
    def _remove_tree(key: str) -> None:
        fs, fs_path = url_to_fs(key)
        if fs.exists(fs_path):
            fs.rm(fs_path, recursive=True)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


class CryosnapCallback(Callback):
    """Save the whole training state into one cryosnap run every N steps; resume ``fit`` from it.

    Parameters
    ----------
    path
        The run: a directory or an fsspec URL.
    every_n_steps
        Save when ``trainer.global_step`` (optimizer steps) is a multiple of this, at the end
        of the training batch.
    save_on_train_end
        Also save the final step when training ends (if it is not saved yet).
    resume
        At the start of ``fit``, restore the newest version of the run (if any): training
        continues from its ``global_step``. A ``ckpt_path`` passed to ``fit`` takes precedence.
    keep, allow_pickle, checkpointer_options
        Passed to :class:`~cryosnap.Checkpointer` (``chunk_bytes``, ``incremental``,
        ``full_every``, ``staging_bytes``, ``max_inflight``).

    Saves are asynchronous: the training loop waits while the state is copied to host memory,
    the write runs in the background; ``fit`` waits for the last one when training ends.
    Resuming mid-epoch continues the data where it stopped only when the dataloader is
    resumable (see Lightning's fault-tolerance notes); Lightning warns otherwise.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        every_n_steps: int,
        save_on_train_end: bool = True,
        resume: bool = True,
        keep: int | None = None,
        allow_pickle: bool = False,
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        if (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps <= 0
        ):
            raise ValueError(
                f"every_n_steps={every_n_steps!r} is invalid: allowed is a positive int"
            )
        self.path = os.fspath(path)
        self.every_n_steps = every_n_steps
        self.save_on_train_end = bool(save_on_train_end)
        self.resume = bool(resume)
        self.allow_pickle = bool(allow_pickle)
        self._options: dict[str, Any] = {"keep": keep, **checkpointer_options}
        self._ckpt: Checkpointer | None = None
        self._last_saved: int | None = None
        self.restored_step: int | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        self._close()
        self._ckpt = Checkpointer(self.path, allow_pickle=self.allow_pickle, **self._options)
        self._last_saved = self._ckpt.latest_step()
        self.restored_step = None
        if self.resume and self._last_saved is not None:
            self._resume(trainer)

    def _resume(self, trainer: Trainer) -> None:
        assert self._ckpt is not None
        checkpoint = self._ckpt.restore()
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is None or not hasattr(connector, "_loaded_checkpoint"):
            raise TypeError(
                f"cannot resume from {self.path}: this Lightning version has no checkpoint "
                "connector to restore through; pass CryosnapCallback(..., resume=False) and "
                "trainer.fit(ckpt_path=...) with CryosnapCheckpointIO instead"
            )
        # Lightning restores right after setup (model, callbacks, then loops, optimizers and
        # schedulers) from what its connector holds; a fit(ckpt_path=...) replaces it.
        connector._loaded_checkpoint = checkpoint
        self.restored_step = int(checkpoint.get("global_step", 0))
        log.info("cryosnap: resuming from step %d of %s", self.restored_step, self.path)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0:
            self._save(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_on_train_end:
            self._save(trainer)
        if self._ckpt is not None:
            self._ckpt.wait()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        try:
            self._close()
        except Exception as exc:  # the training exception is the one to see
            log.error("cryosnap: closing %s after a training failure: %s", self.path, exc)

    def _save(self, trainer: Trainer) -> None:
        step = trainer.global_step
        if self._ckpt is None or (self._last_saved is not None and step <= self._last_saved):
            return
        # What trainer.save_checkpoint() writes: weights, optimizers, schedulers, loops,
        # callbacks, precision plugin (it calls the on_save_checkpoint hooks too).
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self._ckpt.save(step, to_plain(checkpoint, allow_pickle=self.allow_pickle))
        self._last_saved = step

    def _close(self) -> None:
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            ckpt.close()
