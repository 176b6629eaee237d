"""Hugging Face Accelerate integration: the counterpart of ``accelerator.save_state`` /
``load_state`` written by cryosnap, asynchronous, incremental, 1/N per rank, without pickle.

:class:`Checkpoints` (made after ``accelerator.prepare``) saves what ``save_state`` saves, plus
the exact data position of the prepared dataloaders; :class:`_Position` keeps that position.
Under FSDP2 each rank writes its own DTensor shards of the model and optimizer.
With a DeepSpeed plugin the engine's own files go through cryosnap's DeepSpeed checkpoint
engine (cryosnap.integrations.deepspeed), in the same version as the rest.
Runs on the training loop's thread (the dataloader hooks on the thread that iterates); the
writes run on the Checkpointer's threads. docs/design/integrations.md has the rules.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import (
    BatchSamplerShard,
    DataLoaderShard,
    SeedableRandomSampler,
    skip_first_batches,
)
from accelerate.utils import DistributedType
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from cryosnap.checkpointer import Checkpointer, PendingSave
from cryosnap.errors import (
    CheckpointNotFoundError,
    InexactResumeError,
    StateMismatchError,
    WorldSizeError,
)
from cryosnap.integrations.torch import RNGState, arm_ddp_resume

__all__ = ["Checkpoints"]

log = logging.getLogger("cryosnap")

# Top-level keys of a version that are the same on every rank of a DDP job: written 1/N each.
_REPLICATED = ["models", "optimizers", "schedulers", "scaler", "accelerator"]

# Samplers whose order is decided by what _Position records when an iteration begins: the
# global torch generator (a RandomSampler without a generator draws its seed from it), the
# sampler's own generator, or the epoch that DataLoaderShard.set_epoch gives it.
_ORDERED = (RandomSampler, SeedableRandomSampler, SequentialSampler, DistributedSampler)

# With a DeepSpeed plugin: the top-level key of a version that holds what Checkpoints saves
# beside the DeepSpeed engine's files (cryosnap.integrations.deepspeed names its keys after them).
_BESIDE_DEEPSPEED = "accelerate"

# Under FSDP2 the models and optimizers are each rank's own shards (DTensors: each rank writes
# its local shard); what is the same on every rank is written 1/N each.
_REPLICATED_FSDP = ["schedulers", "scaler", "accelerator"]

_UNSUPPORTED = {
    DistributedType.MEGATRON_LM: "Megatron-LM: the Megatron engine saves its own state",
    DistributedType.XLA: "XLA: the tensors live on a TPU and its loaders are XLA's",
}


class Checkpoints:
    """``accelerator.save_state`` / ``load_state`` through one cryosnap run.

    ``Checkpoints(accelerator, "runs/exp1")`` after ``accelerator.prepare(...)``; then
    ``ckpts.save(step)`` in the loop (after the optimizer step of that step), ``step =
    ckpts.restore()`` before it, ``ckpts.close()`` at the end. Collective under DDP: every
    rank makes it, saves the same steps and restores.

    Saved: the prepared models, optimizers, LR schedulers and grad scaler, the accelerator's
    gradient-accumulation step, the objects given to ``register_for_checkpointing``, every
    global random number generator of each rank (:class:`~cryosnap.integrations.torch.RNGState`)
    and the position of each prepared dataloader within its epoch, so that a resumed run
    continues mid-epoch with the very batches an uninterrupted run would have seen. Under DDP
    the model parameters, optimizer, scheduler and scaler state are the same on every rank and
    written once in total (``replicated``: each rank writes 1/N of the new chunks); buffers
    (BatchNorm statistics differ per rank), generators, positions and registered objects
    are each rank's own.

    Under FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``) the parameters and the
    optimizer's state are DTensors sharded over the ranks: each rank writes its own local
    shards (about 1/N of the model and optimizer each, no gather), the scheduler, scaler and
    accelerator step are written 1/N, and ``restore`` puts every rank's shards back in place.
    A version restores on the mesh that saved it: another world size is a
    :class:`~cryosnap.WorldSizeError`, another layout a :class:`~cryosnap.StateMismatchError`,
    each naming the ways on. FSDP1 is refused.

    With a DeepSpeed plugin (``Accelerator(deepspeed_plugin=...)``) the model, optimizer and
    scheduler are the DeepSpeed engine's: cryosnap's DeepSpeed checkpoint engine is installed
    on it, ``save(step)`` is ``engine.save_checkpoint(path, tag=f"step{step}")`` through it
    (captured before ``save`` returns: ``lazy`` does not apply; written in the background,
    the files every data-parallel rank holds alike 1/N by each) and the rest (the
    accelerator's step, registered objects, RNG states, loader positions) lies in the same
    version under ``"accelerate"``; ``restore`` is the engine's ``load_checkpoint`` of that
    version, then the rest.

    Parameters
    ----------
    accelerator
        The prepared ``accelerate.Accelerator`` (single process, DDP, FSDP2 or DeepSpeed
        with one model; not FSDP1, Megatron-LM or XLA).
    path
        The run: a directory or an fsspec URL.
    exact
        A prepared dataloader whose position cannot be saved exactly (an ``IterableDataset``,
        ``dispatch_batches``, a custom batch sampler...) is an
        :class:`~cryosnap.InexactResumeError` at construction (True, default); with False it
        resumes at the start of its saved epoch, with a warning.
    checkpointer_options
        Passed to :class:`~cryosnap.Checkpointer` (``scratch``, ``chunk_bytes``,
        ``allow_pickle``, ``policy``...). ``keep`` is the accelerator's
        ``ProjectConfiguration(total_limit=...)`` unless given here (not both).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        path: str | os.PathLike[str],
        *,
        exact: bool = True,
        **checkpointer_options: Any,
    ) -> None:
        if not isinstance(accelerator, Accelerator):
            raise TypeError(
                f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
            )
        if not isinstance(exact, bool):
            raise TypeError(f"exact must be True or False, got {exact!r}")
        _check_supported(accelerator)
        self.accelerator = accelerator
        self.path = os.fspath(path)
        self.exact = exact
        options = dict(checkpointer_options)
        limit = accelerator.project_configuration.total_limit
        if limit is not None:
            if "keep" in options:
                raise TypeError(
                    f"keep={options['keep']!r} and ProjectConfiguration(total_limit={limit}) "
                    "both say how many versions to keep: give one of them"
                )
            options["keep"] = limit
        deepspeed = _one_engine(accelerator)  # None: no DeepSpeed plugin
        self._positions = _positions(accelerator, self.path, exact)
        # Collective under DDP: every rank opens the run (comm=None: the torch.distributed job).
        try:
            self._ckpt = Checkpointer(self.path, **options)
        except BaseException:
            _release(self._positions)
            raise
        self._engine: Any = None  # the DeepSpeed engine's cryosnap checkpoint engine
        if deepspeed is not None:
            from cryosnap.integrations.deepspeed import install_over

            try:
                self._engine = install_over(deepspeed, self.path, self._ckpt)
            except BaseException:
                self._ckpt.close()
                _release(self._positions)
                raise

    # -- the run ----------------------------------------------------------------------------------

    @property
    def checkpointer(self) -> Checkpointer:
        """The underlying :class:`~cryosnap.Checkpointer` (``steps()``, ``status()``...)."""
        return self._ckpt

    @property
    def preempted(self) -> bool:
        """Whether a signal of ``handle_signals`` arrived (then :meth:`should_save` says yes)."""
        return self._ckpt.preempted

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: asks the ``policy`` given (the same on every rank)."""
        return self._ckpt.should_save(step)

    def save(self, step: int, *, lazy: bool = True) -> PendingSave:
        """Save the accelerator's state as version ``step``; returns at once (``lazy``) or once
        captured, and the version becomes durable in the background (``.result()``).

        Call it after the optimizer step of ``step``, with the batches of that step consumed.
        ``lazy``: the copy runs in the background; the next ``optimizer.step()`` waits until
        the tensors it changes are copied. Anything else that changes saved tensors in place
        before then (an EMA of the weights, a registered object's tensors) must wait for
        ``pending.wait_captured()`` first, or save with ``lazy=False``. With a DeepSpeed
        plugin the version is captured before ``save`` returns, whatever ``lazy`` says.
        """
        if self._engine is not None:
            pending: PendingSave = self._engine.save_with(step, {_BESIDE_DEEPSPEED: self._own()})
            return pending
        state = self._state()
        return self._ckpt.save(step, state, lazy=lazy, replicated=self._replicated())

    def restore(self, step: int | None = None) -> int | None:
        """Put the state of version ``step`` (default: the newest that verifies) back into the
        accelerator's objects, in place; returns the restored step, or None when the run
        holds no version yet (nothing is changed). Waits for this object's saves in flight
        first. Collective under DDP.

        The next iteration of each prepared dataloader continues the saved epoch after its
        consumed batches; under DDP the first training step warms the gradient buckets up
        (:func:`~cryosnap.integrations.torch.arm_ddp_resume`) so that it reduces exactly as
        the saved run did.
        """
        if self._engine is not None:
            return self._restore_deepspeed(step)
        state = self._state()
        self._ckpt.wait()  # this process's own saves count: the newest may still be in flight
        try:
            self._ckpt.restore(step, into=state)
        except WorldSizeError as exc:
            if _is_fsdp2(self.accelerator):
                raise _fsdp_world_size_error(exc) from exc
            raise
        except CheckpointNotFoundError:
            if step is None and not self._ckpt.steps():
                return None
            raise
        # Under DDP: the first synchronized training forward warms the gradient buckets up.
        arm_ddp_resume(self._modules())
        return self._ckpt.restored_step

    def _restore_deepspeed(self, step: int | None) -> int | None:
        """:meth:`restore` with a DeepSpeed plugin: the engine loads its files of the version
        (collective), then the rest of it goes back."""
        tag = None if step is None else f"step{step}"
        load_path, _client = self.accelerator._models[0].load_checkpoint(self.path, tag=tag)
        if load_path is None:
            return None  # the run holds no version yet
        restored = self._ckpt.restored_step
        self._ckpt.restore(
            restored, into={_BESIDE_DEEPSPEED: self._own()}, keys=[_BESIDE_DEEPSPEED]
        )
        return restored

    def close(self) -> None:
        """Wait until every version is durable, release the run and the dataloaders; raise the
        first failure of a save not yet received."""
        try:
            if self._engine is not None:
                self._engine.close()  # commits nothing: save() committed; closes the run
            self._ckpt.close()
        finally:
            _release(self._positions)

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self._ckpt.__exit__(exc_type, exc, tb)
        finally:
            _release(self._positions)

    def __repr__(self) -> str:
        return f"Checkpoints({self.path!r})"

    # -- the state --------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """The tree saved (and restored into): live objects, read when it is flattened."""
        self._check_loaders()
        acc = self.accelerator
        modules = self._modules()
        scaler = acc.scaler
        return {
            "models": {i: _Parameters(m) for i, m in enumerate(modules)},
            "buffers": {i: _Buffers(m) for i, m in enumerate(modules)},
            "optimizers": {i: _inner(o, "optimizer") for i, o in enumerate(acc._optimizers)},
            "schedulers": {i: _inner(s, "scheduler") for i, s in enumerate(acc._schedulers)},
            "scaler": {} if scaler is None else {0: scaler},
            "accelerator": _Step(acc),
            "dataloaders": dict(enumerate(self._positions)),
            "registered": dict(enumerate(acc._custom_objects)),
            "rng": RNGState(),
        }

    def _own(self) -> dict[str, Any]:
        """With a DeepSpeed plugin: what is saved beside the engine's files (live objects)."""
        self._check_loaders()
        acc = self.accelerator
        engine = acc._models[0]
        # A scheduler DeepSpeed does not know (Accelerate gives the engine its own types only).
        schedulers = [_inner(s, "scheduler") for s in acc._schedulers]
        return {
            "schedulers": {i: s for i, s in enumerate(schedulers) if s is not engine.lr_scheduler},
            "accelerator": _Step(acc),
            "dataloaders": dict(enumerate(self._positions)),
            "registered": dict(enumerate(acc._custom_objects)),
            "rng": RNGState(),
        }

    def _modules(self) -> list[torch.nn.Module]:
        """The prepared models, unwrapped (Accelerate lists a DDP's inner module already)."""
        acc = self.accelerator
        return [acc.unwrap_model(m, keep_torch_compile=False) for m in acc._models]

    def _check_loaders(self) -> None:
        found = list(self.accelerator._dataloaders)
        tracked = [p.loader for p in self._positions]
        if len(found) != len(tracked) or any(
            a is not b for a, b in zip(found, tracked, strict=True)
        ):
            raise ValueError(
                f"the accelerator prepared {len(found)} dataloader(s) and Checkpoints tracks "
                f"{len(tracked)}: make Checkpoints after the last accelerator.prepare(...)"
            )

    def _replicated(self) -> list[str] | None:
        if self.accelerator.num_processes == 1:
            return None
        return _REPLICATED_FSDP if _is_fsdp2(self.accelerator) else _REPLICATED


def _check_supported(accelerator: Accelerator) -> None:
    why = _UNSUPPORTED.get(accelerator.distributed_type)
    if why is not None:
        raise NotImplementedError(f"cryosnap Checkpoints does not support {why}")
    fsdp2 = _is_fsdp2(accelerator)
    if accelerator.distributed_type == DistributedType.FSDP and not fsdp2:
        raise NotImplementedError(
            "cryosnap Checkpoints does not support FSDP1 (FullyShardedDataParallel's flat "
            "parameters): use FullyShardedDataParallelPlugin(fsdp_version=2), whose DTensor "
            "shards each rank writes, or accelerator.save_state"
        )
    for model in accelerator._models:
        for name, param in model.named_parameters():
            if not _is_dtensor(param):
                continue
            if not fsdp2:
                raise NotImplementedError(
                    f"cryosnap Checkpoints does not support sharded parameters outside FSDP2 "
                    f"({name} is a DTensor: tensor or context parallelism); use "
                    "accelerator.save_state"
                )
            mesh, placements = param.device_mesh, param.placements
            if mesh.ndim != 1 or not all(p.is_shard() for p in placements):
                raise NotImplementedError(
                    f"cryosnap Checkpoints under FSDP2 saves parameters sharded over a 1-D mesh; "
                    f"{name} lies on a {mesh.ndim}-D mesh with placements {list(placements)} "
                    "(HSDP, tensor or context parallelism): use accelerator.save_state"
                )


def _is_fsdp2(accelerator: Accelerator) -> bool:
    """Whether the accelerator shards its model with FSDP2 (``fsdp_version=2``)."""
    return accelerator.distributed_type == DistributedType.FSDP and bool(accelerator.is_fsdp2)


def _fsdp_world_size_error(exc: WorldSizeError) -> WorldSizeError:
    """``exc`` of a restore under FSDP2, with the ways on that apply to sharded state: its
    shards are each rank's, so ``replicated_only`` and one rank's part give no model back."""
    what = str(exc).split(" Ways on: ")[0].rstrip(".")  # the others' ways do not apply here
    return WorldSizeError(
        f"{what}. Under FSDP2 the model and optimizer of a version are the saving ranks' "
        "DTensor shards, which Checkpoints restores in place on the mesh that saved them: "
        "restart at the saved world size; to change it, save through "
        "torch.distributed.checkpoint with cryosnap.dcp's storage writer (dcp.load reshards) "
        "or with accelerator.save_state",
        step=exc.step,
        path=exc.path,
    )


def _one_engine(accelerator: Accelerator) -> Any:
    """With a DeepSpeed plugin, the one prepared model: a DeepSpeed engine (None without the
    plugin). DeepSpeed is imported here only: an optional extra."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    from deepspeed import DeepSpeedEngine

    models = list(accelerator._models)
    if len(models) != 1 or not isinstance(models[0], DeepSpeedEngine):
        raise NotImplementedError(
            "cryosnap Checkpoints with a DeepSpeed plugin saves one prepared model, a DeepSpeed "
            f"engine; the accelerator prepared {len(models)} model(s) "
            f"({', '.join(type(m).__name__ for m in models) or 'none'}): make Checkpoints "
            "after accelerator.prepare(model, optimizer, ...) of the one model"
        )
    return models[0]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build of torch without torch.distributed
        return False
    return isinstance(tensor, DTensor)


def _inner(obj: Any, attribute: str) -> Any:
    """The torch object an Accelerated wrapper holds (its optimizer step is where the hooks of a
    lazy capture run; the wrapper's own step is not a torch Optimizer's)."""
    return getattr(obj, attribute, obj)


class _Step:
    """The accelerator's gradient-accumulation counter (``accelerator.step``), as state."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) != {"step"} or type(state["step"]) is not int:
            raise StateMismatchError(
                f"accelerator: expected {{'step': int}}, got {state!r:.80}", path="accelerator"
            )
        self.accelerator.step = state["step"]


class _Parameters:
    """A module's parameters, as state: the same on every rank of a DDP job."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def names(self) -> set[str]:
        return {name for name, _ in self.module.named_parameters(remove_duplicate=False)}

    def state_dict(self) -> dict[str, Any]:
        names = self.names()
        # The parameters themselves (detached views): a lazy capture copies them before the
        # next optimizer step changes them.
        return {k: v for k, v in self.module.state_dict().items() if k in names}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _load_part(self.module, state, self.names(), "parameters")


class _Buffers:
    """A module's persistent buffers, as state: each rank's own (DDP broadcasts rank 0's at the
    next forward; until then BatchNorm statistics differ). Copied when saved: a forward, not an
    optimizer step, changes them, and a lazy capture does not wait for forwards."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def names(self) -> set[str]:
        params = {name for name, _ in self.module.named_parameters(remove_duplicate=False)}
        return set(self.module.state_dict()) - params

    def state_dict(self) -> dict[str, Any]:
        names = self.names()
        return {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in self.module.state_dict().items()
            if k in names
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _load_part(self.module, state, self.names(), "buffers")


def _load_part(
    module: torch.nn.Module, state: Mapping[str, Any], names: set[str], what: str
) -> None:
    """Load ``state`` (``what`` of ``module``, exactly the keys ``names``) into ``module``."""
    if set(state) != names:
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        raise StateMismatchError(
            f"{type(module).__name__} {what}: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    if names:
        module.load_state_dict(dict(state), strict=False)


# -- the position of prepared dataloaders -------------------------------------------------------


def _positions(accelerator: Accelerator, path: str, exact: bool) -> list[_Position]:
    positions: list[_Position] = []
    try:
        for i, loader in enumerate(accelerator._dataloaders):
            if "begin" in vars(loader):
                raise ValueError(
                    f"prepared dataloader {i} is tracked by another open Checkpoints: close "
                    "that one first (one Checkpoints per accelerator)"
                )
            why = _why_unpositioned(loader)
            if why is not None:
                message = (
                    f"cryosnap: prepared dataloader {i} ({type(loader).__name__}) cannot resume "
                    f"mid-epoch where it stopped: {why}"
                )
                if exact:
                    raise InexactResumeError(
                        f"{message}; Checkpoints(..., exact=False) resumes it at the start of "
                        "its saved epoch",
                        path=path,
                    )
                warnings.warn(f"{message}; it resumes at the start of its epoch", stacklevel=3)
            positions.append(_Position(loader, exact=why is None, key=f"dataloaders/{i}"))
    except BaseException:
        _release(positions)
        raise
    return positions


def _release(positions: list[_Position]) -> None:
    for position in positions:
        position.release()


def _why_unpositioned(loader: Any) -> str | None:
    """Why a prepared dataloader's position within its epoch cannot be saved (None: it can)."""
    if getattr(loader, "use_stateful_dataloader", False):
        return "it is a torchdata StatefulDataLoader, whose state Checkpoints does not save yet"
    if isinstance(loader.dataset, IterableDataset):
        return (
            f"its dataset, a {type(loader.dataset).__name__}, is an IterableDataset (its "
            "position is in its iterators); use a map-style dataset"
        )
    if not isinstance(loader, DataLoaderShard):
        return (
            f"a {type(loader).__name__} (dispatch_batches=True: rank 0 reads every batch); "
            "use DataLoaderConfiguration(dispatch_batches=False) with a map-style dataset"
        )
    batches = _batch_sampler(loader)
    if type(batches) is not BatchSampler:
        return (
            f"its batch sampler ({type(batches).__name__}) has no state; pass sampler= and "
            "batch_size= (or shuffle=) to the DataLoader instead"
        )
    sampler = batches.sampler
    if type(sampler) not in _ORDERED:
        return (
            f"its sampler ({type(sampler).__name__}) may draw its order from state of its own; "
            "use shuffle=True/False, or a DistributedSampler"
        )
    return None


def _batch_sampler(loader: Any) -> Any:
    """The user's batch sampler under Accelerate's shard of it."""
    batches = loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    if isinstance(batches, BatchSamplerShard):
        batches = batches.batch_sampler
    return batches


class _Position:
    """Where one prepared ``DataLoaderShard`` is in its epochs, as state.

    When an iteration begins (``begin()``, after Accelerate synchronized the generators and
    before the DataLoader draws anything) it records what decides the epoch's order: the
    epoch, torch's global generator (the DataLoader draws its workers' seed from it, a
    ``RandomSampler`` without a generator its seed) and the sampler's generator; each batch
    handed out counts (``_update_state_dict``, called once per batch before it is yielded).
    A restored position makes the next iteration follow the saved order and skip the consumed
    batches at the sampler (``skip_first_batches``' DataLoader for that iteration: no batch is
    loaded to be thrown away), then puts the restored generators back before the first batch.
    ``exact=False``: only the epoch.
    """

    def __init__(self, loader: Any, *, exact: bool, key: str) -> None:
        self.loader = loader
        self.exact = exact
        self.key = key  # where it lies in a version, for the errors
        self.active = False
        self.order: dict[str, Any] | None = None  # the current iteration's, once begun
        self.consumed = 0
        self.resume: tuple[dict[str, Any], int] | None = None
        self.after_skip: torch.Tensor | None = None
        self.base = getattr(loader, "base_dataloader", None)  # the loader's own DataLoader
        if exact:
            self._begin, self._batch, self._end = (
                loader.begin,
                loader._update_state_dict,
                loader.end,
            )
            # Instance attributes over the methods: DataLoaderShard.__iter__ calls them.
            loader.begin, loader._update_state_dict, loader.end = (
                self._on_begin,
                self._on_batch,
                self._on_end,
            )

    def release(self) -> None:
        """Stop tracking: the loader's own methods and DataLoader back."""
        if self.exact and vars(self.loader).get("begin") == self._on_begin:
            for name in ("begin", "_update_state_dict", "end"):
                vars(self.loader).pop(name, None)
            self.loader.base_dataloader = self.base

    def generators(self) -> list[torch.Generator]:
        """The generators that decide the order besides torch's global one (a seedable
        sampler reseeds its own from its seed and the epoch)."""
        found: list[torch.Generator] = []
        sampler = _batch_sampler(self.base).sampler  # the loader's own, not a stand-in's
        for g in (getattr(sampler, "generator", None), self.loader.synchronized_generator):
            if isinstance(sampler, SeedableRandomSampler) and g is sampler.generator:
                continue
            if isinstance(g, torch.Generator) and all(g is not h for h in found):
                found.append(g)
        return found

    # -- the hooks (the iterating thread) ---------------------------------------------------------

    def _on_begin(self) -> None:
        self._begin()
        loader = self.loader
        loader.base_dataloader = self.base  # a resumed epoch's stand-in served its iteration
        resume, self.resume, self.after_skip = self.resume, None, None
        if resume is not None and resume[0]["epoch"] != loader.iteration:
            log.warning(
                "cryosnap: dataloader restored at epoch %d iterates epoch %d (set_epoch): it "
                "starts that epoch afresh",
                resume[0]["epoch"],
                loader.iteration,
            )
            resume = None
        self.consumed = 0
        if resume is not None:
            order, skip = resume
            self.after_skip = torch.get_rng_state()  # the restored one, for the first batch
            torch.set_rng_state(order["torch"])
            for g, state in zip(self.generators(), order["generators"], strict=True):
                g.set_state(state)
            # The samplers' epoch now: __iter__'s set_epoch does not reach them through the
            # stand-in's SkipBatchSampler.
            loader.set_epoch(loader.iteration)
            loader.base_dataloader = skip_first_batches(loader, skip).base_dataloader
            self.consumed = skip
        self.order = {
            "epoch": int(loader.iteration),
            "torch": torch.get_rng_state(),
            "generators": [g.get_state() for g in self.generators()],
        }
        self.active = True

    def _on_batch(self) -> None:
        self._batch()
        self.consumed += 1
        self._skipped()

    def _on_end(self) -> None:
        self._end()
        self.active = False
        self._skipped()
        self.loader.base_dataloader = self.base

    def _skipped(self) -> None:
        if self.after_skip is not None:
            torch.set_rng_state(self.after_skip)
            self.after_skip = None

    # -- as state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``epoch`` and ``consumed`` batches, and mid-epoch the order (``torch``,
        ``generators``): ints and tensors only."""
        loader = self.loader
        epoch = int(loader.iteration)
        if not self.exact or not self.active or self.order is None:
            return {"epoch": epoch, "consumed": 0}
        if loader.end_of_dataloader:  # the epoch's last batch handed out: the next one is due
            # with the samplers' generators as they are now: the next epoch's order draws
            # from them (torch's global generator is the RNG state's).
            gens = [g.get_state() for g in self.generators()]
            return {"epoch": epoch + 1, "consumed": 0, "generators": gens}
        return {**self.order, "consumed": self.consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next iteration continues the saved epoch after its consumed batches."""
        epoch, consumed = state.get("epoch"), state.get("consumed")
        if type(epoch) is not int or type(consumed) is not int or epoch < 0 or consumed < 0:
            raise StateMismatchError(
                f"dataloader position: malformed {dict(state)!r:.120}", path=self.key
            )
        self.loader.iteration = epoch
        self.resume = None
        if consumed == 0 or not self.exact:
            if self.exact and "generators" in state:  # saved at an epoch's end
                self._set_generators(list(state["generators"]))
            return
        order = dict(state)
        if set(order) != {"epoch", "consumed", "torch", "generators"} or len(
            order["generators"]
        ) != len(self.generators()):
            raise StateMismatchError(
                f"dataloader position: saved keys {sorted(order)} with "
                f"{len(order.get('generators', []))} generator(s), this loader has "
                f"{len(self.generators())}",
                path=self.key,
            )
        self.resume = (order, consumed)

    def _set_generators(self, states: list[Any]) -> None:
        """The samplers' generators as an epoch's end left them (the next epoch draws)."""
        gens = self.generators()
        if len(states) != len(gens):
            raise StateMismatchError(
                f"dataloader position: {len(states)} saved generator(s), this loader has "
                f"{len(gens)}",
                path=self.key,
            )
        for g, state in zip(gens, states, strict=True):
            g.set_state(state)
