"""cryosnap.save / cryosnap.load: exact round trips, tied weights, stateful objects and into=."""

from __future__ import annotations

import math
import struct
import tempfile
import uuid
import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import cryosnap
from cryosnap._format.chunks import chunk_count
from cryosnap._format.limits import MAX_STEP
from cryosnap._state import flatten

from .support import (
    NUMPY_DTYPES,
    TORCH_DTYPES,
    assert_same,
    blob_bytes_of,
    count_calls,
    leaves_of,
    make_array,
    make_tensor,
    snapshot,
    state_trees,
    tensor_bytes,
)

# Module-level, so that pickle can find them.
Point = namedtuple("Point", ["x", "y"])


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


@pytest.fixture
def run(tmp_path: Path) -> str:
    return str(tmp_path / "run")


@pytest.fixture
def memory_run() -> Iterator[str]:
    url = f"memory://cryosnap-test-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    if fs.exists(root):
        fs.rm(root, recursive=True)


# ---------------------------------------------------------------------------------------------
# Hypothesis round trips


@given(
    state=state_trees(),
    chunk_bytes=st.sampled_from([4096, 4096, 1 << 20]),
    step=st.integers(0, MAX_STEP),
    backend=st.sampled_from(["local", "memory"]),
)
def test_round_trip_is_exact(state: Any, chunk_bytes: int, step: int, backend: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        location = f"{d}/run" if backend == "local" else f"memory://{Path(d).name}"
        try:
            info = cryosnap.save(location, state, step=step, chunk_bytes=chunk_bytes)
            assert_same(state, cryosnap.load(location))
            assert_same(state, cryosnap.load(location, step=step))
        finally:
            fs = fsspec.filesystem("memory")
            if backend == "memory" and fs.exists(f"/{Path(d).name}"):
                fs.rm(f"/{Path(d).name}", recursive=True)
    # The strategy never ties storage: every non-inline leaf is one blob of its own, or packed
    # with other small tensors (each at a multiple of its element size: gaps of a few bytes).
    sizes = [blob_bytes_of(x) for x in leaves_of(state)]
    blobs = [b.nbytes for b in flatten(state, pack_bytes=chunk_bytes).blobs]
    assert info.step == step
    # Identical chunks may be written once (spatial de-duplication): new <= all.
    assert sum(sizes) <= info.logical_bytes == sum(blobs) <= sum(sizes) + 15 * len(sizes)
    assert 0 <= info.written_bytes <= info.logical_bytes
    assert info.chunks == sum(chunk_count(n, chunk_bytes) for n in blobs)
    assert 0 <= info.new_chunks <= info.chunks
    assert not info.incremental and info.tiers == ("persistent",)


@settings(max_examples=20)
@given(st.lists(st.sampled_from(TORCH_DTYPES), min_size=1, max_size=len(TORCH_DTYPES)))
def test_every_torch_dtype_in_one_state(dtypes: list[torch.dtype]) -> None:
    state = {str(dt): make_tensor(dt, (3, 5), i) for i, dt in enumerate(dtypes)}
    with tempfile.TemporaryDirectory() as d:
        cryosnap.save(d, state, step=1, chunk_bytes=4096)
        assert_same(state, cryosnap.load(d))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize(
    "layout",
    ["contiguous", "0-d", "empty", "empty-2d", "transposed", "strided", "expanded", "big"],
)
def test_torch_dtype_and_layout(run: str, dtype: torch.dtype, layout: str) -> None:
    base = make_tensor(dtype, (6, 4), 7)
    t = {
        "contiguous": base,
        "0-d": make_tensor(dtype, (), 3),
        "empty": make_tensor(dtype, (0,), 0),
        "empty-2d": make_tensor(dtype, (3, 0), 0),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "expanded": base[0].expand(5, 4),
        "big": make_tensor(dtype, (3000,), 11),
    }[layout]
    cryosnap.save(run, {"t": t}, step=0, chunk_bytes=4096)
    out = cryosnap.load(run)["t"]
    assert_same(t, out)
    assert out.is_contiguous()


def test_float_special_values_are_bitwise(run: str) -> None:
    bits = [0x7FF8_0000_0000_0001, 0xFFF8_0000_0000_0000, 0x8000_0000_0000_0000, 0x7FF0 << 48]
    t = torch.from_numpy(np.array(bits, dtype=np.uint64).view(np.float64))
    half = torch.from_numpy(np.array([0x7E01, 0xFE00, 0x8000, 0x7C00], np.uint16).view(np.float16))
    cryosnap.save(run, {"t": t, "h": half}, step=0)
    out = cryosnap.load(run)
    assert tensor_bytes(out["t"]) == tensor_bytes(t)
    assert tensor_bytes(out["h"]) == tensor_bytes(half)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["C", "F", "strided", "0-d", "empty", "big"])
