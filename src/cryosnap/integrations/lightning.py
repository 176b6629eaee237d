"""Lightning integration: checkpoints of a ``lightning.pytorch.Trainer`` written by cryosnap.

Three ways in, all without pickle: :class:`CryosnapCheckpointIO`, a ``CheckpointIO`` plugin;
:class:`CryosnapCallback`, a ``Callback``; :class:`CryosnapDDPStrategy`, a ``DDPStrategy``
whose checkpoints every rank writes its part of. :func:`load_from_checkpoint` builds a module.
Runs on the training loop's thread; the writes run on each Checkpointer's writer thread.
docs/design/integrations.md has how each works, what is stored and what is not supported.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import pathlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from fsspec.core import url_to_fs
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ParallelStrategy, Strategy

from cryosnap import engine
from cryosnap._validate import step as validate_step
from cryosnap.checkpointer import Checkpointer, PendingSave, load
from cryosnap.dist import LocalCoordinator
from cryosnap.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InexactResumeError,
    StateMismatchError,
    UnsupportedError,
)
from cryosnap.integrations import _loaders
from cryosnap.integrations._base import RunSaver, rank_zeros, split_step
from cryosnap.integrations.torch import RNGState
from cryosnap.policy import RetentionPolicy, SavePolicy, VersionInfo, as_retention
from cryosnap.run import Run
from cryosnap.storage import open_store

__all__ = [
    "CryosnapCallback",
    "CryosnapCheckpointIO",
    "CryosnapDDPStrategy",
    "CryosnapFSDPStrategy",
    "InexactResumeError",
    "InexactResumeWarning",
    "load_checkpoint",
    "load_from_checkpoint",
    "to_plain",
]

log = logging.getLogger("cryosnap")

_Module = TypeVar("_Module", bound=LightningModule)
_T = TypeVar("_T")

_RESUME_HINT = (
    "run it with CryosnapCallback(path, ...) (resume=True, the default) or "
    "trainer.fit(..., ckpt_path=path)"
)


class InexactResumeWarning(UserWarning):
    """A train dataloader whose position cannot be restored mid-epoch, or a version saved by
    another number of processes: training goes on, not bit for bit as an uninterrupted one.
    ``CryosnapCallback(exact=True)`` makes it an :class:`~cryosnap.InexactResumeError`."""


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
    ``model.load_state_dict(load_checkpoint(path)["state_dict"])``. A version a cryosnap
    strategy saved holds each rank's checkpoint: this is rank 0's.
    """
    return _with_buffers(_stored(os.fspath(path), step, 0, allow_pickle))


