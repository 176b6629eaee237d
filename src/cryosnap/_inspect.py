"""What a version holds and what changed between two, from their manifests: the leaves of one
rank's part (:func:`describe_leaves`) and the leaf-by-leaf difference of two versions
(:func:`diff_versions`); and the parts of a run's scratch level a reader finds on this node
(:func:`scratch_parts`), so that ``Run.verify`` can check every level.

Reads manifests (resolved through their chains) and no data, except the packs of small tensors
whose chunks differ, read through the engine's verified reader; writes nothing. Imports neither
torch (element sizes of the common dtypes are known here) nor typer. The caller's thread; no
collectives.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap import engine
from cryosnap._format.chunks import chunk_count
from cryosnap._format.manifest import Manifest
from cryosnap._format.skeleton import iter_leaves
from cryosnap._state.torch_import import import_torch
from cryosnap.engine import ResolvedPart
from cryosnap.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError
from cryosnap.storage import Store, join_location, open_store
from cryosnap.storage.striped import LAYOUT_KEY, Device, StripedStore

__all__ = [
    "LeafChange",
    "LeafInfo",
    "ScratchPart",
    "VersionDiff",
    "describe_leaves",
    "diff_parts",
    "diff_versions",
    "packed_range",
    "scratch_parts",
]


# ---------------------------------------------------------------------------------------------
# the leaves of one version


@dataclass(frozen=True, slots=True)
class LeafInfo:
    """One leaf of a manifest skeleton, as ``inspect`` shows it."""

    path: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    nbytes: int
    chunks: int
    blob: int | None
    shared_with: str | None
    value: str | None
    packed_with: str | None = None  # the first leaf of the pack of small tensors it lies in

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": self.shape,
            "bytes": self.nbytes,
            "chunks": self.chunks,
            "blob": self.blob,
            "shared_with": self.shared_with,
            "packed_with": self.packed_with,
            "value": self.value,
        }


# Element sizes of torch dtypes, so inspect never imports torch (slow) for the common ones.
_TORCH_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "complex32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def _torch_itemsize(name: str) -> int | None:
    if name in _TORCH_ITEMSIZE:
        return _TORCH_ITEMSIZE[name]
    if name.startswith("float8"):
        return 1
    try:
        torch = import_torch()  # under the one import lock (another thread may be importing)
    except ImportError:
        return None
    dtype = getattr(torch, name, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def _numpy_dtype(descr: Any) -> np.dtype[Any] | None:
    """The numpy dtype of a manifest ``dtype`` descr; None if it is not one.

    JSON turned the tuples of a structured descr into lists: ``[name, type, shape?]`` per field,
    where ``type`` may itself be a structured descr.
    """

    def as_descr(d: Any) -> Any:
        return [as_field(f) for f in d] if isinstance(d, list) else d

    def as_field(f: Any) -> Any:
        if not isinstance(f, list) or len(f) < 2:
            return f
        name, kind, *shape = f
        name = tuple(name) if isinstance(name, list) else name
        return (name, as_descr(kind), *(tuple(x) if isinstance(x, list) else x for x in shape))

    try:
        dtype: np.dtype[Any] = np.lib.format.descr_to_dtype(as_descr(descr))
    except (TypeError, ValueError, KeyError):
        return None
    return dtype


def _dtype_name(descr: Any) -> str:
    dtype = _numpy_dtype(descr)
    return str(dtype) if dtype is not None else repr(descr)


def _inline_value(node: dict[str, Any]) -> str | None:
    """The display text of a value held in the skeleton itself (no blob)."""
    t = node.get("t")
    v: Any = node.get("v")
    try:
        if t == "none":
            return "None"
        if t in ("int", "bool"):
            return str(v)
        if t == "str":
            return repr(v)
        if t == "file":  # where it was saved from (its bytes are a blob)
            return repr(node["path"]) if isinstance(node.get("path"), str) else None
        if t == "float":
            return repr(float.fromhex(v))
        if t == "complex":
            return repr(complex(float.fromhex(v[0]), float.fromhex(v[1])))
        if t == "size":
            return f"torch.Size({list(v)})"
        if t == "npscalar":
            dtype = _numpy_dtype(node.get("dtype"))
            if dtype is None:
                return None
            return str(np.frombuffer(bytes.fromhex(node["hex"]), dtype=dtype)[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return "<malformed>"
    return None


def describe_leaves(manifest: Manifest) -> list[LeafInfo]:
    """Every leaf of one rank's manifest, from its skeleton alone: no data is read."""
    found = list(iter_leaves(manifest.skeleton))
    owner: dict[int, str] = {}  # blob -> the first leaf that uses it
    leaves: list[LeafInfo] = []
    for path, node in found:
        t = str(node.get("t"))
        blob: int | None = None
        nbytes = 0
        chunks = 0
        shared_with: str | None = None
        packed_with: str | None = None
        if "b" in node:
            b = node["b"]
            if type(b) is not int or not 0 <= b < len(manifest.blobs):
                raise CheckpointFormatError(f"leaf {path}: invalid blob reference {b!r:.40}")
            blob = b
            nbytes = manifest.blobs[b].nbytes
            if b in owner:
                # Packed leaves share a blob, not memory (their chunks count once).
                if "at" in node:
                    packed_with = owner[b]
                else:
                    shared_with = owner[b]
            else:
                owner[b] = path
                chunks = chunk_count(nbytes, manifest.chunk_bytes)
        shape = node.get("shape")
        shape = list(shape) if isinstance(shape, list) else None
        dtype: str | None = None
        if t == "torch":
            dtype = str(node.get("dtype"))
            if "view" in node or "at" in node:
                # A view into a storage shared with other tensors, or a leaf packed with
                # others into one blob: its own elements only.
                own = _own_bytes(node)
                if own is not None:
                    nbytes = own
        elif t in ("numpy", "npscalar"):
            dtype = _dtype_name(node.get("dtype"))
            if "at" in node:  # packed with other arrays: its own elements only
                own = _own_bytes(node)
                if own is not None:
                    nbytes = own
            if t == "npscalar":
                shape = []
                hex_value = node.get("hex")
                nbytes = len(hex_value) // 2 if isinstance(hex_value, str) else 0
        elif t in ("bytes", "bytearray", "file"):
            shape = [nbytes]
        leaves.append(
            LeafInfo(
                path,
                t,
                dtype,
                shape,
                nbytes,
                chunks,
                blob,
                shared_with,
                _inline_value(node),
                packed_with,
            )
        )
    return leaves