def test_numpy_dtype_and_layout(run: str, dtype: np.dtype[Any], layout: str) -> None:
    base = make_array(dtype, (4, 5, 3), 5)
    arr = {
        "C": base,
        "F": np.asfortranarray(base),
        "strided": base[::2, ::-1],
        "0-d": make_array(dtype, (), 1),
        "empty": make_array(dtype, (2, 0), 1),
        "big": make_array(dtype, (70, 90), 2),
    }[layout]
    cryosnap.save(run, {"a": arr}, step=0, chunk_bytes=4096)
    assert_same(arr, cryosnap.load(run)["a"])


def test_numpy_scalar_types_are_preserved(run: str) -> None:
    state = [
        np.float32(1.5),
        np.float64(-0.0),
        np.longdouble(1) / 3,
        np.int8(-3),
        np.uint64(2**64 - 1),
        np.bool_(False),
        np.complex64(1j),
        np.datetime64("2024-01-01T00:00", "m"),
        np.timedelta64("NaT"),
        np.str_("ünï"),
        np.bytes_(b"x\x00y"),
        np.zeros((), np.dtype([("a", "<i2"), ("b", "<f4")]))[()],
    ]
    cryosnap.save(run, state, step=0)
    assert_same(state, cryosnap.load(run))


def test_python_scalars_are_preserved(run: str) -> None:
    state = {
        "ints": [0, -1, 2**63, -(2**64) - 1, 10**1000],
        "floats": [math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308, 0.1],
        "nan": math.nan,
        "complex": complex(-0.0, math.inf),
        "bools": (True, False),
        "str": "naïve ✓ \U0001f600 \x00 \ud7ff",
        "bytes": b"\x00\xff",
        "bytearray": bytearray(b"mutable"),
        "none": None,
        1: "int key",
        "1": "str key",
        -(2**80): "huge int key",
    }
    cryosnap.save(run, state, step=0)
    out = cryosnap.load(run)
    assert_same(state, out)
    assert math.isnan(out["nan"])


def test_huge_python_int_round_trips(run: str) -> None:
    state = {"huge": 1 << 20000, "keyed": {-(1 << 15000): 1}}
    cryosnap.save(run, state, step=0)
    assert_same(state, cryosnap.load(run))


@pytest.mark.parametrize("scalar", [np.bytes_(b"x\x00"), np.str_("a\x00")], ids=["bytes_", "str_"])
def test_numpy_string_scalar_keeps_trailing_nul(run: str, scalar: Any) -> None:
    cryosnap.save(run, {"s": scalar}, step=0)
    out = cryosnap.load(run)["s"]
    assert out == scalar and out.dtype == scalar.dtype


def test_python_float_nan_is_bitwise(run: str) -> None:
    neg_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8_0000_0000_0001))[0]
    cryosnap.save(run, {"x": neg_nan}, step=0)
    out = cryosnap.load(run)["x"]
    assert struct.pack("<d", out) == struct.pack("<d", neg_nan)


