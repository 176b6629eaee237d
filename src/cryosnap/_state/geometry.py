"""The geometry a manifest claims for a leaf, checked against its blob before anything is
allocated for it: its shape, the bytes that shape needs, its place in a blob of its own or in a
pack, the view of a shared storage it may be.

Each rule is written once here. A packed leaf's place is :func:`in_pack`: the walk leaf by leaf
asks it (:func:`check_pack_offset`, which names what is wrong), the columns of a state dict ask
its vector form (:func:`pack_runs`), and the two fast routes that take a state dict's leaves
one by one inline its expression, as a call per leaf would cost them more than the rest of the
check (tests/unit/state/test_routes_differential.py holds every route to the walk's answers).
Pure (:func:`view_of` aside, a tensor over memory already allocated); any thread.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cryosnap._format.skeleton import MAX_ELEMENTS, MAX_NDIM
from cryosnap._state.dtypes import require_torch
from cryosnap.errors import CheckpointFormatError

__all__ = [
    "SMALL_DIM",
    "Geometry",
    "check_pack_offset",
    "checked_shape",
    "checked_view",
    "expect_bytes",
    "in_pack",
    "pack_runs",
    "small_elements",
    "view_of",
]

SMALL_DIM = 2**31  # two such dimensions multiply to less than MAX_ELEMENTS

# A view's place in its shared storage: offset in elements, shape, stride.
Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]


def small_elements(shape: list[Any]) -> int:
    """The elements of ``shape`` (a list) if it has one or two dimensions, each an int below
    SMALL_DIM (a state dict's common leaf, well inside every limit :func:`checked_shape`
    sets); -1 for anything else."""
    if len(shape) == 1:
        d0 = shape[0]
        return d0 if type(d0) is int and 0 <= d0 < SMALL_DIM else -1
    if len(shape) == 2:
        d0, d1 = shape
        if type(d0) is int and type(d1) is int and 0 <= d0 < SMALL_DIM and 0 <= d1 < SMALL_DIM:
            return d0 * d1
    return -1


def checked_shape(node: dict[str, Any], path: str) -> tuple[int, ...]:
    """The shape of the leaf ``node`` at ``path``: at most MAX_NDIM dimensions of at most
    MAX_ELEMENTS elements in all."""
    shape = node.get("shape")
    # The common case (vectors, matrices) in a few operations: well inside every limit.
    if (
        type(shape) is list
        and len(shape) <= 2
        and all(type(s) is int and 0 <= s < SMALL_DIM for s in shape)
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


def expect_bytes(shape: tuple[int, ...], itemsize: int, have: int, path: str) -> None:
    """Refuse a leaf whose shape does not fill its blob of its own (``have`` bytes) exactly."""
    need = math.prod(shape) * itemsize
    if need != have:
        raise CheckpointFormatError(
            f"leaf {path}: shape {list(shape)} of {itemsize}-byte items needs {need} bytes, "
            f"its blob has {have}"
        )


def in_pack(at: int, nbytes: int, item: int, size: int) -> bool:
    """Whether a packed leaf of ``nbytes`` in elements of ``item`` bytes, at byte ``at`` (an
    int) of its pack of ``size`` bytes, lies inside the pack at a multiple of its element size
    (a packed leaf's elements have bytes). Whether it also lies after the leaf packed before
    it is the pack's ledger to say (packs.py)."""
    return item > 0 and 0 <= at <= size - nbytes and not at % item


def check_pack_offset(at: Any, nbytes: int, item: int, size: int, path: str) -> None:
    """:func:`in_pack` for a leaf's ``at`` as the manifest holds it: the error naming what is
    wrong if it says no."""
    if item <= 0:  # never written: a packed leaf has bytes
        raise CheckpointFormatError(f"leaf {path}: packed with elements of {item} bytes")
    if type(at) is not int or not in_pack(at, nbytes, item, size):
        raise CheckpointFormatError(f"leaf {path}: malformed pack offset {at!r:.40}")


def pack_runs(
    b: np.ndarray[Any, Any],
    at: np.ndarray[Any, Any],
    nbytes: np.ndarray[Any, Any],
    item: np.ndarray[Any, Any],
    sizes: np.ndarray[Any, Any],
) -> list[tuple[int, int, int, int]] | None:
    """:func:`in_pack` of many packed leaves at once (blobs ``b``, offsets ``at``, ``nbytes``
    each, elements of ``item`` bytes, in packs of ``sizes`` bytes by blob), and each after the
    one before it in the same pack: per pack, in blob order, ``(blob, first offset, end, index
    of its first leaf)``; None if one leaf fails."""
    if (item <= 0).any() or (at < 0).any() or (at > sizes[b] - nbytes).any() or (at % item).any():
        return None
    order = np.argsort(b, kind="stable")
    sb, sat, send = b[order], at[order], at[order] + nbytes[order]
    same = sb[1:] == sb[:-1]
    if (same & (sat[1:] < send[:-1])).any():
        return None  # over the leaf before it: never as saved
    if not len(sb):
        return []
    first = np.flatnonzero(np.r_[True, ~same])
    last = np.r_[first[1:] - 1, len(sb) - 1]
    return list(
        zip(
            sb[first].tolist(),
            sat[first].tolist(),
            send[last].tolist(),
            order[first].tolist(),
            strict=True,
        )
    )


def checked_view(view: Any, shape: tuple[int, ...], item: int, size: int, path: str) -> Geometry:
    """The geometry of the leaf at ``path``, a ``view`` (as the manifest holds it) of ``shape``
    in elements of ``item`` bytes over a shared storage of ``size`` bytes: aligned, inside it."""
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
    if math.prod(shape) and offset + (extent + 1) * item > size:
        raise CheckpointFormatError(f"leaf {path}: view reaches past its blob")
    return offset // item, shape, tuple(stride)


def view_of(base: Any, dtype: Any, geometry: Geometry) -> Any:
    """A tensor of ``dtype`` over the storage of ``base`` at ``geometry``, on ``base``'s
    device."""
    offset, shape, stride = geometry
    t = require_torch().empty(0, dtype=dtype, device=base.device)
    return t.set_(base.untyped_storage(), offset, shape, stride)
