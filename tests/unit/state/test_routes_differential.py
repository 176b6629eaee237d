"""The routes of a restore agree (issue 57): a leaf of a saved skeleton rewritten one field at
a time (offset, blob, shape, dtype, byte order, view, flags; a column of a state dict in
columns; a blob's size), then restored by the fast routes (``Restorer``'s default: plain
tensors and small arrays of a state dict, state dicts in columns in bulk) and by the walk leaf
by leaf (``fast_routes=False``), each into fresh memory or over "mapped" blobs (``place``):
both return the same tree, or both refuse with the same :class:`CheckpointError`.

A fast route may only accept what the walk accepts; the checks it makes are its own copies
(inline for speed) or geometry.py's vector forms, and this is what holds them to the walk's.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from cryosnap._format import columns
from cryosnap._format.skeleton import dict_columns
from cryosnap._state import Restorer, flatten
from cryosnap._state.dtypes import np_dtype, torch_dtype
from cryosnap._state.geometry import in_pack, pack_runs
from cryosnap.errors import CheckpointError, CheckpointFormatError

from ..support import assert_same

PACK = 4096  # packs of 4 KiB: leaves of up to 1 KiB are packed


@dataclass(frozen=True)
class Base:
    """A saved state: its skeleton as JSON text, its blobs' bytes."""

    name: str
    text: str = field(repr=False)
    blobs: list[bytes] = field(repr=False)


def _state_dict(*, deep: bool) -> dict[str, Any]:
    """A state dict whose pack leaves gaps after a few leaves (``c``, ``d``: a leaf moved into
    one is misaligned, over no other); ``deep``: with a tensor of three dimensions (no fast
    route takes it, nor the columns of its dict in bulk)."""
    g = torch.Generator().manual_seed(0)
    deeper = {"k": torch.randn(2, 2, 2, generator=g)} if deep else {}
    return {
        "a": torch.randn(2, 3, generator=g),  # packed at 0
        "c": torch.ones(3, dtype=torch.float16),  # at 24, 2 bytes before the next
        "b": torch.arange(5, dtype=torch.int64),  # at 32
        "h": torch.randn(3, generator=g).requires_grad_(),
        "l": torch.tensor(7, dtype=torch.int32),  # 0-d
        "i": torch.tensor([True, False, True]),
        "g": torch.nn.Parameter(torch.randn(4, generator=g)),
        "j": torch.arange(6, dtype=torch.uint8).reshape(3, 2),
        "d": torch.full((2, 2), 1.5, dtype=torch.bfloat16),  # no numpy dtype; 6 bytes before
        "m": torch.ones(1, dtype=torch.float64),
        "e": torch.arange(400, dtype=torch.float64),  # 3,200 B: a blob of its own
        "e2": torch.arange(800, dtype=torch.float32),  # as many bytes
        "f": torch.zeros(0),  # empty: a blob of 0 bytes
        **deeper,
    }


def _arrays() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        **{f"x{i}": rng.standard_normal(3 + i).astype(np.float32) for i in range(6)},
        "m": np.arange(12, dtype=np.int16).reshape(3, 4),
        "s": np.float64(2.5) * np.ones((), np.float64),  # 0-d
        "big": rng.standard_normal(300),  # 2,400 B: a blob of its own
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
        "swapped": np.arange(4, dtype=">f4"),
        "u1": np.arange(5, dtype=np.uint8),
    }


def _views() -> dict[str, Any]:
    base = torch.arange(12, dtype=torch.float32)
    return {"base": base, "part": base[2:8], "grid": base.view(3, 4), "t": base.view(3, 4).t()}


def _in_columns(node: Any) -> Any:
    """``node`` with each dict of tensor leaves in columns, as the manifest writer stores it."""
    if not isinstance(node, dict):
        return node
    if node.get("t") in ("dict", "odict") and isinstance(node.get("v"), list):
        table = columns.encode(node["v"])
        if table is not None:
            return {**{k: v for k, v in node.items() if k != "v"}, "cols": table}
        return {**node, "v": [_in_columns(v) for v in node["v"]]}
    if node.get("t") in ("list", "tuple"):
        return {**node, "v": [_in_columns(v) for v in node["v"]]}
    return node


