"""Hugging Face ``transformers`` integration: ``Trainer`` checkpoints written by cryosnap.

``Trainer(..., callbacks=[CryosnapCallback("runs/exp1", save_steps=100)])``; resume with
``trainer.train(resume_from_checkpoint=True)`` or :func:`resume`. No pickle, no ``torch.load``.
Runs on the training loop's thread of every process; the writes run on the Checkpointer's
writer thread. Under DDP every rank holds the run and writes 1/N of the replicated state
(under FSDP2 its own DTensor shards of the model and optimizer, and 1/N of the rest); the
collectives (on the job's default group) are the run's opening, a broadcast of rank 0's trainer
state at each save and the agreement on the version a resume reads.
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

from cryosnap import errors
from cryosnap.checkpointer import load
from cryosnap.errors import CheckpointNotFoundError, UnsupportedError
from cryosnap.integrations._base import RunSaver, rank_zeros, split_step
from cryosnap.integrations.torch import RNGState
from cryosnap.policy import SavePolicy
from cryosnap.run import Run

__all__ = ["CryosnapCallback", "resume"]

log = logging.getLogger("cryosnap")

# The file the Trainer reads its state from when resuming (transformers.trainer.TRAINER_STATE_NAME).
_TRAINER_STATE_NAME = "trainer_state.json"

# The Trainer methods that read a checkpoint directory; resuming feeds them from cryosnap.
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state")

_RESUME_HINT = "pass trainer.train(resume_from_checkpoint=True)"

# Under DDP: the top-level keys that are the same on every rank, written 1/N by each. The
# model's buffers ("model_buffers") and the RNG states ("rng") are each rank's own: DDP
# broadcasts rank 0's buffers at each forward, after which a rank's (BatchNorm statistics) are
# its own again.
_REPLICATED = ("lr_scheduler", "model", "optimizer", "trainer_state")

# Under FSDP2 the model's parameters and the optimizer's state are each rank's own DTensor
# shards (each rank writes its local shards); the rest of the replicated state is as above.
_REPLICATED_FSDP = ("lr_scheduler", "trainer_state")

# A version that some rank cannot read for these (content or a manifest that does not verify)
# makes a resume without a step fall back to the previous version on every rank, as
# cryosnap.load does for one process.
_DAMAGE = (errors.IntegrityError, errors.CheckpointFormatError)


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

    In a job of several processes (DDP, ``torchrun``) every rank saves its part of each
    version: model parameters, optimizer, LR scheduler and trainer state are written once in
    total, 1/N by each rank; each rank's RNG states and model buffers are its own, and each
    gets its own back on resume. The path must then be one that every rank reaches (a shared
    file system or an object store; node-local fast storage goes in ``scratch=``). Under
    FSDP2 (``fsdp_config={"version": 2}``) the parameters and the optimizer's state are each
    rank's DTensor shards: each rank writes its own, a resume fills them in place on the same
    world size (another is a :class:`~cryosnap.WorldSizeError`; the shards are read twice
    then: verified before training starts, and into the model once the Trainer sharded it).
    A Trainer with a DeepSpeed config, or one that shards the model otherwise (FSDP1, HSDP,
    tensor parallel), is refused with :class:`~cryosnap.UnsupportedError`: with DeepSpeed
    the Trainer's own saves go through cryosnap instead
    (:func:`cryosnap.integrations.deepspeed.register` and a ``"cryosnap"`` section in the
    DeepSpeed config; the error says how).
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
        self._distributed = False

    @property
    def preempted_at(self) -> int | None:
        """The step saved on preemption in the last ``train`` (None: not preempted)."""
        return self._saver.preempted_at

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = _constructing_trainer(self)
        if trainer is not None:
            _refuse_unsupported(args, trainer.model, trainer)
            _understand_runs(trainer, self)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        fsdp2 = _refuse_unsupported(args, kwargs.get("model"), None)
        self._distributed = _world_size() > 1
        if self._distributed:
            # Every rank (collective): each writes its part, the replicated state split.
            replicated = _REPLICATED_FSDP if fsdp2 else _REPLICATED
            self._saver.begin(state.global_step, distributed=True, replicated=replicated)
        elif state.is_world_process_zero:
            self._saver.begin(state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._saver.step_end(state.global_step, lambda: self._snapshot(state, control, kwargs)):
            control.should_training_stop = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._saver.end(state.global_step, lambda: self._snapshot(state, control, kwargs))

    def _snapshot(
        self, state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        return _state_of(state, control, kwargs, distributed=self._distributed)

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


def _state_of(
    state: TrainerState, control: TrainerControl, kwargs: dict[str, Any], *, distributed: bool
) -> dict[str, Any]:
    missing = [k for k in ("model", "optimizer", "lr_scheduler") if kwargs.get(k) is None]
    if missing:
        raise TypeError(
            f"cannot checkpoint step {state.global_step}: the Trainer passed no {missing}"
        )
    trainer_state = _state_json(state, control)
    if not distributed:
        return {
            "model": kwargs["model"],
            "optimizer": kwargs["optimizer"],
            "lr_scheduler": kwargs["lr_scheduler"],
            "trainer_state": trainer_state,
            "rng": RNGState(),
        }
    parameters, buffers = _model_parts(kwargs["model"])
    return {
        "model": parameters,
        "model_buffers": buffers,
        "optimizer": kwargs["optimizer"],
        "lr_scheduler": kwargs["lr_scheduler"],
        # Rank 0's, as the Trainer writes trainer_state.json: the other ranks' log the same
        # losses but their own timings (train_runtime), and replicated state must be equal.
        "trainer_state": rank_zeros(trainer_state),
        "rng": RNGState(),
    }


def _model_parts(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's state dict split into parameters and buffers (no copies)."""
    weights = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    parameters = {k: v for k, v in weights.items() if k not in buffers}
    return parameters, {k: v for k, v in weights.items() if k in buffers}


