"""Build a state back from its skeleton and blobs (:class:`Restorer`): allocate empty leaves,
hand out a byte view per blob for the reader to fill, then assemble the tree.

Pure (``to_device`` aside, a copy to a GPU); runs on the caller's thread.
"""

from __future__ import annotations

import math
import pickle
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from cryosnap import _native
from cryosnap._format import columns
from cryosnap._format.columns import Columns
from cryosnap._format.limits import MAX_BLOB_BYTES
from cryosnap._format.skeleton import (
    MAX_ELEMENTS,
    MAX_NDIM,
    Json,
    _key_text,
    dict_columns,
    dict_items,
    dict_keys,
    format_path,
)
from cryosnap._state.device import copy_to_device
from cryosnap._state.files import loaded_file, saved_file_path
from cryosnap._state.torch_import import import_torch
from cryosnap.errors import CheckpointError, CheckpointFormatError


def _torch() -> Any:
    try:
        torch = import_torch()
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise CheckpointFormatError(
            "this checkpoint holds torch tensors but torch is not installed "
            "(pip install 'cryosnap[torch]')"
        ) from exc
    return torch


def _torch_dtype(name: Any, path: str) -> Any:
    torch = _torch()
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"leaf {path}: unknown torch dtype {name!r}")
    if type(name) is str:
        _TORCH_DTYPES[name] = dtype
    return dtype


_TORCH_DTYPES: dict[str, Any] = {}  # the dtype names _torch_dtype found, and their dtypes


# String descrs parsed so far ("<f4"): a restore of 20,000 arrays parses a handful of them
# 40,000 times. Bounded: a hostile manifest's made-up descrs do not grow it past that.
_NP_DTYPES: dict[str, np.dtype[Any]] = {}
_NP_DTYPES_MAX = 256


def _np_dtype(descr: Any, path: str) -> np.dtype[Any]:
    if type(descr) is str:
        known = _NP_DTYPES.get(descr)
        if known is not None:
            return known

    def tuples(d: Any) -> Any:
        if isinstance(d, list):
            return [tuple(tuples(x) for x in f) if isinstance(f, list) else f for f in d]
        return d

    try:
        if isinstance(descr, list):
            descr = [tuple(tuples(x) if isinstance(x, list) else x for x in f) for f in descr]
        dtype: np.dtype[Any] = np.lib.format.descr_to_dtype(descr)
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, RecursionError) as exc:
        raise CheckpointFormatError(f"leaf {path}: invalid numpy dtype {descr!r}") from exc
    if dtype.hasobject:
        raise CheckpointFormatError(f"leaf {path}: numpy dtype {descr!r} holds Python objects")
    if type(descr) is str and len(_NP_DTYPES) < _NP_DTYPES_MAX:
        _NP_DTYPES[descr] = dtype
    return dtype


def _small_elements(shape: list[Any]) -> int:
    """The elements of ``shape`` (a list) if it has one or two dimensions, each an int below
    _SMALL_DIM (a state dict's common leaf, well inside every limit); -1 for anything else."""
    if len(shape) == 1:
        d0 = shape[0]
        return d0 if type(d0) is int and 0 <= d0 < _SMALL_DIM else -1
    if len(shape) == 2:
        d0, d1 = shape
        if type(d0) is int and type(d1) is int and 0 <= d0 < _SMALL_DIM and 0 <= d1 < _SMALL_DIM:
            return d0 * d1
    return -1


def _shape(node: dict[str, Any], path: str) -> tuple[int, ...]:
    shape = node.get("shape")
    # The common case (vectors, matrices) in a few operations: well inside every limit.
    if (
        type(shape) is list
        and len(shape) <= 2
        and all(type(s) is int and 0 <= s < _SMALL_DIM for s in shape)
    ):
        return tuple(shape)
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(s) is int and 0 <= s <= MAX_ELEMENTS for s in shape)
        or math.prod(max(s, 1) for s in shape) > MAX_ELEMENTS
    ):
        raise CheckpointFormatError(f"leaf {path}: invalid shape {shape!r:.120}")
    return tuple(shape)


_SMALL_DIM = 2**31  # two such dimensions multiply to less than MAX_ELEMENTS


def _expect_bytes(shape: tuple[int, ...], itemsize: int, have: int, path: str) -> None:
    """Refuse a leaf whose shape does not fit its blob *before* anything is allocated for it."""
    need = math.prod(shape) * itemsize
    if need != have:
        raise CheckpointFormatError(
            f"leaf {path}: shape {list(shape)} of {itemsize}-byte items needs {need} bytes, "
            f"its blob has {have}"
        )


_Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]


def _view_of(base: Any, dtype: Any, geometry: _Geometry) -> Any:
    """A tensor of ``dtype`` over the storage of ``base`` at ``geometry`` (offset in elements,
    shape, stride), on the device of ``base``."""
    offset, shape, stride = geometry
    t = _torch().empty(0, dtype=dtype, device=base.device)
    return t.set_(base.untyped_storage(), offset, shape, stride)


