"""The reader: ``dcp.load`` from a version written through :class:`cryosnap.dcp.StorageWriter`.

The metadata comes from rank 0's JSON (never unpickled); every chunk read is verified.
Runs on the caller's thread (DCP's load); takes no lock; no collectives of its own.
docs/design/dcp.md has the why.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.futures import Future

from cryosnap import _validate
from cryosnap.checkpointer import PathLike
from cryosnap.dcp._parts import BYTES, TENSORS, PartReader, metadata_text
from cryosnap.dcp._schema import DcpError, DcpFormatError, ItemKey, decode, item_key, leaf_name
from cryosnap.dcp._writer import is_step_id, step_of
from cryosnap.run import committed_steps
from cryosnap.storage import open_run_store

__all__ = ["StorageReader", "read_version_metadata"]


def read_version_metadata(
    path: PathLike, step: int | None = None
) -> tuple[Metadata, dict[ItemKey, int], int]:
    """The DCP ``Metadata`` of version ``step`` (None: the newest), where each item lies and
    the step; :class:`~cryosnap.dcp.DcpFormatError` if it is no DCP version."""
    store = open_run_store(path)
    if step is None:
        step = committed_steps(store)[-1]
    text, parts = metadata_text(store, step)
    metadata, located, world = decode(text, step=step, where=store.url)
    if world != parts:
        raise DcpFormatError(
            f"step {step} of {store.url}: DCP metadata names {world} rank(s), the version has "
            f"{parts} part(s)"
        )
    return metadata, located, step


class StorageReader(_DcpStorageReader):
    """A ``torch.distributed.checkpoint`` storage reader of a cryosnap run's versions.

    ``StorageReader(path, step=None)``: version ``step`` of the run at ``path`` (a directory or
    URL), the newest without one; ``dcp.load(sd, storage_reader=r, checkpoint_id=7)`` picks
    version 7 for that load. Any number of ranks may load a version saved by any number
    (DCP's planner reshards); each reads only the items its plan names. Takes no lock.
    """

    def __init__(self, path: PathLike, step: int | None = None) -> None:
        self._store = open_run_store(path)
        self._asked = None if step is None else _validate.step(step)
        self._step: int | None = None
        self._located: dict[ItemKey, int] = {}
        self._metadata: Metadata | None = None

    def __repr__(self) -> str:
        return f"cryosnap.dcp.StorageReader({self._store.url!r})"

    @property
    def step(self) -> int | None:
        """The version the last ``read_metadata`` read (None: none yet)."""
        return self._step

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._asked = step_of(checkpoint_id)
        self._step, self._metadata, self._located = None, None, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_step_id(checkpoint_id)

    # No **kwargs: DCP would otherwise retry a failed read as "rank-local metadata".
    def read_metadata(self, *args: Any) -> Metadata:
        metadata, located, step = read_version_metadata(self._store, self._asked)
        self._metadata, self._located, self._step = metadata, located, step
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._metadata is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Without a step every rank reads the newest version's metadata on its own; the
        # coordinator's step travels with each rank's plan, so a rank that saw another version
        # (one was committed during the load) fails the load instead of mixing versions.
        return [dataclasses.replace(p, storage_data={_STEP: self._step}) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._metadata is not None and self._step is not None
        told = plan.storage_data.get(_STEP) if isinstance(plan.storage_data, dict) else None
        if told is not None and told != self._step:
            raise DcpError(
                f"{self._store.url}: this rank read the DCP metadata of step {self._step}, the "
                f"coordinator that of step {told} (a version was committed during the load); "
                "pass StorageReader(path, step=...) or checkpoint_id= to load one version"
            )
        by_rank: dict[int, list[ReadItem]] = {}
        for item in plan.items:
            key = item_key(item.storage_index)
            rank = self._located.get(key)
            if rank is None:
                raise DcpFormatError(
                    f"step {self._step}: the load plan asks for {leaf_name(key)!r}, which the "
                    "version's DCP metadata does not locate"
                )
            by_rank.setdefault(rank, []).append(item)
        for rank, items in sorted(by_rank.items()):
            self._read_rank(rank, items, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_rank(self, rank: int, items: list[ReadItem], planner: LoadPlanner) -> None:
        assert self._step is not None and self._metadata is not None
        part = PartReader(self._store, self._step, rank)
        wanted = sorted({_leaf(item) for item in items})
        data = part.read(wanted)
        for item in items:
            buf = data[_leaf(item)]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(buf)))
                continue
            saved = self._chunk(item, buf, part.where)
            lengths = list(item.lengths)
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, lengths, strict=True)):
                saved = saved.narrow(dim, int(offset), int(length))
            target = planner.resolve_tensor(item).detach()
            if target.size() != saved.size():
                raise DcpFormatError(
                    f"{part.where}: {leaf_name(item_key(item.storage_index))!r}: the planner "
                    f"wants {list(target.size())}, the slice is {list(saved.size())}"
                )
            target.copy_(saved)
            planner.commit_tensor(item, target)

    def _chunk(self, item: ReadItem, buf: memoryview, where: str) -> Any:
        """The saved chunk an item reads from, as a tensor over ``buf`` (no copy)."""
        assert self._metadata is not None
        index = item.storage_index
        md = self._metadata.state_dict_metadata.get(index.fqn)
        offsets = None if index.offset is None else list(index.offset)
        chunk = None
        if isinstance(md, TensorStorageMetadata):
            chunk = next((c for c in md.chunks if list(c.offsets) == offsets), None)
        if chunk is None or not isinstance(md, TensorStorageMetadata):
            raise DcpFormatError(f"{where}: no saved chunk {leaf_name(item_key(index))!r}")
        dtype = md.properties.dtype
        sizes = list(chunk.sizes)
        numel = 1
        for s in sizes:
            numel *= s
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if len(buf) != numel * itemsize:
            raise DcpFormatError(
                f"{where}: {leaf_name(item_key(index))!r} holds {len(buf)} bytes, its chunk "
                f"{sizes} of {dtype} needs {numel * itemsize}"
            )
        if numel == 0:
            return torch.empty(sizes, dtype=dtype)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(dtype).view(sizes)


_STEP = "cryosnap_step"


def _leaf(item: ReadItem) -> tuple[str, str]:
    kind = BYTES if item.type == LoadItemType.BYTE_IO else TENSORS
    return kind, leaf_name(item_key(item.storage_index))
