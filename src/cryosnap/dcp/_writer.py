"""The writer: each ``dcp.save`` / ``dcp.async_save`` through it is one cryosnap version.

``write_data`` saves each rank's part (rank 0 adds DCP's ``Metadata``) and returns once the
version is committed; the ranks agree on every failure before any of them saves.
Runs on DCP's save thread (the caller's for ``dcp.save``, DCP's executor thread for
``dcp.async_save``); ``stage`` on the caller's. Collectives on the writer's own channel.
docs/design/dcp.md has the why.
"""

from __future__ import annotations

import io
import os
import threading
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from cryosnap import _validate
from cryosnap.checkpointer import Checkpointer, PathLike, SaveInfo
from cryosnap.dcp._parts import part_state
from cryosnap.dcp._schema import DcpError, ItemKey, encode, item_key, leaf_name
from cryosnap.dcp._staging import Staging
from cryosnap.errors import CheckpointError

__all__ = ["StorageWriter", "step_of"]

# The longest ``stage`` waits for the previous async save's copy to be written.
STAGE_WAIT_SECONDS = 600.0
# Checkpointer options that change nothing for versions written through DCP.
_REFUSED = {
    "max_inflight": "DCP saves one version at a time, each durable before the next",
    "device_diff": "the writer reads DCP's tensors once, on the host",
    "allow_pickle": "nothing is pickled: DCP's bytes items are stored as raw bytes",
}


def step_of(checkpoint_id: object, name: str = "checkpoint_id") -> int:
    """The version a DCP ``checkpoint_id`` names: an int step, or a str of one."""
    if isinstance(checkpoint_id, str) and checkpoint_id.strip().isdigit():
        return _validate.step(int(checkpoint_id), name)
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return _validate.step(checkpoint_id, name)
    raise ValueError(
        f"{name}={checkpoint_id!r:.60} is invalid: a cryosnap DCP checkpoint_id is the "
        "version's step (an int >= 0, or a str of one); the run's path is given to the writer"
    )


def is_step_id(checkpoint_id: object) -> bool:
    """Whether ``checkpoint_id`` names a version (DCP's ``validate_checkpoint_id``)."""
    try:
        step_of(checkpoint_id)
    except (TypeError, ValueError):
        return False
    return True


