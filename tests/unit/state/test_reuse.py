"""Reusing the last flatten (_state/reuse.py, flatten's ``cache``): a flatten that reuses is
the same as a fresh one, byte for byte, and any change of structure flattens afresh."""

from __future__ import annotations

import importlib
import json
import math
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap._state import FlatState, FlattenCache, flatten

from ..support import assert_same

# The module whose _entry a test spies on.
reuse_module = importlib.import_module("cryosnap._state.reuse")

CHUNK = 4096


def _flat(state: Any, cache: FlattenCache | None = None, **kw: Any) -> FlatState:
    if cache is None:
        return flatten(state, pack_bytes=CHUNK, **kw)
    return cache.flatten(state, pack_bytes=CHUNK, **kw)


def _assert_same(a: FlatState, b: FlatState) -> None:
    assert json.dumps(a.skeleton) == json.dumps(b.skeleton)
    assert [(x.key, x.nbytes, x.private, x.origin) for x in a.blobs] == [
        (x.key, x.nbytes, x.private, x.origin) for x in b.blobs
    ]
    assert [bytes(x.host_view()) for x in a.blobs] == [bytes(x.host_view()) for x in b.blobs]
    assert (a.leaves, a.logical_bytes, a.packed, a.files) == (
        b.leaves,
        b.logical_bytes,
        b.packed,
        b.files,
    )
    assert [(p, id(o)) for p, o in a.stateful] == [(p, id(o)) for p, o in b.stateful]


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"layer{i}.weight": torch.randn(8, 4, generator=g) for i in range(30)}
        | {"head": torch.randn(2000, generator=g), "p": torch.nn.Parameter(torch.ones(3))},
        "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"lr": 0.1, "ids": [0]}]},
        "step": 7,
        "name": "run",
        "size": torch.Size([2, 3]),
        "none": None,
    }


def test_a_second_flatten_reuses_the_first_and_reads_the_tensors_anew() -> None:
    state, cache = _state(), FlattenCache()
    first = _flat(state, cache)
    before = json.dumps(first.skeleton)
    state["model"]["layer3.weight"].add_(1.0)  # values change in place
    state["model"]["head"] = torch.randn(2000)  # a new tensor of the same kind
    state["step"], state["opt"]["groups"][0]["lr"] = 8, -0.0
    second = _flat(state, cache)
    assert cache.reused == 1
    _assert_same(second, _flat(state))
    assert json.dumps(first.skeleton) == before  # the first version's skeleton is untouched
    state["opt"]["groups"][0]["lr"] = math.nan  # NaN, -0.0, 0.0: each its own encoding
    _assert_same(_flat(state, cache), _flat(state))
    state["opt"]["groups"][0]["lr"] = 0.0
    _assert_same(_flat(state, cache), _flat(state))
    assert cache.reused == 3


def _add_key(s: dict[str, Any]) -> None:
    s["model"]["extra"] = torch.ones(2)


def _shape(s: dict[str, Any]) -> None:
    s["model"]["layer0.weight"] = torch.randn(4, 8)


def _dtype(s: dict[str, Any]) -> None:
    s["model"]["layer1.weight"] = s["model"]["layer1.weight"].double()


def _view(s: dict[str, Any]) -> None:
    s["model"]["layer2.weight"] = s["model"]["head"][:32].view(8, 4)  # shares head's storage


def _view_at_offset(s: dict[str, Any]) -> None:
    # Past the start of head's storage: found by the storage's address, not the tensor's own.
    s["model"]["layer6.weight"] = s["model"]["head"][100:132].view(8, 4)


def _transposed(s: dict[str, Any]) -> None:
    s["model"]["layer4.weight"] = torch.randn(4, 8).T  # same shape, not contiguous


def _grad(s: dict[str, Any]) -> None:
    s["model"]["layer5.weight"].requires_grad_(True)


def _parameter(s: dict[str, Any]) -> None:
    s["model"]["p"] = s["model"]["p"].detach()


def _order(s: dict[str, Any]) -> None:
    s["model"] = OrderedDict(s["model"])


def _list(s: dict[str, Any]) -> None:
    s["opt"]["groups"][0]["ids"].append(1)


def _scalar_type(s: dict[str, Any]) -> None:
    s["step"] = 7.0