def test_python_complex_nan_is_bitwise(run: str) -> None:
    neg_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8_0000_0000_0001))[0]
    value = complex(neg_nan, neg_nan)
    cryosnap.save(run, {"z": value}, step=0)
    out = cryosnap.load(run)["z"]
    assert struct.pack("<dd", out.real, out.imag) == struct.pack("<dd", value.real, value.imag)


def test_requires_grad_and_parameters_are_preserved(run: str) -> None:
    state = {
        "leaf": torch.ones(3, requires_grad=True),
        "frozen": torch.ones(3),
        "param": nn.Parameter(torch.ones(2, 2)),
        "param_frozen": nn.Parameter(torch.ones(2), requires_grad=False),
        "nonleaf": torch.ones(2, requires_grad=True) * 2,
    }
    cryosnap.save(run, state, step=0)
    out = cryosnap.load(run)
    assert_same(state, out)
    assert out["leaf"].is_leaf and out["nonleaf"].is_leaf


def test_save_info_counts_chunks(run: str) -> None:
    rng = np.random.default_rng(0)  # random content: no two chunks alike, nothing to dedupe
    state = {
        "a": make_tensor(torch.float32, (3000,), 1),
        "b": rng.random(1000),
        "c": rng.bytes(5000),
        "d": 1,
    }
    info = cryosnap.save(run, state, step=4, chunk_bytes=4096)
    assert info.logical_bytes == info.written_bytes == 12000 + 8000 + 5000
    assert info.chunks == info.new_chunks == 3 + 2 + 2
    assert info.seconds >= 0 and info.stall_seconds >= info.seconds  # blocked until durable


def test_paths_and_urls(tmp_path: Path, memory_run: str) -> None:
    state = {"x": torch.arange(3)}
    for location in [tmp_path / "a", str(tmp_path / "b"), f"file://{tmp_path}/c", memory_run]:
        cryosnap.save(location, state, step=1)
        assert_same(state, cryosnap.load(location))
    assert (tmp_path / "c" / "versions").is_dir()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"step": -1}, ValueError, "step=-1"),
        ({"step": MAX_STEP + 1}, ValueError, "step="),
        ({"step": True}, TypeError, "step must be an int"),
        ({"step": 1.0}, TypeError, "step must be an int"),
        ({"chunk_bytes": 4095}, ValueError, "chunk_bytes=4095"),
        ({"chunk_bytes": (64 << 20) + 1}, ValueError, "chunk_bytes"),
        ({"chunk_bytes": 4096.0}, TypeError, "chunk_bytes"),
    ],
)
def test_save_validates_arguments(
    run: str, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        cryosnap.save(run, {"x": 1}, **kwargs)
    assert not Path(run).exists()


@pytest.mark.parametrize("chunk_bytes", [4096, 64 << 20])
def test_chunk_bytes_bounds_are_accepted(run: str, chunk_bytes: int) -> None:
    state = {"x": torch.arange(5000, dtype=torch.int32)}
    info = cryosnap.save(run, state, step=0, chunk_bytes=chunk_bytes)
    assert info.chunks == chunk_count(20000, chunk_bytes)
    assert_same(state, cryosnap.load(run))


def test_load_validates_arguments(run: str) -> None:
    cryosnap.save(run, {"x": 1}, step=0)
    with pytest.raises(ValueError, match="step"):
        cryosnap.load(run, step=-1)
    with pytest.raises(TypeError, match="rank"):
        cryosnap.load(run, rank=True)  # type: ignore[arg-type]
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="rank 3"):
        cryosnap.load(run, rank=3)


# ---------------------------------------------------------------------------------------------
# tied weights


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight


