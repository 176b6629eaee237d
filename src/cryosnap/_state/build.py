"""Build a state back from its skeleton and blobs (:class:`Restorer`): allocate empty leaves,
hand out a byte view per blob for the reader to fill, then assemble the tree.

The walk of the skeleton is here, with the leaves of a blob of their own and the hand-off of
torch leaves to a device. Its other routes have modules of their own: packs.py (packed leaves),
restore_columns.py (state dicts in columns, in bulk); the geometry every route checks is in
geometry.py, the dtypes in dtypes.py, the ledger of blobs in claims.py. A fast route may only
accept what the walk leaf by leaf accepts, and leaves the rest, errors included, to that walk
(tests/unit/state/test_routes_differential.py compares the two).

Pure (``to_device`` aside, a copy to a GPU); runs on the caller's thread.
"""

from __future__ import annotations

import math
import pickle
import struct
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from cryosnap._format.skeleton import Json, _key_text, dict_items, dict_keys, format_path
from cryosnap._state.claims import MAX_ALIGN, BlobClaims, Place
from cryosnap._state.device import copy_to_device
from cryosnap._state.dtypes import (
    ITEMSIZE,
    NUMPY_DTYPES,
    TORCH_DTYPES,
    as_leaf,
    byte_view,
    itemsize,
    np_dtype,
    require_torch,
    torch_dtype,
)
from cryosnap._state.files import loaded_file, saved_file_path
from cryosnap._state.geometry import (
    Geometry,
    checked_shape,
    checked_view,
    expect_bytes,
    small_elements,
    view_of,
)
from cryosnap._state.packs import Packs
from cryosnap._state.restore_columns import ColumnNodes
from cryosnap.errors import CheckpointError, CheckpointFormatError

__all__ = ["DeviceMove", "Place", "Restorer"]

# Every torch leaf of a restore: its node, its blob and, for a view of a shared storage, its
# geometry in that storage.
_Tensors = list[tuple[dict[str, Any], int, "Geometry | None"]]


def _refuse(node: Any, path: str = "") -> bool:
    """The fast routes of a restore made with ``fast_routes=False``: none taken."""
    return False


