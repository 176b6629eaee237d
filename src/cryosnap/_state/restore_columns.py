"""The restore of a dict node stored in columns (a state dict: _format/columns.py), in bulk:
every leaf's geometry checked at once (numpy, geometry.py's rules in their vector form), then
each leaf made into ``into=``'s own tensor (:class:`ColumnTargets`) or a fresh one
(:class:`ColumnNodes`). A node that any check refuses is left to the walk leaf by leaf, which
names what is wrong: this route may only accept what that walk accepts.

Pure; the caller's thread (one restore's allocation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap._format import columns
from cryosnap._format.columns import Columns
from cryosnap._format.limits import MAX_BLOB_BYTES
from cryosnap._format.skeleton import Json, _key_text, dict_columns, dict_keys
from cryosnap._state.claims import BlobClaims
from cryosnap._state.dtypes import TORCH_DTYPES, as_leaf, byte_view, itemsize, require_torch
from cryosnap._state.dtypes import torch_dtype as find_torch_dtype
from cryosnap._state.geometry import SMALL_DIM, pack_runs
from cryosnap._state.packs import Packs
from cryosnap.errors import CheckpointFormatError

__all__ = ["ColumnNodes", "ColumnTargets"]


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


@dataclass(frozen=True, slots=True)
class _ColumnPlan:
    """What the leaves of a dict node in columns claim (:meth:`ColumnNodes._plan`): the
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

    def __call__(self, i: int) -> str:
        return self._prefix + _key_text(self._keys[i])


