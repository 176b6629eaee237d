"""The packs of a restore: small leaves saved back to back in one blob (flatten's ``_Packer``),
each restored as a tensor or array of its own over its bytes in the pack's memory (claimed
once, by the pack's first leaf: mapped where it lies, else allocated), or, for a leaf of
``into=``, copied there from the verified pack (:meth:`Packs.fill`).

:class:`Packs` is the ledger of one restore's packs and their two routes: the checked one, leaf
by leaf (:meth:`Packs.slot`: geometry.py's rule of a leaf's place in its pack, the error naming
what is wrong), and the fast one of a dict of small arrays (:meth:`Packs.try_array`; the
Restorer's plain-tensor route reads ``ends`` too), which inlines that rule, may only accept
what the checked one accepts and leaves anything else to it. Pure (:meth:`Packs.fill`: the
kernel's copies); the caller's thread.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from cryosnap import _native
from cryosnap._state.claims import MAX_ALIGN, BlobClaims
from cryosnap._state.dtypes import NP_DTYPES, byte_view, require_torch
from cryosnap._state.geometry import check_pack_offset, small_elements
from cryosnap.errors import CheckpointFormatError

__all__ = ["Packs"]


class Packs:
    """The packs of one restore, by blob: where the last of its leaves so far ends (``ends``:
    the leaves of a pack come in the order they were packed, each after the one before); the
    packed leaves to copy into ``into=``'s own tensors and arrays (``fills``: offset in the
    pack, bytes, ``into=``'s leaf; ``column_fills``: per dict node in columns, its packs,
    offsets, bytes and ``into=``'s addresses); and how many leaves of dict nodes in columns
    (``columns``) and numpy leaves (``arrays``) each holds. The leaves made go to ``values``
    (by node id); ``targets``: ``into=``'s leaves to fill, by node id."""

    __slots__ = (
        "_dest",
        "_sizes",
        "arrays",
        "claims",
        "column_fills",
        "columns",
        "ends",
        "fills",
        "targets",
        "values",
    )

    def __init__(self, claims: BlobClaims, values: dict[int, Any]) -> None:
        self.claims = claims
        self._dest, self._sizes = claims.dest, claims.sizes  # for try_array, one lookup away
        self.values = values
        self.targets: Mapping[int, Any] = {}
        self.ends: dict[int, int] = {}
        self.fills: dict[int, list[tuple[int, int, Any]]] = {}
        self.column_fills: list[tuple[Any, Any, Any, Any]] = []
        self.columns: Counter[int] = Counter()
        self.arrays: Counter[int] = Counter()

    def slot(
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
        ``into=``'s leaf for it (None: not a target), its fill noted for :meth:`fill`."""
        check_pack_offset(node.get("at"), need, item, self.claims.sizes[b], path)
        at: int = node["at"]
        claims = self.claims
        dest = claims.dest[b]
        if dest is None:
            dest = claims.mapped(b, MAX_ALIGN)
            if dest is None:
                dest = fresh(claims.sizes[b])
            claims.claim(b, dest, path)
            self.fills[b] = []
        elif b not in self.ends:
            raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
        elif at < self.ends[b]:
            # Leaves over the same bytes would change each other: never as saved.
            raise CheckpointFormatError(f"leaf {path}: overlaps the leaf packed before it")
        self.ends[b] = at + need
        target = self.targets.get(id(node))
        if target is not None and need:
            self.fills[b].append((at, need, target))
        return dest, target

    def tensor(
        self, node: dict[str, Any], b: int, dtype: Any, item: int, shape: tuple[int, ...], path: str
    ) -> Any:
        """The tensor of a packed leaf: its own tensor over its bytes in the pack's memory; for
        one of the targets, that target, the leaf noted for :meth:`fill`."""
        torch = require_torch()
        need = math.prod(shape) * item
        dest, target = self.slot(
            node, b, item, need, path, lambda n: byte_view(torch.empty(n, dtype=torch.uint8))
        )
        if target is not None:
            return target
        at: int = node["at"]  # checked by slot
        if not need:
            return torch.empty(shape, dtype=dtype)
        # A storage of its own over the pack's memory (which it keeps alive): the leaf is as
        # independent of its neighbours as when it was saved.
        return torch.frombuffer(dest[at : at + need], dtype=dtype).view(shape)

    def array(
        self,
        node: dict[str, Any],
        b: int,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        order: Literal["C", "F"],
        path: str,
    ) -> Any:
        """The array of a packed numpy leaf, as :meth:`tensor` makes a packed tensor's: over
        its bytes in the pack's memory (a numpy buffer where nothing else claimed it), or
        ``into=``'s own array, filled by :meth:`fill`."""
        need = math.prod(shape) * dtype.itemsize
        dest, target = self.slot(
            node, b, dtype.itemsize, need, path, lambda n: np.empty(n, np.uint8).data
        )
        self.arrays[b] += 1
        if target is not None:
            return target
        at: int = node["at"]  # checked by slot
        if not need:
            return np.empty(shape, dtype=dtype, order=order)
        flat = np.frombuffer(dest[at : at + need], dtype=dtype)
        return flat.reshape(shape[::-1]).T if order == "F" else flat.reshape(shape)

    def try_array(self, node: Any) -> bool:
        """Take ``node`` if it is a dict of small arrays' common leaf (a packed C-order array
        of a descr parsed before and up to two dimensions, in a pack an earlier leaf claimed),
        as :meth:`array` would; False (nothing done) for anything else, which the walk then
        takes leaf by leaf, errors included."""
        if type(node) is not dict or node.get("t") != "numpy" or "order" in node:
            return False
        descr, shape, b, at = node.get("dtype"), node.get("shape"), node.get("b"), node.get("at")
        dtype = NP_DTYPES.get(descr) if type(descr) is str else None
        if dtype is None or type(shape) is not list or type(b) is not int or type(at) is not int:
            return False
        end = self.ends.get(b)
        if end is None or at < end:
            return False  # not packed here yet (the first leaf), or over the leaf before it
        n = len(shape)
        count = small_elements(shape) if n else 1  # 0-d: one element
        if count < 0:
            return False
        item = dtype.itemsize
        nbytes = count * item
        # geometry.in_pack, inline, as in the Restorer's plain-tensor route (which says why).
        if not nbytes or at % item or at + nbytes > self._sizes[b]:
            return False
        self.ends[b] = at + nbytes
        self.arrays[b] += 1
        target = self.targets.get(id(node)) if self.targets else None
        if target is not None:  # filled by fill, no array made for it
            self.fills[b].append((at, nbytes, target))
            self.values[id(node)] = target
            return True
        flat = np.frombuffer(self._dest[b][at : at + nbytes], dtype=dtype)
        self.values[id(node)] = flat if n == 1 else flat.reshape(shape)
        return True

    def follows(self, b: int, at: int) -> bool:
        """Whether a packed leaf at ``at`` of blob ``b`` may be the next of its pack: the
        blob unclaimed (the leaf claims it), or a pack whose leaves so far end by ``at``."""
        end = self.ends.get(b)
        return self.claims.dest[b] is None or (end is not None and at >= end)

    def claim_runs(
        self, runs: list[tuple[int, int, int, int]], paths: Callable[[int], str]
    ) -> None:
        """Claim the packs of ``runs`` (``(blob, first offset, end, its first leaf)``, from
        :func:`geometry.pack_runs`) that no leaf claimed yet, named by their first leaf
        (``paths``, by leaf), and note where each one's leaves end."""
        claims = self.claims
        for blob, _start, end, i in runs:
            if claims.dest[blob] is None:
                dest = claims.mapped(blob, MAX_ALIGN)
                if dest is None:
                    torch = require_torch()
                    dest = byte_view(torch.empty(claims.sizes[blob], dtype=torch.uint8))
                claims.claim(blob, dest, paths(i))
                self.fills[blob] = []
            if not claims.paths[blob]:
                claims.paths[blob] = paths(i)
            self.ends[blob] = end

    def fill(self) -> None:
        """Copy the packed leaves noted for ``into=`` from their verified packs into its
        tensors and arrays: every piece in one :func:`cryosnap._native.copy_pieces` (the
        kernel's copies, the pieces shared between threads), not a ``memmove`` each on this
        thread."""
        dests: list[Any] = []
        sources: list[Any] = []
        sizes: list[Any] = []
        bases: dict[int, int] = {}
        dest = self.claims.dest
        for b, fills in self.fills.items():
            if fills:
                base = bases[b] = _native.address_of(dest[b])
                address = _native.leaf_address
                rows = np.array([(address(t), at, n) for at, n, t in fills], np.int64)
                dests.append(rows[:, 0])
                sources.append(rows[:, 1] + base)
                sizes.append(rows[:, 2])
        for packs, offsets, nbytes, ptrs in self.column_fills:
            for b in set(packs.tolist()) - bases.keys():
                bases[b] = _native.address_of(dest[b])
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

    def name(self, tensors: list[tuple[dict[str, Any], int, Any]]) -> None:
        """Add to the path of each pack's blob how many more leaves it holds (``tensors``: the
        restore's torch leaves, each with its blob; in a pack of ``arrays``, counted there
        whole: numpy arrays), what a message about a damaged pack names."""
        packed = Counter(b for node, b, _g in tensors if "at" in node)
        packed.update({b: len(fills) for b, fills in self.fills.items() if b not in self.arrays})
        packed.update(self.columns)
        packed.update(self.arrays)
        paths = self.claims.paths
        for b, count in packed.items():
            if count > 1:
                more, kind = count - 1, "array" if b in self.arrays else "tensor"
                paths[b] += f" (packed with {more} more {kind}{'s' * (more > 1)})"