class Restorer:
    """Rebuilds a tree from its skeleton, with leaves filled from blob bytes.

    ``allocate()`` creates every tensor/array empty and returns, per blob, a writable flat byte
    view of the memory its bytes go to. Fill them, then ``build()`` returns the tree.

    ``allocate(targets)`` (from :func:`direct_targets`) allocates nothing for those leaves: the
    view of such a blob is the memory of ``into=``'s own tensor or array (``direct[b]`` is
    True), which the built tree holds, so :func:`apply_into` has nothing to copy for it.

    A packed leaf among ``targets`` gets no tensor either: :meth:`fill_packs` copies its bytes
    from the verified pack into ``into=``'s tensor (in :func:`apply_into`'s ``fill_direct``).

    ``allocate(place=...)`` allocates nothing for the tensors and arrays whose bytes already
    lie in memory: ``place(blob, alignment)`` returns that memory (a view of a mapped data
    file, engine/fetch/_mapped.py) when its address is a multiple of ``alignment``, or None; the
    leaf is built over it (``placed[b]`` is True) and the reader only verifies it there.

    ``fast_routes=False`` takes every leaf through the walk leaf by leaf: the reference the
    fast routes (a state dict's plain tensors and small arrays, state dicts in columns) are
    tested against.
    """

    def __init__(
        self,
        skeleton: Json,
        blob_sizes: list[int],
        *,
        allow_pickle: bool,
        fast_routes: bool = True,
    ) -> None:
        self.skeleton = skeleton
        self.blob_sizes = blob_sizes
        self.allow_pickle = allow_pickle
        self._fast = fast_routes
        self._claims = claims = BlobClaims(blob_sizes)
        # What the plain-tensor route reads of each leaf, one attribute away.
        self._dest, self._paths = claims.dest, claims.paths
        self._values: dict[int, Any] = {}  # each leaf (a list per dict node in columns), by id
        self._items: dict[int, list[tuple[str | int, Json]]] = {}  # each dict node's, decoded
        self._targets: Mapping[int, Any] = {}
        self._packs = Packs(claims, self._values)
        self._ends, self._fills = self._packs.ends, self._packs.fills
        self._columns = ColumnNodes(claims, self._packs, self._values)
        self._tensors: _Tensors = []
        self.moved = False  # whether install() put the leaves on a device

    @property
    def blob_paths(self) -> list[str]:
        """Each blob's leaf path, as messages name it (a pack's says how many more it holds)."""
        return self._claims.paths

    @property
    def direct(self) -> list[bool]:
        """Whether each blob is read straight into ``into=``'s own memory."""
        return self._claims.direct

    @property
    def placed(self) -> list[bool]:
        """Whether each blob's leaf was built over the memory ``place`` gave for it."""
        return self._claims.placed

    # phase 1 -------------------------------------------------------------------------------
    def allocate(
        self, targets: Mapping[int, Any] | None = None, place: Place | None = None
    ) -> list[memoryview]:
        self._targets = self._packs.targets = targets or {}
        self._claims.place = place
        try:
            self._alloc(self.skeleton, "")
        finally:
            self._claims.place = None
        if self._packs.ends:  # what a message about a damaged pack names
            self._packs.name(self._tensors)
        return self._claims.views()

    def _alloc(self, node: Json, where: str) -> None:
        """Allocate the leaves under ``node``, at ``where`` (its path as format_path writes it,
        built key by key on the way down; the root's is empty)."""
        if not isinstance(node, dict):
            raise CheckpointFormatError(f"leaf {where or '<root>'}: malformed node {node!r:.80}")
        t = node.get("t")
        if t in ("dict", "odict"):
            self._alloc_dict(node, where)
        elif t in ("list", "tuple"):
            vals = node.get("v")
            if not isinstance(vals, list):
                raise CheckpointFormatError(f"{where or '<root>'}: malformed {t} node")
            for i, v in enumerate(vals):
                self._alloc(v, f"{where}/{i}" if where else str(i))
        elif t == "stateful":
            self._alloc(node.get("v"), where)
        elif t == "torch":
            self._alloc_tensor(node, where or "<root>")
        elif t == "numpy":
            self._alloc_array(node, where or "<root>")
        elif t in ("bytes", "bytearray", "pickle", "file"):
            self._alloc_buffer(node, t, where or "<root>")
        elif t not in ("none", "bool", "int", "float", "complex", "str", "npscalar", "size"):
            raise CheckpointFormatError(f"leaf {where or '<root>'}: unknown node type {t!r}")

    def _alloc_dict(self, node: dict[str, Any], where: str) -> None:
        """A dict node: in columns, in bulk where that route takes it; else each leaf by the
        fast route that takes it, or the walk."""
        if "cols" in node and self._fast and self._columns.allocate(node, where):
            return
        items = self._items[id(node)] = dict_items(node, where or "<root>")
        prefix = f"{where}/" if where else ""
        fast, array = (
            (self._try_plain_tensor, self._packs.try_array) if self._fast else (_refuse, _refuse)
        )
        for k, v in items:
            path = prefix + (k if type(k) is str else _key_text(k))
            if not fast(v, path) and not array(v):
                self._alloc(v, path)

    def _alloc_array(self, node: dict[str, Any], path: str) -> None:
        """A numpy leaf: packed (:meth:`Packs.array`), or ``into=``'s, mapped, or fresh."""
        dtype, shape = np_dtype(node.get("dtype"), path), checked_shape(node, path)
        order: Literal["C", "F"] = "F" if node.get("order") == "F" else "C"
        claims = self._claims
        b = claims.blob(node, path)
        if "at" in node:
            self._values[id(node)] = self._packs.array(node, b, dtype, shape, order, path)
            return
        expect_bytes(shape, dtype.itemsize, self.blob_sizes[b], path)
        target = self._targets.get(id(node))
        if target is not None:  # into='s own C-contiguous array (direct_targets)
            claims.claim(b, target.reshape(-1).view(np.uint8).data, path)
            claims.direct[b] = True
            self._values[id(node)] = target
            return
        placed = claims.mapped(b, dtype.alignment)
        if placed is not None:
            # The blob holds the array's elements in its order: C, or F (the transpose's C).
            if order == "F":
                arr = np.frombuffer(placed, dtype=dtype).reshape(shape[::-1]).T
            else:
                arr = np.frombuffer(placed, dtype=dtype).reshape(shape)
            claims.claim(b, placed, path)
            self._values[id(node)] = arr
            return
        arr = np.empty(shape, dtype=dtype, order=order)
        flat = arr.T.reshape(-1) if order == "F" else arr.reshape(-1)
        claims.claim(b, flat.view(np.uint8).data if flat.size else memoryview(bytearray()), path)
        self._values[id(node)] = arr

    def _alloc_buffer(self, node: dict[str, Any], t: str, path: str) -> None:
        """A leaf of bytes (``bytes``, ``bytearray``, ``pickle``) or a saved ``file``."""
        if t == "pickle" and not self.allow_pickle:
            # Not damage: the version is fine, the caller has to opt in.
            raise CheckpointError(
                f"leaf {path} is pickled; loading it could run code from the checkpoint, "
                "so it needs allow_pickle=True"
            )
        b = self._claims.blob(node, path)
        saved = saved_file_path(node, self.blob_sizes[b], path) if t == "file" else None
        buf = bytearray(self.blob_sizes[b])
        self._claims.claim(b, memoryview(buf), path)
        self._values[id(node)] = buf if saved is None else loaded_file(saved, buf)

    def _try_plain_tensor(self, node: Any, path: str) -> bool:
        """Allocate ``node`` if it is the most common leaf of a state dict (a plain CPU tensor
        of a known dtype and up to two dimensions, not a view, not filled in place; or packed,
        in a pack an earlier leaf claimed), as :meth:`_alloc_tensor` would; False (nothing done)
        for anything else, which :meth:`_alloc` then takes, errors included."""
        if type(node) is not dict or node.get("t") != "torch" or "view" in node:
            return False
        name = node.get("dtype")
        dtype = TORCH_DTYPES.get(name) if type(name) is str else None
        shape = node.get("shape")
        b = node.get("b")
        dest = self._dest
        if dtype is None or type(shape) is not list or type(b) is not int or not 0 <= b < len(dest):
            return False
        at = node.get("at")
        if at is None:
            if dest[b] is not None or "at" in node:  # claimed, or "at": null (malformed)
                return False
        elif type(at) is not int or at < self._ends.get(b, _NO_PACK):
            return False  # not packed here yet (the first leaf), or over the leaf before it
        n = len(shape)
        count = small_elements(shape) if n else -1
        if count < 0:
            return False
        item = ITEMSIZE.get(dtype)
        target = self._targets.get(id(node)) if self._targets else None
        if item is None or (target is not None and at is None):
            return False
        # A dtype in TORCH_DTYPES was found in torch: it is imported.
        torch = sys.modules["torch"]
        nbytes = count * item
        if at is not None:  # packed (as Packs.tensor makes it)
            # geometry.in_pack (at >= 0: it is past the pack's first leaf), inline: a call per
            # leaf cost 60-110 ns against ~1.5 us for the whole leaf, some 5% of allocate() for
            # 20,000 leaves; test_routes_differential.py holds the two to the same answers.
            if not nbytes or at % item or at + nbytes > self.blob_sizes[b]:
                return False
            self._ends[b] = at + nbytes
            if target is not None:  # filled by fill_packs, no tensor made for it
                self._fills[b].append((at, nbytes, target))
                self._values[id(node)] = target
                return True
            t = torch.frombuffer(dest[b][at : at + nbytes], dtype=dtype)
            if n == 2:
                t = t.view(shape)
        elif nbytes != self.blob_sizes[b]:
            return False
        elif (placed := self._claims.mapped(b, item)) is not None:
            t = torch.frombuffer(placed, dtype=dtype)  # one dimension: the shape already
            if n == 2:
                t = t.view(shape)
            dest[b] = placed
        else:
            t = torch.empty(shape, dtype=dtype)
            numpy_view = dtype in NUMPY_DTYPES and count
            dest[b] = memoryview(t.numpy()).cast("B") if numpy_view else byte_view(t)
        if at is None and not self._paths[b]:  # as BlobClaims.name, without a call per leaf
            self._paths[b] = path
        self._tensors.append((node, b, None))
        self._values[id(node)] = as_leaf(t, node, path) if "param" in node or "grad" in node else t
        return True

    def _alloc_tensor(self, node: dict[str, Any], path: str) -> None:
        """A torch leaf, every field checked: packed (:meth:`Packs.tensor`), of a blob of its
        own, or a view of a shared storage."""
        name = node.get("dtype")
        dtype = TORCH_DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            dtype = torch_dtype(name, path)
        shape = checked_shape(node, path)
        b = self._claims.blob(node, path)
        view = node.get("view")
        item = itemsize(dtype)
        if "at" in node:
            if view is not None:
                raise CheckpointFormatError(f"leaf {path}: both packed and a view")
            t = self._packs.tensor(node, b, dtype, item, shape, path)
            if id(node) not in self._targets:
                self._tensors.append((node, b, None))
                t = as_leaf(t, node, path) if "param" in node or "grad" in node else t
            self._values[id(node)] = t
        elif view is None:
            self._own_tensor(node, b, dtype, item, shape, path)
        else:
            geometry = checked_view(view, shape, item, self.blob_sizes[b], path)
            self._view_tensor(node, b, dtype, geometry, path)

    def _own_tensor(
        self, node: dict[str, Any], b: int, dtype: Any, item: int, shape: tuple[int, ...], path: str
    ) -> None:
        """A tensor of a blob of its own: ``into=``'s, over its mapped blob, or fresh."""
        if math.prod(shape) * item != self.blob_sizes[b]:
            expect_bytes(shape, item, self.blob_sizes[b], path)
        claims = self._claims
        target = self._targets.get(id(node))
        if target is not None:  # into='s own contiguous CPU tensor (direct_targets)
            claims.claim(b, byte_view(target.detach()), path)
            claims.direct[b] = True
            self._values[id(node)] = target
            return
        if claims.dest[b] is not None:
            raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
        torch = require_torch()
        placed = claims.mapped(b, item)
        if placed is not None:
            t = torch.frombuffer(placed, dtype=dtype).view(shape)
            claims.dest[b] = placed
        else:
            t = torch.empty(shape, dtype=dtype)
            claims.dest[b] = byte_view(t)
        self._tensors.append((node, b, None))
        self._values[id(node)] = as_leaf(t, node, path) if "param" in node or "grad" in node else t

    def _view_tensor(
        self, node: dict[str, Any], b: int, dtype: Any, geometry: Geometry, path: str
    ) -> None:
        """A view of the storage of blob ``b``, shared by the views of any dtypes over it."""
        if self._dest[b] is None:
            # A storage shared by views of any dtypes: placed only if aligned for all.
            torch = require_torch()
            placed = self._claims.mapped(b, MAX_ALIGN)
            if placed is not None:
                base = torch.frombuffer(placed, dtype=torch.uint8)
                self._claims.claim(b, placed, path)
            else:
                base = torch.empty(self.blob_sizes[b], dtype=torch.uint8)
                self._claims.claim(b, memoryview(base.numpy()), path)
            self._values[-b - 1] = base  # keep the shared storage for its views
        elif -b - 1 not in self._values:  # claimed by a leaf of its own, or a pack
            raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
        try:
            t = view_of(self._values[-b - 1], dtype, geometry)
        except RuntimeError as exc:
            raise CheckpointFormatError(
                f"leaf {path}: malformed view {node.get('view')!r:.80}"
            ) from exc
        self._tensors.append((node, b, geometry))
        self._values[id(node)] = as_leaf(t, node, path)

    def fill_packs(self) -> None:
        """Copy the packed leaves ``allocate(targets)`` noted from their verified packs into
        ``into=``'s tensors (what :func:`direct_targets` picks): :meth:`Packs.fill`."""
        self._packs.fill()

    def to_device(self, device: Any) -> None:
        """Move every torch leaf to ``device`` (a ``torch.device``), once the blobs are filled
        and before :meth:`build`: through the pinned slabs of :mod:`.device`. Leaves that
        shared a storage share one storage there; Parameters stay Parameters. (The leaves are
        copied even when ``device`` is the CPU: callers skip that case.)"""
        move = self.device_move(device)
        copy_to_device([pair for pairs in move.groups.values() for pair in pairs])
        self.install(move)

    def device_move(self, device: Any) -> DeviceMove:
        """The move of :meth:`to_device` planned, after :meth:`allocate` (the blobs may still
        be filling): every torch leaf's destination allocated on ``device``, and the copies
        each blob's bytes need. Copy them (a :class:`cryosnap._state.device.DeviceFeed` can,
        blob by blob as each verifies), then :meth:`install` the move before :meth:`build`."""
        self._columns.expand(self._tensors)
        return _plan_move(self._tensors, self._values, device)

    def install(self, move: DeviceMove) -> None:
        """Put ``move``'s destinations (their copies done) in place of the host leaves."""
        _install(move, self._tensors, self._values)
        self.moved = True

    # phase 2 -------------------------------------------------------------------------------
    def build(self) -> Any:
        return self._build(self.skeleton, ())

    def _build(self, node: dict[str, Any], path: tuple[str | int, ...]) -> Any:
        t = node["t"]
        if t in ("dict", "odict") and "cols" in node and id(node) in self._values:
            # In columns, allocated in bulk: its leaves, in order.
            keys = dict_keys(node, format_path(path))
            leaves = dict(zip(keys, self._values[id(node)], strict=True))
            return OrderedDict(leaves) if t == "odict" else leaves
        if t in ("dict", "odict"):
            items = self._items.get(id(node))
            if items is None:
                items = dict_items(node, format_path(path))
            values = self._values
            # A leaf allocated by allocate() is taken as it is, without a call per leaf.
            built = {
                k: values[id(v)] if v["t"] in _ALLOCATED else self._build(v, (*path, k))
                for k, v in items
            }
            return OrderedDict(built) if t == "odict" else built
        if t == "list":
            return [self._build(v, (*path, i)) for i, v in enumerate(node["v"])]
        if t == "tuple":
            return tuple(self._build(v, (*path, i)) for i, v in enumerate(node["v"]))
        if t == "stateful":
            return self._build(node["v"], path)
        if t in _ALLOCATED:
            return self._values[id(node)]
        if t == "bytes":
            return bytes(self._values[id(node)])
        if t == "pickle":
            return pickle.loads(self._values[id(node)])
        return _scalar(node, format_path(path))