def test_same_tensor_twice_is_stored_once_and_comes_back_shared(run: str) -> None:
    w = torch.randn(64, 64)
    info = cryosnap.save(run, {"a": w, "b": w, "nested": [w]}, step=0)
    assert info.logical_bytes == w.numel() * 4
    out = cryosnap.load(run)
    assert _ptr(out["a"]) == _ptr(out["b"]) == _ptr(out["nested"][0])
    assert torch.equal(out["a"], w) and torch.equal(out["b"], w)
    out["a"][0, 0] = 123.0
    assert out["b"][0, 0].item() == 123.0 and out["nested"][0][0, 0].item() == 123.0


def test_views_of_one_base_come_back_as_views(run: str) -> None:
    w = torch.randn(5, 3)
    state = {"w": w, "rows": w[1:3], "wt": w.t(), "col": w[:, 2], "flat": w.view(-1)[4:]}
    info = cryosnap.save(run, state, step=0)
    assert info.logical_bytes == w.numel() * 4
    out = cryosnap.load(run)
    assert_same(state, out)
    assert len({_ptr(t) for t in out.values()}) == 1
    assert out["wt"].stride() == (1, 3) and not out["wt"].is_contiguous()
    out["w"][2, 1] = -7.0
    assert out["rows"][1, 1].item() == -7.0
    assert out["wt"][1, 2].item() == -7.0
    assert out["flat"][2 * 3 + 1 - 4].item() == -7.0


def test_tied_module_weights(run: str) -> None:
    model = TiedLM()
    cryosnap.save(run, {"model": model}, step=0)
    sd = cryosnap.load(run)["model"]
    assert type(sd) is OrderedDict
    assert _ptr(sd["embed.weight"]) == _ptr(sd["lm_head.weight"])
    assert torch.equal(sd["embed.weight"], model.embed.weight)
    sd["lm_head.weight"][0, 0] = 42.0
    assert sd["embed.weight"][0, 0].item() == 42.0

    fresh = TiedLM()
    params = [fresh.embed.weight, fresh.hidden.weight, fresh.hidden.bias]
    cryosnap.load(run, into={"model": fresh})
    assert [fresh.embed.weight, fresh.hidden.weight, fresh.hidden.bias] == params  # same objects
    assert fresh.lm_head.weight is fresh.embed.weight
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


@pytest.mark.parametrize("case", ["step", "column", "transposed", "complex"])
def test_one_element_strided_view(run: str, case: str) -> None:
    w = torch.randn(3, 4)
    t = {
        "step": torch.arange(4.0)[::4],
        "column": w[:, 1][0:1],
        "transposed": w.t()[0:1, 0:1],
        "complex": torch.ones(4, dtype=torch.complex64)[::4],
    }[case]
    cryosnap.save(run, {"t": t}, step=0)
    assert_same(t, cryosnap.load(run)["t"])


def test_aliasing_storages_from_numpy(run: str) -> None:
    arr = np.arange(10.0)
    state = {"prefix": torch.from_numpy(arr[:5]), "whole": torch.from_numpy(arr)}
    cryosnap.save(run, state, step=0)
    assert_same(state, cryosnap.load(run))


# ---------------------------------------------------------------------------------------------
# stateful objects and into=


