"""DCP's ``Metadata`` as JSON in cryosnap's own schema (``cryosnap.dcp/1``), and back.

What cannot be written without pickle is refused (:class:`DcpError`); what is read back is
validated field by field (:class:`DcpFormatError`). docs/FORMAT.md has the schema.
Pure: no I/O, no collectives; any thread. Imports torch (building ``Metadata`` needs it).
docs/design/dcp.md has the why.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from cryosnap.errors import DcpError, DcpFormatError

__all__ = [
    "ROOT",
    "SCHEMA",
    "DcpError",
    "DcpFormatError",
    "ItemKey",
    "decode",
    "encode",
    "item_key",
    "leaf_name",
]

SCHEMA = "cryosnap.dcp/1"
# The top-level key of every rank's part of a version written through cryosnap.dcp.
ROOT = "cryosnap.dcp"

# (fqn, chunk offsets) of a stored tensor chunk; (fqn, None) of a stored bytes item.
ItemKey = tuple[str, tuple[int, ...] | None]


def item_key(index: MetadataIndex) -> ItemKey:
    """The key an item is stored and located under: its fqn and (tensors) chunk offsets."""
    return index.fqn, None if index.offset is None else tuple(int(o) for o in index.offset)


def leaf_name(key: ItemKey) -> str:
    """The name of an item's leaf in a rank's part: the fqn, with ``@`` and the chunk's
    offsets for a tensor chunk (``layer.weight@0,512``)."""
    fqn, offsets = key
    return fqn if offsets is None else f"{fqn}@{','.join(map(str, offsets))}"


# ---------------------------------------------------------------------------------------------
# encode


def encode(metadata: Metadata, where: dict[ItemKey, int], *, step: int, world_size: int) -> str:
    """``metadata`` as JSON text, each stored item with the rank that holds it (``where``);
    :class:`DcpError` for what JSON cannot hold or an item no rank wrote."""
    entries = {
        fqn: _encode_entry(fqn, md, where, step) for fqn, md in metadata.state_dict_metadata.items()
    }
    doc = {
        "schema": SCHEMA,
        "step": step,
        "world_size": world_size,
        "version": _optional_str(metadata.version, "version", step),
        "state_dict": entries,
        "planner_data": _encode_planner_data(metadata.planner_data, step),
        "storage_meta": _encode_storage_meta(metadata.storage_meta, step),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False)


def _encode_entry(fqn: str, md: Any, where: dict[ItemKey, int], step: int) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes", "rank": _rank_of(where, (fqn, None), step)}
    if not isinstance(md, TensorStorageMetadata):
        raise DcpError(
            f"step {step}: DCP metadata of {fqn!r} is a {type(md).__name__}, which cryosnap "
            "cannot store (tensors and bytes only)"
        )
    props = md.properties
    if props.layout != torch.strided:
        raise DcpError(f"step {step}: {fqn!r} has layout {props.layout} (strided only)")
    chunks = []
    for c in md.chunks:
        offsets = [int(o) for o in c.offsets]
        chunks.append(
            {
                "offsets": offsets,
                "sizes": [int(s) for s in c.sizes],
                "rank": _rank_of(where, (fqn, tuple(offsets)), step),
            }
        )
    return {
        "type": "tensor",
        "dtype": str(props.dtype).removeprefix("torch."),
        "requires_grad": bool(props.requires_grad),
        "size": [int(s) for s in md.size],
        "chunks": chunks,
    }


def _rank_of(where: dict[ItemKey, int], key: ItemKey, step: int) -> int:
    rank = where.get(key)
    if rank is None:
        raise DcpError(
            f"step {step}: DCP metadata names {leaf_name(key)!r}, which no rank wrote "
            "(the planner's metadata and plans disagree)"
        )
    return rank


def _encode_planner_data(data: Any, step: int) -> Any:
    """DCP's default planner keeps fqn -> the path of keys it flattened (str and int keys)."""
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(type(e) in (str, int) for e in v)
        for k, v in data.items()
    ):
        return {k: list(v) for k, v in data.items()}
    raise DcpError(
        f"step {step}: the planner's planner_data ({type(data).__name__}) is not DCP's default "
        "planner's (a dict of fqn -> tuple of str/int keys) and cannot be stored without pickle"
    )


def _encode_storage_meta(meta: StorageMeta | None, step: int) -> Any:
    if meta is None:
        return None
    cid = meta.checkpoint_id
    return {
        "checkpoint_id": None if cid is None else os.fspath(cid),
        "save_id": _optional_str(meta.save_id, "storage_meta.save_id", step),
        "load_id": _optional_str(meta.load_id, "storage_meta.load_id", step),
        "modules": [str(m) for m in meta.modules],
    }


def _optional_str(value: Any, name: str, step: int) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DcpError(f"step {step}: DCP metadata {name} is a {type(value).__name__}, not a str")


# ---------------------------------------------------------------------------------------------
# decode