def _base(name: str, state: Any, *, cols: bool) -> Base:
    flat = flatten(state, pack_bytes=PACK)
    skeleton = json.loads(json.dumps(flat.skeleton))
    if cols:
        skeleton = _in_columns(skeleton)
    blobs = [bytes(b.host_view()) for b in flat.blobs]
    return Base(name, json.dumps(skeleton), blobs)


BASES = [
    _base(
        "state dict in columns",
        # Before it, a leaf in its pack and one of a blob of its own: what its leaves may
        # be rewritten to lie over.
        {"first": torch.arange(3.0), "emb": torch.ones(500), "model": _state_dict(deep=False)},
        cols=True,
    ),
    _base("state dict leaf by leaf", {"model": _state_dict(deep=True), "step": 3}, cols=False),
    _base("dict of arrays", _arrays(), cols=False),
    _base("views and arrays", {"w": torch.ones(4), "v": _views(), "a": _arrays()}, cols=False),
]
assert "cols" in json.loads(BASES[0].text)["v"][2]

TORCH_NAMES = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
    "float8_e4m3fn",
]
NUMPY_DESCRS = ["<f4", ">f4", "<f8", ">f8", "|u1", "|i1", "<i2", ">i2", "<i8", "|b1", "<c8"]
# Every dtype a rewrite may name is known before: the fast routes take only those.
for _name in TORCH_NAMES:
    torch_dtype(_name, "")
for _descr in NUMPY_DESCRS:
    np_dtype(_descr, "")

ODD: list[Any] = [
    -(2**63),
    -1,
    2**31,
    2**40,
    2**63 - 1,
    2**63,
    2**64 + 1,
    None,
    True,
    1.5,
    "7",
    [],
    {},
]


def _near(value: Any) -> st.SearchStrategy[Any]:
    """Ints near ``value`` (an off-by-a-few offset, blob, dimension), or absurd values."""
    base = value if type(value) is int else 0
    return st.one_of(
        st.integers(-3, 3).map(lambda d: base + d),
        st.integers(-24, 24).map(lambda d: base + d),
        st.integers(0, 1 << 13),
        st.booleans(),  # JSON's true and false: ints to numpy, not to the walk
        st.sampled_from(ODD),
    )


def _shapes(shape: Any) -> st.SearchStrategy[Any]:
    dims = st.lists(st.integers(0, 12), max_size=4)
    if isinstance(shape, list) and shape:
        swapped = st.just(shape[::-1])
        grown = st.integers(0, len(shape) - 1).flatmap(
            lambda i: st.integers(-2, 2).map(lambda d: [*shape[:i], shape[i] + d, *shape[i + 1 :]])
        )
        return st.one_of(dims, swapped, grown, st.just([*shape, 1]), st.sampled_from(ODD))
    return st.one_of(dims, st.sampled_from(ODD))


def _leaf_edit(node: dict[str, Any], nblobs: int) -> st.SearchStrategy[tuple[str, Any]]:
    """A rewrite of one field of the leaf ``node`` (of a skeleton of ``nblobs`` blobs):
    (field, new value; ``...`` drops it)."""
    names = TORCH_NAMES if node["t"] == "torch" else NUMPY_DESCRS
    views = st.fixed_dictionaries(
        {"offset": st.integers(0, 64), "stride": st.lists(st.integers(0, 5), max_size=3)}
    )
    fields: dict[str, st.SearchStrategy[Any]] = {
        "at": _near(node.get("at", 0)),
        "b": st.one_of(st.integers(0, nblobs - 1), _near(node.get("b"))),
        "shape": _shapes(node.get("shape")),
        "dtype": st.one_of(st.sampled_from(names), st.sampled_from(["nonsense", 7, None])),
        "view": st.one_of(views, st.sampled_from(["x", None])),
        "order": st.sampled_from(["F", "C", "Z"]),
        "param": st.sampled_from([True, False, 1]),
        "grad": st.sampled_from([True, False, 1]),
        "t": st.sampled_from(["torch", "numpy", "bytes"]),
    }
    # The geometry, more often than the rest.
    field = st.sampled_from(["at", "at", "b", "shape", "shape", "dtype", *sorted(fields)])
    return st.one_of(
        field.flatmap(lambda f: fields[f].map(lambda v: (f, v))),
        field.map(lambda f: (f, ...)),
    )


