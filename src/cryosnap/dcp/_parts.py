"""How DCP's items lie in a cryosnap version: each rank's part, and reading items back.

Each part is one state tree under the key ``cryosnap.dcp``; every tensor chunk is a blob.
Runs on the caller's thread (DCP's load or save thread); no collectives.
docs/design/dcp.md has the layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from cryosnap import engine
from cryosnap._format.skeleton import dict_items
from cryosnap.dcp._schema import ROOT, DcpFormatError
from cryosnap.engine.fetch import read_blobs
from cryosnap.storage import Store

__all__ = ["PartReader", "dcp_node", "metadata_text", "part_state"]

TENSORS, BYTES, METADATA = "tensors", "bytes", "metadata"


def part_state(
    rank: int, tensors: dict[str, Any], raw: dict[str, bytes], metadata: str | None
) -> dict[str, Any]:
    """The state one rank saves for one DCP version (``metadata``: rank 0's JSON)."""
    node: dict[str, Any] = {"rank": rank, TENSORS: tensors, BYTES: raw}
    if metadata is not None:
        node[METADATA] = metadata
    return {ROOT: node}


def dcp_node(skeleton: Any, where: str) -> dict[str | int, Any] | None:
    """The children of a part's ``cryosnap.dcp`` node by key; None when the version was not
    written through cryosnap.dcp (no such key at the top)."""
    if not isinstance(skeleton, dict) or skeleton.get("t") not in ("dict", "odict"):
        return None
    top = dict(dict_items(skeleton, where))
    if set(top) != {ROOT}:
        return None
    node = top[ROOT]
    if not isinstance(node, dict) or node.get("t") != "dict":
        raise DcpFormatError(f"{where}: its {ROOT!r} node is not a dict")
    return dict(dict_items(node, where))


def metadata_text(store: Store, step: int) -> tuple[str, int]:
    """Rank 0's DCP metadata JSON of ``step`` (read from its manifest: no data file is
    opened) and the number of parts the version has."""
    record = engine.read_commit(store, step)
    manifest, _ref = engine.read_manifest(store, record, 0)
    where = f"step {step} of {store.url}"
    node = dcp_node(manifest.skeleton, where)
    if node is None:
        raise DcpFormatError(
            f"{where} is not a torch.distributed.checkpoint version (it was not saved through "
            "cryosnap.dcp.StorageWriter): read it with cryosnap.load"
        )
    meta = node.get(METADATA)
    if not isinstance(meta, dict) or meta.get("t") != "str" or not isinstance(meta.get("v"), str):
        raise DcpFormatError(f"{where}: rank 0's part holds no DCP metadata")
    return meta["v"], record.world_size


class PartReader:
    """One rank's part of one version, resolved once; :meth:`read` fetches some of its items."""

    def __init__(self, store: Store, step: int, rank: int) -> None:
        record = engine.read_commit(store, step)
        if rank >= record.world_size:
            raise DcpFormatError(
                f"step {step} of {store.url}: its DCP metadata names rank {rank}, but the "
                f"version has {record.world_size} part(s)"
            )
        # Every claim of the part's chain is checked before anything is allocated or read.
        manifest, self._part, _keys, _where = engine.resolve_part(store, record, rank)
        self.where = f"step {step} of {store.url}, rank {rank}"
        self.store = store
        node = dcp_node(manifest.skeleton, self.where)
        if node is None:
            raise DcpFormatError(f"{self.where}: not a part written through cryosnap.dcp")
        self._nodes = {kind: _children(node, kind, self.where) for kind in (TENSORS, BYTES)}

    def read(self, wanted: list[tuple[str, str]]) -> dict[tuple[str, str], memoryview]:
        """The bytes of each ``(kind, leaf name)`` asked for (kind ``tensors`` or ``bytes``),
        every chunk verified; a leaf the part lacks is a :class:`DcpFormatError`."""
        spans = [self._blob(kind, name) for kind, name in wanted]
        blobs = [b for b, _lo, _hi in spans]
        unique = sorted(set(blobs))
        sub = dataclasses.replace(
            self._part, blobs=[self._part.blobs[b] for b in unique], _by_path={}
        )
        buffers = [np.empty(self._part.blobs[b].nbytes, dtype=np.uint8) for b in unique]
        read_blobs(self.store, sub, [buf.data for buf in buffers], direct=[False] * len(unique))
        by_blob = dict(zip(unique, buffers, strict=True))
        return {key: by_blob[b].data[lo:hi] for key, (b, lo, hi) in zip(wanted, spans, strict=True)}

    def _blob(self, kind: str, name: str) -> tuple[int, int, int]:
        """The blob that holds item ``name`` and the range of its bytes there (a small item
        is packed with others: its ``at`` and its length)."""
        node = self._nodes[kind].get(name)
        if node is None:
            raise DcpFormatError(f"{self.where}: has no {kind} item {name!r}")
        expected = "numpy" if kind == TENSORS else "bytes"
        b = node.get("b") if isinstance(node, dict) else None
        if type(b) is not int or node.get("t") != expected or not 0 <= b < len(self._part.blobs):
            raise DcpFormatError(f"{self.where}: {kind} item {name!r} is malformed")
        if kind == TENSORS and (node.get("dtype") != "|u1" or len(node.get("shape", ())) != 1):
            raise DcpFormatError(f"{self.where}: tensor item {name!r} is not stored as bytes")
        size = self._part.blobs[b].nbytes
        if "at" not in node:
            return b, 0, size
        at, n = node.get("at"), node["shape"][0]
        if type(at) is not int or type(n) is not int or not 0 <= at <= at + n <= size:
            raise DcpFormatError(f"{self.where}: {kind} item {name!r} is malformed")
        return b, at, at + n


def _children(node: dict[str | int, Any], kind: str, where: str) -> dict[str | int, Any]:
    child = node.get(kind)
    if not isinstance(child, dict) or child.get("t") != "dict":
        raise DcpFormatError(f"{where}: its {kind!r} node is missing or not a dict")
    return dict(dict_items(child, where))
