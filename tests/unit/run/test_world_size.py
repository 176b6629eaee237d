"""Restores at another world size than saved: a WorldSizeError on every participant (parts
left unread, or a participant without a part), replicated_only at any size; every version
damaged is an IntegrityError, no version at all a CheckpointNotFoundError. Ranks are threads
(cryosnap.dist.InProcessGroup); tests/integration/test_dist_torch.py runs real gloo ranks."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
import cryosnap._run.redundancy.partner as _partner
from cryosnap.dist import Coordinator
from cryosnap.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    WorldSizeError,
)

from ..distributed.test_coordinator import run_ranks

_NODE = threading.local()


@pytest.fixture(autouse=True)
def _nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_partner, "node_name", lambda: getattr(_NODE, "name", "node"))


def state_of(rank: int) -> dict[str, Any]:
    return {"model": np.arange(4096, dtype=np.float32), "own": np.full(64, rank), "rank": rank}


def save_at(run: Path, world: int, **options: Any) -> None:
    def body(c: Coordinator) -> None:
        with cryosnap.Checkpointer(run, comm=c, chunk_bytes=4096, **options) as ckpt:
            for step in (1, 2):
                ckpt.save(step, state_of(c.rank), replicated=["model"]).result()

    run_ranks(world, body)


def restore_at(run: Path, world: int, **options: Any) -> list[tuple[str, str, Any]]:
    """Per rank: the error of restore() and of restore(2), and restore(replicated_only=True)."""

    def body(c: Coordinator) -> tuple[str, str, Any]:
        with cryosnap.Checkpointer(run, comm=c, **options) as ckpt:
            with pytest.raises(WorldSizeError) as newest:
                ckpt.restore()
            with pytest.raises(WorldSizeError) as explicit:
                ckpt.restore(2)
            return str(newest.value), str(explicit.value), ckpt.restore(replicated_only=True)

    return run_ranks(world, body)


@pytest.mark.parametrize("world", [1, 2, 6])
def test_another_world_size_is_refused_on_every_rank(tmp_path: Path, world: int) -> None:
    run = tmp_path / "run"
    save_at(run, 4)
    results = restore_at(run, world)
    assert len(results) == world
    for newest, explicit, replicated in results:
        assert f"saved by 4 rank(s) and {world} participant(s)" in newest
        assert "replicated_only=True" in newest and "rank=k" in newest
        assert "restart at 4 ranks" in newest
        unread = "would be left unread" if world < 4 else "would have no part of it"
        assert unread in newest and unread in explicit
        assert list(replicated) == ["model"]
        np.testing.assert_array_equal(replicated["model"], state_of(0)["model"])
    # The ways on: any saved rank's part, by load(rank=k).
    assert cryosnap.load(run, rank=3)["rank"] == 3
    with pytest.raises(WorldSizeError, match="rank 4 has no part"):
        cryosnap.load(run, rank=4)


def test_a_world_of_one_restoring_a_distributed_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_at(run, 2)
    with cryosnap.Checkpointer(run) as ckpt:
        with pytest.raises(WorldSizeError, match="rank 1 would be left unread"):
            ckpt.restore()
        with pytest.raises(CheckpointNotFoundError):  # a WorldSizeError is one
            ckpt.restore(1)
        assert list(ckpt.restore(replicated_only=True)) == ["model"]


def test_scratch_per_rank_knows_the_saved_world_size(tmp_path: Path) -> None:
    # Each rank's scratch holds its part as a run of one: the size comes from the persistent
    # level's record.
    run, scratch = tmp_path / "run", tmp_path / "scratch"

    def save(c: Coordinator) -> None:
        _NODE.name = f"node-{c.rank}"
        with cryosnap.Checkpointer(run, comm=c, scratch=scratch) as ckpt:
            ckpt.save(1, state_of(c.rank), replicated=["model"]).result()

    run_ranks(4, save)

    def restore(c: Coordinator) -> tuple[str, str, Any]:
        _NODE.name = f"node-{c.rank}"
        with cryosnap.Checkpointer(run, comm=c, scratch=scratch) as ckpt:
            with pytest.raises(WorldSizeError) as newest:
                ckpt.restore()
            with pytest.raises(WorldSizeError) as explicit:
                ckpt.restore(1)
            return str(newest.value), str(explicit.value), ckpt.restore(replicated_only=True)

    for newest, explicit, replicated in run_ranks(2, restore):
        assert "saved by 4 rank(s) and 2 participant(s)" in newest
        assert "ranks 2..3 would be left unread" in explicit
        assert list(replicated) == ["model"]


def _flip_every_data_file(run: Path) -> None:
    for data in run.rglob("*.dat"):
        raw = bytearray(data.read_bytes())
        raw[0] ^= 0xFF
        data.write_bytes(bytes(raw))


def test_every_version_damaged_is_an_integrity_error_on_every_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_at(run, 2)
    _flip_every_data_file(run)

    def body(c: Coordinator) -> str:
        with (
            cryosnap.Checkpointer(run, comm=c) as ckpt,
            pytest.raises(IntegrityError) as damaged,
        ):
            ckpt.restore()
        return str(damaged.value)

    for message in run_ranks(2, body):
        assert "every version" in message and "steps tried: 2, 1" in message
    with (
        pytest.warns(RuntimeWarning, match="skipping damaged step"),
        pytest.raises(IntegrityError, match="steps tried: 2, 1"),
    ):
        cryosnap.load(run)


def test_no_version_at_all_stays_not_found(tmp_path: Path) -> None:
    def body(c: Coordinator) -> bool:
        with cryosnap.Checkpointer(tmp_path / "run", comm=c) as ckpt:
            with pytest.raises(CheckpointNotFoundError) as none:
                ckpt.restore()
            return isinstance(none.value, (IntegrityError, WorldSizeError))

    assert run_ranks(2, body) == [False, False]
    with pytest.raises(CheckpointNotFoundError):
        cryosnap.load(tmp_path / "run")