def _state_json(state: TrainerState, control: TrainerControl) -> bytes:
    fields = dataclasses.asdict(state)
    # As Trainer._save_checkpoint does: the control flow's state as of this step.
    fields["stateful_callbacks"] = {
        **(fields.get("stateful_callbacks") or {}),
        type(control).__name__: control.state(),
    }
    # Bytes, not str: a blob, chunked and de-duplicated (log_history only grows), split
    # across the ranks; a str would be repeated whole in every rank's manifest.
    return json.dumps(fields, sort_keys=True).encode()


def _world_size() -> int:
    """The processes of the torch.distributed job (1 when there is none)."""
    import torch.distributed as dist

    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1


def _refuse_unsupported(args: TrainingArguments, model: Any, trainer: Trainer | None) -> bool:
    """Refuse a Trainer whose state cryosnap cannot save as it is yet (UnsupportedError);
    whether its model is sharded by FSDP2 (each rank's DTensor shards)."""
    deepspeed = (
        getattr(trainer, "is_deepspeed_enabled", False)
        or bool(getattr(args, "deepspeed", None))
        or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    )
    if deepspeed:
        raise UnsupportedError(
            "CryosnapCallback does not save a Trainer with a DeepSpeed config: the model, "
            "optimizer and scheduler live in DeepSpeed's engine, which saves them itself. Let "
            "the Trainer save through cryosnap's DeepSpeed checkpoint engine instead: drop the "
            "callback, call cryosnap.integrations.deepspeed.register() before trainer.train(), "
            'add a "cryosnap": {"path": "runs/exp1"} section (Checkpointer arguments) to the '
            'DeepSpeed config, keep the Trainer\'s save_strategy="steps" with save_steps=N, '
            "and resume with trainer.train(resume_from_checkpoint=True)"
        )
    plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(plugin, "fsdp_plugin", None) if plugin is not None else None
    if getattr(trainer, "is_fsdp_enabled", False) and getattr(plugin, "fsdp_version", 1) != 2:
        raise UnsupportedError(_NOT_SHARDED_SO.format(what="FSDP1 (flat parameters)"))
    return model is not None and _fsdp2(model)


# How a sharded model the callback does not save is refused; {what} names the sharding.
_NOT_SHARDED_SO = (
    "CryosnapCallback does not support a model sharded by {what}: it saves DDP models "
    "(every rank writes 1/N) and FSDP2 ones (fsdp_config={{'version': 2}}: every rank writes "
    "its DTensor shards). Train without the callback (the Trainer's save_strategy saves "
    "sharded state through torch.distributed.checkpoint), or with DDP or FSDP2"
)


