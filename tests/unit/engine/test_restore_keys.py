"""Selective restore (``keys=``): only the chunks of the top-level keys asked for are read and
verified; ``into=`` gets only those keys; bad or missing keys are clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cryosnap
from cryosnap import engine
from cryosnap.storage import LocalStore


def make_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3)},
        "data": np.arange(8192, dtype=np.int64),
        "step": 7,
        3: "int key",
    }


def flip_blob(run: Path, step: int, path: str) -> None:
    """Flip one byte of the first chunk of the leaf at ``path`` in the data file it lies in."""
    store = LocalStore(run)
    _m, part, _keys, _where = engine.resolve_part(store, engine.read_commit(store, step), 0)
    blob = next(b for b in part.blobs if b.path == path)
    data = run / part.files[int(blob.files[0])]
    raw = bytearray(data.read_bytes())
    raw[int(blob.offsets[0])] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_keys_reads_only_those_keys_and_other_damage_does_not_matter(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cryosnap.save(run, make_state(), step=1, chunk_bytes=4096)
    flip_blob(run, 1, "data")
    got = cryosnap.load(run, keys=["model", "step"])
    assert list(got) == ["model", "step"]
    assert torch.equal(got["model"]["w"], make_state()["model"]["w"])
    assert got["step"] == 7
    assert cryosnap.load(run, keys=(3,)) == {3: "int key"}
    with pytest.raises(cryosnap.IntegrityError, match="data"):
        cryosnap.load(run, step=1)
    with pytest.raises(cryosnap.IntegrityError, match="data"):
        cryosnap.load(run, step=1, keys=["data"])
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.restore(keys=["step"]) == {"step": 7}
        # Without a step every version is damaged: an IntegrityError naming what was tried.
        with (
            pytest.warns(RuntimeWarning, match="skipping damaged step 1"),
            pytest.raises(cryosnap.IntegrityError, match=r"steps tried: 1\)"),
        ):
            ckpt.restore()


def test_keys_with_into_fills_only_those_keys(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cryosnap.save(run, make_state(), step=1)
    into: dict[Any, Any] = {
        "model": {"w": torch.zeros(4096), "b": torch.zeros(3)},
        "data": np.zeros(8192, dtype=np.int64),
        "step": 0,
        3: "",
    }
    w, data = into["model"]["w"], into["data"]
    got = cryosnap.load(run, into=into, keys=["model", "step"])
    assert list(got) == ["model", "step"]
    assert into["model"]["w"] is w and torch.equal(w, make_state()["model"]["w"])
    assert into["step"] == 7
    assert into["data"] is data and not data.any()  # untouched
    assert into[3] == ""
    with cryosnap.Checkpointer(run) as ckpt:
        got = ckpt.restore(into=into, keys=["data"])
    assert list(got) == ["data"] and into["data"][-1] == 8191


def test_keys_errors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cryosnap.save(run, make_state(), step=1)
    with pytest.raises(cryosnap.KeyNotFoundError, match=r"'optim'.*'model', 'data', 'step', 3"):
        cryosnap.load(run, keys=["model", "optim"])
    with pytest.raises(KeyError):
        cryosnap.load(run, keys=["optim"])
    for bad in ("model", [1.5], ["model", None], {"model"}, [True]):
        with pytest.raises(TypeError, match="keys must be"):
            cryosnap.load(run, keys=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        cryosnap.load(run, keys=["step", "step"])
    with pytest.raises(cryosnap.StateMismatchError, match="holding the selected keys"):
        cryosnap.load(run, keys=["step"], into={"model": {}})
    cryosnap.save(tmp_path / "list", [np.ones(3)], step=0)
    with pytest.raises(cryosnap.StateMismatchError, match="saved state is a list"):
        cryosnap.load(tmp_path / "list", keys=[0])
    with cryosnap.Checkpointer(run) as ckpt, pytest.raises(cryosnap.KeyNotFoundError):
        ckpt.restore(keys=["nope"])


def test_keys_of_an_incremental_chain_and_of_packed_tensors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    small = {f"t{i}": torch.full((4,), float(i)) for i in range(50)}  # packed together
    with cryosnap.Checkpointer(run, chunk_bytes=4096) as ckpt:
        ckpt.save(1, {"small": small, "big": torch.zeros(8192)}).result()
        ckpt.save(2, {"small": small, "big": torch.ones(8192)}).result()  # incremental
    got = cryosnap.load(run, keys=["small"])
    assert list(got) == ["small"] and torch.equal(got["small"]["t49"], torch.full((4,), 49.0))
    assert torch.equal(cryosnap.load(run, keys=["big"])["big"], torch.ones(8192))
