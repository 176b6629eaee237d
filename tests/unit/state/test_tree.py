"""cryosnap._state: flatten / restore without any storage (pure round trips and validation)."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given

from cryosnap._format.skeleton import format_path
from cryosnap._state import Restorer, apply_into, check_into, flatten, is_stateful
from cryosnap.errors import CheckpointError, CheckpointFormatError, StateMismatchError

from ..support import assert_same, blob_bytes_of, leaves_of, state_trees


def round_trip(state: Any, *, allow_pickle: bool = False) -> Any:
    """flatten -> JSON -> Restorer, copying each blob's bytes like the engine does."""
    flat = flatten(state, allow_pickle=allow_pickle)
    skeleton = json.loads(json.dumps(flat.skeleton, allow_nan=False))
    restorer = Restorer(skeleton, [b.nbytes for b in flat.blobs], allow_pickle=allow_pickle)
    views = restorer.allocate()
    for blob, view in zip(flat.blobs, views, strict=True):
        src = blob.host_view()
        assert src.nbytes == blob.nbytes == view.nbytes
        view[:] = src
    return restorer.build()


@given(state_trees())
def test_flatten_restore_round_trip(state: Any) -> None:
    assert_same(state, round_trip(state))


@given(state_trees())
def test_skeleton_is_plain_json_and_sizes_add_up(state: Any) -> None:
    flat = flatten(state)
    # Serializable as strict JSON (no NaN, no bytes, no custom objects) and stable through it.
    text = json.dumps(flat.skeleton, allow_nan=False)
    assert json.dumps(json.loads(text), allow_nan=False) == text
    leaves = leaves_of(state)
    assert flat.leaves == len(leaves)
    # Leaves built by the strategy never share storage: one blob per non-inline leaf.
    assert flat.logical_bytes == sum(b.nbytes for b in flat.blobs)
    assert flat.logical_bytes == sum(blob_bytes_of(x) for x in leaves)


def test_format_path() -> None:
    assert format_path(()) == "<root>"
    assert format_path(("optim", "state", 0, "exp_avg")) == "optim/state/0/exp_avg"


def test_is_stateful() -> None:
    assert is_stateful(torch.nn.Linear(2, 2))
    assert not is_stateful({"state_dict": 1})
    assert not is_stateful(torch.ones(2))


def test_blob_is_a_view_not_a_copy() -> None:
    arr = np.arange(10, dtype=np.float64)
    t = torch.arange(10, dtype=torch.float32)
    flat = flatten({"a": arr, "t": t})
    views = {b.path: b.host_view() for b in flat.blobs}
    arr[3] = -1.0
    t[4] = -2.0
    assert np.frombuffer(views["a"], np.float64)[3] == -1.0
    assert np.frombuffer(views["t"], np.float32)[4] == -2.0


def test_tied_tensors_become_one_blob() -> None:
    w = torch.arange(12.0).reshape(3, 4)
    flat = flatten({"a": w, "b": w, "row": w[1:3], "wt": w.t()})
    assert len(flat.blobs) == 1
    assert flat.blobs[0].nbytes == w.numel() * 4
    assert flat.blobs[0].path == "a"


def test_views_without_base_cover_only_used_bytes() -> None:
    base = torch.arange(100.0)
    a, b = base[10:12], base[20:24]
    flat = flatten({"a": a, "b": b})
    assert len(flat.blobs) == 1
    assert flat.blobs[0].nbytes == (24 - 10) * 4  # not the whole base storage
    out = round_trip({"a": a, "b": b})
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)


def test_lone_view_is_stored_compact() -> None:
    base = torch.zeros(1000, dtype=torch.float64)
    flat = flatten({"v": base[::100]})
    assert [b.nbytes for b in flat.blobs] == [10 * 8]


def test_shared_storage_across_dtypes() -> None:
    w = torch.arange(8, dtype=torch.float32)
    as_int = w.view(torch.int32)
    raw = w.view(torch.uint8)[5:9]
    out = round_trip({"w": w, "i": as_int, "raw": raw})
    assert_same({"w": w, "i": as_int, "raw": raw}, out)
    ptrs = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(ptrs) == 1


def test_lazily_conjugated_shared_view_is_refused() -> None:
    z = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match="b"):
        flatten({"a": z, "b": z.conj()})


def test_torch_size_and_ordered_dict_survive() -> None:
    state = OrderedDict(shape=torch.Size([2, 3]), n=1)
    out = round_trip(state)
    assert type(out) is OrderedDict and list(out) == ["shape", "n"]
    assert type(out["shape"]) is torch.Size and out["shape"] == torch.Size([2, 3])


def test_reference_cycle_is_refused_with_path() -> None:
    loop: list[Any] = [1]
    loop.append({"again": loop})
    with pytest.raises(TypeError, match=r"cycle at loop/1/again"):
        flatten({"x": 0, "loop": loop})