@dataclass(slots=True)
class DeviceMove:
    """:meth:`Restorer.device_move`'s plan: per blob, the (host leaf, its destination) pairs
    its bytes are copied by; the destinations of the plain leaves (by node id) and of the
    shared storages (by blob)."""

    groups: dict[int, list[tuple[Any, Any]]]
    plain: dict[int, Any]
    bases: dict[int, Any]


def _plan_move(
    tensors: _Tensors,
    values: dict[int, Any],
    device: Any,
) -> DeviceMove:
    """:meth:`Restorer.device_move` of its ``tensors``, whose leaves ``values`` holds (by node
    id; a shared storage's base by ``-blob - 1``)."""
    empty = require_torch().empty
    move = DeviceMove({}, {}, {})
    for node, b, geometry in tensors:
        if geometry is None:
            src = values[id(node)].detach()
            dst = move.plain[id(node)] = empty(src.shape, dtype=src.dtype, device=device)
        elif b not in move.bases:
            src = values[-b - 1]
            dst = move.bases[b] = empty(src.shape, dtype=src.dtype, device=device)
        else:
            continue
        move.groups.setdefault(b, []).append((src, dst))
    return move


def _install(
    move: DeviceMove,
    tensors: _Tensors,
    values: dict[int, Any],
) -> None:
    for node, _b, geometry in tensors:
        if geometry is None:
            values[id(node)] = as_leaf(move.plain[id(node)], node, "")
    for b, base in move.bases.items():
        values[-b - 1] = base
    for node, b, geometry in tensors:
        if geometry is not None:
            dtype = values[id(node)].dtype
            view = view_of(values[-b - 1], dtype, geometry)
            values[id(node)] = as_leaf(view, node, "")


