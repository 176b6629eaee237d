"""Golden runs of format_version 1 (tests/golden): read exactly, damage named, fallback kept.

The expected values are written out here by hand from the states in
tests/golden/make_golden.py, never taken from a load. Each run is copied to a temporary folder
first: nothing is written into tests/golden.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cryosnap
from cryosnap import engine
from cryosnap.storage import LocalStore

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CHUNK = 4096


@pytest.fixture
def golden(tmp_path: Path) -> Any:
    def copy(name: str) -> Path:
        dest = tmp_path / name
        shutil.copytree(GOLDEN / name, dest)
        return dest

    return copy


def _array(got: Any, expected: np.ndarray) -> None:
    assert type(got) is np.ndarray
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()


def test_oneshot_reads_exactly(golden: Any) -> None:
    run = golden("oneshot")
    state = cryosnap.load(run)
    assert list(state) == [
        "f32", "i16_fortran", "u8", "flags", "c64", "table", "bf16", "i32",
        "scalars", "text", "raw", "nested", 3, "np_scalar",
    ]  # fmt: skip
    _array(
        state["f32"],
        np.array(
            [[0.0, 0.25, 0.5, 0.75], [1.0, 1.25, 1.5, 1.75], [2.0, 2.25, 2.5, 2.75]], np.float32
        ),
    )
    fortran = state["i16_fortran"]
    _array(fortran, np.array([[-3, -2, -1], [0, 1, 2]], np.int16))
    assert fortran.flags.f_contiguous and not fortran.flags.c_contiguous
    _array(state["u8"], np.array([i % 256 for i in range(5000)], np.uint8))
    _array(state["flags"], np.array([True, False, True]))
    _array(state["c64"], np.array([1 + 2j, -0.5j], np.complex64))
    _array(state["table"], np.array([i / 8 for i in range(1500)], np.float64))
    bf16 = state["bf16"]
    assert type(bf16) is torch.Tensor and bf16.dtype == torch.bfloat16
    assert bf16.float().tolist() == [1.5, -2.0, 0.25, 3.0]
    i32 = state["i32"]
    assert type(i32) is torch.Tensor and i32.dtype == torch.int32
    assert i32.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert state["scalars"] == {"int": -7, "big": 2**70, "float": 0.1, "bool": True, "none": None}
    assert [type(v) for v in state["scalars"].values()] == [int, int, float, bool, type(None)]
    assert state["text"] == "héllo"
    assert state["raw"] == b"\x00\x01golden" and type(state["raw"]) is bytes
    assert state["nested"] == {"list": [1, [2, (3, "four")]], "tuple": (None, 2.5)}
    assert type(state["nested"]["list"][1][1]) is tuple
    assert state[3] == {"int_key": 1, 10: "ten"}
    assert type(state["np_scalar"]) is np.float32 and state["np_scalar"] == 0.75
    assert cryosnap.load(run, step=5)["text"] == "héllo"


def _grid(step: int) -> np.ndarray:
    rows = []
    for i in range(70):
        value = 0.0
        if step >= 1 and i % 2 == 0:
            value = 1.0
        if step >= 2 and i % 2 == 1:
            value = 2.0
        rows.append(np.full(CHUNK // 4, value, np.float32))
    return np.concatenate(rows)


@pytest.mark.parametrize("step", [0, 1, 2])
def test_chain_reads_exactly(golden: Any, step: int) -> None:
    run = golden("chain")
    state = cryosnap.load(run, step=step)
    assert list(state) == ["grid", "small", "step"]
    _array(state["grid"], _grid(step))
    _array(state["small"], np.array([0, 1, 2, 3, 4, 5, 6, 7], np.int64) * (step + 1))
    assert state["step"] == step
    part = engine.verify_part(LocalStore(run), step)
    assert part.chain == tuple(range(step + 1))  # 1 and 2 resolve through their bases


def test_chain_is_incremental_with_packed_tables(golden: Any) -> None:
    run = golden("chain")
    store = LocalStore(run)
    assert engine.list_steps(store) == [0, 1, 2]
    for step in (1, 2):
        record = engine.read_commit(store, step)
        manifest, _ref = engine.read_manifest(store, record, 0)
        assert record.incremental and manifest.base is not None
        assert max(len(b.table) for b in manifest.blobs) == 70  # written packed (> 64)
    assert cryosnap.load(run)["step"] == 2


def test_packs_read_exactly(golden: Any) -> None:
    """Small tensors packed several to a blob (tests/golden/packs, made when packs came)."""
    run = golden("packs")
    state = cryosnap.load(run)
    model = state["model"]
    assert list(state) == ["model", "optim"]
    assert list(model) == ["norm.weight", "norm.bias", "mask", "proj", "count", "big"]
    want = {
        "norm.weight": torch.tensor([1.0, 0.5, -2.0]),
        "norm.bias": torch.tensor([0.25, -0.125, 3.0], dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True, True, False]),
        "proj": torch.tensor(
            [[0.0, 0.125, 0.25, 0.375], [0.5, 0.625, 0.75, 0.875], [1.0, 1.125, 1.25, 1.375]],
            dtype=torch.float16,
        ),
        "count": torch.tensor(7, dtype=torch.int64),
        "big": torch.arange(2000, dtype=torch.float32),
    }
    for key, expected in want.items():
        got = model[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        assert torch.equal(got, expected), key
    assert isinstance(model["proj"], torch.nn.Parameter) and model["proj"].requires_grad
    assert torch.equal(state["optim"]["step"], torch.tensor(3.0)) and state["optim"]["lr"] == 0.01
    # Seven tensors in one pack of 60 bytes (one zero byte before the float16 matrix), each
    # restored as a tensor of its own.
    record = engine.read_commit(LocalStore(run), 3)
    manifest, _ref = engine.read_manifest(LocalStore(run), record, 0)
    assert [b.nbytes for b in manifest.blobs] == [8000, 60]
    # Its manifest says 2 (packed tensors; a cryosnap from before packs refuses it by that),
    # its commit record 1 (test_golden_runs_are_format_1).
    assert manifest.format_version == 2
    ptrs = {t.untyped_storage().data_ptr() for t in model.values()}
    assert len(ptrs) == 6


def test_files_read_exactly(golden: Any) -> None:
    """cryosnap.File leaves (tests/golden/files, made when File leaves came)."""
    run = golden("files")
    state = cryosnap.load(run)
    assert list(state) == ["grid", "empty", "it"] and state["it"] == 4
    grid, empty = state["grid"], state["empty"]
    assert isinstance(grid, cryosnap.File) and isinstance(empty, cryosnap.File)
    assert grid.read_bytes() == bytes(i % 251 for i in range(10_000)) and grid.size == 10_000
    assert empty.read_bytes() == b"" and empty.size == 0
    assert Path(grid.path).name == "grid.bin" and Path(grid.path).is_absolute()
    # Its manifest says 3 (file leaves; a cryosnap from before them refuses it by that).
    record = engine.read_commit(LocalStore(run), 4)
    manifest, _ref = engine.read_manifest(LocalStore(run), record, 0)
    assert manifest.format_version == 3 and [b.nbytes for b in manifest.blobs] == [10_000, 0]


def _columns_want() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.tensor([[0.0, 0.25, 0.5], [0.75, 1.0, 1.25], [1.5, 1.75, 2.0],
                                      [2.25, 2.5, 2.75]]),
        "embed.scale": torch.tensor([0.5, -1.5], dtype=torch.bfloat16),
        "block.0.weight": torch.tensor([[1.0, -1.0], [2.0, -2.0]]),
        "block.0.bias": torch.tensor([0.125, 0.25], dtype=torch.float16),
        "block.0.mask": torch.tensor([True, False, False, True]),
        "block.0.count": torch.tensor(11, dtype=torch.int64),
        "block.0.empty": torch.zeros(0, 3),
        "block.1.table": torch.arange(1500, dtype=torch.int32),
        "block.1.z": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        "head.weight": torch.tensor([[-0.75, -0.75], [-0.75, -0.75]], dtype=torch.float64),
    }  # fmt: skip


def _columns_match(model: dict[str, Any]) -> None:
    want = _columns_want()
    assert list(model) == list(want)
    for key, expected in want.items():
        got = model[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        assert torch.equal(got, expected), key
    weight = model["block.0.weight"]
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad


def test_columns_read_exactly(golden: Any) -> None:
    """A state dict in columns (tests/golden/columns, made when columns came): fresh, into=
    (filled in place), keys=; its manifest says 4."""
    run = golden("columns")
    state = cryosnap.load(run)
    assert list(state) == ["model", "step"] and state["step"] == 9
    _columns_match(state["model"])
    into = {
        "model": {k: torch.zeros_like(v) for k, v in _columns_want().items()},
        "step": 0,
    }
    into["model"]["block.0.weight"] = torch.nn.Parameter(torch.zeros(2, 2))
    tensors = [id(v) for v in into["model"].values()]
    cryosnap.load(run, into=into)
    assert [id(v) for v in into["model"].values()] == tensors and into["step"] == 9
    _columns_match(into["model"])
    _columns_match(cryosnap.load(run, keys=["model"])["model"])
    record = engine.read_commit(LocalStore(run), 9)
    manifest, _ref = engine.read_manifest(LocalStore(run), record, 0)
    assert manifest.format_version == 4 and "cols" in manifest.skeleton["v"][0]
    assert [b.nbytes for b in manifest.blobs] == [0, 6000, 136]  # the pack: 9 leaves, gaps


_RECORD = np.dtype([("id", "<i4"), ("w", "<f8")])


def _arrays_want() -> dict[str, np.ndarray]:
    return {
        "rho": np.array([[0.0, 0.25, 0.5], [0.75, 1.0, 1.25]], np.float32),
        "flag": np.array([True, False, True]),
        "count": np.array(11, np.int64),
        "be": np.array([1, -2, 300], ">i2"),
        "z": np.array([1 + 2j, -0.5j], np.complex128),
        "rec": np.array([(1, 0.5), (-2, 2.25)], _RECORD),
        "when": np.array(["2026-12-06", "1970-01-01"], "datetime64[D]"),
        "fortran": np.array([[0, 1, 2], [3, 4, 5]], np.int16, order="F"),
        "empty": np.zeros((0, 4), np.float32),
        "big": np.array([i / 8 for i in range(1500)], np.float64),
    }


def _arrays_match(fields: dict[str, Any]) -> None:
    want = _arrays_want()
    assert list(fields) == list(want)
    for key, expected in want.items():
        _array(fields[key], expected)
    assert fields["fortran"].flags.f_contiguous and not fields["fortran"].flags.c_contiguous


def test_arrays_read_exactly(golden: Any) -> None:
    """Packed numpy arrays (tests/golden/arrays, made when they came): fresh, into= (filled
    in place), keys=; its manifest says 5, the small C-order arrays share one pack, the
    Fortran-order, empty and large ones and the tensor's pack stay apart."""
    run = golden("arrays")
    state = cryosnap.load(run)
    assert list(state) == ["fields", "t", "step"] and state["step"] == 11
    _arrays_match(state["fields"])
    assert type(state["t"]) is torch.Tensor and state["t"].tolist() == [0.5, -1.0]
    into = {"fields": {k: np.zeros_like(v) for k, v in _arrays_want().items()}, "t": None}
    into["step"] = 0
    arrays = [id(v) for v in into["fields"].values()]
    cryosnap.load(run, into=into)
    assert [id(v) for v in into["fields"].values()] == arrays and into["step"] == 11
    _arrays_match(into["fields"])
    _arrays_match(cryosnap.load(run, keys=["fields"])["fields"])
    record = engine.read_commit(LocalStore(run), 11)
    manifest, _ref = engine.read_manifest(LocalStore(run), record, 0)
    assert manifest.format_version == 5
    nodes = dict(zip(manifest.skeleton["v"][0]["k"], manifest.skeleton["v"][0]["v"], strict=True))
    packed = ["rho", "flag", "count", "be", "z", "rec", "when"]
    assert [k for k, n in nodes.items() if "at" in n] == packed
    # Each at a multiple of its element size, in one pack of arrays of 128 bytes.
    assert [nodes[k]["at"] for k in packed] == [0, 24, 32, 40, 48, 84, 112]
    assert {nodes[k]["b"] for k in packed} == {3}
    assert nodes["be"]["dtype"] == ">i2" and nodes["fortran"]["order"] == "F"
    # fortran, empty and big alone, the pack of arrays, the tensor's pack.
    assert [b.nbytes for b in manifest.blobs] == [12, 0, 12000, 128, 8]