def _with_buffers(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A strategy's ``checkpoint`` as Lightning's: its buffers back in the ``state_dict``."""
    if _BUFFERS in checkpoint:
        checkpoint["state_dict"] = {**checkpoint["state_dict"], **checkpoint.pop(_BUFFERS)}
    return checkpoint


def _stored(path: str, step: int | None, rank: int, allow_pickle: bool) -> dict[str, Any]:
    """Part ``rank`` of version ``step`` of ``path`` as stored (a strategy's: with its buffers
    apart from the ``state_dict``)."""
    checkpoint = load(path, step=step, rank=rank or None, allow_pickle=allow_pickle)
    if not isinstance(checkpoint, dict):
        raise TypeError(f"{path} does not hold a Lightning checkpoint (a dict)")
    return checkpoint


def load_from_checkpoint(
    cls: type[_Module],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    map_location: str | torch.device | None = None,
    strict: bool | None = None,
    allow_pickle: bool = False,
    **kwargs: Any,
) -> _Module:
    """``cls.load_from_checkpoint(path)`` for a cryosnap run (``"runs/x"`` or ``"runs/x@40"``).

    ``LightningModule.load_from_checkpoint`` reads files with ``torch.load`` and has no plugin
    seam, so cryosnap runs load through this function instead: the module is built from the
    saved ``hyper_parameters`` (``kwargs`` override them, as there), its ``on_load_checkpoint``
    hook runs and the weights are loaded (``strict`` as there), then it is moved to
    ``map_location`` (default: the CPU).
    """
    from lightning.pytorch.core.saving import _load_state

    run, at = split_step(os.fspath(path))
    checkpoint = load_checkpoint(run, step=at if step is None else step, allow_pickle=allow_pickle)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    assert isinstance(model, cls)
    return model.to(torch.device(map_location or "cpu"))


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
        # Global rank 0 alone writes (as TorchCheckpointIO), in a world of one.
        self._options = {"comm": LocalCoordinator(), **checkpointer_options}
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
        key, step = split_step(os.fspath(path))
        self._close(key)
        checkpoint = load_checkpoint(
            key, step=step, allow_pickle=self.allow_pickle and not weights_only
        )
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
    """Save the whole training state into one cryosnap run; resume ``fit`` from it exactly.

    Parameters
    ----------
    path
        The run: a directory or an fsspec URL.
    every_n_steps, policy
        When to save: every N optimizer steps (``trainer.global_step``), or a save policy from
        :mod:`cryosnap.policy` (``EveryNSteps``, ``EveryNSeconds``, ``Adaptive``); one of the
        two. Saves happen at the end of a training batch, once per optimizer step.
    save_on_train_end
        Also save the final step when training ends (if it is not saved yet).
    resume
        At the start of ``fit``, restore the newest version of the run (if any): training
        continues from its ``global_step``, so running the same script again (a requeued job)
        resumes. A ``ckpt_path`` given to ``fit`` takes precedence. ``resume=False`` into a
        run that holds versions is refused.
    exact
        The train dataloaders resume mid-epoch where they stopped: a loader with
        ``state_dict``/``load_state_dict`` by itself (Lightning saves it), a plain
        ``DataLoader`` over a map-style dataset through the callback (its sampler's order at
        the start of the epoch is saved, and on resume the consumed batches are skipped
        without being loaded). A loader that cannot be made so (an ``IterableDataset``, a
        sampler without state, loaders of different lengths that ``CombinedLoader`` cycles)
        trains anyway and is named in one :class:`InexactResumeWarning`; ``exact=True``
        refuses to start instead (:class:`~cryosnap.InexactResumeError`).
    handle_signals
        Preemption signals (default ``(signal.SIGTERM,)``; ``()``: none): the batch in progress
        ends, its step is saved and durable, then the signal goes on to Lightning's own handler
        (which ends ``fit``).
    run_id
        This training's id (default: a new one; the run's own when resuming).
    keep, allow_pickle, checkpointer_options
        Passed to :class:`~cryosnap.Checkpointer` (``chunk_bytes``, ``incremental``,
        ``full_every``, ``staging_bytes``, ``max_inflight``, ``scratch``...).

    Saves are asynchronous: the training loop waits while the state is copied to host memory,
    the write runs in the background; ``fit`` waits for the last one when training ends.
    The callback's own state (saved with every Lightning checkpoint, this callback's and
    ``ModelCheckpoint``'s alike) holds the random number generators (:class:`RNGState`), put
    back when training starts, and the order of the epoch of each plain train dataloader.
    Under DDP every rank saves its part of each version: rank 0 the checkpoint, each rank its
    own state of this callback, which it gets back on resume (docs/design/integrations.md).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        every_n_steps: int | None = None,
        policy: SavePolicy | None = None,
        save_on_train_end: bool = True,
        resume: bool = True,
        exact: bool = False,
        handle_signals: Sequence[int] | None = None,
        run_id: str | None = None,
        keep: int | None = None,
        allow_pickle: bool = False,
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        self.resume = bool(resume)
        self.exact = bool(exact)
        self.allow_pickle = bool(allow_pickle)
        self._saver = RunSaver(
            path,
            every_n_steps=every_n_steps,
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
        )
        self._init_state()

    def _init_state(self) -> None:
        """The rest of the constructor, once ``self._saver`` is set."""
        self.path = self._saver.path
        self.restored_step: int | None = None
        self._rng: Any = None  # generator states to put back when training starts
        self._io: tuple[Any, CheckpointIO] | None = None  # (strategy, its own CheckpointIO)
        self._trainer: Trainer | None = None
        self._positions: list[Any] = []  # saved data positions for the next train loaders
        self._next_epoch = False
        self._warned: set[str] = set()

    @property
    def preempted_at(self) -> int | None:
        """The step saved on preemption in the last ``fit`` (None: not preempted)."""
        return self._saver.preempted_at

    # -- Lightning's checkpoint of this callback: the generators ----------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"rng": RNGState().state_dict(), "data": self._data_positions()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rng = state_dict.get("rng")
        self._positions = list(state_dict.get("data") or [])
        # Saved at the end of an epoch: the next one starts afresh (see on_train_start).
        self._next_epoch = bool(self._positions) and all(p is None for p in self._positions)

    def _data_positions(self) -> list[dict[str, Any] | None]:
        """Per train dataloader: its epoch's order and the batches the loop consumed (None:
        the epoch is done or not started, or the loader saves its own position)."""
        trainer = self._trainer
        combined = None if trainer is None else trainer.fit_loop._combined_loader
        if trainer is None or combined is None:
            return []
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        done = batches == 0 or batches >= trainer.num_training_batches
        positions: list[dict[str, Any] | None] = []
        for loader in combined.flattened:  # one entry per loader, in Lightning's order
            order = _epoch_order(loader)
            if done or order is None or order.order is None:
                positions.append(None)
            else:
                positions.append({"order": order.order, "batches": batches})
        return positions

    # -- hooks ----------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._saver.close()
        self.restored_step = None
        self._rng = None
        self._positions = []
        self._next_epoch = False
        self._trainer = trainer
        self._read_runs_through(trainer)
        self._order_train_loaders(trainer)
        if self.resume and self._saver.steps():
            self._resume(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_loaders(trainer)
        if self._rng is not None:
            # Here, not in load_state_dict: setting up the data and the loops draws numbers
            # that the uninterrupted run drew before its checkpoint.
            RNGState().load_state_dict(self._rng)
            self._rng = None
            if self._next_epoch:
                self._start_next_epoch(trainer)
        # Opened here, after Lightning installed its signal handlers: cryosnap's goes in front.
        # Under DDP on every rank (collective): each saves its own part of every version.
        self._saver.begin(
            trainer.global_step,
            distributed=trainer.world_size > 1,
            replicated=self._replicated(trainer),
        )

    def _replicated(self, trainer: Trainer) -> list[str] | None:
        """The top-level keys of the saved state that every rank holds alike (None: rank 0
        saves the checkpoint, each other rank its own state of this callback)."""
        return None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._saver.step_end(trainer.global_step, lambda: self._dump(trainer)):
            trainer.should_stop = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._saver.end(trainer.global_step, lambda: self._dump(trainer))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore_io()
            self._saver.close()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._restore_io()
        self._saver.abort()

    # -- the position of plain train dataloaders ------------------------------------------------

    def _order_train_loaders(self, trainer: Trainer) -> None:
        """Give each plain train dataloader an EpochOrder as Lightning sets it up: after the
        strategy processed it (a DistributedSampler injected), before its first ``iter()``
        (which, with workers, draws indices at once)."""
        strategy = trainer.strategy
        process = type(strategy).process_dataloader.__get__(strategy)

        def process_dataloader(dataloader: object) -> object:
            dataloader = process(dataloader)
            if trainer.training:
                order = _loaders.install(dataloader)
                position = self._positions.pop(0) if self._positions else None
                # An order of another kind of sampler (saved by a job of another world size,
                # already warned about) cannot be followed: the epoch starts afresh.
                if order is not None and position is not None and order.fits(position["order"]):
                    skip = int(position["batches"]) * _batch_size(dataloader)
                    order.resume_at(position["order"], skip)
            return dataloader

        # An instance attribute over the method, for this fit only (teardown removes it).
        vars(strategy)["process_dataloader"] = process_dataloader

    def _start_next_epoch(self, trainer: Trainer) -> None:
        """Resumed at the end of an epoch: iterate the plain loaders again, after the
        generators are back. The uninterrupted run starts its next epoch's iterators from
        these generators (a DataLoader draws its workers' base seed, a RandomSampler its seed);
        the iterators made before the restore drew from the fresh process's."""
        self._next_epoch = False
        combined, fetcher = trainer.fit_loop._combined_loader, trainer.fit_loop._data_fetcher
        if combined is None or fetcher is None:
            return
        if all(_epoch_order(loader) is not None for loader in combined.flattened):
            iter(fetcher)

    def _check_loaders(self, trainer: Trainer) -> None:
        """Refuse (``exact=True``) or name once a train dataloader that cannot resume exactly."""
        loaders = _loaders_of(trainer.train_dataloader)
        for i, loader in enumerate(loaders):
            why = _loaders.why_inexact(loader)
            if why is not None:
                name = f"train dataloader {i}" if len(loaders) > 1 else "the train dataloader"
                self._inexact(f"{name} ({type(loader).__name__}) cannot resume mid-epoch", why)
        combined = trainer.fit_loop._combined_loader
        if combined is not None:
            why = _loaders.why_combined_inexact(combined._mode, combined.flattened)
            if why is not None:
                self._inexact("the train dataloaders cannot resume mid-epoch", why)

    def _inexact(self, what: str, why: str) -> None:
        """``exact=True``: raise (on every rank alike); else warn once, on global rank 0."""
        message = (
            f"cryosnap: {what} where it stopped: {why}. A resume would differ from an "
            "uninterrupted run"
        )
        if self.exact:
            raise InexactResumeError(f"{message}; CryosnapCallback(exact=True) refuses it")
        trainer = self._trainer
        if message not in self._warned and (trainer is None or trainer.is_global_zero):
            self._warned.add(message)
            warnings.warn(message, InexactResumeWarning, stacklevel=3)

    # -- resuming -------------------------------------------------------------------------------

    def _resume(self, trainer: Trainer) -> None:
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is None or not hasattr(connector, "_loaded_checkpoint"):
            raise TypeError(
                f"cannot resume from {self.path}: this Lightning version has no checkpoint "
                "connector to restore through; pass CryosnapCallback(..., resume=False) and "
                f"trainer.fit(ckpt_path={self.path!r})"
            )
        checkpoint = self._checkpoint_of_rank(trainer, self.path, None, self.allow_pickle)
        # Lightning restores right after setup (model, callbacks, then loops, optimizers and
        # schedulers) from what its connector holds; a fit(ckpt_path=...) replaces it.
        connector._loaded_checkpoint = checkpoint
        self.restored_step = int(checkpoint.get("global_step", 0))
        log.info("cryosnap: resuming from step %d of %s", self.restored_step, self.path)
        if 0 <= trainer.max_steps <= self.restored_step:
            log.warning(
                "cryosnap: %s already holds the end of this training (step %d, max_steps=%d): "
                "fit has nothing left to train; a new training needs a new path",
                self.path,
                self.restored_step,
                trainer.max_steps,
            )

    def _checkpoint_of_rank(
        self, trainer: Trainer, run: str, step: int | None, allow_pickle: bool
    ) -> dict[str, Any]:
        """This rank's Lightning checkpoint of version ``step`` of ``run`` (None: the newest
        that verifies, as rank 0 finds it). Under DDP rank 0's part holds the checkpoint and
        every rank's part its own state of this callback (generators, data positions); the
        ranks read the same version (collective: every rank calls it at the same point)."""
        world, rank = trainer.world_size, trainer.global_rank
        checkpoint: dict[str, Any] | None = None
        if world == 1:
            checkpoint = load_checkpoint(run, step=step, allow_pickle=allow_pickle)
            at = int(checkpoint.get("global_step", 0)) if step is None else step
            return self._own_state(run, at, (1, 0), checkpoint, allow_pickle)
        if step is None and rank == 0:
            checkpoint, failed = _attempt(lambda: load_checkpoint(run, allow_pickle=allow_pickle))
            if checkpoint is not None:
                step = int(checkpoint.get("global_step", 0))
        else:
            failed = None
        step = _agree(run, step, failed)
        own, failed = _attempt(
            lambda: self._own_state(run, step, (world, rank), checkpoint, allow_pickle)
        )
        _agree(run, step, failed)
        assert own is not None
        return own

    def _own_state(
        self,
        run: str,
        step: int,
        where: tuple[int, int],
        checkpoint: dict[str, Any] | None,
        allow_pickle: bool,
    ) -> dict[str, Any]:
        """Rank 0's checkpoint of ``step`` with this rank's (world, rank) own callback state."""
        world, rank = where
        if checkpoint is None:
            checkpoint = load_checkpoint(run, step=step, allow_pickle=allow_pickle)
        try:
            saved = Run(run).info(step).world_size
        except CheckpointNotFoundError:  # not a version at global_step: not the callback's
            saved = 1
        key = self.state_key
        if saved != world:
            self._inexact(
                f"step {step} of {run}, saved by {saved} process(es), cannot resume "
                f"{world} process(es)",
                "every rank takes rank 0's random number generators and data position; resume "
                "with as many processes (devices x num_nodes) as saved",
            )
        elif rank:
            part = load(run, step=step, rank=rank, keys=["callbacks"], allow_pickle=allow_pickle)
            checkpoint.setdefault("callbacks", {})[key] = part["callbacks"][key]
        return checkpoint

    def _read_runs_through(self, trainer: Trainer) -> None:
        """Make ``fit(ckpt_path=<run>[@step])`` read cryosnap runs (Lightning's default
        CheckpointIO reads files with ``torch.load``)."""
        strategy = trainer.strategy
        io = strategy.checkpoint_io
        if type(io) is TorchCheckpointIO:
            strategy.checkpoint_io = _RunsOrFiles(
                io,
                allow_pickle=self.allow_pickle,
                load=lambda *how: self._checkpoint_of_rank(trainer, *how),
            )
            self._io = (strategy, io)

    def _restore_io(self) -> None:
        if self._io is not None:
            strategy, io = self._io
            strategy.checkpoint_io = io
            self._io = None
        if self._trainer is not None:
            vars(self._trainer.strategy).pop("process_dataloader", None)

    def _dump(self, trainer: Trainer) -> Any:
        # What trainer.save_checkpoint() writes: weights, optimizers, schedulers, loops (the
        # data position of a resumable train dataloader included), callbacks (this one's RNG
        # states), precision plugin; it calls the on_save_checkpoint hooks too.
        # Under DDP every rank dumps (as trainer.save_checkpoint does: a strategy may gather
        # optimizer state); rank 0's part is the checkpoint, another rank's its own state of
        # this callback (its generators and data positions), the rest being rank 0's.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if trainer.world_size > 1 and trainer.global_rank > 0:
            checkpoint = {"callbacks": {self.state_key: checkpoint["callbacks"][self.state_key]}}
        return to_plain(checkpoint, allow_pickle=self.allow_pickle)


class _RunsOrFiles(CheckpointIO):
    """Lightning's ``TorchCheckpointIO``, except that a cryosnap run (``path`` or
    ``path@step``) is loaded through cryosnap."""

    def __init__(
        self,
        files: CheckpointIO,
        *,
        allow_pickle: bool,
        load: Callable[[str, int | None, bool], dict[str, Any]],
    ) -> None:
        super().__init__()
        self.files = files
        self.allow_pickle = allow_pickle
        self.load = load  # the callback's: (run, step, allow_pickle) -> this rank's checkpoint

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        self.files.save_checkpoint(checkpoint, os.fspath(path), storage_options=storage_options)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        run, step = split_step(os.fspath(path))
        if step is None and not _holds_versions(run):
            return self.files.load_checkpoint(
                os.fspath(path), map_location, weights_only=weights_only
            )
        return self.load(run, step, self.allow_pickle and not weights_only)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        self.files.remove_checkpoint(os.fspath(path))

    def teardown(self) -> None:
        self.files.teardown()


def _holds_versions(path: str) -> bool:
    try:
        return bool(engine.list_steps(open_store(path)))
    except (OSError, ValueError):
        return False


def _attempt(read: Callable[[], _T]) -> tuple[_T | None, Exception | None]:
    """``read()``, or None and what failed (to be agreed on by every rank)."""
    try:
        return read(), None
    except InexactResumeError:
        raise  # every rank decides it alike, from the same record
    except (CheckpointError, OSError, TypeError, ValueError, KeyError) as exc:
        return None, exc


def _agree(run: str, step: int | None, failed: Exception | None) -> int:
    """Every rank: rank 0's ``step``, once no rank ``failed`` (else the rank that failed raises
    its error, the others one naming it). Collective on the job's default process group."""
    import torch.distributed as dist

    told: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(told, (step, None if failed is None else f"{failed}"))
    if failed is not None:
        raise failed
    for rank, (_step, error) in enumerate(told):
        if error is not None:
            raise CheckpointError(f"cannot resume from {run}: rank {rank}: {error}", path=run)
    agreed = told[0][0]
    assert isinstance(agreed, int)
    return agreed


def _loaders_of(iterables: Any) -> list[Any]:
    """The dataloaders of ``trainer.train_dataloader`` (one, or a collection of them)."""
    if isinstance(iterables, Mapping):
        return [d for v in iterables.values() for d in _loaders_of(v)]
    if isinstance(iterables, (list, tuple)):
        return [d for v in iterables for d in _loaders_of(v)]
    return [] if iterables is None else [iterables]


def _epoch_order(loader: object) -> _loaders.EpochOrder | None:
    batches = getattr(loader, "batch_sampler", None)
    order = getattr(batches, "sampler", None)
    return order if isinstance(order, _loaders.EpochOrder) else None


def _batch_size(loader: object) -> int:
    size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else 1


# -- the strategies: every rank saves its part --------------------------------------------------

_BUFFERS = "cryosnap_buffers"  # a rank's own module buffers, beside the replicated parameters
_REPLICATED = ["optimizer_states", "state_dict"]  # the same on every DDP rank: written 1/N each
_POINTER = "cryosnap_run"  # the key of a checkpoint file the strategy writes for Lightning
_POINTER_MAX_BYTES = 4096
_STRATEGY_HINT = (
    "run it with the same strategy (resume=True, the default) or trainer.fit(..., ckpt_path=path)"
)
# The Checkpointer's arguments the strategy sets itself.
_STRATEGY_SETS = frozenset(
    {"path", "policy", "handle_signals", "comm", "run_id", "keep", "allow_pickle"}
)


class _Named:
    """The strategies' retention. A version a checkpoint file of Lightning names (a
    ``ModelCheckpoint``'s top-k, best and last) is kept while the file is; one whose files
    were all removed, and that the strategy's schedule did not choose, goes; among the others
    ``keep`` chooses (None: all). Asked on the writer thread: the sets are replaced on the
    training loop's thread, never changed in place."""

    def __init__(self, keep: RetentionPolicy | None) -> None:
        self.keep = keep
        self.named: frozenset[int] = frozenset()
        self.dropped: frozenset[int] = frozenset()

    def select(self, versions: Sequence[VersionInfo]) -> set[int]:
        rest = [v for v in versions if v.step not in self.named and v.step not in self.dropped]
        kept = {v.step for v in rest} if self.keep is None else self.keep.select(rest)
        return kept | {v.step for v in versions if v.step in self.named}

    def __repr__(self) -> str:
        return f"_Named(keep={self.keep!r}, named={sorted(self.named)})"


class _StrategySaves(CryosnapCallback):
    """The :class:`CryosnapCallback` a cryosnap strategy installs in its Trainer: its schedule,
    preemption, generators, data positions and resume, except that every rank saves its whole
    checkpoint (the replicated keys 1/N each, its own generators, data position and buffers)
    and restores its own part. Runs on the training loop's thread."""

    def __init__(
        self,
        strategy: _CryosnapStrategy,
        saver: RunSaver,
        *,
        resume: bool,
        exact: bool,
        allow_pickle: bool,
    ) -> None:
        Callback.__init__(self)
        self.resume, self.exact, self.allow_pickle = resume, exact, allow_pickle
        self._saver = saver
        self._strategy = strategy
        self._init_state()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._strategy._check_trainer(trainer)
        super().setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._strategy._find_names(trainer)

    def _replicated(self, trainer: Trainer) -> list[str] | None:
        return self._strategy._replicated_keys()

    def _read_runs_through(self, trainer: Trainer) -> None:
        pass  # the strategy's load_checkpoint reads runs and Lightning's files

    def _dump(self, trainer: Trainer) -> Any:
        return self._strategy._saved_state(
            trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        )

    def _checkpoint_of_rank(
        self, trainer: Trainer, run: str, step: int | None, allow_pickle: bool
    ) -> dict[str, Any]:
        """This rank's own part of version ``step`` of ``run`` (None: the newest that verifies,
        as rank 0 finds it); collective: every rank calls it at the same point."""
        world, rank = trainer.world_size, trainer.global_rank
        checkpoint: dict[str, Any] | None = None
        failed: Exception | None = None
        if world == 1:
            return self._part(run, step, (1, 0), allow_pickle)
        if step is None and rank == 0:
            checkpoint, failed = _attempt(lambda: self._part(run, None, (world, 0), allow_pickle))
            if checkpoint is not None:
                step = int(checkpoint.get("global_step", 0))
        step = _agree(run, step, failed)
        failed = None
        if checkpoint is None:
            checkpoint, failed = _attempt(
                lambda: self._part(run, step, (world, rank), allow_pickle)
            )
        _agree(run, step, failed)
        assert checkpoint is not None
        return checkpoint

    def _part(
        self, run: str, step: int | None, where: tuple[int, int], allow_pickle: bool
    ) -> dict[str, Any]:
        """Part ``rank`` of version ``step`` (None: the newest that verifies) as Lightning's
        checkpoint: the buffers back in the ``state_dict``. A version saved by another number
        of processes gives each rank part ``rank % saved`` (inexact: warned or refused)."""
        world, rank = where
        checkpoint = _stored(run, step, 0, allow_pickle)
        at = int(checkpoint.get("global_step", 0)) if step is None else step
        try:
            saved = Run(run).info(at).world_size
        except CheckpointNotFoundError:  # a run@step whose step is not the global step
            saved = 1
        ours = _BUFFERS in checkpoint
        if saved != world or not ours:
            why = (
                f"step {at} of {run}, saved by {saved} process(es), cannot resume {world} "
                "process(es)"
                if ours
                else f"step {at} of {run} was saved by CryosnapCallback, not a strategy"
            )
            self._inexact(
                why,
                "every rank takes the random number generators and data position "
                "of another rank; resume with as many processes as saved",
            )
        part = rank % saved if ours else 0
        if part:
            checkpoint = _stored(run, at, part, allow_pickle)
        return _with_buffers(checkpoint)


class _CryosnapStrategy(ParallelStrategy):
    """What both cryosnap strategies add to Lightning's: ``save_checkpoint``,
    ``load_checkpoint`` and ``remove_checkpoint`` on every rank, into one cryosnap run; the
    schedule and resume of :class:`_StrategySaves`; the lazy capture's barrier before each
    optimizer update. Runs on the training loop's thread."""

    path: str
    _saves: _StrategySaves
    _kept: _Named
    _names: dict[str, int]  # a checkpoint file Lightning asked for -> the version it names
    _loaded_from: str

    def _init_cryosnap(
        self,
        path: str | os.PathLike[str],
        every_n_steps: int | None,
        policy: SavePolicy | None,
        options: dict[str, Any],
        checkpointer_options: dict[str, Any],
    ) -> None:
        cls = type(self).__name__
        unknown = sorted(set(checkpointer_options) - _CHECKPOINTER_OPTIONS)
        if unknown:
            raise TypeError(
                f"{cls} got unexpected argument(s) {', '.join(unknown)}: not a Checkpointer "
                f"option ({', '.join(sorted(_CHECKPOINTER_OPTIONS))}); the parent strategy's "
                "go in its own options argument"
            )
        allow_pickle = bool(options["allow_pickle"])
        self._kept = _Named(as_retention(options["keep"]))
        saver = RunSaver(
            path,
            every_n_steps=every_n_steps,
            policy=policy,
            save_on_train_end=options["save_on_train_end"],
            handle_signals=options["handle_signals"],
            run_id=options["run_id"],
            resume_hint=_STRATEGY_HINT,
            checkpointer_options={
                "keep": self._kept,
                "allow_pickle": allow_pickle,
                **checkpointer_options,
            },
            scheduled=False,
            lazy=True,
        )
        self.path = saver.path
        self._saves = _StrategySaves(
            self,
            saver,
            resume=bool(options["resume"]),
            exact=bool(options["exact"]),
            allow_pickle=allow_pickle,
        )
        self._names = {}
        self._loaded_from = self.path

    @property
    def restored_step(self) -> int | None:
        """The step the last ``fit`` resumed from by itself (None: it did not)."""
        return self._saves.restored_step

    @property
    def preempted_at(self) -> int | None:
        """The step saved on preemption in the last ``fit`` (None: not preempted)."""
        return self._saves.preempted_at

    # -- the Trainer ------------------------------------------------------------------------

    def connect(self, model: Any) -> None:
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        callbacks = [] if trainer is None else _callbacks(trainer)
        if trainer is not None and all(cb is not self._saves for cb in callbacks):
            # Last, after the checkpoint callbacks: a step a ModelCheckpoint saves holds the
            # state of the ModelCheckpoint that saved it, as in a torch file of its own.
            callbacks.append(self._saves)

    def _check_trainer(self, trainer: Trainer) -> None:
        """Refuse what would checkpoint beside the strategy or be ignored by it."""
        cls = type(self).__name__
        for cb in _callbacks(trainer):
            if isinstance(cb, CryosnapCallback) and cb is not self._saves:
                raise UnsupportedError(
                    f"{cls} saves the training itself and CryosnapCallback({cb.path!r}) would "
                    "save it again (two runs, the same steps): remove the callback; the "
                    "strategy's every_n_steps= or policy= is its schedule",
                    path=self.path,
                )
            if isinstance(cb, ModelCheckpoint) and cb.save_weights_only:
                raise UnsupportedError(
                    f"ModelCheckpoint(save_weights_only=True) with {cls}: a version of the run "
                    "must resume training, and a weights-only one cannot; drop "
                    "save_weights_only (cryosnap.integrations.lightning.load_from_checkpoint "
                    "reads the weights of any version)",
                    path=self.path,
                )
        io = self._checkpoint_io
        if io is not None and type(io) is not TorchCheckpointIO:
            raise UnsupportedError(
                f"{cls} writes every checkpoint itself, on every rank: the CheckpointIO plugin "
                f"{type(io).__name__} would never be called; remove it from the Trainer",
                path=self.path,
            )

    # -- saving ---------------------------------------------------------------------------------

    def _saved_state(self, checkpoint: dict[str, Any]) -> Any:
        """What every rank saves of Lightning's ``checkpoint``: the model's parameters apart
        from its buffers (each rank's own, and a forward changes them: copied here, as a lazy
        capture does not wait for forwards)."""
        params = self._parameter_names()
        weights = checkpoint["state_dict"]
        state = dict(checkpoint)
        state["state_dict"] = {k: v for k, v in weights.items() if k in params}
        state[_BUFFERS] = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in weights.items()
            if k not in params
        }
        return to_plain(state, allow_pickle=self._saves.allow_pickle)

    def _parameter_names(self) -> set[str]:
        """The keys of the saved ``state_dict`` that are parameters (the rest: buffers)."""
        module = self.lightning_module
        assert module is not None
        return {name for name, _ in module.named_parameters(remove_duplicate=False)}

    def _replicated_keys(self) -> list[str] | None:
        """The top-level keys of a saved state that are the same on every rank."""
        return list(_REPLICATED) if self.world_size > 1 else None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Save ``checkpoint`` as the run's version ``global_step`` (every rank its part, at
        once: the copy runs in the background) and write at ``filepath`` a small file naming
        it, for Lightning (``ModelCheckpoint``'s top-k, best and last, ``ckpt_path=``)."""
        cls = type(self).__name__
        if storage_options is not None:
            raise TypeError(f"{cls}.save_checkpoint takes no storage_options")
        if "optimizer_states" not in checkpoint:
            raise UnsupportedError(
                f"{cls} saves whole training states: a weights-only checkpoint "
                f"({os.fspath(filepath)}) cannot resume training",
                path=self.path,
            )
        step = validate_step(checkpoint.get("global_step", 0), "checkpoint['global_step']")
        if step == 0:
            raise UnsupportedError(
                f"{cls} saves trained states, from step 1: {os.fspath(filepath)} at step 0",
                path=self.path,
            )
        saver = self._saves._saver
        opened = saver.ckpt is None  # outside fit: the run is opened for this save
        if opened:
            saver.begin(step, distributed=self.world_size > 1, replicated=self._replicated_keys())
        try:
            saver.save(step, lambda: self._saved_state(checkpoint))
        finally:
            if opened:
                saver.close()
        key = _file_key(filepath)
        self._names[key] = step
        self._kept.named = frozenset(self._names.values())
        if self.is_global_zero:
            _write_pointer(key, self.path, step)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Forget ``filepath``: its version goes at the run's next save unless another file
        names it or the strategy's schedule chose it too (then ``keep`` decides)."""
        key = _file_key(filepath)
        step = self._names.pop(key, None)
        self._kept.named = frozenset(self._names.values())
        if step is not None and step not in self._saves._saver.chosen:
            self._kept.dropped = self._kept.dropped | {step}
        if self.is_global_zero and _read_pointer(key) is not None:
            fs, fs_path = url_to_fs(key)
            fs.rm(fs_path)

    def _find_names(self, trainer: Trainer) -> None:
        """The versions the ModelCheckpoints of ``trainer`` name after a resume (their top-k,
        best and last files that point into this run), as global rank 0 reads them."""
        names: dict[str, int] = {}
        if trainer.is_global_zero:
            run = _run_key(self.path)
            for cb in trainer.checkpoint_callbacks:
                if not isinstance(cb, ModelCheckpoint):
                    continue
                for path in [*cb.best_k_models, cb.best_model_path, cb.last_model_path]:
                    pointer = _read_pointer(_file_key(path)) if path else None
                    if pointer is not None and pointer[0] == run:
                        names[_file_key(path)] = pointer[1]
        if trainer.world_size > 1:
            names = rank_zeros(names)
        self._names = {**names, **self._names}
        self._kept.named = frozenset(self._names.values())

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's, with the capture barrier between the closure (forward and backward:
        they overlap the copy of the last save) and the update that changes what it copies."""
        saver = self._saves._saver

        def closure_then_captured() -> Any:
            result = closure()
            saver.wait_captured()
            return result

        return super().optimizer_step(optimizer, closure_then_captured, model, **kwargs)

    # -- loading --------------------------------------------------------------------------------

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """``checkpoint_path``: a file this strategy wrote (a ``last`` file of a
        ModelCheckpoint stands for the run's newest version), a run (``path`` or
        ``path@step``) or a Lightning checkpoint file; every rank reads its own part."""
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        self._saves._saver.wait_captured()
        path = os.fspath(checkpoint_path)
        run, step = _resolve(path, trainer)
        if run is None:
            self._loaded_from = path
            return super().load_checkpoint(path, weights_only=weights_only)
        self._loaded_from = run if step is None else f"{run}@{step}"
        allow = self._saves.allow_pickle and not weights_only
        return self._saves._checkpoint_of_rank(trainer, run, step, allow)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if strict:
            _check_model(module.state_dict(), checkpoint["state_dict"], self._loaded_from, module)
        super().load_model_state_dict(checkpoint, strict=strict)


class CryosnapDDPStrategy(_CryosnapStrategy, DDPStrategy):
    """Lightning's ``DDPStrategy`` whose checkpoints every rank writes into one cryosnap run.

    ``Trainer(strategy=CryosnapDDPStrategy(path, every_n_steps=100))`` is all a script adds:
    the strategy saves on its schedule (as :class:`CryosnapCallback` does, no callback to add)
    and whenever Lightning saves (``ModelCheckpoint``, ``trainer.save_checkpoint``); each rank
    writes 1/N of the model and optimizer (the same on every rank) and its own generators,
    data position and buffers. Saves are lazy: ``save`` returns before the copy, which runs
    while the next batch's forward and backward do, and the next optimizer update waits for
    it. ``fit`` resumes from the run's newest version by itself (``resume``);
    ``fit(ckpt_path=...)`` takes a file it wrote, ``"last"``, a run or ``run@step``, or a
    Lightning checkpoint file.

    Parameters
    ----------
    path
        The run: a directory or an fsspec URL.
    every_n_steps, policy
        The strategy's own schedule: every N optimizer steps, or a save policy from
        :mod:`cryosnap.policy`; neither (the default): only when Lightning saves.
    keep
        Which versions to keep among those no Lightning checkpoint file names (an int n: the
        newest n; a retention policy; None: all). A version a file names (a ModelCheckpoint's
        top-k, best, last) is kept while the file is; one whose files ModelCheckpoint removed
        goes at the next save unless the schedule chose it too; the newest is always kept.
    save_on_train_end, resume, exact, handle_signals, run_id, allow_pickle
        As :class:`CryosnapCallback`'s.
    ddp_options
        ``DDPStrategy``'s own arguments (``process_group_backend``, ``timeout``,
        ``find_unused_parameters``...).
    checkpointer_options
        Passed to :class:`~cryosnap.Checkpointer` (``chunk_bytes``, ``scratch``, ``partner``,
        ``incremental``...).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        every_n_steps: int | None = None,
        policy: SavePolicy | None = None,
        *,
        keep: int | RetentionPolicy | None = None,
        save_on_train_end: bool = True,
        resume: bool = True,
        exact: bool = False,
        handle_signals: Sequence[int] | None = None,
        run_id: str | None = None,
        allow_pickle: bool = False,
        ddp_options: Mapping[str, Any] | None = None,
        **checkpointer_options: Any,
    ) -> None:
        DDPStrategy.__init__(self, **dict(ddp_options or {}))
        options = {
            "keep": keep,
            "save_on_train_end": save_on_train_end,
            "resume": resume,
            "exact": exact,
            "handle_signals": handle_signals,
            "run_id": run_id,
            "allow_pickle": allow_pickle,
        }
        self._init_cryosnap(path, every_n_steps, policy, options, checkpointer_options)