# Where a blob's bytes already lie (engine/_fetch.py's mapped data files): blob, alignment ->
# the memory, or None (see Restorer).
Place = Callable[[int, int], "memoryview | None"]
# The alignment asked of a storage that views of several dtypes share: the largest element.
_MAX_ALIGN = 16

_ITEMSIZE: dict[Any, int] = {}
_NUMPY_DTYPES: frozenset[Any] = frozenset()


def _itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype (no tensor made for it after the first time)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = _torch().empty(0, dtype=dtype).element_size()
    return size


def _byte_view(t: Any) -> memoryview:
    """A flat writable byte view of the fresh contiguous CPU tensor ``t``, which it keeps
    alive (a read that outlives a failed restore writes into memory still owned)."""
    global _NUMPY_DTYPES
    if not t.numel():
        return memoryview(bytearray())
    if not _NUMPY_DTYPES:
        torch = _torch()
        names = "float16 float32 float64 complex64 complex128 bool uint8 int8 int16 int32 int64"
        _NUMPY_DTYPES = frozenset(getattr(torch, n) for n in names.split())
    if t.dtype in _NUMPY_DTYPES:
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.reshape(-1).view(_torch().uint8).numpy())


def _as_leaf(t: Any, node: dict[str, Any], path: str) -> Any:
    """``t`` as the saved leaf was: a Parameter, or requiring grad, if it was."""
    try:
        if node.get("param"):
            return _torch().nn.Parameter(t, requires_grad=bool(node.get("grad")))
        if node.get("grad"):
            t.requires_grad_(True)
    except RuntimeError as exc:  # e.g. requires_grad on an integer tensor
        raise CheckpointFormatError(f"leaf {path}: {exc}") from exc
    return t


@dataclass(frozen=True, slots=True)
class _ColumnPlan:
    """What the leaves of a dict node in columns claim (:meth:`Restorer._column_plan`): the
    packed leaves (indices), per pack the first claim ``(blob, first offset, end, leaf)`` in
    blob order, and the leaves of a blob of their own (indices)."""

    packed: np.ndarray[Any, Any]
    packs: list[tuple[int, int, int, int]]
    own: np.ndarray[Any, Any]


class _LeafPaths:
    """The path of each leaf of a dict node, as messages name it, made when asked for."""

    __slots__ = ("_keys", "_prefix")

    def __init__(self, node: dict[str, Any], where: str) -> None:
        self._keys = dict_keys(node, where or "<root>")
        self._prefix = f"{where}/" if where else ""

    def __getitem__(self, i: int) -> str:
        return self._prefix + _key_text(self._keys[i])


