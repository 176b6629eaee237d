"""The VersionWriter and WriterThread built from their collaborators: the commit protocol's
order of storage calls, a failed commit record, a two-rank commit, retention after commit."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._format.keys import commit_key, manifest_key
from cryosnap._run.levels.levels import Levels
from cryosnap._run.writer import WriterThread
from cryosnap.dist import InProcessGroup
from cryosnap.errors import CheckpointError, StorageError, StorageTimeoutError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from .rooms import chain, job, level, on_ranks, state, version_writer


def test_a_version_is_written_data_then_manifest_then_commit_record(tmp_path: Path) -> None:
    store = FaultyStore(LocalStore(tmp_path))
    writer = version_writer(level(store))
    info, part = writer.write(job(3, state(3)))
    writes = [(op, key) for op, key in store.ops if op in ("open_writer", "write")]
    kinds = [key.split("/")[0] if op == "open_writer" else key for op, key in writes]
    assert kinds[0] == "data"
    assert kinds[-2:] == [manifest_key(3, 0), commit_key(3)]
    assert info.step == 3 and info.tiers == ("persistent",)
    assert engine.list_steps(store) == [3]
    got = cryosnap.load(tmp_path, step=3)
    assert np.array_equal(got["big"], state(3)["big"])
    assert part.written_bytes == info.written_bytes


def test_a_failing_commit_record_write_leaves_no_version(tmp_path: Path) -> None:
    def fault(op: str, key: str) -> None:
        if op == "write" and key == commit_key(1):
            raise StorageError("the commit record write failed")

    store = FaultyStore(LocalStore(tmp_path), fault=fault)
    writer = version_writer(level(store))
    with pytest.raises(CheckpointError, match="commit record write failed"):
        writer.write(job(1, state(1)))
    assert engine.list_steps(store) == []
    assert writer.in_doubt == set()  # a failure that cannot still land


def test_a_commit_record_write_that_timed_out_reserves_its_files(tmp_path: Path) -> None:
    def fault(op: str, key: str) -> None:
        if op == "write" and key == commit_key(1):
            raise StorageTimeoutError("the commit record write timed out")

    store = FaultyStore(LocalStore(tmp_path), fault=fault)
    lvl = level(store)
    writer = version_writer(lvl)
    with pytest.raises(StorageTimeoutError):
        writer.write(job(1, state(1)))
    assert writer.in_doubt == {1}
    assert manifest_key(1, 0) in lvl.reserved
    assert any(key.startswith("data/") for key in lvl.reserved)


def test_two_ranks_commit_one_version_with_both_parts(tmp_path: Path) -> None:
    group = InProcessGroup(2, timeout=30)
    lvl = level(LocalStore(tmp_path))

    def rank(r: int) -> int:
        writer = version_writer(lvl, coordinator=group.coordinator(r))
        info, _part = writer.write(job(5, state(5 + r)))
        return info.step

    assert on_ranks(2, rank) == [5, 5]
    record = engine.read_commit(LocalStore(tmp_path), 5)
    assert record.world_size == 2
    for r in (0, 1):
        got = cryosnap.load(tmp_path, step=5, rank=r)
        assert np.array_equal(got["step"], state(5 + r)["step"])


def test_a_rank_that_cannot_write_fails_the_version_on_both(tmp_path: Path) -> None:
    group = InProcessGroup(2, timeout=30)
    lvl = level(LocalStore(tmp_path))

    def rank(r: int) -> object:
        writer = version_writer(lvl, coordinator=group.coordinator(r))
        if r == 1:
            writer.fail(5, CheckpointError("rank 1 has no part"))
            return "failed"
        return writer.write(job(5, state(5)))

    got = on_ranks(2, rank)
    assert isinstance(got[0], CheckpointError) and "rank 1 has no part" in str(got[0])
    assert got[1] == "failed"
    assert engine.list_steps(LocalStore(tmp_path)) == []


def test_the_writer_thread_retires_after_commit_and_reports_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    lvl = level(store, keep=cryosnap.policy.KeepLast(1))
    idx = chain()
    levels = Levels([lvl], chain=idx, coordinator=cryosnap.dist.LocalCoordinator())
    events: list[tuple[str, int]] = []
    inflight = threading.BoundedSemaphore(1)
    thread = WriterThread(
        version_writer(lvl, chain_index=idx),
        levels=levels,
        policy_event=lambda event, step, **_: events.append((event, step)),
        clock=lambda: 0.0,
        inflight=inflight,
    )
    try:
        for step in (1, 2):
            inflight.acquire()
            j = job(step, state(step))
            thread.submit(j)
            assert j.pending.result(30).step == step
            thread.settle()
    finally:
        thread.stop()
    assert engine.list_steps(store) == [2]
    assert events == [("durable", 1), ("durable", 2)]