_CHECKPOINTER_OPTIONS = frozenset(inspect.signature(Checkpointer.__init__).parameters) - {
    "self",
    *_STRATEGY_SETS,
}


def _callbacks(trainer: Trainer) -> list[Callback]:
    """The Trainer's list of callbacks (set by its callback connector, untyped)."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    return callbacks


def _file_key(path: Any) -> str:
    """A checkpoint file's path as the strategies key it (local: absolute, normalized)."""
    text = str(os.fspath(path))
    return text if "://" in text else os.path.normpath(os.path.abspath(text))


def _run_key(path: str) -> str:
    return _file_key(path)


def _write_pointer(key: str, run: str, step: int) -> None:
    """Write at ``key`` the file naming version ``step`` of ``run`` (replaced whole)."""
    fs, fs_path = url_to_fs(key)
    fs.makedirs(fs.sep.join(fs_path.split(fs.sep)[:-1]) or ".", exist_ok=True)
    body = json.dumps({_POINTER: _run_key(run), "step": step}).encode()
    tmp = f"{fs_path}.tmp-{os.getpid()}"
    fs.pipe_file(tmp, body)
    fs.mv(tmp, fs_path)


def _read_pointer(key: str) -> tuple[str, int] | None:
    """(run, step) of the file at ``key`` if a cryosnap strategy wrote it, else None."""
    fs, fs_path = url_to_fs(key)
    try:
        if not fs.isfile(fs_path) or fs.size(fs_path) > _POINTER_MAX_BYTES:
            return None
        told = json.loads(fs.cat_file(fs_path))
    except (OSError, ValueError):
        return None
    if not isinstance(told, dict) or not isinstance(told.get(_POINTER), str):
        return None
    step = told.get("step")
    if type(step) is not int:
        return None
    return told[_POINTER], step