class Counter:
    """A minimal stateful object (not a torch class)."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.history = [float(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.history = list(sd["history"])


def _training_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "counter": Counter(),
        "buf": torch.zeros(2, 3),
        "arr": np.zeros((3, 2), np.float32, order="F"),
        "meta": {"epoch": 0, "name": "fresh", "pair": [torch.zeros(2), np.zeros(1)]},
    }


def _trained_state() -> dict[str, Any]:
    state = _training_state(seed=1)
    model, opt = state["model"], state["optim"]
    for _ in range(2):
        loss = model(torch.randn(5, 4)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["sched"].step()
    state["counter"] = Counter(7)
    state["buf"] = torch.randn(2, 3)
    state["arr"] = np.asfortranarray(np.random.default_rng(0).random((3, 2), np.float32))
    state["meta"] = {"epoch": 3, "name": "trained", "pair": [torch.randn(2), np.ones(1)]}
    return state


@pytest.fixture
def trained(run: str) -> dict[str, Any]:
    state = _trained_state()
    cryosnap.save(run, state, step=3)
    return state


def test_load_without_into_returns_state_dicts(run: str, trained: dict[str, Any]) -> None:
    out = cryosnap.load(run)
    assert_same(trained["model"].state_dict(), out["model"])
    assert_same(trained["optim"].state_dict(), out["optim"])
    assert_same(trained["sched"].state_dict(), out["sched"])
    assert out["counter"] == {"n": 7, "history": [7.0]}
    assert list(out["optim"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    assert type(out["optim"]["param_groups"][0]["betas"]) is tuple


def test_load_into_fills_in_place(run: str, trained: dict[str, Any]) -> None:
    into = _training_state(seed=2)
    model, opt, sched, counter = into["model"], into["optim"], into["sched"], into["counter"]
    params = list(model.parameters())
    buf, arr, pair = into["buf"], into["arr"], into["meta"]["pair"]
    pair0, pair1 = pair
    calls = count_calls(counter, "load_state_dict")

    out = cryosnap.load(run, into=into)

    assert out is into
    assert into["model"] is model and list(model.parameters()) == params
    assert into["optim"] is opt and into["sched"] is sched and into["counter"] is counter
    assert into["buf"] is buf and into["arr"] is arr and into["meta"]["pair"] is pair
    assert pair[0] is pair0 and pair[1] is pair1
    assert calls() == 1
    assert_same(trained["model"].state_dict(), model.state_dict())
    assert_same(trained["buf"], buf)
    assert_same(trained["arr"], arr)
    assert_same(trained["meta"], into["meta"])
    assert counter.n == 7 and counter.history == [7.0]
    assert sched.last_epoch == trained["sched"].last_epoch
    assert opt.param_groups[0]["lr"] == trained["optim"].param_groups[0]["lr"]
    for p, q in zip(params, trained["model"].parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], trained["optim"].state[q][key]), key
    # The restored optimizer keeps training the restored parameters.
    loss = model(torch.randn(5, 4)).pow(2).sum()
    loss.backward()
    before = [p.detach().clone() for p in params]
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))


def _bad_shape(s: dict[str, Any]) -> None:
    s["buf"] = torch.zeros(3, 2)


def _bad_dtype(s: dict[str, Any]) -> None:
    s["buf"] = torch.zeros(2, 3, dtype=torch.float64)


def _bad_np_dtype(s: dict[str, Any]) -> None:
    s["arr"] = np.zeros((3, 2), np.float64)


def _bad_np_shape(s: dict[str, Any]) -> None:
    s["arr"] = np.zeros((2, 3), np.float32)


def _readonly_array(s: dict[str, Any]) -> None:
    s["arr"].flags.writeable = False


def _missing_key(s: dict[str, Any]) -> None:
    del s["meta"]["name"]


def _extra_key(s: dict[str, Any]) -> None:
    s["meta"]["extra"] = torch.zeros(1)


def _dict_for_list(s: dict[str, Any]) -> None:
    s["meta"]["pair"] = {"0": torch.zeros(2), "1": np.zeros(1)}


def _list_for_dict(s: dict[str, Any]) -> None:
    s["meta"] = [3, "trained", [torch.zeros(2), np.zeros(1)]]


def _short_list(s: dict[str, Any]) -> None:
    s["meta"]["pair"] = [torch.zeros(2)]


def _array_for_tensor(s: dict[str, Any]) -> None:
    s["meta"]["pair"][0] = np.zeros(2, np.float32)


def _tensor_for_array(s: dict[str, Any]) -> None:
    s["meta"]["pair"][1] = torch.zeros(1, dtype=torch.float64)


def _tensor_for_scalar(s: dict[str, Any]) -> None:
    s["meta"]["epoch"] = torch.zeros(())


def _wider_module(s: dict[str, Any]) -> None:
    torch.manual_seed(5)
    s["model"] = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))


def _deeper_module(s: dict[str, Any]) -> None:
    s["model"] = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2), nn.Linear(2, 2))


def _module_for_tensor(s: dict[str, Any]) -> None:
    s["buf"] = nn.Linear(2, 3)


def _dict_for_module(s: dict[str, Any]) -> None:
    s["counter"] = {"n": 0, "history": [0.0]}


MISMATCHES: list[tuple[Callable[[dict[str, Any]], None], str]] = [
    (_bad_shape, "buf"),
    (_bad_dtype, "buf"),
    (_bad_np_dtype, "arr"),
    (_bad_np_shape, "arr"),
    (_readonly_array, "arr"),
    (_missing_key, "meta"),
    (_extra_key, "meta"),
    (_dict_for_list, "meta/pair"),
    (_list_for_dict, "meta"),
    (_short_list, "meta/pair"),
    (_array_for_tensor, "meta/pair/0"),
    (_tensor_for_array, "meta/pair/1"),
    (_tensor_for_scalar, "meta/epoch"),
    (_wider_module, "model/0.weight"),
    (_deeper_module, "model"),
    (_dict_for_module, "counter"),
]


@pytest.mark.parametrize(("mutate", "path"), MISMATCHES, ids=[m.__name__ for m, _ in MISMATCHES])
def test_into_mismatch_names_the_path_and_changes_nothing(
    run: str, trained: dict[str, Any], mutate: Callable[[dict[str, Any]], None], path: str
) -> None:
    into = _training_state(seed=9)
    mutate(into)
    before = snapshot(into)
    counter = into["counter"]
    counter_calls = (
        count_calls(counter, "load_state_dict") if isinstance(counter, Counter) else None
    )
    with pytest.raises(cryosnap.StateMismatchError) as info:
        cryosnap.load(run, into=into)
    assert isinstance(info.value, ValueError)
    assert f"at {path}:" in str(info.value)
    assert snapshot(into) == before
    assert counter_calls is None or counter_calls() == 0


def test_optimizer_mismatch_changes_nothing(run: str, trained: dict[str, Any]) -> None:
    into = _training_state(seed=9)
    model = into["model"]
    into["optim"] = torch.optim.Adam(list(model.parameters())[:2])  # a different param group
    into["sched"] = torch.optim.lr_scheduler.StepLR(into["optim"], step_size=1)
    before = snapshot(into)
    with pytest.raises(cryosnap.StateMismatchError, match="optim"):
        cryosnap.load(run, into=into)
    assert snapshot(into) == before


def _dict_for_tensor(s: dict[str, Any]) -> None:
    s["buf"] = {"inner": torch.zeros(2, 3)}


@pytest.mark.parametrize("mutate", [_dict_for_tensor, _module_for_tensor])
def test_container_for_leaf_is_a_mismatch(
    run: str, trained: dict[str, Any], mutate: Callable[[dict[str, Any]], None]
) -> None:
    into = _training_state(seed=9)
    mutate(into)
    buf = into["buf"]
    before = snapshot(into)
    with pytest.raises(cryosnap.StateMismatchError, match="at buf:"):
        cryosnap.load(run, into=into)
    assert into["buf"] is buf
    assert snapshot(into) == before


# ---------------------------------------------------------------------------------------------
# unsupported leaves and allow_pickle


UNSUPPORTED: list[tuple[str, Any]] = [
    ("object", object()),
    ("set", {1, 2}),
    ("frozenset", frozenset({"a"})),
    ("namedtuple", Point(1, 2)),
    ("lambda", lambda: 0),
    ("class", Opaque(3)),
    ("object-array", np.array([None, 1], dtype=object)),
    ("list-subclass", type("MyList", (list,), {})([1])),
    ("float-key", {1.5: 0}),
    ("bool-key", {True: 0}),
    ("tuple-key", {(1, 2): 0}),
]


@pytest.mark.parametrize("leaf", [x for _, x in UNSUPPORTED], ids=[n for n, _ in UNSUPPORTED])
def test_unsupported_leaf_is_refused_with_path(run: str, leaf: Any) -> None:
    with pytest.raises(TypeError, match=r"outer/0/bad"):
        cryosnap.save(run, {"ok": 1, "outer": [{"bad": leaf}]}, step=0)
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        cryosnap.load(run)


PICKLABLE: list[tuple[str, Any]] = [
    ("set", {1, 2}),
    ("frozenset", frozenset({"a"})),
    ("namedtuple", Point(1, torch.ones(2))),
    ("class", Opaque(3)),
    ("object-array", np.array([None, 1, "x"], dtype=object)),
]


@pytest.mark.parametrize("leaf", [x for _, x in PICKLABLE], ids=[n for n, _ in PICKLABLE])
def test_allow_pickle_round_trips_only_when_load_allows(run: str, leaf: Any) -> None:
    state = {"ok": torch.arange(3), "outer": [{"bad": leaf}]}
    cryosnap.save(run, state, step=2, allow_pickle=True)
    out = cryosnap.load(run, allow_pickle=True)
    got = out["outer"][0]["bad"]
    assert type(got) is type(leaf)
    if isinstance(leaf, np.ndarray):
        assert got.tolist() == leaf.tolist()
    elif isinstance(leaf, Point):
        assert got.x == 1 and torch.equal(got.y, leaf.y)
    else:
        assert got == leaf
    with pytest.raises(cryosnap.CheckpointError, match=r"outer/0/bad.*allow_pickle"):
        cryosnap.load(run, step=2)


def test_pickled_version_without_allow_pickle_is_not_damage(run: str) -> None:
    cryosnap.save(run, {"x": 1}, step=1)
    cryosnap.save(run, {"x": {1, 2}}, step=2, allow_pickle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(cryosnap.CheckpointError, match="allow_pickle"):
            cryosnap.load(run)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_unpicklable_leaf_names_its_path(run: str) -> None:
    with pytest.raises(TypeError, match=r"outer/0/bad"):
        cryosnap.save(run, {"outer": [{"bad": lambda: 0}]}, step=0, allow_pickle=True)


def test_masked_array_is_not_silently_unmasked(run: str) -> None:
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    try:
        cryosnap.save(run, {"m": masked}, step=0)
    except TypeError as exc:  # refusing it is fine too
        assert "m" in str(exc)
        return
    out = cryosnap.load(run)["m"]
    assert isinstance(out, np.ma.MaskedArray)
    assert out.mask.tolist() == [False, True, False]


def test_a_plain_dataloader_points_at_the_resumable_loader(run: str) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8)))
    with pytest.raises(TypeError, match=r"loader: .*DataLoader") as info:
        cryosnap.save(run, {"step": 1, "loader": loader}, step=1)
    assert "cryosnap.integrations.torch.ResumableLoader" in str(info.value)
    assert "allow_pickle=True" not in str(info.value)  # a pickled loader resumes nothing
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        cryosnap.load(run)


@pytest.mark.parametrize(
    "view",
    [
        lambda: torch.zeros(1).expand(2**40),  # 4 TiB if copied: torch's allocator would fail
        lambda: torch.zeros(3, 1).expand(3, 2**38),
    ],
    ids=["1-d", "2-d"],
)
def test_a_huge_expanded_view_is_refused_before_any_copy(run: str, view: Any) -> None:
    with pytest.raises(ValueError, match=r"^cannot checkpoint big: an expanded view") as info:
        cryosnap.save(run, {"ok": torch.ones(2), "big": view()}, step=1)
    message = str(info.value)
    assert ".contiguous()" in message and ".expand()" in message
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        cryosnap.load(run)


def test_a_small_expanded_view_is_saved_as_its_values(run: str) -> None:
    small = torch.arange(3.0).expand(4, 3)
    cryosnap.save(run, {"small": small}, step=1)
    assert torch.equal(cryosnap.load(run)["small"], small.contiguous())