# ---------------------------------------------------------------------------------------------
# the difference of two versions


def _leaf_nodes(manifest: Manifest) -> dict[str, Any]:
    return dict(iter_leaves(manifest.skeleton))


def _own_bytes(node: dict[str, Any]) -> int | None:
    """The bytes of a torch or numpy leaf's own elements (a view or a packed leaf takes fewer
    than its blob), or None where its dtype or shape is unknown."""
    shape = node.get("shape")
    if node.get("t") == "numpy":
        dtype = _numpy_dtype(node.get("dtype"))
        item = dtype.itemsize if dtype is not None else None
    else:
        item = _torch_itemsize(str(node.get("dtype")))
    if not isinstance(shape, list) or item is None:
        return None
    return int(np.prod(shape, dtype=np.int64)) * item


def packed_range(node: dict[str, Any], blob_bytes: int) -> tuple[int, int] | None:
    """The byte range a packed leaf takes in its blob, or None (not packed, or malformed)."""
    at, own = node.get("at"), _own_bytes(node)
    if type(at) is not int or own is None:
        return None
    return (at, at + own) if 0 <= at <= at + own <= blob_bytes else None


class _Packs:
    """Packs of small tensors read for ``diff`` (through the engine's reader: every chunk
    verified); the last few are kept, since a pack's tensors come one after the other (every
    tensor of a changed pack reads it once, not once per tensor)."""

    _KEEP = 8

    def __init__(self, store: Store) -> None:
        self.store = store
        self.kept: dict[tuple[int, int], bytes] = {}

    def span(self, part: ResolvedPart, b: int, span: tuple[int, int]) -> bytes:
        """The bytes ``span`` of blob ``b`` of ``part``."""
        key = (id(part), b)
        data = self.kept.get(key)
        if data is None:
            data = self.kept[key] = engine.read_blob(self.store, part, b)
            if len(self.kept) > self._KEEP:
                del self.kept[next(iter(self.kept))]
        return data[span[0] : span[1]]


def _packed_diff(
    packs: _Packs,
    path: str,
    new: tuple[ResolvedPart, int, tuple[int, int] | None],
    old: tuple[ResolvedPart, int, tuple[int, int] | None],
    comparable: bool,
) -> LeafChange | None:
    """The change of a packed leaf, or None (unchanged). ``new`` and ``old``: the version,
    the blob and the leaf's byte range in it; ``comparable``: the two nodes are alike (dtype,
    shape; the offset in the pack aside) and the chunk sizes the same. Where the chunks the
    leaf lies in differ (small leaves share chunks), or the leaf moved in its pack (a leaf
    before it came or went), the packs are read, verified, and the leaf's own bytes
    compared."""
    (vx, bx, rx), (vy, by, ry) = new, old
    if rx is None or ry is None or not comparable:
        size = 0 if rx is None else rx[1] - rx[0]
        return LeafChange(path, "changed", size)
    if rx != ry:
        if packs.span(vx, bx, rx) == packs.span(vy, by, ry):
            return None
        return LeafChange(path, "changed", rx[1] - rx[0])
    # One range, inside both blobs (packed_range): so are its chunks.
    cb = vx.manifest.chunk_bytes
    lo, hi = rx[0] // cb, -(-rx[1] // cb)
    if (vx.blobs[bx].hashes[lo:hi] != vy.blobs[by].hashes[lo:hi]).any():
        if packs.span(vx, bx, rx) == packs.span(vy, by, ry):
            return None
        return LeafChange(path, "changed", rx[1] - rx[0])
    return None


