"""Levels, Handoff and flush_version built from their collaborators: a flush copies a version
whole with its commit record last, refuses a damaged source, and a hand-off reports each level."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._format.keys import commit_key
from cryosnap._run.levels.flush import Flusher, flush_version
from cryosnap._run.levels.levels import Levels
from cryosnap.dist import LocalCoordinator
from cryosnap.errors import SourceDamagedError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from .rooms import chain, job, level, state, version_writer


def _version_on(path: Path, step: int) -> LocalStore:
    store = LocalStore(path)
    version_writer(level(store)).write(job(step, state(step)))
    return store


def test_a_flush_copies_a_version_whole_commit_record_last(tmp_path: Path) -> None:
    src = _version_on(tmp_path / "scratch", 2)
    dst = FaultyStore(LocalStore(tmp_path / "persistent"))
    copied = flush_version(src, dst, 2)
    writes = [key for op, key in dst.ops if op in ("write", "open_writer")]
    assert writes[-1] == commit_key(2)
    assert set(writes) == {key for key in src.list("") if key != "writer.lock"}
    assert copied > 0 and engine.list_steps(dst) == [2]
    got = cryosnap.load(tmp_path / "persistent", step=2)
    assert np.array_equal(got["big"], state(2)["big"])


def test_a_damaged_source_is_refused_and_nothing_is_committed(tmp_path: Path) -> None:
    src = _version_on(tmp_path / "scratch", 2)
    data = next(key for key in src.list("data"))
    path = tmp_path / "scratch" / data
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    path.write_bytes(bytes(raw))
    dst = LocalStore(tmp_path / "persistent")
    with pytest.raises(SourceDamagedError):
        flush_version(src, dst, 2)
    assert engine.list_steps(dst) == []


def test_a_handoff_reports_each_level_and_the_next_one_lists_it(tmp_path: Path) -> None:
    scratch = level(LocalStore(tmp_path / "scratch"), "scratch", shared=False, keep=2)
    persistent = level(LocalStore(tmp_path / "persistent"), "persistent")
    idx = chain()
    levels = Levels([scratch, persistent], chain=idx, coordinator=LocalCoordinator())
    reached: list[tuple[int, str]] = []
    levels.observe = lambda step, name, seconds: reached.append((step, name))
    levels.start_handoffs(retry_seconds=5.0, yield_to=lambda: None)
    try:
        j = job(4, state(4), levels=levels.names)
        info, _part = version_writer(scratch, chain_index=idx).write(j)
        levels.reached(0, 4, j.pending, info)
        done = j.pending.result(30)
    finally:
        levels.close_handoffs()
    assert done.tiers == ("scratch", "persistent")
    assert reached == [(4, "scratch"), (4, "persistent")]
    assert levels.status().steps == {"scratch": (4,), "persistent": (4,)}
    assert levels.status().not_persistent == ()


def test_versions_left_unflushed_are_handed_off_on_open(tmp_path: Path) -> None:
    scratch_store = _version_on(tmp_path / "scratch", 7)
    scratch = level(scratch_store, "scratch", shared=False, keep=2)
    persistent = level(LocalStore(tmp_path / "persistent"), "persistent")
    levels = Levels([scratch, persistent], chain=chain(), coordinator=LocalCoordinator())
    levels.start_handoffs(retry_seconds=5.0, yield_to=lambda: None)
    try:
        resumed = levels.resume_unflushed(None)
        assert [p.step for p in resumed] == [7]
        # A version this session did not save: done, with no SaveInfo of its own.
        assert resumed[0]._done.wait(30) and not resumed[0].failed()
    finally:
        levels.close_handoffs()
    assert engine.list_steps(persistent.store) == [7]


class _FakeTime:
    """The flusher's clock and backoff wait: each wait moves the clock on by its seconds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return False


@pytest.mark.parametrize(
    ("retry_seconds", "waits"),
    [
        (0.0, []),
        (1.0, [0.05, 0.1, 0.2, 0.4]),  # the next (0.8) would end past the deadline
        (10.0, [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2]),  # then 5 (the longest): past it
        (30.0, [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0, 5.0]),
    ],
)
def test_a_failing_flush_backs_off_until_retry_seconds_then_fails_the_version(
    tmp_path: Path, retry_seconds: float, waits: list[float]
) -> None:
    fake = _FakeTime()
    attempts: list[float] = []

    def failing(src: object, dst: object, step: int, **_kw: object) -> int:
        attempts.append(fake.now)
        raise cryosnap.StorageError(f"the persistent tier is down (step {step})")

    outcomes: dict[int, object] = {}
    flusher = Flusher(
        LocalStore(tmp_path / "scratch"),
        LocalStore(tmp_path / "persistent"),
        retry_seconds=retry_seconds,
        on_done=outcomes.__setitem__,
        flush=failing,
        clock=fake.clock,
        wait=fake.wait,
    )
    flusher.submit(7)
    flusher.close()
    assert fake.waits == waits
    assert len(attempts) == len(waits) + 1 and attempts[-1] <= retry_seconds
    error = outcomes[7]
    assert isinstance(error, cryosnap.StorageError)
    plural = "s" * (len(attempts) > 1)
    assert "step 7 is on scratch" in str(error)
    assert f"after {len(attempts)} attempt{plural}:" in str(error)