class ColumnTargets:
    """The leaves of ``into=`` that fill a dict node in columns (:func:`direct_targets`), every
    non-empty one directly: ``leaves`` in the node's order, the size of each one's element
    (``item``), their ``nbytes`` and addresses (``ptrs``), and the index of each in the spans
    (-1: empty)."""

    __slots__ = ("cols", "cols_node", "index", "item", "leaves", "nbytes", "ptrs")

    def __init__(
        self,
        node: Json,
        cols: Columns,
        leaves: list[Any],
        item: np.ndarray[Any, np.dtype[np.int64]],
        nbytes: np.ndarray[Any, np.dtype[np.int64]],
        ptrs: np.ndarray[Any, np.dtype[np.int64]],
    ) -> None:
        self.cols_node, self.cols, self.leaves = node, cols, leaves
        self.item, self.nbytes, self.ptrs = item, nbytes, ptrs
        self.index = np.full(len(leaves), -1, np.int64)  # numbered by direct_targets

    def spans(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        full = self.index >= 0
        lo = self.ptrs[full]
        return np.stack([lo, lo + self.nbytes[full], self.index[full]], axis=1)

    def apart(self, shared: set[int]) -> bool:
        """Whether none of its leaves is among the ``shared`` (overlapping) indices."""
        return not np.isin(self.index, np.fromiter(shared, np.int64, len(shared))).any()

    def leaf_targets(self, shared: set[int]) -> dict[int, Any]:
        """Its leaves that overlap no other, by the id of the node each stands for."""
        nodes = self.cols.nodes()
        return {
            id(nodes[i]): leaf
            for i, (leaf, j) in enumerate(zip(self.leaves, self.index.tolist(), strict=True))
            if j >= 0 and j not in shared
        }


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
    file, engine/_fetch.py) when its address is a multiple of ``alignment``, or None; the leaf
    is built over it (``placed[b]`` is True) and the reader only verifies it there.
    """

    def __init__(self, skeleton: Json, blob_sizes: list[int], *, allow_pickle: bool) -> None:
        self.skeleton = skeleton
        self.blob_sizes = blob_sizes
        self.allow_pickle = allow_pickle
        self.blob_paths: list[str] = [""] * len(blob_sizes)
        self.direct: list[bool] = [False] * len(blob_sizes)
        self.placed: list[bool] = [False] * len(blob_sizes)
        self._place: Place | None = None
        self._dest: list[Any] = [None] * len(blob_sizes)
        self._values: dict[int, Any] = {}
        self._items: dict[int, list[tuple[str | int, Json]]] = {}  # each dict node's, decoded
        self._targets: Mapping[int, Any] = {}
        # The blobs packed leaves claimed, each with where its last leaf so far ends: the leaves
        # of a pack come in the order they were packed, each after the one before.
        self._packs: dict[int, int] = {}
        # Per pack, the packed leaves filled into into='s own tensors: (offset in the pack,
        # bytes, into='s tensor), in pack order.
        self._pack_fills: dict[int, list[tuple[int, int, Any]]] = {}
        # Every torch leaf: its node, its blob and, for a view of a shared storage, its
        # (offset in elements, shape, stride) in that storage.
        self._tensors: list[tuple[dict[str, Any], int, _Geometry | None]] = []
        # The packed leaves of dict nodes in columns filled into into='s tensors, per node:
        # their packs, offsets there, bytes and into='s addresses (arrays); and how many
        # leaves of each pack they are.
        self._column_fills: list[tuple[Any, Any, Any, Any]] = []
        self._column_packs: Counter[int] = Counter()
        # The packs of numpy leaves, and how many leaves each holds.
        self._array_packs: Counter[int] = Counter()
        # The dict nodes in columns allocated fresh in bulk (their leaves a list by node id).
        self._fresh: list[dict[str, Any]] = []
        self.moved = False  # whether install() put the leaves on a device

    # phase 1 -------------------------------------------------------------------------------
    def allocate(
        self, targets: Mapping[int, Any] | None = None, place: Place | None = None
    ) -> list[memoryview]:
        self._targets = targets or {}
        self._place = place
        try:
            self._alloc(self.skeleton, "")
        finally:
            self._place = None
        if self._packs:  # what a message about a damaged pack names
            _name_packs(
                self.blob_paths,
                self._tensors,
                self._pack_fills,
                self._column_packs,
                self._array_packs,
            )
        views: list[memoryview] = []
        for i, dest in enumerate(self._dest):
            if dest is None:
                raise CheckpointFormatError(f"blob {i} is referenced by no leaf")
            views.append(dest)
        return views

    def _blob(self, node: dict[str, Any], path: str) -> int:
        b = node.get("b")
        if type(b) is not int or not 0 <= b < len(self.blob_sizes):
            raise CheckpointFormatError(f"leaf {path}: invalid blob reference {b!r}")
        if not self.blob_paths[b]:
            self.blob_paths[b] = path
        return b

    def _claim(self, b: int, view: memoryview, path: str) -> None:
        if self._dest[b] is not None:
            raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
        if view.nbytes != self.blob_sizes[b]:
            raise CheckpointFormatError(
                f"leaf {path}: holds {view.nbytes} bytes but its blob has {self.blob_sizes[b]}"
            )
        self._dest[b] = view

    def _alloc(self, node: Json, where: str) -> None:
        """Allocate the leaves under ``node``, at ``where`` (its path as format_path writes it,
        built key by key on the way down; the root's is empty)."""
        if not isinstance(node, dict):
            raise CheckpointFormatError(f"leaf {where or '<root>'}: malformed node {node!r:.80}")
        t = node.get("t")
        if t in ("dict", "odict"):
            if "cols" in node and self._alloc_columns(node, where):
                return
            items = self._items[id(node)] = dict_items(node, where or "<root>")
            prefix = f"{where}/" if where else ""
            fast, array = self._plain_tensor, self._packed_plain_array
            for k, v in items:
                path = prefix + (k if type(k) is str else _key_text(k))
                if not fast(v, path) and not array(v):
                    self._alloc(v, path)
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
            p = where or "<root>"
            dtype, shape = _np_dtype(node.get("dtype"), p), _shape(node, p)
            order: Literal["C", "F"] = "F" if node.get("order") == "F" else "C"
            b = self._blob(node, p)
            if "at" in node:
                self._values[id(node)] = self._packed_array(node, b, dtype, shape, order, p)
                return
            _expect_bytes(shape, dtype.itemsize, self.blob_sizes[b], p)
            target = self._targets.get(id(node))
            if target is not None:  # into='s own C-contiguous array (direct_targets)
                self._claim(b, target.reshape(-1).view(np.uint8).data, p)
                self.direct[b] = True
                self._values[id(node)] = target
                return
            placed = self._placed(b, dtype.alignment)
            if placed is not None:
                # The blob holds the array's elements in its order: C, or F (the transpose's C).
                if order == "F":
                    arr = np.frombuffer(placed, dtype=dtype).reshape(shape[::-1]).T
                else:
                    arr = np.frombuffer(placed, dtype=dtype).reshape(shape)
                self._claim(b, placed, p)
                self._values[id(node)] = arr
                return
            arr = np.empty(shape, dtype=dtype, order=order)
            flat = arr.T.reshape(-1) if order == "F" else arr.reshape(-1)
            self._claim(b, flat.view(np.uint8).data if flat.size else memoryview(bytearray()), p)
            self._values[id(node)] = arr
        elif t in ("bytes", "bytearray", "pickle"):
            p = where or "<root>"
            if t == "pickle" and not self.allow_pickle:
                # Not damage: the version is fine, the caller has to opt in.
                raise CheckpointError(
                    f"leaf {p} is pickled; loading it could run code from the checkpoint, "
                    "so it needs allow_pickle=True"
                )
            b = self._blob(node, p)
            buf = bytearray(self.blob_sizes[b])
            self._claim(b, memoryview(buf), p)
            self._values[id(node)] = buf
        elif t == "file":
            p = where or "<root>"
            b = self._blob(node, p)
            saved = saved_file_path(node, self.blob_sizes[b], p)
            buf = bytearray(self.blob_sizes[b])
            self._claim(b, memoryview(buf), p)
            self._values[id(node)] = loaded_file(saved, buf)
        elif t not in ("none", "bool", "int", "float", "complex", "str", "npscalar", "size"):
            raise CheckpointFormatError(f"leaf {where or '<root>'}: unknown node type {t!r}")

    def _alloc_columns(self, node: dict[str, Any], where: str) -> bool:
        """A dict node in columns allocated in bulk: into ``into=``'s own tensors where every
        leaf is filled directly (its :class:`ColumnTargets` among the targets), or, with no
        targets at all, fresh leaves (each packed one a tensor of its own over its bytes in
        the pack, as :meth:`_packed` makes it). False, nothing done, for anything else or
        anything a check refuses: the walk leaf by leaf then takes the node and names what
        is wrong."""
        target = self._targets.get(id(node)) if self._targets else None
        if isinstance(target, ColumnTargets):
            if target.cols_node is not node:
                return False
            return self._into_columns(node, where, target)
        if self._targets:  # into='s leaves here are targets leaf by leaf, or none is
            return False
        return self._fresh_columns(node, where)

    def _column_plan(
        self, cols: Columns, nbytes: np.ndarray[Any, Any], item: np.ndarray[Any, Any]
    ) -> _ColumnPlan | None:
        """What the leaves of ``cols`` (of ``nbytes`` each, elements of ``item`` bytes) claim,
        every check of :meth:`_packed` and :meth:`_claim` made for all of them at once; None
        if one fails. Changes nothing."""
        sizes = np.asarray(self.blob_sizes, np.int64)
        b, at = cols.b, cols.at
        if len(b) and int(b.max()) >= len(sizes):
            return None
        packed = at >= 0
        if (packed & (nbytes == 0)).any():
            return None  # an empty packed leaf: as _packed takes it
        # Packed leaves: aligned, inside their pack, and each after the one before it in the
        # same pack.
        pk = np.flatnonzero(packed)
        pb, pat, pend = b[pk], at[pk], at[pk] + nbytes[pk]
        if ((pat % item[pk]) != 0).any() or (pend > sizes[pb]).any():
            return None
        order = np.argsort(pb, kind="stable")
        sb, sat, send = pb[order], pat[order], pend[order]
        same = sb[1:] == sb[:-1]
        if (same & (sat[1:] < send[:-1])).any():
            return None
        first = np.flatnonzero(np.r_[True, ~same]) if len(sb) else np.empty(0, np.int64)
        last = np.r_[first[1:] - 1, len(sb) - 1] if len(sb) else first
        packs = list(
            zip(
                sb[first].tolist(),
                sat[first].tolist(),
                send[last].tolist(),
                pk[order[first]].tolist(),
                strict=True,
            )
        )
        for blob, start, _end, _i in packs:
            if self._dest[blob] is not None and (
                blob not in self._packs or start < self._packs[blob]
            ):
                return None  # claimed by a leaf of its own, or overlapping an earlier leaf
        # Leaves of a blob of their own (empty ones included): the whole blob, claimed once.
        own = np.flatnonzero(~packed)
        ob = b[own]
        if (
            (nbytes[own] != sizes[ob]).any()
            or len(np.unique(ob)) != len(ob)
            or np.isin(ob, pb).any()
            or any(self._dest[x] is not None for x in ob.tolist())
        ):
            return None
        return _ColumnPlan(pk, packs, own)

    def _claim_packs(self, plan: _ColumnPlan, cols: Columns, paths: _LeafPaths) -> None:
        """Claim the packs ``plan``'s packed leaves are the first of (named by the leaf
        that claims each: ``paths``, by leaf), and note where each pack's leaves end."""
        for blob, _start, end, i in plan.packs:
            if self._dest[blob] is None:
                dest = self._placed(blob, _MAX_ALIGN)
                if dest is None:
                    dest = _byte_view(_torch().empty(self.blob_sizes[blob], dtype=_torch().uint8))
                self._claim(blob, dest, paths[i])
                self._pack_fills[blob] = []
            if not self.blob_paths[blob]:
                self.blob_paths[blob] = paths[i]
            self._packs[blob] = end
        for blob, n in zip(*np.unique(cols.b[plan.packed], return_counts=True), strict=True):
            self._column_packs[int(blob)] += int(n)

    def _into_columns(self, node: dict[str, Any], where: str, target: ColumnTargets) -> bool:
        """:meth:`_alloc_columns` into ``into=``'s tensors: each packed leaf noted for
        :meth:`fill_packs`, each other leaf's blob claimed by its tensor."""
        cols, nbytes = target.cols, target.nbytes
        plan = self._column_plan(cols, nbytes, target.item)
        if plan is None:
            return False
        paths = _LeafPaths(node, where)
        self._claim_packs(plan, cols, paths)
        leaves = target.leaves
        for i, blob in zip(plan.own.tolist(), cols.b[plan.own].tolist(), strict=True):
            x = leaves[i]
            view = _byte_view(x.detach()) if nbytes[i] else memoryview(bytearray())
            self._claim(blob, view, paths[i])
            self.direct[blob] = bool(nbytes[i])
            if not self.blob_paths[blob]:
                self.blob_paths[blob] = paths[i]
        pk = plan.packed
        if len(pk):
            self._column_fills.append((cols.b[pk], cols.at[pk], nbytes[pk], target.ptrs[pk]))
        self._values[id(node)] = leaves
        return True

    def _fresh_columns(self, node: dict[str, Any], where: str) -> bool:
        """:meth:`_alloc_columns` of fresh leaves, where every leaf has at most two
        dimensions of fewer than 2**31 elements (as :meth:`_plain_tensor` takes them)."""
        cols = dict_columns(node, where or "<root>")
        if (
            cols is None
            or not cols.count
            or (cols.ndim > 2).any()
            or (cols.dims >= _SMALL_DIM).any()
        ):
            return False
        dtypes = []
        for name in cols.dtypes:
            dtype = _TORCH_DTYPES.get(name)
            if dtype is None:
                try:
                    dtype = _torch_dtype(name, where)
                except CheckpointFormatError:
                    return False  # the walk leaf by leaf names the leaf
            dtypes.append(dtype)
        item = np.array([_itemsize(d) for d in dtypes], np.int64)[cols.dtype]
        counts = cols.elements()  # two dims below 2**31 each: no wrap
        if (counts > MAX_BLOB_BYTES // item).any():
            return False  # more than any blob holds (and counts * item might wrap)
        nbytes = counts * item
        plan = self._column_plan(cols, nbytes, item)
        if plan is None:
            return False
        paths = _LeafPaths(node, where)
        self._claim_packs(plan, cols, paths)
        torch = _torch()
        frombuffer, empty = torch.frombuffer, torch.empty
        dims, leaves = cols["dims"], [None] * cols.count
        kinds = [dtypes[i] for i in cols["dtype"]]
        ends = np.cumsum(cols.ndim)
        ndims, starts, stops = cols["ndim"], (ends - cols.ndim).tolist(), ends.tolist()
        for i, blob, at, n in zip(
            plan.packed.tolist(),
            cols.b[plan.packed].tolist(),
            cols.at[plan.packed].tolist(),
            nbytes[plan.packed].tolist(),
            strict=True,
        ):
            # A storage of its own over the pack's memory (which it keeps alive).
            t = frombuffer(self._dest[blob][at : at + n], dtype=kinds[i])
            leaves[i] = t if ndims[i] == 1 else t.view(dims[starts[i] : stops[i]])
        for i, blob in zip(plan.own.tolist(), cols.b[plan.own].tolist(), strict=True):
            shape = dims[starts[i] : stops[i]]
            placed = self._placed(blob, int(item[i]))
            if placed is not None:
                t = frombuffer(placed, dtype=kinds[i]).view(shape)
                self._claim(blob, placed, paths[i])
            else:
                t = empty(shape, dtype=kinds[i])
                self._claim(blob, _byte_view(t) if nbytes[i] else memoryview(bytearray()), paths[i])
            if not self.blob_paths[blob]:
                self.blob_paths[blob] = paths[i]
            leaves[i] = t
        for i, flags in zip(
            np.flatnonzero(cols.flags).tolist(), cols.flags[cols.flags != 0].tolist(), strict=True
        ):
            marks = {"param": bool(flags & columns.PARAM), "grad": bool(flags & columns.GRAD)}
            leaves[i] = _as_leaf(leaves[i], marks, paths[i])
        self._values[id(node)] = leaves
        self._fresh.append(node)
        return True

    def _expand_columns(self) -> None:
        """The fresh leaves of dict nodes in columns noted leaf by leaf, by the nodes the
        columns stand for (what a move to a device walks); the nodes then build leaf by leaf."""
        for node in self._fresh:
            cols = dict_columns(node, "")
            assert cols is not None
            leaves = self._values.pop(id(node))
            for child, leaf, blob in zip(cols.nodes(), leaves, cols.b.tolist(), strict=True):
                self._values[id(child)] = leaf
                self._tensors.append((child, blob, None))
        self._fresh = []

    def _placed(self, b: int, alignment: int) -> memoryview | None:
        """The memory ``place`` has for blob ``b`` at ``alignment`` (and ``placed[b]`` set),
        or None: the leaf is allocated (always for an empty blob)."""
        if self._place is None or not self.blob_sizes[b]:
            return None
        view = self._place(b, alignment)
        if view is not None:
            self.placed[b] = True
        return view

    def _plain_tensor(self, node: Any, path: str) -> bool:
        """Allocate ``node`` if it is the most common leaf of a state dict (a plain CPU tensor
        of a known dtype and up to two dimensions, not a view, not filled in place; or packed,
        in a pack an earlier leaf claimed) with every check :meth:`_alloc_tensor` makes, inline;
        False (nothing done) for anything else, which :meth:`_alloc` then takes, errors
        included."""
        if type(node) is not dict or node.get("t") != "torch" or "view" in node:
            return False
        name = node.get("dtype")
        dtype = _TORCH_DTYPES.get(name) if type(name) is str else None
        shape = node.get("shape")
        b = node.get("b")
        if (
            dtype is None
            or type(shape) is not list
            or type(b) is not int
            or not 0 <= b < len(self._dest)
        ):
            return False
        at = node.get("at")
        if at is None:
            if self._dest[b] is not None:
                return False
        elif type(at) is not int or at < self._packs.get(b, _NO_PACK):
            return False  # not packed here yet (the first leaf), or malformed
        n = len(shape)
        count = _small_elements(shape) if n else -1
        if count < 0:
            return False
        item = _ITEMSIZE.get(dtype)
        target = self._targets.get(id(node)) if self._targets else None
        if item is None or (target is not None and at is None):
            return False
        # A dtype in _TORCH_DTYPES was found in torch: it is imported.
        torch = sys.modules["torch"]
        nbytes = count * item
        if at is not None:  # packed (as _packed does it)
            if not nbytes or at < 0 or at % item or at + nbytes > self.blob_sizes[b]:
                return False
            self._packs[b] = at + nbytes
            if target is not None:  # filled by fill_packs, no tensor made for it
                self._pack_fills[b].append((at, nbytes, target))
                self._values[id(node)] = target
                return True
            t = torch.frombuffer(self._dest[b][at : at + nbytes], dtype=dtype)
            if n == 2:
                t = t.view(shape)
            self._tensors.append((node, b, None))
            self._values[id(node)] = (
                _as_leaf(t, node, path) if "param" in node or "grad" in node else t
            )
            return True
        if nbytes != self.blob_sizes[b]:
            return False
        placed = self._placed(b, item)
        if placed is not None:
            t = torch.frombuffer(placed, dtype=dtype)  # one dimension: the shape already
            if n == 2:
                t = t.view(shape)
            self._dest[b] = placed
        else:
            t = torch.empty(shape, dtype=dtype)
            self._dest[b] = (
                memoryview(t.numpy()).cast("B")
                if dtype in _NUMPY_DTYPES and count
                else _byte_view(t)
            )
        if not self.blob_paths[b]:
            self.blob_paths[b] = path
        self._tensors.append((node, b, None))
        self._values[id(node)] = _as_leaf(t, node, path) if "param" in node or "grad" in node else t
        return True

    def _packed_plain_array(self, node: Any) -> bool:
        """Allocate ``node`` if it is a dict of small arrays' common leaf (a packed C-order
        array of a descr parsed before and up to two dimensions, in a pack an earlier leaf
        claimed) with every check :meth:`_alloc` and :meth:`_packed_array` make, inline; False
        (nothing done) for anything else, which :meth:`_alloc` then takes, errors included."""
        if type(node) is not dict or node.get("t") != "numpy" or "order" in node:
            return False
        descr, shape, b, at = node.get("dtype"), node.get("shape"), node.get("b"), node.get("at")
        dtype = _NP_DTYPES.get(descr) if type(descr) is str else None
        if dtype is None or type(shape) is not list or type(b) is not int or type(at) is not int:
            return False
        if not 0 <= b < len(self._dest) or at < self._packs.get(b, _NO_PACK):
            return False  # not packed here yet (the first leaf), or malformed
        n = len(shape)
        count = _small_elements(shape) if n else 1  # 0-d: one element
        if count < 0:
            return False
        item = dtype.itemsize
        nbytes = count * item
        if not nbytes or at % item or at + nbytes > self.blob_sizes[b]:
            return False
        self._packs[b] = at + nbytes
        self._array_packs[b] += 1
        target = self._targets.get(id(node)) if self._targets else None
        if target is not None:  # filled by fill_packs, no array made for it
            self._pack_fills[b].append((at, nbytes, target))
            self._values[id(node)] = target
            return True
        flat = np.frombuffer(self._dest[b][at : at + nbytes], dtype=dtype)
        self._values[id(node)] = flat if n == 1 else flat.reshape(shape)
        return True

    def _alloc_tensor(self, node: dict[str, Any], path: str) -> None:
        torch = _torch()
        name = node.get("dtype")
        dtype = _TORCH_DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            dtype = _torch_dtype(name, path)
        shape = _shape(node, path)
        b = self._blob(node, path)
        view = node.get("view")
        item = _itemsize(dtype)
        if "at" in node:
            if view is not None:
                raise CheckpointFormatError(f"leaf {path}: both packed and a view")
            t = self._packed(node, b, dtype, item, shape, path)
            if id(node) not in self._targets:
                self._tensors.append((node, b, None))
                t = _as_leaf(t, node, path) if "param" in node or "grad" in node else t
            self._values[id(node)] = t
            return
        if view is None:
            if math.prod(shape) * item != self.blob_sizes[b]:
                _expect_bytes(shape, item, self.blob_sizes[b], path)
            target = self._targets.get(id(node))
            if target is not None:  # into='s own contiguous CPU tensor (direct_targets)
                self._claim(b, _byte_view(target.detach()), path)
                self.direct[b] = True
                self._values[id(node)] = target
                return
            if self._dest[b] is not None:
                raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
            placed = self._placed(b, item)
            if placed is not None:
                t = torch.frombuffer(placed, dtype=dtype).view(shape)
                self._dest[b] = placed
            else:
                t = torch.empty(shape, dtype=dtype)
                self._dest[b] = _byte_view(t)
            self._tensors.append((node, b, None))
            self._values[id(node)] = (
                _as_leaf(t, node, path) if "param" in node or "grad" in node else t
            )
            return
        else:
            if not isinstance(view, dict):
                raise CheckpointFormatError(f"leaf {path}: malformed view {view!r}")
            offset, stride = view.get("offset"), view.get("stride")
            if (
                type(offset) is not int
                or not 0 <= offset <= MAX_ELEMENTS
                or offset % item
                or not isinstance(stride, list)
                or len(stride) != len(shape)
                or not all(type(s) is int and 0 <= s <= MAX_ELEMENTS for s in stride)
            ):
                raise CheckpointFormatError(f"leaf {path}: malformed view {view!r}")
            extent = sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
            if math.prod(shape) and offset + (extent + 1) * item > self.blob_sizes[b]:
                raise CheckpointFormatError(f"leaf {path}: view reaches past its blob")
            base = self._dest[b]
            if base is None:
                # A storage shared by views of any dtypes: placed only if aligned for all.
                placed = self._placed(b, _MAX_ALIGN)
                if placed is not None:
                    base_t = torch.frombuffer(placed, dtype=torch.uint8)
                    self._claim(b, placed, path)
                else:
                    base_t = torch.empty(self.blob_sizes[b], dtype=torch.uint8)
                    self._claim(b, memoryview(base_t.numpy()), path)
                self._values[-b - 1] = base_t  # keep the shared storage for its views
            geometry = (offset // item, shape, tuple(stride))
            try:
                t = _view_of(self._values[-b - 1], dtype, geometry)
            except RuntimeError as exc:
                raise CheckpointFormatError(f"leaf {path}: malformed view {view!r:.80}") from exc
            self._tensors.append((node, b, geometry))
        self._values[id(node)] = _as_leaf(t, node, path)

    def _packed(
        self, node: dict[str, Any], b: int, dtype: Any, item: int, shape: tuple[int, ...], path: str
    ) -> Any:
        """The tensor of a packed leaf: its own tensor over its bytes in the pack's memory
        (claimed by the first of its leaves: mapped, or allocated once for all of them); for
        one of the targets, that target, the leaf noted for :meth:`fill_packs`."""
        torch = _torch()
        need = math.prod(shape) * item
        dest, target = self._pack_slot(
            node, b, item, need, path, lambda n: _byte_view(torch.empty(n, dtype=torch.uint8))
        )
        if target is not None:
            return target
        at: int = node["at"]  # checked by _pack_slot
        if not need:
            return torch.empty(shape, dtype=dtype)
        # A storage of its own over the pack's memory (which it keeps alive): the leaf is as
        # independent of its neighbours as when it was saved.
        return torch.frombuffer(dest[at : at + need], dtype=dtype).view(shape)

    def _packed_array(
        self,
        node: dict[str, Any],
        b: int,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        order: Literal["C", "F"],
        path: str,
    ) -> Any:
        """The array of a packed numpy leaf, as :meth:`_packed` makes a packed tensor's: over
        its bytes in the pack's memory (a numpy buffer where nothing else claimed it), or
        ``into=``'s own array, filled by :meth:`fill_packs`."""
        need = math.prod(shape) * dtype.itemsize
        dest, target = self._pack_slot(
            node, b, dtype.itemsize, need, path, lambda n: np.empty(n, np.uint8).data
        )
        self._array_packs[b] += 1
        if target is not None:
            return target
        at: int = node["at"]  # checked by _pack_slot
        if not need:
            return np.empty(shape, dtype=dtype, order=order)
        flat = np.frombuffer(dest[at : at + need], dtype=dtype)
        return flat.reshape(shape[::-1]).T if order == "F" else flat.reshape(shape)

    def _pack_slot(
        self,
        node: dict[str, Any],
        b: int,
        item: int,
        need: int,
        path: str,
        fresh: Callable[[int], memoryview],
    ) -> tuple[memoryview, Any]:
        """The memory of pack ``b`` that the packed leaf ``node`` (of ``need`` bytes, elements
        of ``item``) lies in: claimed by the pack's first leaf (mapped where it lies, else
        ``fresh(nbytes)``), its offset checked against the pack and the leaf before it; and
        ``into=``'s leaf for it (None: not a target), its fill noted for :meth:`fill_packs`."""
        at = node.get("at")
        if item <= 0:  # never written: a packed leaf has bytes
            raise CheckpointFormatError(f"leaf {path}: packed with elements of {item} bytes")
        if type(at) is not int or not 0 <= at <= self.blob_sizes[b] - need or at % item:
            raise CheckpointFormatError(f"leaf {path}: malformed pack offset {at!r:.40}")
        dest = self._dest[b]
        if dest is None:
            dest = self._placed(b, _MAX_ALIGN)
            if dest is None:
                dest = fresh(self.blob_sizes[b])
            self._claim(b, dest, path)
            self._pack_fills[b] = []
        elif b not in self._packs:
            raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
        elif at < self._packs[b]:
            # Leaves over the same bytes would change each other: never as saved.
            raise CheckpointFormatError(f"leaf {path}: overlaps the leaf packed before it")
        self._packs[b] = at + need
        target = self._targets.get(id(node))
        if target is not None and need:
            self._pack_fills[b].append((at, need, target))
        return dest, target

    def fill_packs(self) -> None:
        """Copy the packed leaves ``allocate(targets)`` noted from their verified packs into
        ``into=``'s tensors (what :func:`direct_targets` picks): every piece in one
        :func:`cryosnap._native.copy_pieces` (the kernel's copies, the pieces shared between
        threads), not a ``memmove`` each on this thread."""
        dests: list[Any] = []
        sources: list[Any] = []
        sizes: list[Any] = []
        bases: dict[int, int] = {}
        for b, fills in self._pack_fills.items():
            if fills:
                base = bases[b] = _native.address_of(self._dest[b])
                address = _native.leaf_address
                rows = np.array([(address(t), at, n) for at, n, t in fills], np.int64)
                dests.append(rows[:, 0])
                sources.append(rows[:, 1] + base)
                sizes.append(rows[:, 2])
        for packs, offsets, nbytes, ptrs in self._column_fills:
            for b in set(packs.tolist()) - bases.keys():
                bases[b] = _native.address_of(self._dest[b])
            starts = np.array([bases[b] for b in packs.tolist()], np.int64)
            dests.append(ptrs)
            sources.append(starts + offsets)
            sizes.append(nbytes)
        if sizes:
            _native.copy_pieces(
                np.concatenate(dests),
                np.concatenate(sources),
                np.concatenate(sizes),
                threads=_native.COPY_THREADS,
            )

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
        self._expand_columns()
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


def _name_packs(
    paths: list[str],
    tensors: list[tuple[dict[str, Any], int, _Geometry | None]],
    fills: dict[int, list[tuple[int, int, Any]]],
    columns: Counter[int],
    arrays: Counter[int],
) -> None:
    """Add to the path of each pack's blob how many more tensors (in a pack of ``arrays``,
    counted there whole: numpy arrays) it holds."""
    packed = Counter(b for node, b, _g in tensors if "at" in node)
    packed.update({b: len(members) for b, members in fills.items() if b not in arrays})
    packed.update(columns)
    packed.update(arrays)
    for b, count in packed.items():
        if count > 1:
            more, kind = count - 1, "array" if b in arrays else "tensor"
            paths[b] += f" (packed with {more} more {kind}{'s' * (more > 1)})"


@dataclass(slots=True)
class DeviceMove:
    """:meth:`Restorer.device_move`'s plan: per blob, the (host leaf, its destination) pairs
    its bytes are copied by; the destinations of the plain leaves (by node id) and of the
    shared storages (by blob)."""

    groups: dict[int, list[tuple[Any, Any]]]
    plain: dict[int, Any]
    bases: dict[int, Any]


def _plan_move(
    tensors: list[tuple[dict[str, Any], int, _Geometry | None]],
    values: dict[int, Any],
    device: Any,
) -> DeviceMove:
    """:meth:`Restorer.device_move` of its ``tensors``, whose leaves ``values`` holds (by node
    id; a shared storage's base by ``-blob - 1``)."""
    empty = _torch().empty
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
    tensors: list[tuple[dict[str, Any], int, _Geometry | None]],
    values: dict[int, Any],
) -> None:
    for node, _b, geometry in tensors:
        if geometry is None:
            values[id(node)] = _as_leaf(move.plain[id(node)], node, "")
    for b, base in move.bases.items():
        values[-b - 1] = base
    for node, b, geometry in tensors:
        if geometry is not None:
            dtype = values[id(node)].dtype
            view = _view_of(values[-b - 1], dtype, geometry)
            values[id(node)] = _as_leaf(view, node, "")


_ALLOCATED = frozenset(("torch", "numpy", "bytearray", "file"))
_NO_PACK = 1 << 63  # Restorer._packs' answer for a blob no packed leaf claimed yet


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
            return _torch().Size(v)
        if t == "npscalar":
            dtype = _np_dtype(node.get("dtype"), path)
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