@dataclass(frozen=True, slots=True)
class LeafChange:
    """One leaf that differs between two versions: ``status`` is ``"added"``, ``"removed"``
    or ``"changed"``; ``changed_bytes`` None for an added or removed leaf; ``changed_chunks``
    of ``chunks`` where the leaf's chunks were compared one by one."""

    path: str
    status: str
    changed_bytes: int | None
    changed_chunks: int | None = None
    chunks: int | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "path": self.path,
            "status": self.status,
            "changed_bytes": self.changed_bytes,
        }
        if self.changed_chunks is not None:
            doc["changed_chunks"] = self.changed_chunks
            doc["chunks"] = self.chunks
        return doc


@dataclass(frozen=True, slots=True)
class VersionDiff:
    """What changed from step ``a`` to step ``b`` (rank ``rank``'s parts): the leaves that
    differ, in ``b``'s tree order then those only ``a`` has, and the bytes that changed out of
    ``b``'s ``logical_bytes``."""

    a: int
    b: int
    rank: int
    leaves: tuple[LeafChange, ...]
    changed_bytes: int
    logical_bytes: int


def diff_versions(store: Store, a: int, b: int, *, rank: int = 0) -> VersionDiff:
    """Per leaf: added, removed or changed between steps ``a`` and ``b``, with changed bytes.

    Compares chunk hashes from the two manifests (resolved through their chains): no data is
    read, and the changed bytes are those of the chunks whose content differs. A small tensor
    packed with others shares its chunk with them: where that chunk differs, it is read (from
    both versions, verified) to compare the leaf's own bytes.
    """
    old = engine.resolve_version(store, a, rank=rank)
    new = engine.resolve_version(store, b, rank=rank)
    return diff_parts(store, old, new, rank=rank)


def diff_parts(store: Store, old: ResolvedPart, new: ResolvedPart, *, rank: int = 0) -> VersionDiff:
    """:func:`diff_versions` of two parts already resolved (rank ``rank``'s of two versions
    of ``store``): what the lineage's ``changes`` and deltas start from."""
    a, b = old.step, new.step
    old_nodes, new_nodes = _leaf_nodes(old.manifest), _leaf_nodes(new.manifest)
    packs = _Packs(store)
    rows: list[LeafChange] = []
    for path, node in new_nodes.items():
        before = old_nodes.get(path)
        row = (
            LeafChange(path, "added", None)
            if before is None
            else _leaf_change(packs, path, (new, node), (old, before))
        )
        if row is not None:
            rows.append(row)
    rows.extend(LeafChange(p, "removed", None) for p in old_nodes if p not in new_nodes)
    changed = sum(r.changed_bytes or 0 for r in rows)
    return VersionDiff(a, b, rank, tuple(rows), changed, new.manifest.logical_bytes)


def _without_blob(node: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k != "b"}


def _without(node: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k not in keys}


def _leaf_change(
    packs: _Packs,
    path: str,
    new: tuple[ResolvedPart, dict[str, Any]],
    old: tuple[ResolvedPart, dict[str, Any]],
) -> LeafChange | None:
    """The change of a leaf present in both versions (``(part, node)`` each), or None."""
    (vx, node), (vy, before) = new, old
    meta_same = _without_blob(node) == _without_blob(before)
    blob_new, blob_old = node.get("b"), before.get("b")
    if blob_new is None or blob_old is None:
        return None if meta_same else LeafChange(path, "changed", 0)
    x, y = vx.blobs[blob_new], vy.blobs[blob_old]
    cb = vx.manifest.chunk_bytes
    if "at" in node or "at" in before:
        # A leaf packed with others: its own bytes, where it lies in both versions.
        alike = _without(node, "b", "at") == _without(before, "b", "at")
        return _packed_diff(
            packs,
            path,
            (vx, blob_new, packed_range(node, x.nbytes)),
            (vy, blob_old, packed_range(before, y.nbytes)),
            alike and vy.manifest.chunk_bytes == cb,
        )
    if x.nbytes != y.nbytes or vy.manifest.chunk_bytes != cb:
        return LeafChange(path, "changed", x.nbytes)
    differ = np.flatnonzero((x.hashes != y.hashes).any(axis=1))
    if differ.size == 0 and meta_same:
        return None
    sizes = np.minimum(cb, x.nbytes - differ.astype(np.int64) * cb)
    return LeafChange(path, "changed", int(sizes.sum()), int(differ.size), len(x.hashes))