_ALLOCATED = frozenset(("torch", "numpy", "bytearray", "file"))
_NO_PACK = 1 << 63  # Packs.ends' answer, to the plain-tensor route, for a blob not a pack yet


def _scalar(node: dict[str, Any], path: str) -> Any:
    t = node["t"]
    v: Any = node.get("v")
    try:
        if t == "none":
            return None
        if t == "bool" and type(v) is bool:
            return v
        if t == "int" and type(v) is int:
            return v
        if t == "int" and isinstance(node.get("hex"), str):
            return int(node["hex"], 16)
        if t == "float":
            bits = node.get("bits")
            if bits is not None:
                return float(struct.unpack("<d", bytes.fromhex(bits))[0])
            return float.fromhex(v)
        if t == "complex" and "bits" in node:
            real, imag = struct.unpack("<dd", bytes.fromhex(node["bits"]))
            return complex(real, imag)
        if t == "complex":
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
        if t == "str" and type(v) is str:
            return v
        if t == "size":
            return require_torch().Size(v)
        if t == "npscalar":
            dtype = np_dtype(node.get("dtype"), path)
            raw = bytes.fromhex(node["hex"])
            # Indexing an array strips trailing NULs of fixed-width strings: rebuild those.
            if dtype.kind == "S":
                return np.bytes_(raw)
            if dtype.kind == "U":
                big = dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big")
                return np.str_(raw.decode("utf-32-be" if big else "utf-32-le"))
            return np.frombuffer(raw, dtype=dtype)[0]
    except (
        TypeError,
        ValueError,
        IndexError,
        KeyError,
        OverflowError,
        RuntimeError,
        struct.error,
    ) as exc:
        # OverflowError: float.fromhex of a huge exponent; RuntimeError: torch.Size of one;
        # struct.error: NaN bits of the wrong length.
        raise CheckpointFormatError(f"leaf {path}: malformed {t} value {v!r:.80}") from exc
    raise CheckpointFormatError(f"leaf {path}: malformed {t} value {v!r:.80}")
