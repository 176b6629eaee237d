"""The lineage of a run's versions, read through its Merkle trees: the history of one leaf or
subtree across versions (:func:`history`), the leaves that differ between two versions
(:func:`changes`), and what a delta between two versions holds (:func:`delta_parts`: the
changed leaves and each version's root per leaf, :class:`LeafRoot`, the same digest
:func:`value_root` computes of a leaf in memory).

Reads manifests (each chain resolved, every claim checked) and, of the data, only the chunks
of the leaves asked for, each verified; writes nothing. Imports torch only to build or hash a
torch leaf, never typer. The caller's thread; no collectives. docs/design/lineage.md has the
why.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap import engine
from cryosnap._format.chunks import hash_chunks, merkle_root
from cryosnap._format.manifest import Manifest
from cryosnap._format.skeleton import Json, dict_items, format_path, iter_leaves
from cryosnap._inspect import diff_parts, packed_range
from cryosnap._located import located
from cryosnap._state.flatten import dtype_name
from cryosnap._state.torch_import import loaded_torch
from cryosnap.engine import ResolvedPart
from cryosnap.errors import ExportError, KeyNotFoundError, PartNotFoundError
from cryosnap.storage import Store

__all__ = [
    "CHANGES_BATCH_BYTES",
    "DeltaParts",
    "LeafRoot",
    "changes",
    "delta_parts",
    "history",
    "leaf_keys",
    "value_root",
]

# ``changes`` reads the changed leaves in batches of about this many bytes of blobs, so that
# a large difference is never held in memory at once.
CHANGES_BATCH_BYTES = 256 << 20

Key = str | int


# ---------------------------------------------------------------------------------------------
# the root of one leaf


@dataclass(frozen=True, slots=True)
class LeafRoot:
    """What a delta records of one leaf of a version: its ``kind`` (``torch``, ``numpy``,
    ``npscalar``, ``bytes``, ``bytearray``, ``size`` or a Python scalar's: ``int``,
    ``float``, ``bool``, ``complex``, ``str``, ``none``), ``dtype`` (a torch dtype's name, a
    numpy descr: a string, or the JSON text of a record's), ``shape``, and ``root``: the hex
    Merkle root of its bytes cut in the version's chunks and hashed as the format hashes
    them (xxh3-128). The bytes are a tensor's or array's elements in C order, a numpy
    scalar's, a bytes leaf's; a Python scalar's are a fixed encoding (an int in hex, a float's
    or complex's IEEE bits, a str in UTF-8). For a leaf saved in a blob of its own the root is
    the blob's Merkle root, read from the manifest: no data is read for it."""

    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    root: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "root": self.root,
        }

    def describe(self) -> str:
        """The kind, dtype and shape, for a message."""
        what = self.kind if self.dtype is None else f"{self.kind} {self.dtype}"
        return what if self.shape is None else f"{what} {list(self.shape)}"


def value_root(value: Any, chunk_bytes: int) -> LeafRoot | None:
    """The :class:`LeafRoot` of a leaf in memory (a tensor on any device, an array, a scalar),
    its bytes cut in ``chunk_bytes`` chunks; None for a value no delta holds (a file, a
    pickled object, a tensor that is not dense)."""
    found = _leaf_bytes(value)
    if found is None:
        return None
    kind, dtype, shape, data = found
    root = merkle_root(hash_chunks(data, chunk_bytes))
    return LeafRoot(kind, dtype, shape, root.hex())


_SCALAR_KINDS = {bool: "bool", int: "int", float: "float", complex: "complex", str: "str"}


def _leaf_bytes(value: Any) -> tuple[str, str | None, tuple[int, ...] | None, memoryview] | None:
    """``(kind, dtype, shape, bytes)`` of a leaf, as :class:`LeafRoot` describes them."""
    tp = type(value)
    if tp is np.ndarray:
        if value.dtype.hasobject:
            return None
        flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        return "numpy", _descr_text(value.dtype), tuple(value.shape), flat.data
    if isinstance(value, np.generic):
        if value.dtype.hasobject:
            return None
        return "npscalar", _descr_text(value.dtype), (), memoryview(value.tobytes())
    if tp in (bytes, bytearray):
        return tp.__name__, None, (len(value),), memoryview(bytes(value))
    if value is None:
        return "none", None, None, memoryview(b"")
    if tp in _SCALAR_KINDS:
        return _SCALAR_KINDS[tp], None, None, memoryview(_scalar_bytes(value))
    torch = loaded_torch()
    if torch is None:
        return None
    if tp is torch.Size:
        return "size", None, tuple(value), memoryview(b"")
    if tp in (torch.Tensor, torch.nn.Parameter):
        return _tensor_bytes(value, torch)
    return None