def _resolve(path: str, trainer: Trainer) -> tuple[str | None, int | None]:
    """What ``fit(ckpt_path=path)`` names: (run, step or None for the newest), or (None,
    None) for a Lightning checkpoint file."""
    key = _file_key(path)
    pointer = _read_pointer(key)
    if pointer is not None:
        run, step = pointer
        last = any(
            key in {_file_key(p) for p in cb._find_last_checkpoints(trainer)}
            for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint)
        )
        return run, None if last else step
    run_path, at = split_step(path)
    if _holds_versions(run_path):
        return run_path, at
    fs, fs_path = url_to_fs(path)
    if fs.isfile(fs_path):
        return None, None
    raise CheckpointNotFoundError(
        f"ckpt_path={path!r} is neither a checkpoint file (Lightning's, or one a cryosnap "
        "strategy wrote) nor a cryosnap run holding versions (a run's directory or URL, or "
        "run@step)",
        path=path,
    )


def _check_model(
    own: Mapping[str, Any], saved: Mapping[str, Any], where: str, module: torch.nn.Module
) -> None:
    """Refuse a saved ``state_dict`` that does not fit ``own`` (the state of ``module``: names
    and shapes), naming the differences, before anything is loaded."""
    missing = sorted(set(own) - set(saved))
    unexpected = sorted(set(saved) - set(own))
    shapes = [
        f"{k} {tuple(saved[k].shape)} (the model's: {tuple(own[k].shape)})"
        for k in own
        if k in saved
        and isinstance(saved[k], torch.Tensor)
        and isinstance(own[k], torch.Tensor)
        and saved[k].shape != own[k].shape
    ]
    if not (missing or unexpected or shapes):
        return
    parts = [
        f"{label}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
        for label, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("other shapes", shapes),
        )
        if names
    ]
    raise StateMismatchError(
        f"cannot restore {where} into {type(module).__name__}: the saved weights do not fit it "
        f"({'; '.join(parts)}); resume with the model that saved it (under FSDP, with the same "
        "wrapping and number of ranks too), or start a new run",
        path=where,
    )


