"""``_run/scavenge.py`` in one process: the flush of versions a writer left on scratch (here its
persistent tier refused them and the writer gave up), with ranks as threads where the run is
distributed. tests/integration/test_flush.py does the same with SIGKILLed writers, the command
line, mpiexec and torchrun.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointNotFoundError, StorageError, WorldSizeError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from ..distributed.test_coordinator import run_ranks


def state(step: int) -> dict[str, Any]:
    return {"a": np.arange(50_000, dtype=np.float64) * step, "step": step}


def left_on_scratch(persistent: Path, scratch: Path) -> None:
    """Steps 1 (persistent) and 2 (scratch only: the persistent tier refused its data)."""

    def fault(op: str, key: str) -> None:
        if op == "open_writer" and key.startswith("data/000000000002"):
            raise StorageError(f"injected: {key}")

    store = FaultyStore(LocalStore(persistent), fault=fault)
    with cryosnap.Checkpointer(
        store, scratch=scratch, chunk_bytes=16 << 10, flush_retry_seconds=0
    ) as ckpt:
        ckpt.save(1, state(1)).result()
        with pytest.raises(StorageError, match="could not be flushed"):
            ckpt.save(2, state(2)).result()
    assert engine.list_steps(LocalStore(persistent)) == [1]


def test_the_versions_left_on_scratch_are_flushed_once(tmp_path: Path) -> None:
    persistent, scratch = tmp_path / "persistent", tmp_path / "scratch"
    left_on_scratch(persistent, scratch)
    report = cryosnap.flush(persistent, scratch=scratch)
    assert report.ok and (report.rank, report.world_size) == (0, 1)
    assert [v.step for v in report.flushed] == [2] and report.flushed[0].nbytes > 0
    assert report.already == (1,) and report.superseded == report.partial == ()
    out = cryosnap.load(persistent, step=2)
    np.testing.assert_array_equal(out["a"], state(2)["a"])
    doc = cryosnap.flush(persistent, scratch=scratch).to_json()
    assert doc["flushed"] == [] and doc["already_persistent"] == [1, 2] and doc["ok"]


def test_scratch_is_required(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scratch= is required"):
        cryosnap.flush(tmp_path, scratch=None)


def test_every_rank_fails_alike_when_one_has_no_scratch_part(tmp_path: Path) -> None:
    (tmp_path / "persistent").mkdir()
    (tmp_path / "scratch" / "rank-00000").mkdir(parents=True)

    def rank(coord: Coordinator) -> str:
        try:
            cryosnap.flush(tmp_path / "persistent", scratch=tmp_path / "scratch", comm=coord)
        except CheckpointNotFoundError as exc:
            return str(exc)
        return "flushed"

    told = run_ranks(2, rank)
    assert told[0] == told[1] and "rank 1: no scratch run at" in told[0]


def test_a_flush_on_fewer_ranks_than_saved_is_refused(tmp_path: Path) -> None:
    persistent = tmp_path / "persistent"
    scratch = tmp_path / "scratch"

    def save(coord: Coordinator) -> None:
        with cryosnap.Checkpointer(persistent, comm=coord) as ckpt:
            ckpt.save(1, state(coord.rank)).result()

    run_ranks(2, save)
    (scratch).mkdir()
    with pytest.raises(WorldSizeError, match="saved by 2 rank"):
        cryosnap.flush(persistent, scratch=scratch)


def test_a_distributed_run_is_flushed_by_its_ranks(tmp_path: Path) -> None:
    persistent, scratch = tmp_path / "persistent", tmp_path / "scratch"

    def fault(op: str, key: str) -> None:
        if op == "open_writer" and key.startswith("data/000000000002"):
            raise StorageError(f"injected: {key}")

    def save(coord: Coordinator) -> None:
        store = FaultyStore(LocalStore(persistent), fault=fault)
        with cryosnap.Checkpointer(
            store, scratch=scratch, comm=coord, chunk_bytes=16 << 10, flush_retry_seconds=0
        ) as ckpt:
            ckpt.save(1, {**state(1), "rank": coord.rank}).result()
            with pytest.raises(StorageError):
                ckpt.save(2, {**state(2), "rank": coord.rank}).result()

    run_ranks(2, save)
    assert engine.list_steps(LocalStore(persistent)) == [1]
    reports = run_ranks(2, lambda coord: cryosnap.flush(persistent, scratch=scratch, comm=coord))
    assert [r.rank for r in reports] == [0, 1]
    # The figures are every rank's together, the same on each; the scratch each rank's own.
    assert reports[0].flushed == reports[1].flushed and reports[0].already == (1,)
    assert reports[1].scratch == (str(scratch / "rank-00001"),)
    (flushed,) = reports[0].flushed
    assert flushed.step == 2 and flushed.nbytes > 0
    for rank in (0, 1):
        out = cryosnap.load(persistent, step=2, rank=rank)
        assert out["rank"] == rank
        np.testing.assert_array_equal(out["a"], state(2)["a"])
