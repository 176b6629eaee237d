"""Conversions: a DCP version as one state dict (``cryosnap export``), and an existing DCP
checkpoint directory imported as a version of a run (``cryosnap import-dcp``).

Import only checkpoints you trust: DCP's own ``.metadata`` is a pickle, which DCP's reader loads.
Runs on the caller's thread, in one process (no collectives); holds the whole checkpoint in
memory while it converts. docs/design/dcp.md has the why.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from cryosnap import _validate
from cryosnap.checkpointer import Checkpointer, PathLike, SaveInfo
from cryosnap.dcp._parts import part_state
from cryosnap.dcp._reader import StorageReader, read_version_metadata
from cryosnap.dcp._schema import DcpError, ItemKey, encode, item_key, leaf_name
from cryosnap.dcp._writer import _tensor_bytes
from cryosnap.errors import CheckpointError

__all__ = ["ImportResult", "full_state_dict", "import_dcp"]


class _WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the whole state dict, reading bytes items with
    ``weights_only=True`` instead of a full unpickle."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DcpError(
                f"item {fqn!r} is a pickled object that torch.load(weights_only=True) refuses "
                f"({first:.200}); load the version with dcp.load into your own state dict"
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def full_state_dict(path: PathLike, step: int) -> dict[str, Any]:
    """Version ``step`` of the run at ``path`` (written through cryosnap.dcp) as one state
    dict with whole tensors, as ``dcp_to_torch_save`` would write it."""
    read_version_metadata(path, step)  # a version that is no DCP one fails here, plainly
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=StorageReader(path, step),
            planner=_WeightsOnlyPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except CheckpointException as exc:
        raise _unwrapped(exc) from exc
    return state


def _unwrapped(exc: CheckpointException) -> BaseException:
    """The cryosnap error DCP wrapped (it collects every rank's failure into one exception),
    or DCP's exception itself."""
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            return inner
    return exc


# ---------------------------------------------------------------------------------------------
# import


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What :func:`import_dcp` saved: the step, how many tensor chunks and bytes items, and
    the cryosnap SaveInfo of the version."""

    source: str
    path: str
    step: int
    tensor_chunks: int
    bytes_items: int
    info: SaveInfo


class _RawPlanner(LoadPlanner):
    """Receives every saved chunk and bytes item as stored (no resharding, no unpickling)."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self.tensors: dict[str, Any] = {}
        self.raw: dict[str, bytes] = {}

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        return None

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                index = MetadataIndex(fqn)
                items.append(_read_item(LoadItemType.BYTE_IO, index, []))
                continue
            assert isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks:
                self.tensors[leaf_name((fqn, tuple(chunk.offsets)))] = torch.empty(
                    list(chunk.sizes), dtype=md.properties.dtype
                )
                index = MetadataIndex(fqn, chunk.offsets)
                items.append(_read_item(LoadItemType.TENSOR, index, list(chunk.sizes)))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.raw[leaf_name(item_key(read_item.storage_index))] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor: torch.Tensor = self.tensors[leaf_name(item_key(read_item.storage_index))]
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None


def _read_item(kind: LoadItemType, index: MetadataIndex, sizes: list[int]) -> ReadItem:
    zeros = torch.Size([0] * len(sizes))
    return ReadItem(
        type=kind,
        dest_index=index,
        dest_offsets=zeros,
        storage_index=index,
        storage_offsets=zeros,
        lengths=torch.Size(sizes),
    )


def import_dcp(
    source: str | os.PathLike[str],
    path: PathLike,
    *,
    step: int | None = None,
    **checkpointer_options: Any,
) -> ImportResult:
    """Save the DCP checkpoint directory ``source`` as version ``step`` of the run at ``path``
    (None: the step after the run's newest, 0 in a new run); returns what was saved."""
    if step is not None:
        step = _validate.step(step)
    src = Path(os.fspath(source))
    if not (src / ".metadata").is_file():
        raise DcpError(
            f"{src} is not a torch.distributed.checkpoint directory (it has no .metadata file)"
        )
    reader = FileSystemReader(src)
    metadata = reader.read_metadata()
    planner = _RawPlanner(metadata)
    plan = planner.create_local_plan()
    reader.set_up_storage_reader(metadata, True)
    reader.read_data(plan, planner).wait()
    tensors = {name: _tensor_bytes(name, t) for name, t in planner.tensors.items()}
    where: dict[ItemKey, int] = {item_key(item.storage_index): 0 for item in plan.items}
    with Checkpointer(path, **checkpointer_options) as ckpt:
        if ckpt.coordinator.world_size != 1:
            raise DcpError("import_dcp runs in one process; open it outside a distributed job")
        if step is None:
            newest = ckpt.latest_step()
            step = 0 if newest is None else newest + 1
        text = encode(metadata, where, step=step, world_size=1)
        info = ckpt._save_durable(step, part_state(0, tensors, planner.raw, text), reuse=False)
    return ImportResult(
        source=str(src),
        path=ckpt.store.url,
        step=step,
        tensor_chunks=len(tensors),
        bytes_items=len(planner.raw),
        info=info,
    )