def _scalar_bytes(value: Any) -> bytes:
    if type(value) is bool:
        return b"\x01" if value else b"\x00"
    if type(value) is int:
        return hex(value).encode()
    if type(value) is float:
        return struct.pack("<d", value)
    if type(value) is complex:
        return struct.pack("<dd", value.real, value.imag)
    return str(value).encode("utf-8", "surrogatepass")


def _tensor_bytes(
    t: Any, torch: Any
) -> tuple[str, str | None, tuple[int, ...] | None, memoryview] | None:
    if t.layout != torch.strided or t.is_quantized or t.is_meta:
        return None
    x = t.detach()
    if x.is_complex():
        x = x.resolve_conj()
    x = x.resolve_neg().to("cpu").contiguous()
    flat = x.reshape(-1).view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)
    return "torch", dtype_name(t.dtype), tuple(t.shape), flat.numpy().data


def _descr_text(dtype: np.dtype[Any]) -> str:
    descr: Any = np.lib.format.dtype_to_descr(dtype)
    return descr if isinstance(descr, str) else json.dumps(descr)


def _node_dtype_text(node: dict[str, Any]) -> str | None:
    """A saved node's dtype as :class:`LeafRoot` writes it (``_descr_text`` of a numpy one)."""
    dtype = node.get("dtype")
    if node.get("t") == "torch":
        return str(dtype)
    return dtype if isinstance(dtype, str) else json.dumps(dtype)


def _stored_root(part: ResolvedPart, node: dict[str, Any]) -> LeafRoot | None:
    """The root of a leaf whose blob holds its bytes and nothing else (a tensor or array
    stored alone in C order, a bytes leaf), from the chunk hashes the part resolved to (the
    ones every read of it is verified against); None where the leaf's bytes must be read."""
    t, b = node.get("t"), node.get("b")
    if type(b) is not int or not 0 <= b < len(part.blobs):
        return None
    if any(k in node for k in ("at", "view", "order", "dtensor")):
        return None
    blob = part.blobs[b]
    root = merkle_root(blob.hashes.tobytes()).hex()
    if t in ("bytes", "bytearray"):
        return LeafRoot(str(t), None, (blob.nbytes,), root)
    if t not in ("torch", "numpy"):
        return None
    shape = node.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        return None
    return LeafRoot(str(t), _node_dtype_text(node), tuple(shape), root)


# ---------------------------------------------------------------------------------------------
# one version's leaves


@dataclass(slots=True)
class _Version:
    """One rank's part of a version, resolved with every claim of its chain checked."""

    step: int
    manifest: Manifest
    part: ResolvedPart
    where: str


def _resolved(store: Store, step: int, rank: int) -> _Version:
    with located(step=step, path=store.url):
        record = engine.read_commit(store, step)
        if rank >= record.world_size:
            raise PartNotFoundError(
                f"step {step} in {store.url} was saved by {record.world_size} rank(s): "
                f"rank {rank} has no part of it",
                step=step,
                path=store.url,
            )
        manifest, part, _keys, where = engine.resolve_part(store, record, rank)
    return _Version(step, manifest, part, where)


def _read_nodes(
    store: Store, version: _Version, nodes: Sequence[Json], *, allow_pickle: bool
) -> list[Any]:
    """The values of ``nodes`` (leaf nodes of ``version``'s skeleton), their blobs only read
    and verified."""
    if not nodes:
        return []
    skeleton, index = engine.renumbered({"t": "list", "v": list(nodes)}, len(version.part.blobs))
    part = engine.cut_part(version.part, index)
    values: list[Any] = engine.read_selection(store, part, skeleton, allow_pickle=allow_pickle)
    return values