def _column_edit(
    cols: dict[str, Any], i: int, nblobs: int
) -> st.SearchStrategy[tuple[str, int, Any]]:
    """A rewrite of leaf ``i``'s entry in one column (for ``dims`` and ``dtypes``, an entry
    of those lists) of a skeleton of ``nblobs`` blobs: (column, index, new value)."""
    per_leaf = ["at", "at", "at", "b", "dtype", "ndim", "flags", "device"]
    leaf = st.sampled_from(per_leaf).flatmap(lambda f: _near(cols[f][i]).map(lambda v: (f, i, v)))
    options = [leaf, leaf, leaf, st.integers(0, nblobs - 1).map(lambda v: ("b", i, v))]
    if cols["dims"]:
        options.append(
            st.integers(0, len(cols["dims"]) - 1).flatmap(
                lambda j: _near(cols["dims"][j]).map(lambda v: ("dims", j, v))
            )
        )
    options.append(
        st.integers(0, len(cols["dtypes"]) - 1).flatmap(
            lambda k: st.sampled_from([*TORCH_NAMES, "nonsense"]).map(lambda v: ("dtypes", k, v))
        )
    )
    return st.one_of(options)


def _sites(node: Any, out: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Every leaf a rewrite may touch: ("leaf", node) or ("column", cols, i)."""
    if not isinstance(node, dict):
        return out
    if "cols" in node:
        out.extend(("column", node["cols"], i) for i in range(len(node["cols"]["b"])))
    elif node.get("t") in ("torch", "numpy"):
        out.append(("leaf", node))
    for v in node.get("v", []) if isinstance(node.get("v"), list) else []:
        _sites(v, out)
    return out


def _mutate(data: st.DataObject, base: Base) -> tuple[str, list[int]]:
    """A rewritten skeleton (as JSON text) and blob sizes: one field of one leaf, or the
    size of one blob."""
    skeleton = json.loads(base.text)
    sizes = [len(b) for b in base.blobs]
    if data.draw(st.integers(0, 9), label="size?") == 0:
        b = data.draw(st.integers(0, len(sizes) - 1), label="blob")
        sizes[b] = max(0, sizes[b] + data.draw(st.integers(-24, 24), label="size change"))
        return json.dumps(skeleton), sizes
    site = data.draw(st.sampled_from(_sites(skeleton, [])), label="site")
    if site[0] == "leaf":
        node = site[1]
        field, value = data.draw(_leaf_edit(node, len(sizes)), label=f"edit of {node}")
        if value is ...:
            node.pop(field, None)
        else:
            node[field] = value
    else:
        cols, i = site[1], site[2]
        edit = _column_edit(cols, i, len(sizes))
        name, j, value = data.draw(edit, label=f"column edit of leaf {i}")
        cols[name][j] = value
    return json.dumps(skeleton), sizes


def _place(blobs: list[bytes], sizes: list[int]) -> Callable[[int, int], memoryview | None]:
    """A ``place`` as a mapped data file gives it: each blob's bytes at a 64-byte boundary."""
    keep: list[np.ndarray[Any, Any]] = []

    def place(b: int, alignment: int) -> memoryview | None:
        raw = np.zeros(sizes[b] + 64, np.uint8)
        keep.append(raw)
        start = -raw.ctypes.data % 64
        if start % alignment:
            return None
        mem = raw[start : start + sizes[b]]
        n = min(len(blobs[b]), sizes[b])
        mem[:n] = np.frombuffer(blobs[b], np.uint8)[:n]
        return mem.data

    return place


def _restore(text: str, sizes: list[int], blobs: list[bytes], *, fast: bool, mapped: bool) -> Any:
    """The tree a restore of ``text`` builds, or the CheckpointError it raises (anything else
    propagates: an escape)."""
    restorer = Restorer(json.loads(text), sizes, allow_pickle=False, fast_routes=fast)
    try:
        views = restorer.allocate(place=_place(blobs, sizes) if mapped else None)
        for blob, view in zip(blobs, views, strict=True):
            n = min(len(blob), view.nbytes)
            view[:n] = blob[:n]
        return restorer.build()
    except CheckpointError as exc:
        return exc


def _same_outcome(slow: Any, fast: Any) -> None:
    if isinstance(slow, CheckpointError) or isinstance(fast, CheckpointError):
        assert type(fast) is type(slow) and str(fast) == str(slow), (slow, fast)
    else:
        assert_same(slow, fast)


@pytest.mark.parametrize("base", BASES, ids=[b.name for b in BASES])
def test_the_routes_restore_an_intact_state_alike(base: Base) -> None:
    sizes = [len(b) for b in base.blobs]
    for mapped in (False, True):
        slow = _restore(base.text, sizes, base.blobs, fast=False, mapped=mapped)
        assert not isinstance(slow, CheckpointError), slow
        _same_outcome(slow, _restore(base.text, sizes, base.blobs, fast=True, mapped=mapped))


@settings(max_examples=1000)
@given(st.data())
def test_a_rewritten_leaf_is_taken_or_refused_alike_by_every_route(data: st.DataObject) -> None:
    base = data.draw(st.sampled_from([*BASES, BASES[0]]), label="base")  # columns: twice
    text, sizes = _mutate(data, base)
    mapped = data.draw(st.booleans(), label="mapped")
    note(f"skeleton {text}, sizes {sizes}")
    slow = _restore(text, sizes, base.blobs, fast=False, mapped=mapped)
    fast = _restore(text, sizes, base.blobs, fast=True, mapped=mapped)
    _same_outcome(slow, fast)


@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(-8, 600),
            st.integers(0, 64),
            st.sampled_from([0, 1, 2, 4, 8, 16]),
        ),
        max_size=12,
    ),
    st.lists(st.integers(0, 700), min_size=4, max_size=4),
)
def test_pack_runs_is_in_pack_for_every_leaf_and_the_order(
    leaves: list[tuple[int, int, int, int]], sizes: list[int]
) -> None:
    """geometry's vector form says yes exactly where in_pack says yes for each leaf and each
    leaf of a pack starts where the one before it (in the order given) ended, or after."""
    fields = list(zip(*leaves, strict=True)) if leaves else [(), (), (), ()]
    b, at, nbytes, item = (np.array(f, np.int64) for f in fields)
    runs = pack_runs(b, at, nbytes, item, np.array(sizes, np.int64))
    ends: dict[int, int] = {}
    expect = True
    for blob, a, n, i in leaves:
        if not in_pack(a, n, i, sizes[blob]) or a < ends.get(blob, 0):
            expect = False
        ends[blob] = a + n
    assert (runs is not None) == expect
    if runs is not None:
        assert [r[0] for r in runs] == sorted(ends)
        assert [r[2] for r in runs] == [ends[blob] for blob in sorted(ends)]


def test_a_column_leaf_left_without_a_blob_by_a_selection_of_keys_is_refused() -> None:
    """``load(keys=...)`` renumbers the blobs a skeleton's leaves name and leaves a reference
    out of range invalid (-1, engine/_select.py): the columns in bulk took -1 for the last
    blob (here the pack the leaf's neighbours are in) and restored another leaf's bytes; both
    routes now name the leaf."""
    base = _base("pack", {f"t{i}": torch.full((4,), float(i)) for i in range(10)}, cols=True)
    skeleton = json.loads(base.text)
    cols = dict_columns(skeleton, "")
    assert cols is not None and set(cols.b.tolist()) == {0}  # one pack, the last blob
    skeleton["cols"] = cols.with_blobs([-1, *cols.b.tolist()[1:]])
    sizes = [len(b) for b in base.blobs]
    for fast in (False, True):
        restorer = Restorer(copy.deepcopy(skeleton), sizes, allow_pickle=False, fast_routes=fast)
        with pytest.raises(CheckpointFormatError, match=r"leaf t0: invalid blob reference -1"):
            restorer.allocate()