def test_same_container_twice_is_not_a_cycle() -> None:
    shared = [1, 2]
    assert round_trip({"a": shared, "b": shared}) == {"a": [1, 2], "b": [1, 2]}


# ---------------------------------------------------------------------------------------------
# Restorer validates the skeleton: a damaged or hostile manifest never gets past it


def _restore(skeleton: Any, sizes: list[int], *, allow_pickle: bool = False) -> Any:
    r = Restorer(skeleton, sizes, allow_pickle=allow_pickle)
    r.allocate()
    return r.build()


_T = {"t": "torch", "dtype": "float32", "shape": [2], "b": 0}


_MALFORMED = [
    ({"t": "wat"}, [], "unknown node type"),
    ([1, 2], [], "malformed node"),
    ({"t": "dict", "k": ["a"], "v": []}, [], "malformed dict"),
    ({"t": "dict", "k": [1.5], "v": [{"t": "none"}]}, [], "invalid key"),
    ({"t": "list", "v": {}}, [], "malformed list"),
    ({**_T, "b": 1}, [8], "invalid blob reference"),
    ({**_T, "b": True}, [8], "invalid blob reference"),
    (_T, [12], "needs 8 bytes, its blob has 12"),
    ({"t": "list", "v": [_T, _T]}, [8], "claimed twice"),
    ({"t": "none"}, [4], "referenced by no leaf"),
    ({**_T, "dtype": "Tensor"}, [8], "unknown torch dtype"),
    ({**_T, "dtype": "float32; import os"}, [8], "unknown torch dtype"),
    ({**_T, "shape": [-2]}, [8], "invalid shape"),
    ({**_T, "shape": "2"}, [8], "invalid shape"),
    ({**_T, "view": {"offset": 4, "stride": [1]}}, [8], "past its blob"),
    ({**_T, "view": {"offset": 2, "stride": [1]}}, [16], "malformed view"),
    ({**_T, "view": {"offset": 0, "stride": [-1]}}, [8], "malformed view"),
    ({"t": "numpy", "dtype": "|O", "shape": [1], "b": 0}, [8], "Python objects"),
    ({"t": "numpy", "dtype": "<f9", "shape": [1], "b": 0}, [8], "invalid numpy dtype"),
    ({"t": "pickle", "b": 0}, [3], "allow_pickle"),
    ({"t": "int", "v": "12"}, [], "malformed int"),
    ({"t": "float", "v": 1.5}, [], "malformed float"),
    ({"t": "bool", "v": 1}, [], "malformed bool"),
    ({"t": "npscalar", "dtype": "<f4", "hex": "zz"}, [], "malformed npscalar"),
]


@pytest.mark.parametrize(
    ("skeleton", "sizes", "match"),
    _MALFORMED,
    ids=[f"{i}-{m.replace(' ', '-')}" for i, (_s, _z, m) in enumerate(_MALFORMED)],
)
def test_restorer_rejects_malformed_skeletons(skeleton: Any, sizes: list[int], match: str) -> None:
    # A pickled leaf without allow_pickle is not malformed, only refused: any CheckpointError.
    pickled = isinstance(skeleton, dict) and skeleton.get("t") == "pickle"
    error = CheckpointError if pickled else CheckpointFormatError
    with pytest.raises(error, match=match):
        _restore(skeleton, sizes)


# ---------------------------------------------------------------------------------------------
# check_into / apply_into


def test_check_into_names_the_path_and_changes_nothing() -> None:
    saved = {"a": {"w": torch.ones(2, 3)}, "n": 1}
    flat = flatten(saved)
    into = {"a": {"w": torch.zeros(3, 2)}, "n": 0}
    with pytest.raises(StateMismatchError, match=r"at a/w: saved float32\[2, 3\]"):
        check_into(flat.skeleton, into)
    assert torch.equal(into["a"]["w"], torch.zeros(3, 2)) and into["n"] == 0


def test_apply_into_fills_in_place_and_replaces_scalars() -> None:
    saved = {"w": torch.ones(2), "arr": np.full(3, 7.0), "n": 5, "pair": (torch.ones(1), 2)}
    flat = flatten(saved)
    loaded = round_trip(saved)
    w, arr, one = torch.zeros(2), np.zeros(3), torch.zeros(1)
    into = {"w": w, "arr": arr, "n": 0, "pair": (one, 0)}
    check_into(flat.skeleton, into)
    out = apply_into(flat.skeleton, loaded, into)
    assert out is into and into["w"] is w and into["arr"] is arr
    assert torch.equal(w, torch.ones(2)) and np.array_equal(arr, np.full(3, 7.0))
    assert into["n"] == 5
    assert into["pair"][0] is one and torch.equal(one, torch.ones(1)) and into["pair"][1] == 2