def _array(s: dict[str, Any]) -> None:
    s["step"] = np.ones(3)


@pytest.mark.parametrize(
    "change",
    [
        _add_key,
        _shape,
        _dtype,
        _view,
        _view_at_offset,
        _transposed,
        _grad,
        _parameter,
        _order,
        _list,
        _scalar_type,
        _array,
    ],
)
def test_any_change_of_structure_flattens_afresh(change: Callable[[Any], None]) -> None:
    state, cache = _state(), FlattenCache()
    _flat(state, cache)
    change(state)
    _assert_same(_flat(state, cache), _flat(state))
    assert cache.reused == 0
    # ...and the new structure is the one reused next (but for an array, or tensors sharing
    # storage: those are flattened in full every time).
    _assert_same(_flat(state, cache), _flat(state))
    assert cache.reused == (0 if change in (_array, _view, _view_at_offset) else 1)


def test_a_device_or_option_change_is_no_reuse() -> None:
    state, cache = _state(), FlattenCache()
    _flat(state, cache)
    _flat(state, cache, pack_apart=["opt"])  # other options: their own flatten
    assert cache.reused == 0
    state["model"]["head"] = torch.empty(2000, device="meta")
    with pytest.raises(TypeError, match="model/head"):
        _flat(state, cache)  # what a fresh flatten says, not a stale reuse


def test_modules_and_optimizers_are_scanned_through_their_state_dicts() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    state, cache = {"model": model, "opt": opt, "step": 1}, FlattenCache()
    _flat(state, cache)
    opt.step()  # the step counters and moments change, not their structure
    state["step"] = 2
    second = _flat(state, cache)
    assert cache.reused == 1
    _assert_same(second, _flat(state))
    assert [o for _p, o in second.stateful] == [model, opt]


def test_a_checkpointer_restores_each_reused_version(tmp_path: Path) -> None:
    state = _state()
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        for step in range(3):
            state["model"]["layer7.weight"].add_(1.0)
            state["step"] = step
            ckpt.save(step, state).result()
            assert_same(ckpt.restore(step=step), state)
        assert ckpt._saves.flattened.reused == 2
        entry = ckpt._saves.flattened._entry
        assert entry is not None and any(entry.buffers._held)  # the packs' memory, kept
        # Each version's skeleton is a copy with "step" changed: the model's node is shared,
        # its text kept for the next manifest.
        model = entry.skeleton["v"][0]
        texts = ckpt._writer.version.skeleton_texts
        assert texts.holds(model)
    assert ckpt._saves.flattened._entry is None  # and let go of at close()
    assert not texts.holds(model)  # the texts too


def test_a_one_shot_save_keeps_no_flatten_to_reuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cryosnap.save saves once: what a next save would reuse is not made (each tensor's
    metadata read again); a Checkpointer's first save makes it."""
    made: list[object] = []
    real = reuse_module._entry

    def spy(*args: Any) -> Any:
        entry = real(*args)
        made.append(entry)
        return entry

    monkeypatch.setattr(reuse_module, "_entry", spy)
    state = _state()
    cryosnap.save(tmp_path / "once", state)
    assert made == []
    assert_same(cryosnap.load(tmp_path / "once"), state)
    with cryosnap.Checkpointer(tmp_path / "many", chunk_bytes=CHUNK) as ckpt:
        ckpt.save(0, state).result()
        assert len(made) == 1 and made[0] is not None


_leaf = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.tuples(
        st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool]),
        st.lists(st.integers(0, 5), max_size=2),
    ),
)
_tree = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=2), inner, max_size=4)
    ),
    max_leaves=12,
)


def _build(spec: Any, g: torch.Generator) -> Any:
    if isinstance(spec, tuple):
        dtype, shape = spec
        return (torch.randn(shape, generator=g) * 9).to(dtype)
    if isinstance(spec, list):
        return [_build(v, g) for v in spec]
    if isinstance(spec, dict):
        return {k: _build(v, g) for k, v in spec.items()}
    return spec


@settings(max_examples=40, deadline=None)
@given(_tree, _tree)
def test_reuse_is_a_fresh_flatten_whatever_the_trees(first: Any, second: Any) -> None:
    g = torch.Generator().manual_seed(1)
    cache = FlattenCache()
    for spec in (first, first, second, second):
        state = {"s": _build(spec, g)}  # fresh values every time
        _assert_same(_flat(state, cache), _flat(state))


