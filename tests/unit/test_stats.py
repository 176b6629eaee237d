"""Per-leaf statistics recorded at save time (``Run.stats``): held against numpy computed on the
loaded data, for random float arrays with NaN and Inf, every float dtype, leaves packed with
others, leaves split across chunks and batches, incremental versions and capture-unchanged
leaves; manifests of older format versions read, without statistics."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap import LeafStats
from cryosnap._format.manifest import STATS_FORMAT_VERSION
from cryosnap.errors import CheckpointFormatError, StatsNotRecordedError

_DTYPES = [np.float16, np.float32, np.float64]


def expected(value: Any) -> LeafStats:
    """The statistics of one leaf, computed by numpy in float64 from its elements."""
    if isinstance(value, torch.Tensor):
        value = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
    x = np.asarray(value).astype(np.float64).ravel()
    fin = np.isfinite(x)
    f = x[fin]
    nan = int(np.isnan(x).sum())
    if not len(f):
        return LeafStats(nan, len(x) - nan, None, None, None, 0.0)
    return LeafStats(
        nan, len(x) - nan - len(f), f.min(), f.max(), f.mean(), float(np.sqrt(np.dot(f, f)))
    )


def assert_close(got: LeafStats, want: LeafStats, where: str) -> None:
    assert (got.nan, got.inf) == (want.nan, want.inf), where
    assert got.min == want.min and got.max == want.max, where  # exact: elements themselves
    for name in ("mean", "norm"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, where
        else:
            assert a is not None and math.isclose(
                a, b, rel_tol=1e-5, abs_tol=1e-6 * (1 + abs(b))
            ), (
                where,
                name,
                a,
                b,
            )


def check_run(path: str | Path, step: int) -> None:
    """Every float leaf's recorded statistics against numpy on the loaded version."""
    state = cryosnap.load(path, step=step)
    stats = cryosnap.Run(path).stats(step)
    flat = dict(_leaves(state))
    floats = {
        p: v
        for p, v in flat.items()
        if (isinstance(v, np.ndarray) and v.dtype.kind == "f")
        or (isinstance(v, torch.Tensor) and v.is_floating_point())
    }
    assert set(stats) == set(floats)
    for p, v in floats.items():
        assert_close(stats[p], expected(v), p)


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}/")
        else:
            out.append((f"{prefix}{key}", value))
    return out


_ELEMENTS = st.sampled_from([0.0, -1.5, 1e3, float("nan"), float("inf"), -float("inf")])


@st.composite
def float_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(_DTYPES))
    n = draw(st.integers(0, 3000) | st.sampled_from([70_000]))
    base = np.array(draw(st.lists(_ELEMENTS, min_size=min(n, 64), max_size=min(n, 64))), dtype)
    if n <= 64:
        return base
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = (rng.standard_normal(n) * draw(st.sampled_from([1e-3, 1.0, 1e4]))).astype(dtype)
    out[rng.integers(0, n, len(base))] = base
    return out


@settings(max_examples=25, deadline=None)
@given(st.lists(float_arrays(), min_size=1, max_size=6), st.booleans())
def test_stats_match_numpy(arrays: list[np.ndarray], big_chunks: bool) -> None:
    state: dict[str, Any] = {f"x{i}": a for i, a in enumerate(arrays)}
    state["ints"] = np.arange(5)
    state["t"] = {"bf16": torch.tensor(arrays[0][:50].astype(np.float32)).bfloat16()}
    with tempfile.TemporaryDirectory() as d:
        chunk = 1 << 20 if big_chunks else 4096  # small chunks: leaves across chunks
        with cryosnap.Checkpointer(d, chunk_bytes=chunk) as ck:
            ck.save(1, state).result()
            state["x0"] = state["x0"][::-1].copy()
            ck.save(2, state).result()
        check_run(d, 1)
        check_run(d, 2)


def test_packed_small_leaves_and_many_dtypes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    state = {
        f"p{i}": torch.tensor(rng.standard_normal(7 + i), dtype=dt)
        for i, dt in enumerate([torch.float16, torch.bfloat16, torch.float32, torch.float64] * 5)
    }
    state["p3"][2] = float("nan")
    state["p6"][0] = float("-inf")
    state["np"] = rng.standard_normal(11).astype(np.float32)
    cryosnap.save(tmp_path, state, step=1)
    manifest = json.loads((tmp_path / "versions/000000000001/rank-00000.json").read_text())
    assert manifest["format_version"] == STATS_FORMAT_VERSION
    assert any("at" in str(node) for node in [manifest["tree"]])  # packed
    check_run(tmp_path, 1)
    stats = cryosnap.Run(tmp_path).stats(1)
    assert stats["p3"].nan == 1 and stats["p6"].inf == 1