class StorageWriter(_DcpStorageWriter):
    """A ``torch.distributed.checkpoint`` storage writer that saves versions of a cryosnap run.

    ``StorageWriter(path, **checkpointer_options)`` opens ``cryosnap.Checkpointer(path, ...)``
    at once and keeps it across saves (incremental versions need the chain): construct it on
    every rank at the same point, after ``init_process_group`` (collective, as a Checkpointer
    is), and :meth:`close` it at the end (or use ``with``). Options are the Checkpointer's
    (``scratch``, ``keep``, ``incremental``, ``full_every``, ``chunk_bytes``, ``comm``...);
    ``staging_bytes`` bounds the pool that :meth:`stage` copies into for ``dcp.async_save``.

    **Steps.** ``dcp.save(sd, storage_writer=w, checkpoint_id=7)`` saves version 7;
    without ``checkpoint_id`` the next step after the newest version of the run (or that this
    writer saved). A step that exists is a :class:`~cryosnap.CheckpointExistsError`.

    **Async.** The writer is DCP's ``AsyncStager`` too: ``dcp.async_save(sd,
    storage_writer=w)`` stages through it (``async_stager=w`` is the same), copying the
    state into its pool, reused from one save to the next.
    """

    # AsyncStager: staging is done when stage() returns, nothing to synchronize afterwards.
    _synchronize_after_execute = False

    def __init__(
        self, path: PathLike, *, staging_bytes: int | None = None, **checkpointer_options: Any
    ) -> None:
        refused = sorted(set(checkpointer_options) & set(_REFUSED))
        if refused:
            name = refused[0]
            raise ValueError(
                f"{name}= is not an option of cryosnap.dcp.StorageWriter: {_REFUSED[name]}"
            )
        budget = _validate.positive_int_or_none(staging_bytes, "staging_bytes")
        self._staging = Staging(budget_bytes=budget, timeout_seconds=STAGE_WAIT_SECONDS)
        self._ckpt = Checkpointer(path, **checkpointer_options)
        try:
            self._channel = self._ckpt.coordinator.channel("dcp")
        except BaseException:
            self._ckpt.close()
            raise
        self._lock = threading.Lock()
        self._requested: int | None = None
        newest = self._ckpt.latest_step()
        self._newest = -1 if newest is None else newest
        self._step: int | None = None
        self._last: int | None = None
        self._info: SaveInfo | None = None
        self._saves = 0
        self._committed: tuple[Metadata, dict[ItemKey, int], str] | None = None

    # -- the writer's own API

    @property
    def checkpointer(self) -> Checkpointer:
        """The run's Checkpointer: ``steps()``, ``status()``, ``restore()`` of raw parts."""
        return self._ckpt

    @property
    def last_step(self) -> int | None:
        """The step of the newest version this writer saved (None: none yet)."""
        return self._last

    @property
    def last_info(self) -> SaveInfo | None:
        """This rank's :class:`~cryosnap.SaveInfo` of the newest version this writer saved:
        ``written_bytes`` is what it wrote (only changed chunks in an incremental version)."""
        return self._info

    def close(self) -> None:
        """Close the Checkpointer (drains, releases the run's lock) and drop idle slabs."""
        self._staging.close()
        self._ckpt.close()

    def __enter__(self) -> StorageWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The Checkpointer's own exit: on an exception it stops retrying flushes and does not
        # mask the exception with a failure of its own.
        self._staging.close()
        self._ckpt.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"cryosnap.dcp.StorageWriter({self._ckpt.store.url!r})"

    # -- AsyncStager

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in the writer's staging pool (DCP's ``AsyncStager``):
        training may change the original as soon as this returns."""
        staged: dict[str, Any] = self._staging.stage(state_dict)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    # -- StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._requested = None if checkpoint_id is None else step_of(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_step_id(checkpoint_id)

    def set_up_storage_writer(
        self,
        is_coordinator: bool,
        *args: Any,
        rank: int | None = None,
        use_collectives: bool = True,
        **kwargs: Any,
    ) -> None:
        coord = self._ckpt.coordinator
        if not use_collectives:
            raise DcpError(
                "dcp.save(use_collectives=False) is not supported by cryosnap.dcp: a version "
                "is committed once every rank's part is durable"
            )
        if is_coordinator != (coord.rank == 0) or (rank is not None and rank != coord.rank):
            raise DcpError(
                f"DCP runs this save as rank {rank} (coordinator: {is_coordinator}), but the "
                f"writer's run has this process as rank {coord.rank} of {coord.world_size}: "
                "save with the process group the writer was opened in (no_dist=True only in a "
                "world of one)"
            )
        with self._lock:
            step = self._requested if self._requested is not None else self._newest + 1
            self._requested = None
            self._step = step
            self._committed = None
            self._saves += 1
            self._staging.claim(self._saves)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save, step = self._saves, self._step
        if step is None:
            raise DcpError("write_data before set_up_storage_writer: not a DCP save flow")
        try:
            results = self._write(plan, planner, step)
        finally:
            self._staging.release(save)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        committed = self._committed
        if committed is None:
            raise DcpError("finish before write_data: not a DCP save flow")
        stored, where, text = committed
        if metadata is stored:
            return
        try:
            same = encode(metadata, where, step=self._step or 0, world_size=self._world()) == text
        except DcpError:
            same = False
        if not same:
            raise DcpError(
                f"step {self._step} was committed with the planner's metadata "
                "(planner.metadata), which differs from the metadata DCP finished with: "
                "the planner's create_global_plan must return the metadata it keeps"
            )

    # -- writing one version

    def _world(self) -> int:
        return self._ckpt.coordinator.world_size

    def _write(self, plan: SavePlan, planner: SavePlanner, step: int) -> list[WriteResult]:
        coord = self._channel
        error = ""
        tensors: dict[str, Any] = {}
        raw: dict[str, bytes] = {}
        results: list[WriteResult] = []
        try:
            results = _resolve(plan, planner, tensors, raw)
        except (CheckpointError, TypeError, ValueError, RuntimeError) as exc:
            error = f"rank {coord.rank}: {type(exc).__name__}: {exc}"
        keys = [[fqn, None if o is None else list(o)] for fqn, o in map(_key_of, results)]
        told = coord.all_gather([error, keys])
        errors = [e for e, _k in told if e]
        if errors:
            raise DcpError(f"step {step}: nothing saved: {errors[0]}")
        where: dict[ItemKey, int] = {}
        for r, (_e, ks) in enumerate(told):
            for fqn, offsets in ks:
                where[(fqn, None if offsets is None else tuple(offsets))] = r
        text, metadata = self._metadata_text(planner, where, step)
        info = self._ckpt._save_durable(step, part_state(coord.rank, tensors, raw, text))
        with self._lock:
            self._info = info
            self._newest = max(self._newest, step)
            self._last = step
        if metadata is not None and text is not None:
            self._committed = (metadata, where, text)
        return results

    def _metadata_text(
        self, planner: SavePlanner, where: dict[ItemKey, int], step: int
    ) -> tuple[str | None, Metadata | None]:
        """Rank 0: DCP's metadata as JSON; every rank learns whether rank 0 could make it."""
        coord = self._channel
        text, metadata, error = None, None, ""
        if coord.rank == 0:
            metadata = getattr(planner, "metadata", None)
            if not isinstance(metadata, Metadata):
                error = (
                    f"step {step}: the planner {type(planner).__name__} keeps no metadata "
                    "(planner.metadata) after planning; cryosnap.dcp needs it (DCP's "
                    "DefaultSavePlanner and its subclasses keep it)"
                )
            else:
                try:
                    text = encode(metadata, where, step=step, world_size=coord.world_size)
                except DcpError as exc:
                    error = str(exc)
        error = coord.broadcast(error)
        if error:
            raise DcpError(error if coord.rank == 0 else f"rank 0: {error}")
        return text, metadata


def _key_of(result: WriteResult) -> ItemKey:
    return item_key(result.index)


def _resolve(
    plan: SavePlan, planner: SavePlanner, tensors: dict[str, Any], raw: dict[str, bytes]
) -> list[WriteResult]:
    """Every write item's data, as the part stores it; the results DCP gathers."""
    results: list[WriteResult] = []
    for item in plan.items:
        data = planner.resolve_data(item)
        name = leaf_name(item_key(item.index))
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{name}: a bytes item resolved to {type(data).__name__}")
            raw[name] = data.getvalue()
            size = len(raw[name])
        else:
            tensors[name] = arr = _tensor_bytes(name, data)
            size = arr.nbytes
        results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=name))
    return results


def _tensor_bytes(name: str, data: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes of a chunk as one flat uint8 array (no copy for a contiguous CPU tensor)."""
    t = data.to_local() if isinstance(data, DTensor) else data
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: a tensor item resolved to {type(t).__name__}")
    t = t.detach()
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{name}: only dense strided tensors are supported, got {t.layout}")
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_complex():
        t = t.resolve_conj().resolve_neg()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    arr: np.ndarray[Any, np.dtype[np.uint8]] = t.view(torch.uint8).numpy()
    return arr