def test_a_reused_flatten_keeps_incremental_versions_small(tmp_path: Path) -> None:
    state = {"m": {f"t{i}": torch.full((100,), float(i)) for i in range(60)}}  # 6 packs
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, incremental=True) as ckpt:
        first = ckpt.save(1, state).result()
        state["m"]["t33"].add_(1.0)
        second = ckpt.save(2, state).result()  # one changed tensor: its pack's chunk
        third = ckpt.save(3, state).result()  # nothing changed: nothing new
        assert ckpt._saves.flattened.reused == 2
    assert first.written_bytes >= 60 * 400
    assert 0 < second.written_bytes <= CHUNK
    assert third.written_bytes == 0
    assert_same(cryosnap.load(tmp_path, step=2), state)


def _packs(flat: FlatState) -> list[Any]:
    return [b.source for b in flat.blobs if b.private]


def test_a_reused_flatten_fills_the_packs_of_a_version_no_longer_referenced() -> None:
    state, cache = _state(), FlattenCache()
    _flat(state, cache)  # the fresh flatten: the entry, no buffers yet
    second = _flat(state, cache)
    addresses = [p.data_ptr() for p in _packs(second)]
    assert addresses
    del second  # written and dropped: its packs' memory is filled again
    state["model"]["layer0.weight"].add_(1.0)
    third = _flat(state, cache)
    assert [p.data_ptr() for p in _packs(third)] == addresses
    _assert_same(third, _flat(state))


def _hold_tensor(flat: FlatState) -> Any:
    return _packs(flat)[0]


def _hold_view(flat: FlatState) -> Any:
    return _packs(flat)[0][4:8]


def _hold_array(flat: FlatState) -> Any:
    return flat.blobs[[b.private for b in flat.blobs].index(True)].host_view()


@pytest.mark.parametrize("hold", [_hold_tensor, _hold_view, _hold_array])
def test_a_pack_still_referenced_is_never_filled_again(hold: Callable[[FlatState], Any]) -> None:
    """A version still being written (its pack, a view of it or the array the writer reads)
    keeps its bytes while later versions are flattened."""
    state, cache = _state(), FlattenCache()
    _flat(state, cache)
    second = _flat(state, cache)
    held = hold(second)
    expected = bytes(memoryview(held.numpy() if isinstance(held, torch.Tensor) else held))
    first_pack = _packs(second)[0].data_ptr()
    del second
    for i in range(3):  # more versions than the buffers kept per pack
        state["model"]["layer0.weight"].add_(1.0)
        flat = _flat(state, cache)
        assert _packs(flat)[0].data_ptr() != first_pack
        _assert_same(flat, _flat(state))
        if i == 0:
            keep = flat  # two versions alive at once: neither's packs are shared
        else:
            assert _packs(flat)[0].data_ptr() != _packs(keep)[0].data_ptr()
    actual = bytes(memoryview(held.numpy() if isinstance(held, torch.Tensor) else held))
    assert actual == expected


def test_reuse_reads_each_tensor_where_it_lies_now() -> None:
    """The packs' copies by address are the last save's only while every tensor lies where it
    did: a tensor moved to new memory, or packed but not contiguous, is read where it is."""
    state, cache = _state(), FlattenCache()
    state["model"]["t"] = torch.randn(4, 8).T  # packed, not contiguous
    _flat(state, cache)
    for step in range(4):
        if step == 2:
            state["model"]["layer7.weight"] = torch.full((8, 4), 5.0)  # same kind, new memory
        state["model"]["layer7.weight"].add_(1.0)
        state["model"]["t"].mul_(2.0)
        _assert_same(_flat(state, cache), _flat(state))
    assert cache.reused == 4


def test_without_torch_s_storage_use_count_every_pack_is_fresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch cannot tell who holds a pack's storage, no pack's memory is kept."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    state, cache = _state(), FlattenCache()
    _flat(state, cache)
    for _ in range(3):
        state["model"]["layer0.weight"].add_(1.0)
        _assert_same(_flat(state, cache), _flat(state))
    entry = cache._entry
    assert entry is not None and entry.packed
    assert not any(entry.buffers._held)