class CryosnapFSDPStrategy(_CryosnapStrategy, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) whose checkpoints every rank writes into one cryosnap
    run: its own shards, restored in place.

    What a rank saves is what it holds: its shard of each parameter (with
    ``use_orig_params=True``, Lightning's default, the parameters are views of the rank's part
    of FSDP's flat parameters; a parameter wholly on other ranks has no elements here), its
    buffers, and its optimizer's own ``state_dict()`` (the state of those shards), with its
    generators and data position; no gather, no ``ShardedTensor``. A version restores into
    the same wrapping on the same number of ranks, each shard copied into place (another
    layout: a :class:`StateMismatchError` naming the parameters). Saves are lazy, as
    :class:`CryosnapDDPStrategy`'s. On the CPU (gloo) torch's FSDP needs a device, which
    Lightning does not pass: this strategy passes the CPU (and Lightning's check that FSDP
    runs on a GPU applies to its own class only).

    Parameters are :class:`CryosnapDDPStrategy`'s, with ``fsdp_options`` (``FSDPStrategy``'s
    own arguments: ``auto_wrap_policy``, ``sharding_strategy``...) for ``ddp_options``.
    Versions hold shards: :func:`load_from_checkpoint` cannot build a module from them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        every_n_steps: int | None = None,
        policy: SavePolicy | None = None,
        *,
        keep: int | RetentionPolicy | None = None,
        save_on_train_end: bool = True,
        resume: bool = True,
        exact: bool = False,
        handle_signals: Sequence[int] | None = None,
        run_id: str | None = None,
        allow_pickle: bool = False,
        fsdp_options: Mapping[str, Any] | None = None,
        **checkpointer_options: Any,
    ) -> None:
        fsdp = dict(fsdp_options or {})
        if fsdp.get("use_orig_params") is False or "state_dict_type" in fsdp:
            raise UnsupportedError(
                "CryosnapFSDPStrategy saves each rank's shard of each parameter "
                "(use_orig_params=True, Lightning's default): use_orig_params=False is not "
                "supported, and state_dict_type does not apply",
                path=os.fspath(path),
            )
        FSDPStrategy.__init__(self, **fsdp)
        options = {
            "keep": keep,
            "save_on_train_end": save_on_train_end,
            "resume": resume,
            "exact": exact,
            "handle_signals": handle_signals,
            "run_id": run_id,
            "allow_pickle": allow_pickle,
        }
        self._init_cryosnap(path, every_n_steps, policy, options, checkpointer_options)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()
        ):
            wrapped: torch.nn.Module = super()._setup_model(model)
            return wrapped
        # Lightning passes device_id=None for the CPU, and torch's FSDP then looks for an
        # accelerator ("FSDP needs a non-CPU accelerator device"): name the CPU.
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )

    def _wrapped_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards and buffers, by the wrapped model's names."""
        model = self.model
        assert model is not None
        state = {name: p.detach() for name, p in model.named_parameters()}
        state.update((name, b) for name, b in model.named_buffers())
        return state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._wrapped_state()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        state: dict[str, Any] = inner.state_dict()
        return state

    def _parameter_names(self) -> set[str]:
        model = self.model
        assert model is not None
        return {name for name, _ in model.named_parameters()}

    def _replicated_keys(self) -> list[str] | None:
        return None  # every rank's shards are its own

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Copy each saved shard into this rank's (the wrapping and ranks of the save)."""
        own = self._wrapped_state()
        saved = checkpoint["state_dict"]
        module = self.lightning_module
        assert module is not None
        _check_model(own, saved, self._loaded_from, module)
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(saved[name])

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True  # FSDPStrategy's load_checkpoint loads them; this one's returns them

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # FSDPStrategy's does nothing (its load_checkpoint loaded them): Strategy's loads
        # each optimizer's own state_dict, the state of this rank's shards.
        Strategy.load_optimizer_state_dict(self, checkpoint)
