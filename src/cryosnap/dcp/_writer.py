"""The writer: each ``dcp.save`` / ``dcp.async_save`` through it is one cryosnap version.

``write_data`` opens the run, saves each rank's part (rank 0 adds DCP's ``Metadata``) and
closes the run once the version is committed: no writer holds the run's lock between saves.
The ranks agree on every failure before any of them saves.
Runs on DCP's save thread (the caller's for ``dcp.save``, DCP's executor thread for
``dcp.async_save``); ``stage`` on the caller's. Collectives on the writer's own channel.
docs/design/dcp.md has the why.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time
import warnings
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
from cryosnap._run.open import flush_channel
from cryosnap._run.options import RunOptions
from cryosnap.checkpointer import Checkpointer, PathLike, SaveInfo
from cryosnap.dcp import _session
from cryosnap.dcp._parts import part_state
from cryosnap.dcp._schema import DcpError, ItemKey, encode, item_key, leaf_name
from cryosnap.dcp._staging import Staged, Staging
from cryosnap.errors import CheckpointError
from cryosnap.run import Run

__all__ = ["StorageWriter", "step_of"]

# The longest ``stage`` waits for the previous async save's copy to be written, and a save
# for another save of the same run in this process.
STAGE_WAIT_SECONDS = 600.0
# Checkpointer options that change nothing for versions written through DCP.
_REFUSED = {
    "max_inflight": "DCP saves one version at a time, each durable before the next",
    "device_diff": "the writer reads DCP's tensors once, on the host",
    "allow_pickle": "nothing is pickled: DCP's bytes items are stored as raw bytes",
    "policy": "the writer holds no run between saves to ask: ask a policy of your own",
    "clock": "it is the save policy's clock, and the writer takes no policy",
    "handle_signals": "the writer holds no run between saves to mark as preempted",
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

    ``dcp.save(sd, storage_writer=cryosnap.dcp.StorageWriter(path, **options))``: a writer per
    save, as DCP's ``FileSystemWriter`` is used, or one writer reused for every save; either
    way each save is the next version of the run, incremental against the one before (in this
    process or in an earlier one). Construction does no I/O (the first in a torch.distributed
    job makes the gloo groups of the run's coordinator, once per process: construct it on every
    rank at the same point). Each save opens the run (``cryosnap.Checkpointer(path,
    **options)``: its write lock, the chain read back from the newest version) and closes it
    once the version is committed, so no writer holds the run's lock between saves; another
    process saving the run meanwhile is refused, and a second save of the run in this process
    waits for the first. Options are the Checkpointer's (``scratch``, ``keep``,
    ``incremental``, ``full_every``, ``chunk_bytes``, ``comm``...); ``staging_bytes`` bounds the
    pool that :meth:`stage` copies into for ``dcp.async_save``.

    **Steps.** ``dcp.save(sd, storage_writer=w, checkpoint_id=7)`` saves version 7;
    without ``checkpoint_id`` the next step after the newest version of the run. A step that
    exists is a :class:`~cryosnap.CheckpointExistsError`.

    **Async.** The writer is DCP's ``AsyncStager`` too: ``dcp.async_save(sd,
    storage_writer=w)`` stages through it (``async_stager=w`` is the same), copying the
    state into its pool, reused from one save to the next of this writer.
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
        # Validated here, on the caller's thread; each save opens its Checkpointer with them.
        self._run_options = RunOptions(path=path, **checkpointer_options)
        self._path = path
        self._options = dict(checkpointer_options)
        self._key = _session.run_key(path)
        self._coord = _session.coordinator(self._run_options.comm)
        if self._run_options.scratch_devices and self._coord.world_size > 1:
            # The persistent hand-off's channel, made here rather than at the first save's open,
            # which dcp.async_save runs on a thread of its own while training goes on.
            self._coord.channel(flush_channel(1))
        self._staging = Staging(budget_bytes=budget, timeout_seconds=STAGE_WAIT_SECONDS)
        self._lock = threading.Lock()
        self._requested: int | None = None
        self._asked: int | None = None
        self._step: int | None = None
        self._last: int | None = None
        self._info: SaveInfo | None = None
        self._saves = 0
        self._began = 0.0
        self._staged: Staged | None = None
        self._committed: tuple[Metadata, dict[ItemKey, int], str] | None = None

    # -- the writer's own API

    @property
    def run(self) -> Run:
        """A read-only handle on the run at ``path`` (``steps()``, ``info()``, ``verify()``);
        takes no lock. :class:`~cryosnap.CheckpointNotFoundError` before the first version."""
        return Run(self._path, storage_options=self._run_options.storage_options)

    @property
    def checkpointer(self) -> Run:
        """Deprecated: :attr:`run` (this name is removed in the next release)."""
        warnings.warn(
            "StorageWriter.checkpointer is deprecated, use StorageWriter.run (a read-only "
            "cryosnap.Run); removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.run

    @property
    def last_step(self) -> int | None:
        """The step of the newest version this writer saved (None: none yet)."""
        return self._last

    @property
    def last_info(self) -> SaveInfo | None:
        """This rank's :class:`~cryosnap.SaveInfo` of the newest version this writer saved:
        ``written_bytes`` is what it wrote (only changed chunks in an incremental version).
        Both times run from one start: for ``dcp.async_save`` the staging copy's, ``seconds``
        until durable and ``stall_seconds`` the copy's time; for ``dcp.save`` DCP setting the
        writer up, and ``stall_seconds`` is ``seconds`` (the caller waits until durable)."""
        return self._info

    def close(self) -> None:
        """Drop the staging pool's idle slabs (optional: the writer holds no run or lock)."""
        self._staging.close()

    def __enter__(self) -> StorageWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"cryosnap.dcp.StorageWriter({self._key!r})"

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
        coord = self._coord
        if not use_collectives:
            raise DcpError(
                "dcp.save(use_collectives=False) is not supported by cryosnap.dcp: a version "
                "is committed once every rank's part is durable"
            )
        if is_coordinator != (coord.rank == 0) or (rank is not None and rank != coord.rank):
            raise DcpError(
                f"DCP runs this save as rank {rank} (coordinator: {is_coordinator}), but the "
                f"writer's run has this process as rank {coord.rank} of {coord.world_size}: "
                "save with the process group the writer was made in (no_dist=True only in a "
                "world of one)"
            )
        with self._lock:
            self._asked, self._requested = self._requested, None
            self._step = None
            self._committed = None
            self._saves += 1
            self._began = time.perf_counter()
            self._staged = self._staging.claim(self._saves)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._saves
        if save == 0:
            raise DcpError("write_data before set_up_storage_writer: not a DCP save flow")
        try:
            # The run is open (its lock held) only while this save is in flight.
            with (
                _session.in_flight(self._key, timeout_seconds=STAGE_WAIT_SECONDS),
                Checkpointer(self._path, **{**self._options, "comm": self._coord}) as ckpt,
            ):
                results = self._write(ckpt, plan, planner)
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
        return self._coord.world_size

    def _write(self, ckpt: Checkpointer, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        coord = ckpt.coordinator.channel(_session.DCP_CHANNEL)
        error = ""
        tensors: dict[str, Any] = {}
        raw: dict[str, bytes] = {}
        results: list[WriteResult] = []
        newest = ckpt.latest_step()
        mine = self._asked if self._asked is not None else 0 if newest is None else newest + 1
        try:
            results = _resolve(plan, planner, tensors, raw)
        except (CheckpointError, TypeError, ValueError, RuntimeError) as exc:
            error = f"rank {coord.rank}: {type(exc).__name__}: {exc}"
        keys = [[fqn, None if o is None else list(o)] for fqn, o in map(_key_of, results)]
        # Rank 0 learns where every item lies (its metadata names them); the others only the
        # step and the first error: O(1) bytes each.
        told = coord.gather([error, keys, mine])
        decided = (
            None if told is None else [int(told[0][2]), next((t[0] for t in told if t[0]), "")]
        )
        step, first = coord.broadcast(decided)
        self._step = step = int(step)
        if first:
            raise DcpError(f"step {step}: nothing saved: {first}")
        where: dict[ItemKey, int] = {}
        for r, (_e, ks, _s) in enumerate(told or []):
            for fqn, offsets in ks:
                where[(fqn, None if offsets is None else tuple(offsets))] = r
        text, metadata = self._metadata_text(coord, planner, where, step)
        called = time.perf_counter()
        info = ckpt._save_durable(step, part_state(coord.rank, tensors, raw, text))
        with self._lock:
            self._info = _from_start(info, called, began=self._began, staged=self._staged)
            self._last = step
        if metadata is not None and text is not None:
            self._committed = (metadata, where, text)
        return results

    def _metadata_text(
        self, coord: Any, planner: SavePlanner, where: dict[ItemKey, int], step: int
    ) -> tuple[str | None, Metadata | None]:
        """Rank 0: DCP's metadata as JSON; every rank learns whether rank 0 could make it."""
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


def _from_start(info: SaveInfo, called: float, *, began: float, staged: Staged | None) -> SaveInfo:
    """``info`` with both times from the DCP save's start: the staging copy's
    (``dcp.async_save``), else DCP's set-up (``began``). The Checkpointer times ``seconds``
    from ``_save_durable``'s call (``called``), after the run's open, the key exchange and
    the metadata: reported as it is, a sync save was durable before it began blocking."""
    # ``called`` is read a few instructions before the Checkpointer's own start: the version
    # was durable at ``called + info.seconds`` or a microsecond later.
    if staged is None:  # dcp.save: the caller waited from the set-up until durable
        seconds = called - began + info.seconds
        return dataclasses.replace(info, seconds=seconds, stall_seconds=seconds)
    # dcp.async_save: the copy ended before this save was set up, so seconds > the copy's.
    seconds = called - staged.started + info.seconds
    return dataclasses.replace(info, seconds=seconds, stall_seconds=staged.seconds)


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