def test_golden_runs_are_format_1() -> None:
    for commit in GOLDEN.glob("*/versions/*/COMMIT.json"):
        assert b'"format_version":1' in commit.read_bytes(), commit
    versions = {"packs": 2, "files": 3, "columns": 4, "arrays": 5}
    for manifest in GOLDEN.glob("*/versions/*/rank-*.json"):
        version = versions.get(manifest.parts[-4], 1)
        assert f'"format_version":{version}'.encode() in manifest.read_bytes()


@pytest.mark.parametrize(
    ("name", "step", "error", "match", "fallback"),
    [
        ("damaged_flip", 5, cryosnap.IntegrityError, "leaf table: chunk", None),
        ("damaged_truncated", 2, cryosnap.IntegrityError, "truncated", 1),
        ("damaged_manifest", 2, cryosnap.IntegrityError, "does not match its recorded hash", 1),
        ("damaged_missing", 2, cryosnap.IntegrityError, "missing", 1),
    ],
)
def test_damaged_copies(
    golden: Any,
    name: str,
    step: int,
    error: type[Exception],
    match: str,
    fallback: int | None,
) -> None:
    run = golden(name)
    with pytest.raises(error, match=match) as info:
        cryosnap.load(run, step=step)
    assert f"step {step}" in str(info.value)
    with pytest.raises(error, match=match):
        engine.verify_part(LocalStore(run), step)
    if fallback is None:  # nothing older to fall back to
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(cryosnap.IntegrityError, match="every version"):
                cryosnap.load(run)
        return
    with pytest.warns(RuntimeWarning, match=f"skipping damaged step {step}"):
        state = cryosnap.load(run)
    assert state["step"] == fallback
    _array(state["grid"], _grid(fallback))