def leaf_keys(skeleton: Json) -> dict[str, tuple[tuple[Key, ...], tuple[str, ...]]]:
    """Per leaf path of ``skeleton``: its keys from the root, and the kind of each container
    on the way (``dict``, ``odict``, ``list``, ``tuple``; a stateful node is its state dict)."""
    out: dict[str, tuple[tuple[Key, ...], tuple[str, ...]]] = {}
    stack: list[tuple[Json, tuple[Key, ...], tuple[str, ...]]] = [(skeleton, (), ())]
    while stack:
        node, keys, kinds = stack.pop()
        while isinstance(node, dict) and node.get("t") == "stateful":
            node = node.get("v")
        t = node.get("t") if isinstance(node, dict) else None
        if t in ("dict", "odict"):
            items = dict_items(node, "/".join(map(str, keys)))
            stack.extend((v, (*keys, k), (*kinds, str(t))) for k, v in reversed(items))
        elif t in ("list", "tuple") and isinstance(node.get("v"), list):
            vals = list(enumerate(node["v"]))
            stack.extend((v, (*keys, i), (*kinds, str(t))) for i, v in reversed(vals))
        else:
            out.setdefault(format_path(keys), (keys, kinds))
    return out


# ---------------------------------------------------------------------------------------------
# the history of a leaf


def history(
    store: Store,
    leaf: str,
    steps: Sequence[int] | None,
    *,
    rank: int = 0,
    allow_pickle: bool = False,
) -> Iterator[tuple[int, Any]]:
    """``(step, value)`` of the node at ``leaf`` in each of ``steps`` (None: every version
    that holds it), ascending; see :meth:`cryosnap.Run.history`. The manifests are read
    first (a missing leaf, a change of shape or dtype are known before any data is read);
    the returned iterator then reads each distinct content of the leaf once."""
    held = _held_steps(store, leaf, steps, rank)
    return _history_values(store, leaf, held, rank, allow_pickle)


def _held_steps(store: Store, leaf: str, steps: Sequence[int] | None, rank: int) -> list[int]:
    """The steps whose version holds ``leaf``: each of ``steps`` must (KeyNotFoundError);
    with ``steps`` None, those of the run's versions that do, at least one. Warns once when
    the kind, dtype or shape of a leaf below ``leaf`` changes, naming the steps."""
    asked = engine.list_steps(store) if steps is None else list(steps)
    held: list[int] = []
    changed: list[int] = []
    last: list[Any] | None = None
    missing: tuple[int, Any, str] | None = None
    for step in asked:
        with located(step=step, path=store.url):
            record = engine.read_commit(store, step)
            if rank >= record.world_size:
                raise PartNotFoundError(
                    f"step {step} in {store.url} was saved by {record.world_size} rank(s): "
                    f"rank {rank} has no part of it"
                )
            manifest, ref = engine.read_manifest(store, record, rank)
            where = f"step {step}, tier {store.url}: {ref.key}"
            node = engine.find_subtree(manifest.skeleton, leaf, where)
        if node is None:
            missing = (step, manifest.skeleton, where)
            if steps is not None:
                break
            continue
        meta = [(p, n.get("t"), n.get("dtype"), n.get("shape")) for p, n in iter_leaves(node)]
        if last is not None and meta != last:
            changed.append(step)
        last = meta
        held.append(step)
    if missing is not None and (steps is not None or not held):
        step, skeleton, where = missing
        raise _no_leaf(store, leaf, step, skeleton, any_version=steps is None)
    if changed:
        warnings.warn(
            f"cryosnap: the history of {leaf!r} in {store.url} changes kind, dtype or shape "
            f"at step(s) {', '.join(map(str, changed))}: each version's value is yielded as it "
            "holds it",
            UserWarning,
            stacklevel=engine.caller_stacklevel(),
        )
    return held


def _no_leaf(
    store: Store, leaf: str, step: int, skeleton: Json, *, any_version: bool
) -> KeyNotFoundError:
    near = engine.closest_paths(skeleton, leaf)
    where = "no version of" if any_version else f"step {step} of"
    return KeyNotFoundError(
        f"{where} {store.url} holds the leaf path {leaf!r:.200}"
        + (f" (step {step}, the newest, has none)" if any_version else "")
        + f"; closest paths: {', '.join(repr(p) for p in near) or 'none (no leaves)'} "
        "(paths as `cryosnap inspect` prints them)",
        step=step,
        path=store.url,
    )


def _history_values(
    store: Store, leaf: str, held: list[int], rank: int, allow_pickle: bool
) -> Iterator[tuple[int, Any]]:
    last_sig: Any = None
    value: Any = None
    for step in held:
        version = _resolved(store, step, rank)
        with located(step=step, path=store.url):
            node = engine.find_subtree(version.manifest.skeleton, leaf, version.where)
            if node is None:  # a version cannot change: only its own damage gets here
                raise _no_leaf(store, leaf, step, version.manifest.skeleton, any_version=False)
            sig = _signature(node, version.part, version.manifest.chunk_bytes)
            if sig != last_sig:
                skeleton, index = engine.renumbered(node, len(version.part.blobs))
                part = engine.cut_part(version.part, index)
                value = engine.read_selection(store, part, skeleton, allow_pickle=allow_pickle)
                last_sig = sig
        yield step, value


