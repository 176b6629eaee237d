"""What the lineage tests share: runs of random versions (random leaf edits, saved through one
Checkpointer, incremental), a store that counts the data bytes read, and brute-force answers
(every version loaded whole) to hold ``history``, ``changes`` and deltas against."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import cryosnap
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore
from tests.unit.support import (
    assert_same,
    big_leaves,
    make_array,
    make_tensor,
    numpy_scalars,
    python_scalars,
)

__all__ = [
    "CountingStore",
    "Edit",
    "Flat",
    "counting",
    "differs",
    "leaf_at",
    "lineages",
    "nest",
    "save_versions",
]

# A state as its leaves: key path -> value (nested into dicts by nest()).
Flat = dict[tuple[str, ...], Any]
# One version's edits: (path, new leaf) sets it, (path, None) removes it.
Edit = list[tuple[tuple[str, ...], Any]]

# Leaf paths the states draw from: leaves at the top, and inside groups (no path is both).
PATHS = [("x0",), ("x1",), ("x2",)] + [(g, y) for g in ("g0", "g1") for y in ("y0", "y1", "y2")]


class CountingStore(FaultyStore):
    """A store that counts the bytes read from data files (``data/...``), per key."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.data_bytes: dict[str, int] = {}
        self._count_lock = threading.Lock()

    def _count(self, key: str, nbytes: int) -> None:
        if key.startswith("data/"):
            with self._count_lock:
                self.data_bytes[key] = self.data_bytes.get(key, 0) + nbytes

    @property
    def total(self) -> int:
        return sum(self.data_bytes.values())

    def reset(self) -> None:
        self.data_bytes.clear()

    def read(self, key: str) -> bytes:
        data = super().read(key)
        self._count(key, len(data))
        return data

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        super().read_into(key, offset, buffers)
        self._count(key, sum(b.nbytes for b in buffers))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        super().read_ranges(key, ranges)
        self._count(key, sum(b.nbytes for _o, views in ranges for b in views))


def counting(path: Path) -> CountingStore:
    return CountingStore(LocalStore(path))


_TORCH = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.float16]
_NUMPY = [np.dtype("<f4"), np.dtype("<f8"), np.dtype("<i4"), np.dtype("u1"), np.dtype(">f8")]


@st.composite
def _leaf(draw: st.DrawFn) -> Any:
    seed = draw(st.integers(0, 2**32 - 1))
    kinds = ["tensor", "param", "array", "small", "scalar", "npscalar", "big"]
    kind = draw(st.sampled_from(kinds))
    if kind == "tensor":
        shape = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=2)))
        return make_tensor(draw(st.sampled_from(_TORCH)), shape, seed)
    if kind == "param":  # an nn.Parameter, or a tensor that requires grad
        t = make_tensor(torch.float32, (draw(st.integers(1, 40)),), seed)
        if draw(st.booleans()):
            return torch.nn.Parameter(t, requires_grad=draw(st.booleans()))
        return t.requires_grad_(True)
    if kind == "array":
        shape = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=2)))
        arr = make_array(draw(st.sampled_from(_NUMPY)), shape, seed)
        return np.asfortranarray(arr) if draw(st.booleans()) else arr
    if kind == "small":  # a few bytes: packed with its neighbours
        return make_array(np.dtype("<f4"), (draw(st.integers(1, 3)),), seed)
    if kind == "scalar":
        return draw(python_scalars())
    if kind == "npscalar":
        return draw(numpy_scalars())
    return draw(big_leaves())


def _poke(value: Any) -> Any:
    """``value`` with one element changed (same kind, dtype and shape), or None."""
    if isinstance(value, torch.Tensor) and value.numel():
        out = value.detach().clone()
        raw = out.reshape(-1).view(torch.uint8)
        raw[-1] ^= 1 if out.dtype == torch.bool else 0x55
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=value.requires_grad)
        return out.requires_grad_(value.requires_grad)
    if isinstance(value, np.ndarray) and value.size:
        out = value.copy(order="K")
        out.reshape(-1, order="A").view(np.uint8)[-1] ^= 1 if out.dtype == np.bool_ else 0x55
        return out
    return None


@st.composite
def lineages(draw: st.DrawFn, versions: int = 4) -> tuple[Flat, list[Edit]]:
    """A first state and the edits of each later version: leaves set anew (another kind,
    dtype or shape at times), changed in one element, added, removed."""
    first = {
        p: draw(_leaf())
        for p in draw(st.lists(st.sampled_from(PATHS), min_size=1, max_size=6, unique=True))
    }
    state = dict(first)
    edits: list[Edit] = []
    for _ in range(draw(st.integers(1, versions - 1))):
        edit: Edit = []
        for path in draw(st.lists(st.sampled_from(PATHS), max_size=3, unique=True)):
            op = draw(st.sampled_from(["set", "poke", "drop"]))
            value: Any = None
            if op == "poke" and path in state:
                value = _poke(state[path])
            if op == "set" or (op == "poke" and value is None):
                value = draw(_leaf())
            if value is None and len(state) - (path in state) < 1:
                continue  # keep a leaf
            edit.append((path, value))
            if value is None:
                state.pop(path, None)
            else:
                state[path] = value
        edits.append(edit)
    return first, edits


def nest(flat: Flat) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def save_versions(path: Path, first: Flat, edits: list[Edit], *, step0: int = 10) -> list[int]:
    """Save ``first`` and each edit as versions ``step0``, ``step0 + 10``..., through one
    Checkpointer (incremental, small chunks); the steps."""
    state = dict(first)
    steps = [step0 + 10 * i for i in range(len(edits) + 1)]
    with cryosnap.Checkpointer(path, chunk_bytes=4096) as ckpt:
        ckpt.save(steps[0], nest(state)).result()
        for step, edit in zip(steps[1:], edits, strict=True):
            for key, value in edit:
                if value is None:
                    state.pop(key, None)
                else:
                    state[key] = value
            ckpt.save(step, nest(state)).result()
    return steps


def leaf_at(tree: Any, path: str) -> tuple[bool, Any]:
    """Whether ``tree`` (a nested dict) holds ``path`` (keys joined by ``/``), and the node."""
    node = tree
    for key in path.split("/"):
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def differs(a: Any, b: Any) -> bool:
    """Whether two loaded values differ in anything a load can tell (types, dtype, shape,
    bytes, memory order), checked both ways."""
    try:
        assert_same(a, b)
        assert_same(b, a)
    except AssertionError:
        return True
    return False