def test_incremental_versions_keep_stats_of_unchanged_leaves(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    state = {"a": rng.standard_normal(300_000), "b": rng.standard_normal(1000).astype(np.float32)}
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=1 << 16) as ck:
        ck.save(1, state).result()
        state["a"][5] = np.nan  # one chunk changes
        ck.save(2, state).result()
        state["b"] += 1
        ck.save(3, state).result()
    for step in (1, 2, 3):
        check_run(tmp_path, step)
    run = cryosnap.Run(tmp_path)
    assert run.stats(1)["a"].nan == 0 and run.stats(2)["a"].nan == 1
    assert run.stats(2)["b"] == run.stats(1)["b"] != run.stats(3)["b"]


def test_stats_off_and_old_manifests(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path, stats=False) as ck:
        ck.save(1, {"a": np.ones(3)}).result()
    manifest = json.loads((tmp_path / "versions/000000000001/rank-00000.json").read_text())
    assert "stats" not in manifest and manifest["format_version"] < STATS_FORMAT_VERSION
    with pytest.raises(StatsNotRecordedError, match=r"step 1 .* without per-leaf statistics") as e:
        cryosnap.Run(tmp_path).stats(1)
    assert e.value.step == 1 and e.value.path is not None
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        cryosnap.Run(tmp_path).stats(7)
    with pytest.raises(TypeError, match="stats"):
        cryosnap.Checkpointer(tmp_path, stats="yes")  # type: ignore[arg-type]


def test_malformed_stats_field_is_a_format_error() -> None:
    from cryosnap._format.stats import decode_stats

    with pytest.raises(CheckpointFormatError, match="stats of leaf 'a'"):
        decode_stats({"a": [0, 0, "x", None, None, "0x0p+0"]}, "where")
    with pytest.raises(CheckpointFormatError, match="malformed count"):
        decode_stats({"a": [-1, 0, None, None, None, "0x0p+0"]}, "where")
    s = LeafStats(1, 2, -1.0, 3.0, 0.5, math.inf)
    from cryosnap._format.stats import encode_stats

    assert decode_stats(encode_stats({"a": s}), "w") == {"a": s}
    assert s.to_json()["norm"] is None and not s.finite


def test_a_leaf_equal_to_the_base_takes_its_row_unreduced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cryosnap.engine.write import _stats

    reduced: list[str] = []
    one = _stats.Recorder._one

    def counting(self: _stats.Recorder, raw: Any, s: Any, dtype: str) -> None:
        reduced.append(s.path)
        one(self, raw, s, dtype)

    monkeypatch.setattr(_stats.Recorder, "_one", counting)
    rng = np.random.default_rng(2)
    state = {"a": rng.standard_normal(50_000), "b": rng.standard_normal(50_000)}
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=1 << 16) as ckpt:
        ckpt.save(1, state).result()
        assert sorted(reduced) == ["a", "b"]
        reduced.clear()
        state["b"][7] = np.inf
        ckpt.save(2, state).result()
        assert reduced == ["b"]  # "a" hashed as in step 1: its row is step 1's
    run = cryosnap.Run(tmp_path)
    assert run.stats(2)["a"] == run.stats(1)["a"] and run.stats(2)["b"].inf == 1
    check_run(tmp_path, 2)


def test_leaves_split_across_batches_and_paths_as_inspect_prints_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    big = rng.standard_normal(400_000).astype(np.float32)  # 1.6 MB through 64 KiB of staging
    big[123_456] = np.nan
    model = torch.nn.Linear(8, 4)
    state = {"big": big, "model": model.state_dict(), "a/b": np.ones(5, np.float16)}
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=4096, staging_bytes=1 << 16) as ckpt:
        ckpt.save(1, state).result()
    stats = cryosnap.Run(tmp_path).stats(1)
    assert_close(stats["big"], expected(big), "big")
    paths = {leaf.path for leaf in cryosnap.Run(tmp_path).info(1).leaves}
    assert set(stats) <= paths and {"model/weight", "model/bias"} <= set(stats)
    assert_close(stats["model/weight"], expected(model.weight.detach()), "model/weight")