def _signature(node: Json, part: ResolvedPart, chunk_bytes: int) -> tuple[Any, ...]:
    """What the value built from ``node`` depends on: its structure, each leaf's node (but
    its blob's number) and the hashes of the chunks its bytes lie in (of a packed leaf,
    those of its own bytes' range in the pack). Equal signatures build equal values."""
    leaves = []
    for path, leaf in iter_leaves(node):
        meta = json.dumps(
            {k: v for k, v in leaf.items() if k != "b"}, sort_keys=True, default=_plain
        )
        hashes = b""
        b = leaf.get("b")
        if type(b) is int and 0 <= b < len(part.blobs):
            blob = part.blobs[b]
            span = packed_range(leaf, blob.nbytes) if "at" in leaf else None
            if span is not None:
                lo, hi = span[0] // chunk_bytes, -(-span[1] // chunk_bytes)
                hashes = blob.hashes[lo:hi].tobytes()
            else:
                hashes = blob.hashes.tobytes() + blob.nbytes.to_bytes(8, "little")
        leaves.append((path, meta, hashes))
    return (chunk_bytes, _structure(node), leaves)


def _plain(value: Any) -> Any:
    """A numpy value in a node, as JSON holds it."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} in a skeleton node")


def _structure(node: Json) -> Any:
    """The containers of ``node`` (kinds and keys), its leaves left out."""
    if not isinstance(node, dict):
        return None
    t = node.get("t")
    if t == "stateful":
        return ["stateful", _structure(node.get("v"))]
    if t in ("dict", "odict"):
        return [t, node.get("k"), [_structure(v) for _k, v in dict_items(node, "")]]
    if t in ("list", "tuple") and isinstance(node.get("v"), list):
        return [t, [_structure(v) for v in node["v"]]]
    return None


# ---------------------------------------------------------------------------------------------
# the leaves that changed between two versions


def changes(
    store: Store,
    a: int,
    b: int,
    *,
    rank: int = 0,
    allow_pickle: bool = False,
    batch_bytes: int = CHANGES_BATCH_BYTES,
) -> Iterator[tuple[str, Any]]:
    """``(path, value in b)`` of every leaf of ``b`` added or changed since ``a``, in ``b``'s
    tree order; see :meth:`cryosnap.Run.changes`. Both versions are resolved and compared
    (:func:`cryosnap._inspect.diff_parts`) before the iterator is returned; it reads the
    leaves in batches of about ``batch_bytes`` of blobs."""
    old, new = _resolved(store, a, rank), _resolved(store, b, rank)
    diff = diff_parts(store, old.part, new.part, rank=rank)
    paths = [row.path for row in diff.leaves if row.status != "removed"]
    return _changed_values(store, new, paths, allow_pickle, batch_bytes)


def _changed_values(
    store: Store, new: _Version, paths: list[str], allow_pickle: bool, batch_bytes: int
) -> Iterator[tuple[str, Any]]:
    nodes = dict(iter_leaves(new.manifest.skeleton))
    batch: list[str] = []
    blobs: set[int] = set()
    size = 0
    for i, path in enumerate(paths):
        b = nodes[path].get("b")
        if type(b) is int and 0 <= b < len(new.part.blobs) and b not in blobs:
            blobs.add(b)
            size += new.part.blobs[b].nbytes
        batch.append(path)
        if size < batch_bytes and i + 1 < len(paths):
            continue
        values = _read_nodes(store, new, [nodes[p] for p in batch], allow_pickle=allow_pickle)
        yield from zip(batch, values, strict=True)
        batch, blobs, size = [], set(), 0


# ---------------------------------------------------------------------------------------------
# what a delta between two versions holds


@dataclass(frozen=True, slots=True)
class DeltaParts:
    """What a delta from step ``a`` to step ``b`` (rank ``rank``'s parts) holds: per version
    its chunk size and the :class:`LeafRoot` of each of its leaves (tree order); ``values``
    the leaves of ``b`` added or changed since ``a`` (``b``'s tree order), with their nodes
    in ``b``'s skeleton and their keys from the root (:func:`leaf_keys`); ``removed`` the
    paths of ``a``'s leaves that ``b`` lacks."""

    a: int
    b: int
    rank: int
    chunk_bytes: tuple[int, int]
    roots: tuple[dict[str, LeafRoot], dict[str, LeafRoot]]
    values: list[tuple[str, Any]]
    nodes: dict[str, Json]
    keys: dict[str, tuple[tuple[Key, ...], tuple[str, ...]]]
    removed: tuple[str, ...]


def delta_parts(store: Store, a: int, b: int, *, rank: int = 0) -> DeltaParts:
    """The :class:`DeltaParts` of steps ``a`` and ``b``. Reads, every chunk verified, the
    leaves of ``b`` that changed, and of the others only those whose bytes share a blob (the
    packs of small tensors, tensors sharing a storage, arrays stored in Fortran order): the
    roots of the rest are their blobs' Merkle roots. A leaf unchanged from ``a`` to ``b``
    has one root, taken from ``b``. A version holding a file, pickled or DTensor leaf is
    refused (ExportError): a delta holds tensors, arrays and scalars."""
    old, new = _resolved(store, a, rank), _resolved(store, b, rank)
    diff = diff_parts(store, old.part, new.part, rank=rank)
    changed = [row.path for row in diff.leaves if row.status != "removed"]
    removed = tuple(row.path for row in diff.leaves if row.status == "removed")
    nodes_a = _unique_leaves(store, old)
    nodes_b = _unique_leaves(store, new)
    _refuse_unsupported(store, old, nodes_a)
    _refuse_unsupported(store, new, nodes_b)
    roots_b, values = _roots(store, new, nodes_b, want=set(changed), known={})
    unchanged = set(nodes_a).intersection(nodes_b).difference(changed)
    known = {path: roots_b[path] for path in unchanged}
    roots_a, _ = _roots(store, old, nodes_a, want=set(), known=known)
    keys = leaf_keys(new.manifest.skeleton)
    return DeltaParts(
        a,
        b,
        rank,
        (old.manifest.chunk_bytes, new.manifest.chunk_bytes),
        (roots_a, roots_b),
        [(path, values[path]) for path in changed],
        {path: nodes_b[path] for path in changed},
        {path: keys[path] for path in changed},
        removed,
    )


def _unique_leaves(store: Store, version: _Version) -> dict[str, Json]:
    """The leaves of ``version`` by path; two of one path (a key holding ``/``, int and str
    keys printed alike) are refused: a delta names its leaves by path."""
    nodes: dict[str, Json] = {}
    for path, node in iter_leaves(version.manifest.skeleton):
        if path in nodes:
            raise ExportError(
                f"step {version.step} of {store.url}: two leaves have the path {path!r:.120} "
                "(a key holds '/', or int and str keys print alike): a delta cannot name both",
                step=version.step,
                path=store.url,
            )
        nodes[path] = node
    return nodes


def _refuse_unsupported(store: Store, version: _Version, nodes: dict[str, Json]) -> None:
    for path, node in nodes.items():
        t = node.get("t")
        if t in ("file", "pickle") or "dtensor" in node:
            what = "a DTensor" if "dtensor" in node else f"a {t} leaf"
            raise ExportError(
                f"step {version.step} of {store.url}: leaf {path} is {what}, which a delta "
                "cannot hold (tensors, arrays and scalars only); export the whole version",
                step=version.step,
                path=store.url,
            )


def _roots(
    store: Store,
    version: _Version,
    nodes: dict[str, Json],
    *,
    want: set[str],
    known: dict[str, LeafRoot],
) -> tuple[dict[str, LeafRoot], dict[str, Any]]:
    """The root of each leaf of ``version`` (``nodes``, tree order): ``known`` ones as given,
    stored ones from their blobs, the others from their values, read; and the values of the
    leaves in ``want``, read."""
    roots: dict[str, LeafRoot | None] = {}
    read: list[str] = []
    for path, node in nodes.items():
        root = known.get(path) or _stored_root(version.part, node)
        roots[path] = root
        if root is None or path in want:
            read.append(path)
    values = dict(
        zip(
            read,
            _read_nodes(store, version, [nodes[p] for p in read], allow_pickle=False),
            strict=True,
        )
    )
    cb = version.manifest.chunk_bytes
    out: dict[str, LeafRoot] = {}
    for path, root in roots.items():
        if root is None:
            root = value_root(values[path], cb)
            if root is None:  # refused above; a node of another kind is malformed
                raise ExportError(
                    f"step {version.step} of {store.url}: leaf {path} cannot be in a delta",
                    step=version.step,
                    path=store.url,
                )
        out[path] = root
    return out, {path: values[path] for path in want}