class _Check:
    """Field checks of one version's metadata; every failure names the step and the field."""

    def __init__(self, step: int, where: str) -> None:
        self.prefix = f"step {step} of {where}: DCP metadata"

    def fail(self, what: str) -> DcpFormatError:
        return DcpFormatError(f"{self.prefix}: {what}")

    def get(self, obj: Any, key: str, kind: type | tuple[type, ...], field: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(f"{field} is missing")
        value = obj[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise self.fail(f"{field} is {value!r:.60}, of the wrong type")
        return value

    def ints(self, value: Any, field: str, *, minimum: int = 0) -> list[int]:
        if not isinstance(value, list) or not all(type(v) is int and v >= minimum for v in value):
            raise self.fail(f"{field} is {value!r:.60}, not a list of ints >= {minimum}")
        return value


def decode(text: str, *, step: int, where: str) -> tuple[Metadata, dict[ItemKey, int], int]:
    """The ``Metadata`` stored as ``text``, where each item lies (rank), and the world size
    that saved it; :class:`DcpFormatError` names what is malformed."""
    check = _Check(step, where)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise check.fail(f"is not valid JSON ({exc})") from exc
    schema = check.get(doc, "schema", str, "schema")
    if schema != SCHEMA:
        raise check.fail(f"has schema {schema!r:.40}; this cryosnap reads {SCHEMA!r}")
    if check.get(doc, "step", int, "step") != step:
        raise check.fail(f"says it is step {doc['step']}")
    world = check.get(doc, "world_size", int, "world_size")
    if world < 1:
        raise check.fail(f"world_size is {world}")
    located: dict[ItemKey, int] = {}
    entries = check.get(doc, "state_dict", dict, "state_dict")
    state_md = {fqn: _decode_entry(check, fqn, e, world, located) for fqn, e in entries.items()}
    version = doc.get("version")
    if version is not None and not isinstance(version, str):
        raise check.fail(f"version is {version!r:.40}, not a str")
    metadata = Metadata(
        state_dict_metadata=state_md,
        planner_data=_decode_planner_data(check, doc.get("planner_data")),
        storage_data={MetadataIndex(fqn, offs): r for (fqn, offs), r in located.items()},
        storage_meta=_decode_storage_meta(check, doc.get("storage_meta")),
        version=version,
    )
    return metadata, located, world


def _decode_entry(
    check: _Check, fqn: str, entry: Any, world: int, located: dict[ItemKey, int]
) -> Any:
    field = f"state_dict[{fqn!r:.80}]"
    kind = check.get(entry, "type", str, f"{field}.type")
    if kind == "bytes":
        located[(fqn, None)] = _decode_rank(check, entry, world, field)
        return BytesStorageMetadata()
    if kind != "tensor":
        raise check.fail(f"{field}.type is {kind!r:.40}")
    dtype_name = check.get(entry, "dtype", str, f"{field}.dtype")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise check.fail(f"{field}.dtype {dtype_name!r:.40} is not a torch dtype")
    size = check.ints(check.get(entry, "size", list, f"{field}.size"), f"{field}.size")
    chunks = []
    for i, c in enumerate(check.get(entry, "chunks", list, f"{field}.chunks")):
        name = f"{field}.chunks[{i}]"
        offsets = check.ints(check.get(c, "offsets", list, name), f"{name}.offsets")
        sizes = check.ints(check.get(c, "sizes", list, name), f"{name}.sizes")
        if not (len(offsets) == len(sizes) == len(size)) or any(
            o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)
        ):
            raise check.fail(f"{name} (offsets {offsets}, sizes {sizes}) is outside size {size}")
        located[(fqn, tuple(offsets))] = _decode_rank(check, c, world, name)
        chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    grad = entry.get("requires_grad", False)
    if not isinstance(grad, bool):
        raise check.fail(f"{field}.requires_grad is {grad!r:.40}")
    props = TensorProperties(dtype=dtype, requires_grad=grad)
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _decode_rank(check: _Check, obj: Any, world: int, field: str) -> int:
    rank = check.get(obj, "rank", int, f"{field}.rank")
    if not 0 <= rank < world:
        raise check.fail(f"{field}.rank is {rank}, outside the {world} rank(s) that saved it")
    return int(rank)


def _decode_planner_data(check: _Check, data: Any) -> Any:
    if data is None:
        return None
    if not isinstance(data, dict) or not all(
        isinstance(v, list) and all(type(e) in (str, int) for e in v) for v in data.values()
    ):
        raise check.fail("planner_data is not a dict of fqn -> list of str/int keys")
    return {k: tuple(v) for k, v in data.items()}


def _decode_storage_meta(check: _Check, meta: Any) -> StorageMeta | None:
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise check.fail("storage_meta is not an object")
    fields = {}
    for name in ("checkpoint_id", "save_id", "load_id"):
        value = meta.get(name)
        if value is not None and not isinstance(value, str):
            raise check.fail(f"storage_meta.{name} is {value!r:.40}, not a str")
        fields[name] = value
    modules = meta.get("modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise check.fail("storage_meta.modules is not a list of str")
    return StorageMeta(modules=modules, **fields)