class ColumnNodes:
    """The dict nodes in columns of one restore, each allocated in bulk (its leaves, a list,
    in ``values`` by the node's id); ``fresh``: those allocated fresh, which
    :meth:`expand` notes leaf by leaf for a move to a device."""

    __slots__ = ("claims", "fresh", "packs", "values")

    def __init__(self, claims: BlobClaims, packs: Packs, values: dict[int, Any]) -> None:
        self.claims, self.packs, self.values = claims, packs, values
        self.fresh: list[dict[str, Any]] = []

    def allocate(self, node: dict[str, Any], where: str) -> bool:
        """Allocate the dict node in columns ``node`` (at ``where``): into ``into=``'s own
        tensors where every leaf is filled directly (its :class:`ColumnTargets` among the
        targets), or, with no targets at all, fresh leaves (each packed one a tensor of its own
        over its bytes in the pack, as :meth:`Packs.tensor` makes it). False, nothing done, for
        anything else or anything a check refuses."""
        targets = self.packs.targets
        target = targets.get(id(node)) if targets else None
        if isinstance(target, ColumnTargets):
            if target.cols_node is not node:
                return False
            return self._into(node, where, target)
        if targets:  # into='s leaves here are targets leaf by leaf, or none is
            return False
        return self._fresh(node, where)

    def _plan(
        self, cols: Columns, nbytes: np.ndarray[Any, Any], item: np.ndarray[Any, Any]
    ) -> _ColumnPlan | None:
        """What the leaves of ``cols`` (of ``nbytes`` each, elements of ``item`` bytes) claim,
        every check of the walk leaf by leaf (:meth:`Packs.slot`, :meth:`BlobClaims.claim`)
        made for all of them at once; None if one fails. Changes nothing."""
        if _holds_bools(cols):
            return None
        sizes = np.asarray(self.claims.sizes, np.int64)
        b, at = cols.b, cols.at
        # -1: a reference out of range, left invalid by a selection of keys (engine/_select).
        if len(b) and (int(b.max()) >= len(sizes) or int(b.min()) < 0):
            return None
        packed = at >= 0
        if (packed & (nbytes == 0)).any():
            return None  # an empty packed leaf: as Packs.tensor takes it
        pk = np.flatnonzero(packed)
        runs = pack_runs(b[pk], at[pk], nbytes[pk], item[pk], sizes)
        if runs is None:
            return None
        runs = [(blob, start, end, int(pk[i])) for blob, start, end, i in runs]
        if not all(self.packs.follows(blob, start) for blob, start, _end, _i in runs):
            return None  # claimed by a leaf of its own, or over an earlier leaf
        # Leaves of a blob of their own (empty ones included): the whole blob, claimed once.
        own = np.flatnonzero(~packed)
        ob = b[own]
        if (
            (nbytes[own] != sizes[ob]).any()
            or len(np.unique(ob)) != len(ob)
            or np.isin(ob, b[pk]).any()
            or any(self.claims.dest[x] is not None for x in ob.tolist())
        ):
            return None
        return _ColumnPlan(pk, runs, own)

    def _claim_packs(self, plan: _ColumnPlan, cols: Columns, paths: _LeafPaths) -> None:
        """Claim the packs ``plan``'s packed leaves are the first of, and count their leaves."""
        self.packs.claim_runs(plan.packs, paths)
        blobs, counts = np.unique(cols.b[plan.packed], return_counts=True)
        for blob, n in zip(blobs.tolist(), counts.tolist(), strict=True):
            self.packs.columns[blob] += n

    def _into(self, node: dict[str, Any], where: str, target: ColumnTargets) -> bool:
        """:meth:`allocate` into ``into=``'s tensors: each packed leaf noted for
        :meth:`Packs.fill`, each other leaf's blob claimed by its tensor."""
        cols, nbytes = target.cols, target.nbytes
        plan = self._plan(cols, nbytes, target.item)
        if plan is None:
            return False
        paths = _LeafPaths(node, where)
        self._claim_packs(plan, cols, paths)
        claims, leaves = self.claims, target.leaves
        for i, blob in zip(plan.own.tolist(), cols.b[plan.own].tolist(), strict=True):
            x = leaves[i]
            view = byte_view(x.detach()) if nbytes[i] else memoryview(bytearray())
            claims.claim(blob, view, paths(i))
            claims.direct[blob] = bool(nbytes[i])
            claims.name(blob, paths(i))
        pk = plan.packed
        if len(pk):
            fills = (cols.b[pk], cols.at[pk], nbytes[pk], target.ptrs[pk])
            self.packs.column_fills.append(fills)
        self.values[id(node)] = leaves
        return True

    def _fresh(self, node: dict[str, Any], where: str) -> bool:
        """:meth:`allocate` of fresh leaves, where every leaf has at most two dimensions of
        fewer than 2**31 elements (as the walk's plain-tensor route takes them)."""
        cols = dict_columns(node, where or "<root>")
        if (
            cols is None
            or not cols.count
            or (cols.ndim > 2).any()
            or (cols.dims >= SMALL_DIM).any()
        ):
            return False
        dtypes = _torch_dtypes(cols, where)
        if dtypes is None:
            return False
        item = np.array([itemsize(d) for d in dtypes], np.int64)[cols.dtype]
        counts = cols.elements()  # two dims below 2**31 each: no wrap
        if (counts > MAX_BLOB_BYTES // item).any():
            return False  # more than any blob holds (and counts * item might wrap)
        nbytes = counts * item
        plan = self._plan(cols, nbytes, item)
        if plan is None:
            return False
        paths = _LeafPaths(node, where)
        self._claim_packs(plan, cols, paths)
        kinds = [dtypes[i] for i in cols["dtype"]]
        self.values[id(node)] = self._fresh_leaves(cols, plan, kinds, item, nbytes, paths)
        self.fresh.append(node)
        return True

    def _fresh_leaves(
        self,
        cols: Columns,
        plan: _ColumnPlan,
        kinds: list[Any],
        item: np.ndarray[Any, Any],
        nbytes: np.ndarray[Any, Any],
        paths: _LeafPaths,
    ) -> list[Any]:
        """The leaves of ``cols`` (of dtypes ``kinds``, elements of ``item`` bytes, ``nbytes``
        each) that ``plan`` claims, made: each packed
        one over its bytes in its pack, each other one over its mapped blob or fresh."""
        torch = require_torch()
        frombuffer, empty = torch.frombuffer, torch.empty
        claims, dest = self.claims, self.claims.dest
        dims, leaves = cols["dims"], [None] * cols.count
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
            t = frombuffer(dest[blob][at : at + n], dtype=kinds[i])
            leaves[i] = t if ndims[i] == 1 else t.view(dims[starts[i] : stops[i]])
        for i, blob in zip(plan.own.tolist(), cols.b[plan.own].tolist(), strict=True):
            shape = dims[starts[i] : stops[i]]
            placed = claims.mapped(blob, int(item[i]))
            if placed is not None:
                t = frombuffer(placed, dtype=kinds[i]).view(shape)
                claims.claim(blob, placed, paths(i))
            else:
                t = empty(shape, dtype=kinds[i])
                claims.claim(blob, byte_view(t) if nbytes[i] else memoryview(bytearray()), paths(i))
            claims.name(blob, paths(i))
            leaves[i] = t
        flagged = np.flatnonzero(cols.flags).tolist()
        for i, flags in zip(flagged, cols.flags[cols.flags != 0].tolist(), strict=True):
            marks = {"param": bool(flags & columns.PARAM), "grad": bool(flags & columns.GRAD)}
            leaves[i] = as_leaf(leaves[i], marks, paths(i))
        return leaves

    def expand(self, tensors: list[tuple[dict[str, Any], int, Any]]) -> None:
        """The fresh leaves of dict nodes in columns noted leaf by leaf, by the nodes the
        columns stand for, in ``values`` and ``tensors`` (what a move to a device walks); the
        nodes then build leaf by leaf."""
        for node in self.fresh:
            cols = dict_columns(node, "")
            assert cols is not None
            leaves = self.values.pop(id(node))
            for child, leaf, blob in zip(cols.nodes(), leaves, cols.b.tolist(), strict=True):
                self.values[id(child)] = leaf
                tensors.append((child, blob, None))
        self.fresh.clear()


def _holds_bools(cols: Columns) -> bool:
    """Whether a column that the leaves' nodes take as stored (``dims``, ``b``, ``at``:
    :meth:`Columns.nodes`) holds a JSON ``true`` or ``false``: numpy read it as 1 or 0, the walk
    leaf by leaf refuses it. (About 12 ns a value.)"""
    return any(bool in set(map(type, cols[field])) for field in ("dims", "b", "at"))


def _torch_dtypes(cols: Columns, where: str) -> list[Any] | None:
    """The torch dtype of each of ``cols``' dtype names; None if one is unknown (the walk
    leaf by leaf names the leaf)."""
    dtypes = []
    for name in cols.dtypes:
        dtype = TORCH_DTYPES.get(name)
        if dtype is None:
            try:
                dtype = find_torch_dtype(name, where)
            except CheckpointFormatError:
                return None
        dtypes.append(dtype)
    return dtypes