def _fsdp2(model: Any) -> bool:
    """Whether ``model`` is sharded by FSDP2 over a 1-D mesh (each rank's DTensor shards);
    another sharding (FSDP1, HSDP, tensor parallel) is an UnsupportedError."""
    import torch.distributed as dist

    modules = getattr(model, "modules", None)
    if modules is None or not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    found = list(modules())
    if any(isinstance(m, FullyShardedDataParallel) for m in found):
        raise UnsupportedError(_NOT_SHARDED_SO.format(what="FSDP1 (flat parameters)"))
    shards = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not shards:
        return False
    if not any(isinstance(m, FSDPModule) for m in found) or any(
        p.device_mesh.ndim != 1 or not all(x.is_shard() for x in p.placements) for p in shards
    ):
        raise UnsupportedError(
            _NOT_SHARDED_SO.format(what="DTensors beyond FSDP2's over one mesh dimension")
        )
    return True


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
    found = _read(path, step, allow_pickle)
    if found is None:
        log.info("cryosnap: %s holds no version yet, training from the start", path)
        return train(**train_kwargs)
    at, saved = found
    shards = None if at is None else _shards_reader(path, at, allow_pickle)
    trainer_state = _text(saved["trainer_state"])
    log.info(
        "cryosnap: resuming from step %s of %s", json.loads(trainer_state)["global_step"], path
    )
    with tempfile.TemporaryDirectory(prefix="cryosnap-resume-") as tmp:
        with open(os.path.join(tmp, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(trainer_state)
        with _loading_from(trainer, saved, shards):
            return train(resume_from_checkpoint=tmp, **train_kwargs)


def _text(trainer_state: str | bytes) -> str:
    # bytes since the distributed callback; str in versions saved before it.
    return trainer_state.decode() if isinstance(trainer_state, bytes) else trainer_state


def _read(
    path: str, step: int | None, allow_pickle: bool
) -> tuple[int | None, dict[str, Any]] | None:
    """This process's state of version ``step`` of ``path`` (None: the newest that verifies),
    and in a job of several processes the step read; None when ``step`` is None and the run
    holds no version. In a job of several processes collective: see :func:`_read_own_part`."""
    if _world_size() > 1:
        return _read_own_part(path, step, allow_pickle)
    try:
        saved: dict[str, Any] = load(path, step=step, allow_pickle=allow_pickle)
    except CheckpointNotFoundError:
        if step is not None:
            raise
        return None
    # The callback saves version N at global step N: the step that load() took.
    _refuse_other_world(path, json.loads(_text(saved["trainer_state"]))["global_step"], 1)
    return None, saved


def _read_own_part(
    path: str, step: int | None, allow_pickle: bool
) -> tuple[int, dict[str, Any]] | None:
    """Every rank (collective): its own part of version ``step`` of ``path``, verified; with
    ``step`` None the newest version that every rank reads intact (rank 0 lists the run).
    Each part holds the whole replicated state (chunks written by any rank) and the rank's
    own RNG states. A failure on any rank raises on every rank (its own error there, the
    same class naming that rank elsewhere)."""
    world, rank = _world_size(), _rank()
    listed, failed = (
        _attempt(functools.partial(_newest_first, path, step)) if rank == 0 else ([], None)
    )
    told: tuple[list[int], str | None] = rank_zeros(
        (listed, None if failed is None else f"{failed}")
    )
    if told[1] is not None:
        raise errors.CheckpointError(f"cannot resume from {path}: {told[1]}", path=path)
    for at in told[0]:
        saved, failed = _attempt(functools.partial(_load_part, path, at, world, rank, allow_pickle))
        failures = _gathered(None if failed is None else _describe(failed))
        if not any(failures):
            assert isinstance(saved, dict)
            return at, saved
        damaged = all(f is None or f[2] for f in failures)
        if step is not None or not damaged:
            _raise_first(path, at, failed, failures)
        log.warning(
            "cryosnap: step %d of %s is damaged on rank(s) %s; trying the previous version",
            at,
            path,
            [r for r, f in enumerate(failures) if f is not None],
        )
    if told[0]:
        raise errors.IntegrityError(f"every version of {path} is damaged on some rank", path=path)
    return None


def _newest_first(path: str, step: int | None) -> list[int]:
    """``[step]``, or the run's versions from the newest (none when there is no run)."""
    if step is not None:
        return [step]
    try:
        return Run(path).steps()[::-1]
    except CheckpointNotFoundError:
        return []


def _load_part(path: str, step: int, world: int, rank: int, allow_pickle: bool) -> Any:
    """Rank ``rank``'s part of version ``step``: its own when as many ranks saved it, else
    saved part ``rank % saved`` (every part holds the replicated state; the RNG states are
    another rank's, so training goes on, not bit for bit as it would have)."""
    saved = _refuse_other_world(path, step, world)
    if saved != world and rank == 0:
        log.warning(
            "cryosnap: step %d of %s was saved by %d process(es), resumed by %d: every rank "
            "gets the replicated state, and the RNG states of saved rank (rank %% %d); the "
            "run goes on, not bit for bit as it would have",
            step,
            path,
            saved,
            world,
            saved,
        )
    return load(
        path, step=step, rank=rank if saved == world else rank % saved, allow_pickle=allow_pickle
    )


def _attempt(read: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """``read()``, or None and what failed (to be told to the other ranks)."""
    try:
        return read(), None
    except (errors.CheckpointError, OSError, TypeError, ValueError, KeyError) as exc:
        return None, exc


def _describe(failed: Exception) -> tuple[str, str, bool]:
    return type(failed).__name__, str(failed), isinstance(failed, _DAMAGE)


def _gathered(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (collective on the job's default group)."""
    import torch.distributed as dist

    out: list[Any] = [None] * _world_size()
    dist.all_gather_object(out, value)
    return out


def _raise_first(path: str, step: int, failed: Exception | None, failures: Sequence[Any]) -> None:
    """Raise this rank's failure, or (it read its part) the first failing rank's, as the
    same class of :mod:`cryosnap.errors` (CheckpointError for a builtin's)."""
    if failed is not None:
        raise failed
    rank, (name, message, _) = next((r, f) for r, f in enumerate(failures) if f is not None)
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
        cls = errors.CheckpointError
    raise cls(f"cannot resume from {path}: rank {rank}: {message}", step=step, path=path)


def _rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank())


def _part(obj: Any, name: str) -> Any:
    if obj is None:
        raise TypeError(f"cannot resume: the Trainer has no {name} yet")
    return obj


def _refuse_other_world(path: str, step: int, world: int) -> int:
    """The world size that saved version ``step``; a version of FSDP2 shards that ``world``
    processes would resume at another size is a WorldSizeError (another rank's shard is not
    this one's)."""
    info = Run(path).info(step)
    saved = info.world_size
    if saved != world and _sharded_version(saved, info.replicated):
        raise errors.WorldSizeError(
            f"step {step} of {path} was saved by {saved} ranks under FSDP2 (each rank's DTensor "
            f"shards of the model and optimizer) and {world} resume it: resume at {saved} "
            "ranks; to change the world size, save through the Trainer's own FSDP checkpoints "
            "(save_strategy, torch.distributed.checkpoint, which reshards when it loads)",
            step=step,
            path=path,
        )
    return saved


def _sharded_version(world_size: int, replicated: Any) -> bool:
    """Whether a version of a job of several ranks holds each rank's shards of the model
    (FSDP2: the model was not saved as replicated)."""
    return world_size > 1 and isinstance(replicated, tuple) and "model" not in replicated


def _shards_reader(path: str, step: int, allow_pickle: bool) -> Callable[[Any], None] | None:
    """For a version of FSDP2 shards: a function that restores this rank's shards of the
    given top-level keys into the live objects (``into=``: each DTensor's local shard filled
    in place, its layout checked; the optimizer's state wrapped as DTensors of its
    parameters'); None for any other version."""
    info = Run(path).info(step)
    if not _sharded_version(info.world_size, info.replicated):
        return None
    rank = _rank()

    def restore(into: Any) -> None:
        load(path, step=step, rank=rank, into=into, keys=list(into), allow_pickle=allow_pickle)

    return restore


@contextmanager
def _loading_from(
    trainer: Trainer, saved: dict[str, Any], shards: Callable[[Any], None] | None
) -> Iterator[None]:
    """Make ``trainer``'s checkpoint loaders read ``saved`` while the block runs; with
    ``shards`` (a version of FSDP2 shards) the model and optimizer come from it instead, once
    the Trainer sharded them."""

    def load_model(_checkpoint: str, model: Any = None) -> None:
        weights, buffers = saved["model"], saved.get("model_buffers")
        target = _part(trainer.model, "model")
        if shards is not None:
            shards({"model": _model_parts(target)[0]})
            target.load_state_dict(buffers or {}, strict=False)
            return
        if buffers:  # a distributed version holds the buffers apart (each rank's own)
            weights = {**weights, **buffers}
        target.load_state_dict(weights)

    def load_optimizer_and_scheduler(_checkpoint: str | None) -> None:
        optimizer = _part(trainer.optimizer, "optimizer")
        if shards is not None:
            shards({"optimizer": optimizer})
        else:
            optimizer.load_state_dict(saved["optimizer"])
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