# ---------------------------------------------------------------------------------------------
# the parts of a scratch level

# ``<scratch>/rank-<r>``: where rank r of a distributed run keeps its part (_run/open.py).
_RANK_DIR = re.compile(r"rank-(\d{5,})")


@dataclass(frozen=True, slots=True)
class ScratchPart:
    """A part of a run's scratch level as a reader finds it: the whole scratch of a world of
    one (``rank`` None), or rank ``rank``'s ``<scratch>/rank-<r>`` of a distributed run; each
    is a run of its own. ``store``: its devices seen as one, for reading."""

    rank: int | None
    store: Store

    @property
    def level(self) -> str:
        """The part's name in reports: ``scratch`` or ``scratch rank-00001``."""
        return "scratch" if self.rank is None else f"scratch rank-{self.rank:05d}"


def scratch_parts(tiers: Sequence[Device]) -> list[ScratchPart]:
    """The parts of the scratch level whose devices are ``tiers`` (as the Checkpointer was
    given them, fastest first) that this node holds: the level's own run, and the
    ``rank-<r>`` directories below it. Empty when it is empty (a wiped node-local disk); a
    local directory that does not exist, or one that holds something else, is a
    :class:`~cryosnap.CheckpointNotFoundError`. Reads listings and the devices'
    layout (``scratch-devices.json``), writes nothing."""
    locations = [t.path for t in tiers]
    first = open_store(locations[0])
    root = first.capabilities.local_path
    if root is not None and not root.is_dir():
        raise CheckpointNotFoundError(f"no scratch at {first.url}")
    parts = [ScratchPart(None, _part_store(locations, None))] if _holds_part(first) else []
    for name, rank in _rank_dirs(first):
        parts.append(ScratchPart(rank, _part_store(locations, name)))
    if not parts and first.list(""):
        raise CheckpointNotFoundError(
            f"{first.url} is not a run's scratch: it holds no versions/, {LAYOUT_KEY} or "
            "rank-<r>/ (give the scratch devices as the Checkpointer was given them, first device "
            "first)"
        )
    return parts


def _holds_part(store: Store) -> bool:
    return bool(store.list("versions")) or store.exists(LAYOUT_KEY)


def _rank_dirs(store: Store) -> list[tuple[str, int]]:
    """The ``rank-<r>`` directories just below ``store``, by rank."""
    root = store.capabilities.local_path
    if root is not None:
        names = {p.name for p in root.iterdir() if p.is_dir()}
    else:
        names = {key.split("/", 1)[0] for key in store.list("") if "/" in key}
    found = [(n, m) for n in names if (m := _RANK_DIR.fullmatch(n)) is not None]
    return sorted(((n, int(m.group(1))) for n, m in found), key=lambda x: x[1])


def _part_store(locations: Sequence[Any], sub: str | None) -> Store:
    """The devices of one part (``sub`` below each location) as one store. One location
    given: the devices its layout records (a striped level found from its first device)."""
    stores = [open_store(_below(loc, sub)) for loc in locations]
    recorded = _layout(stores[0])
    if recorded is None:
        if len(stores) > 1 and _holds_part(stores[0]):
            raise CheckpointFormatError(
                f"{stores[0].url} holds versions but no {LAYOUT_KEY}: it is not the first "
                "device of a scratch level (give the devices in the writer's order)"
            )
        return stores[0]
    if len(stores) == len(recorded) == 1:
        return stores[0]  # one device, nothing striped (wherever it was written)
    if len(stores) == 1 and recorded[0] == stores[0].url:
        stores += [open_store(url) for url in recorded[1:]]
    # The layout on the first device is there and (StripedStore checks) the same list: the
    # store only reads it, and a different list is a CheckpointError naming both.
    return StripedStore(stores, [None] * len(stores))


def _below(location: Any, sub: str | None) -> Any:
    if sub is None:
        return location
    if isinstance(location, Store):
        raise CheckpointError(
            f"scratch={location!r}: a distributed run's scratch is a path or URL (each rank's "
            "part is <scratch>/rank-<r>), not a Store"
        )
    return join_location(os.fspath(location), sub)


def _layout(store: Store) -> list[str] | None:
    """The devices the scratch part on ``store`` was written with (None: no layout)."""
    try:
        doc = json.loads(store.read(LAYOUT_KEY))
    except (CheckpointNotFoundError, ValueError):
        return None
    devices = doc.get("devices") if isinstance(doc, dict) else None
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        return None
    return devices or None
