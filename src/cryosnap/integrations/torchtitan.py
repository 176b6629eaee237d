"""torchtitan integration: a checkpoint manager that torchtitan builds from its configuration
and that writes a cryosnap run: lazily, incrementally, each rank its own shards and 1/N of the
replicated state.

:class:`CryosnapCheckpointManager` is a torchtitan ``BaseCheckpointManager``; torchtitan's
``Trainer`` calls its ``save`` after each step, ``maybe_wait_for_staging`` right before
``optimizers.step()`` (the capture barrier), ``load`` before training and ``close`` at the end.
Runs on the training loop's thread; the writes run on the Checkpointer's threads; opening,
saving and loading are collective (every rank, at the same points, as the trainer calls them).
docs/design/integrations.md has the rules.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from cryosnap.checkpointer import Checkpointer, PendingSave
from cryosnap.errors import (
    CheckpointNotFoundError,
    ConfigError,
    StateMismatchError,
    UnsupportedError,
    WorldSizeError,
)

__all__ = ["CryosnapCheckpointManager"]

log = logging.getLogger("cryosnap")

# The states torchtitan passes that are the same on every rank (the trainer's step and token
# count, the schedulers' epoch): written once in total, 1/N by each rank.
_SAME_EVERYWHERE = frozenset({LR_SCHEDULER, TRAIN_STATE})
# The states split entry by entry: DTensor shards are each rank's own; replicated DTensors,
# plain tensors (buffers, Adam's step) and hyperparameters the same on every rank.
_SPLIT = frozenset({MODEL, OPTIMIZER})
# A version's top-level keys: each state's own part under its name, its replicated part under
# _SHARED + name, and what the version holds under _META.
_SHARED = "replicated."
_META = "torchtitan"
_FULL, _MODEL_ONLY = "full", "model"


class CryosnapCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan's checkpoint manager, written by cryosnap.

    ``Trainer.Config(checkpoint=CryosnapCheckpointManager.Config(enable=True, folder=...,
    interval=...))``: torchtitan builds it with the trainer's model parts, optimizers, LR
    schedulers, dataloader and ``train_state``, on every rank.

    Each save is a version of the cryosnap run at ``dump_folder/folder``, its step the
    trainer's. ``save`` returns at once (``lazy``): the copy of the state overlaps the next
    step's forward and backward, and ``maybe_wait_for_staging`` (called by the trainer before
    ``optimizers.step()``) waits until it is copied; the version becomes durable in the
    background. Each rank writes the local shards of its DTensors (FSDP2, tensor parallel),
    its dataloader position and 1/N of the state that is the same on every rank (replicated
    DTensors: HSDP's and DDP's parameters; plain tensors; the schedulers and the trainer's
    step), and only what changed since the previous version (``incremental``).

    ``load`` restores the newest version (or ``load_step``) bit-exact on the mesh it was
    saved on; a run with no version starts from ``initial_load_path`` (a DCP checkpoint, a
    run written through :mod:`cryosnap.dcp`, or Hugging Face safetensors with
    ``initial_load_in_hf``), whose planner reshards. The inherited fields mean what they mean
    for torchtitan's DCP manager, except ``last_save_in_hf`` and ``create_seed_checkpoint``,
    refused (:class:`~cryosnap.UnsupportedError`), and ``keep_latest_k=1``, refused as torchtitan
    refuses it (:class:`~cryosnap.ConfigError`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint fields plus cryosnap's own."""

        lazy: bool = True
        """Capture in the background until ``maybe_wait_for_staging`` (False: ``save``
        returns once the state is copied)."""

        scratch: str | None = None
        """A node-local directory written first (tmpfs, NVMe); the run's folder is then the
        persistent level, flushed to in the background."""

        keep_scratch: int | None = None
        """Versions kept on ``scratch`` (None: cryosnap's default)."""

        incremental: bool = True
        """Write only the chunks that changed since the previous version."""

        full_every: int = 16
        """A full (base) version at least every N versions."""

        chunk_bytes: int = 1 << 20
        """The unit of change detection and de-duplication."""

        staging_bytes: int | None = None
        """Host memory for captured state (None: as needed)."""

        partner: bool | str = False
        """Copy each rank's scratch data to another node (True), XOR parity ("xor") or
        Reed-Solomon sets ("rs:K+M")."""

        def __post_init__(self) -> None:
            if self.keep_latest_k == 1:
                raise ConfigError(
                    "checkpoint.keep_latest_k=1: torchtitan refuses it (the newest checkpoint "
                    "may still be in flight) and so does cryosnap's manager, to keep the "
                    "configurations of both managers interchangeable; use 0 (keep all) or >= 2"
                )
            BaseCheckpointManager.Config.__post_init__(self)
            if self.last_save_in_hf:
                raise UnsupportedError(
                    "checkpoint.last_save_in_hf: cryosnap's manager writes no Hugging Face "
                    "safetensors; save the last step as a version (last_save_in_hf=False) and "
                    "export it (`cryosnap export RUN --step N model.safetensors`), or use "
                    "torchtitan's CheckpointManager for that run"
                )
            if self.create_seed_checkpoint:
                raise UnsupportedError(
                    "checkpoint.create_seed_checkpoint: a seed checkpoint is saved by one rank "
                    "and loaded by many on another mesh, which cryosnap's manager does not "
                    "reshard; create it with torchtitan's CheckpointManager and pass it as "
                    "checkpoint.initial_load_path"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: PendingSave | None = None
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        for key in config.exclude_from_loading:
            if key not in self.states:
                raise ConfigError(
                    f"checkpoint.exclude_from_loading names {key!r}, not a state of this "
                    f"trainer (its states: {sorted(self.states)})"
                )
        self.sd_adapter = sd_adapter
        if config.initial_load_in_hf and sd_adapter is None:
            raise ConfigError(
                "checkpoint.initial_load_in_hf=True needs the model's state dict adapter, and "
                "this model has none"
            )
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._pending: PendingSave | None = None
        # Collective: every rank opens the run (comm=None: the torch.distributed job).
        self._ckpt: Checkpointer | None = Checkpointer(
            self.folder,
            scratch=config.scratch,
            keep=config.keep_latest_k or None,
            keep_scratch=config.keep_scratch,
            incremental=config.incremental,
            full_every=config.full_every,
            chunk_bytes=config.chunk_bytes,
            staging_bytes=config.staging_bytes,
            partner=config.partner,
        )

    def __repr__(self) -> str:
        return f"CryosnapCheckpointManager({getattr(self, 'folder', None)!r})"

    @property
    def checkpointer(self) -> Checkpointer:
        """The underlying :class:`~cryosnap.Checkpointer` (``steps()``, ``status()``...)."""
        if not self.enable or self._ckpt is None:
            raise RuntimeError("the checkpoint manager is disabled or closed")
        return self._ckpt

    # -- saving -----------------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        """torchtitan's rule: every ``interval`` steps, the first with
        ``enable_first_step_checkpoint``, the last; none with ``load_only``."""
        config = self.config
        if config.load_only:
            return False
        if curr_step == 1 and config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % config.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        model_only = last_step and self.config.last_save_model_only
        names = [MODEL] if model_only else list(self.states)
        tree, replicated, _ = self._tree(names, model_only=model_only, export=model_only)
        self._pending = self.checkpointer.save(
            curr_step, tree, lazy=self.config.lazy, replicated=replicated
        )
        self.save_future = self._pending
        return True

    def _maybe_wait_for_staging(self) -> None:
        """The capture barrier: the state of the last save is copied once this returns."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait_captured()

    def _wait_for_saving(self) -> None:
        pending, self.save_future = self.save_future, None
        if pending is not None:
            pending.result()

    def _close(self) -> None:
        """Wait until every version is durable and release the run; raise the first failure
        not yet received."""
        ckpt, self._ckpt = self._ckpt, None
        self._pending = self.save_future = None
        if ckpt is not None:
            ckpt.close()

    def _tree(
        self, names: list[str], *, model_only: bool, export: bool = False
    ) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
        """The version's tree of ``names``' states, live tensors (a lazy capture copies them
        before the optimizer step), its replicated top-level keys, and the state dicts."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        tree: dict[str, Any] = {_META: {"contents": _MODEL_ONLY if model_only else _FULL}}
        replicated = [_META]
        states: dict[str, Any] = {}
        for name in names:
            obj = self.states[name]
            if obj is None:  # no dataloader
                continue
            state = states[name] = obj.state_dict()
            if export:
                state = {k: self._exported(v) for k, v in state.items()}
            tree[name], tree[_SHARED + name] = _split(name, state, world)
            replicated.append(_SHARED + name)
        return tree, replicated, states

    def _exported(self, value: Any) -> Any:
        """``value`` in ``export_dtype`` (a last, model-only save), as torchtitan converts."""
        dtype = self.export_dtype
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    # -- loading ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        ckpt = self.checkpointer
        ckpt.wait()  # this process's saves count: the newest may still be in flight
        steps = ckpt.steps()
        if step != -1 and step not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: the run at {self.folder} holds "
                f"{_show(steps) if steps else 'no version'}",
                path=self.folder,
            )
        if not steps:
            return self._initial_load()
        meta = ckpt.restore(None if step == -1 else step, keys=[_META])
        restored = ckpt.restored_step
        model_only = meta[_META]["contents"] == _MODEL_ONLY
        excluded = set(self.config.exclude_from_loading)
        names = [n for n in self.states if n not in excluded and self.states[n] is not None]
        if model_only:  # a last save with last_save_model_only: the model alone
            log.warning(
                "cryosnap: step %d of %s holds the model only (last_save_model_only): the "
                "optimizers, schedulers, dataloader and train state start afresh",
                restored,
                self.folder,
            )
            names = [MODEL]
        tree, _, states = self._tree(names, model_only=model_only)
        keys = [k for k in tree if k != _META]
        try:
            ckpt.restore(restored, into=tree, keys=keys)
        except WorldSizeError as exc:
            raise WorldSizeError(f"{exc}{_OTHER_MESH}", step=restored, path=self.folder) from exc
        except StateMismatchError as exc:
            raise StateMismatchError(
                f"step {restored} of {self.folder} does not fit this trainer's state: {exc}. A "
                f"resume needs the model, optimizers and mesh the run was saved with{_OTHER_MESH}",
                step=restored,
                path=self.folder,
            ) from exc
        for name, state in states.items():
            merged = {**tree[name], **tree[_SHARED + name]}
            self.states[name].load_state_dict(_rejoin(state, merged))
        log.info("cryosnap: restored step %d of %s", restored, self.folder)
        return True

    def _initial_load(self) -> bool:
        """A run with no version: start from ``initial_load_path`` (or the model's Hugging Face
        weights with ``initial_load_in_hf``), through DCP's planner (it reshards)."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        config = self.config
        path = config.initial_load_path
        if config.initial_load_in_hf:
            adapter = self.sd_adapter
            path = path or adapter.hf_assets_path
            if not path or not filesystem.isdir(path):
                raise CheckpointNotFoundError(
                    f"initial_load_in_hf: no Hugging Face checkpoint at {path!r}", path=path
                )
            hf = adapter.to_hf(self.states[MODEL].state_dict())
            reader = adapter.get_hf_storage_reader(path, config.initial_load_in_hf_quantized)
            dcp_load(hf, storage_reader=reader)
            self.states[MODEL].load_state_dict(adapter.from_hf(hf))
            return True
        if not path:
            log.info(
                "cryosnap: %s holds no version and no initial_load_path: a fresh start", self.folder
            )
            return False
        state = self._flat(model_only=config.initial_load_model_only)
        dcp_load(state, **_reader_of(path))
        self.states[MODEL].load_state_dict(state)
        for name, obj in self.states.items():
            if name != MODEL and name in state and obj is not None:
                obj.load_state_dict(state[name])
        return True

    def _flat(self, *, model_only: bool) -> dict[str, Any]:
        """The state as torchtitan's DCP manager loads it: the model's entries at the top,
        beside the other states (those not in ``exclude_from_loading``)."""
        model = self.states[MODEL].state_dict()
        if model_only:
            return dict(model)
        excluded = set(self.config.exclude_from_loading)
        others = {
            n: obj
            for n, obj in self.states.items()
            if n != MODEL and n not in excluded and obj is not None
        }
        return {**{n: obj.state_dict() for n, obj in others.items()}, **model}


_OTHER_MESH = (
    ". To continue on another mesh (other ranks, parallel degrees or placements), load a "
    "checkpoint through DCP's planner, which reshards: save the model with torchtitan's "
    "CheckpointManager or through cryosnap.dcp.StorageWriter and give it as "
    "checkpoint.initial_load_path to a new folder"
)


def _reader_of(path: str) -> dict[str, Any]:
    """DCP's ``load`` arguments for ``initial_load_path``: a DCP checkpoint directory, or a
    cryosnap run written through :mod:`cryosnap.dcp` (its newest version)."""
    if filesystem.isfile(filesystem.join(path, ".metadata")) or filesystem.is_remote(path):
        return {"checkpoint_id": path}
    from cryosnap import engine
    from cryosnap.dcp import StorageReader
    from cryosnap.storage import open_store

    if os.path.isdir(path) and engine.list_steps(open_store(path)):
        return {"storage_reader": StorageReader(path)}
    raise CheckpointNotFoundError(
        f"checkpoint.initial_load_path={path}: neither a DCP checkpoint (no .metadata) nor a "
        "cryosnap run",
        path=path,
    )


# -- the split of a state into each rank's own part and the replicated part ----------------------


def _split(name: str, state: dict[str, Any], world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(own, replicated)``: the entries of ``state`` each rank holds alone, and those the same
    on every rank (replicated DTensors as their local tensors: one tensor on every rank)."""
    if name in _SAME_EVERYWHERE:
        return {}, _local(state)
    if name not in _SPLIT:
        return dict(state), {}  # the dataloader (each rank's position), a user's state
    own: dict[str, Any] = {}
    shared: dict[str, Any] = {}
    for k, v in state.items():
        if _per_rank(v, world):
            own[k] = v
        else:
            shared[k] = _local(v)
    return own, shared


def _per_rank(value: Any, world: int) -> bool:
    """Whether ``value`` holds a DTensor whose local tensor is not the whole tensor on every
    rank of the job."""
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        if mesh.size() != world:
            return True
        return not all(
            isinstance(p, Replicate) or mesh.size(i) == 1 for i, p in enumerate(value.placements)
        )
    if isinstance(value, dict):
        return any(_per_rank(v, world) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_per_rank(v, world) for v in value)
    return False


def _local(value: Any) -> Any:
    """``value`` with its (replicated) DTensors as their local tensors."""
    if isinstance(value, DTensor):
        return value._local_tensor
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_local(v) for v in value)
    return value


def _rejoin(original: Any, restored: Any) -> Any:
    """The restored state with the live DTensors back where their local tensors were filled."""
    if isinstance(original, DTensor):
        return original
    if isinstance(original, dict) and isinstance(restored, dict):
        return {k: _rejoin(original.get(k), v) for k, v in restored.items()}
    if isinstance(original, (list, tuple)) and isinstance(restored, (list, tuple)):
        items = [_rejoin(o, r) for o, r in zip(original, restored, strict=False)]
        return type(restored)(items)
    return restored


def _show(steps: list[int]) -> str:
    listed = ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]} ... {steps[-1]}"
    return f"steps {listed}"
