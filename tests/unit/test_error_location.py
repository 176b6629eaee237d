"""Errors say which version and which store they are about: ``.step`` and ``.path`` are set on
the read, verify and write paths even where the raiser deep in a pipeline did not know them
(``cryosnap.errors.located``), and a raiser that knew better keeps its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._located import located
from cryosnap.errors import CheckpointError, IntegrityError, StorageError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

CHUNK = 4096


def _state(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(4 * CHUNK, value, dtype=np.float32), "b": np.arange(10.0)}


def _damage_data(run: Path) -> None:
    data = sorted(p for p in run.rglob("*") if p.is_file() and p.suffix == ".dat")
    assert data, sorted(str(p) for p in run.rglob("*"))
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data[0].write_bytes(bytes(raw))


def test_located_fills_what_is_missing_and_keeps_what_is_set() -> None:
    with pytest.raises(CheckpointError) as bare, located(step=3, path="runs/a"):
        raise CheckpointError("no location")
    assert (bare.value.step, bare.value.path) == (3, "runs/a")
    with pytest.raises(CheckpointError) as known, located(step=3, path="runs/a"):
        raise CheckpointError("knows", step=7, path="runs/b")
    assert (known.value.step, known.value.path) == (7, "runs/b")
    with pytest.raises(ValueError), located(step=3, path="runs/a"):
        raise ValueError("not a checkpoint error: untouched")


def test_a_damaged_chunk_names_its_step_and_run_on_load(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, _state(1.0), step=5, chunk_bytes=CHUNK)
    _damage_data(tmp_path)
    with pytest.raises(IntegrityError) as err:
        cryosnap.load(tmp_path, step=5)
    assert err.value.step == 5
    assert err.value.path == LocalStore(tmp_path).url


def test_verify_part_names_its_step_and_store(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, _state(1.0), step=2, chunk_bytes=CHUNK)
    _damage_data(tmp_path)
    store = LocalStore(tmp_path)
    with pytest.raises(IntegrityError) as err:
        engine.verify_part(store, 2)
    assert (err.value.step, err.value.path) == (2, store.url)


def test_a_missing_version_names_its_step(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, _state(1.0), step=2, chunk_bytes=CHUNK)
    store = LocalStore(tmp_path)
    with pytest.raises(CheckpointError) as err:
        engine.resolve_version(store, 9)
    assert (err.value.step, err.value.path) == (9, store.url)


def test_a_failed_write_names_its_step_and_level(tmp_path: Path) -> None:
    def fail_data(op: str, key: str) -> None:
        if op == "open_writer" and key.endswith(".dat"):
            raise StorageError(f"disk full writing {key}")

    store = FaultyStore(LocalStore(tmp_path), fault=fail_data)
    with cryosnap.Checkpointer(store, chunk_bytes=CHUNK) as ckpt:
        pending = ckpt.save(4, _state(2.0))
        with pytest.raises(StorageError) as err:
            pending.result(timeout=60)
    assert err.value.step == 4
    assert err.value.path == store.url
