"""Multi-level runs: scratch first, background flush to persistent, restore from either.

Covers: save + flush + wipe scratch + restore from persistent; a persistent tier that fails for
a while then recovers (nothing lost, saves never blocked); one that never recovers (the error
reaches ``result()`` and ``wait()``, the versions stay on scratch); a SIGKILL between the scratch
commit and the flush (the next run restores from scratch and flushes it); per-tier retention;
several scratch devices with capacities; and the persistent commit record written last.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import Tier
from cryosnap.engine import list_steps
from cryosnap.errors import StorageError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from .levels_support import KillBeforeFlush, check, state

pytestmark = pytest.mark.timeout(120)


def test_save_flush_wipe_scratch_restore(tmp_path: Path) -> None:
    scratch, persistent = tmp_path / "scratch", tmp_path / "persistent"
    with cryosnap.Checkpointer(persistent, scratch=scratch, chunk_bytes=64 << 10) as ckpt:
        infos = [ckpt.save(s, state(s)).result() for s in (1, 2, 3)]
        assert [i.tiers for i in infos] == [("scratch", "persistent")] * 3
        assert infos[1].incremental
        status = ckpt.status()
        assert status.steps["persistent"] == (1, 2, 3)
        assert status.not_persistent == ()
    # The persistent tier alone is a complete run.
    check(cryosnap.load(persistent), 3)
    check(cryosnap.load(persistent, step=2), 2)
    shutil.rmtree(scratch)
    with cryosnap.Checkpointer(persistent, scratch=scratch, chunk_bytes=64 << 10) as ckpt:
        assert ckpt.steps() == [1, 2, 3]
        check(ckpt.restore(), 3)
        # Scratch was wiped: the next version is full there (each tier is self-contained).
        info = ckpt.save(4, state(4)).result()
        assert not info.incremental
    check(cryosnap.load(scratch), 4)
    check(cryosnap.load(persistent), 4)


def test_result_scratch_returns_before_the_flush(tmp_path: Path) -> None:
    gate, armed = threading.Event(), threading.Event()

    def fault(op: str, key: str) -> None:
        if armed.is_set() and key != "writer.lock" and op in ("write", "open_writer"):
            gate.wait(30)

    slow = FaultyStore(LocalStore(tmp_path / "persistent"), fault=fault)
    with cryosnap.Checkpointer(slow, scratch=tmp_path / "scratch") as ckpt:
        armed.set()
        pending = ckpt.save(1, state(1))
        info = pending.result(tier="scratch", timeout=30)
        assert info.tiers == ("scratch",)
        assert not pending.done()
        assert ckpt.status().not_persistent == (1,)
        # Reads come from scratch while the flush waits.
        check(ckpt.restore(), 1)
        gate.set()
        assert pending.result(timeout=30).tiers == ("scratch", "persistent")
    with pytest.raises(ValueError, match="tier="):
        pending.result(tier="nvme")


def test_persistent_down_then_back_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    down = threading.Event()

    def fault(op: str, key: str) -> None:
        if down.is_set() and op != "list" and op != "exists":
            raise StorageError(f"injected outage on {key}")

    persistent = FaultyStore(LocalStore(tmp_path / "persistent"), fault=fault)
    with (
        caplog.at_level(logging.WARNING, logger="cryosnap"),
        cryosnap.Checkpointer(
            persistent, scratch=tmp_path / "scratch", keep_scratch=1, flush_retry_seconds=60
        ) as ckpt,
    ):
        down.set()  # the outage starts after the run opened
        pendings = [ckpt.save(s, state(s)) for s in (1, 2, 3)]
        for p in pendings:
            assert p.result(tier="scratch", timeout=30).tiers == ("scratch",)
        status = ckpt.status()
        assert set(status.not_persistent) >= {2, 3}
        deadline = time.monotonic() + 30
        while status.flush_error is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the flusher's first attempt may not have run yet
            status = ckpt.status()
        assert isinstance(status.flush_error, StorageError)
        # keep_scratch=1, yet nothing unflushed left scratch.
        assert list_steps(LocalStore(tmp_path / "scratch")) == [1, 2, 3]
        down.clear()
        infos = [p.result(timeout=60) for p in pendings]
        assert [i.tiers for i in infos] == [("scratch", "persistent")] * 3
    assert any("stays on scratch" in r.getMessage() for r in caplog.records)
    assert list_steps(LocalStore(tmp_path / "persistent")) == [1, 2, 3]
    for s in (1, 2, 3):
        check(cryosnap.load(tmp_path / "persistent", step=s), s)
    # Now that all are persistent, scratch retention applies.
    assert list_steps(LocalStore(tmp_path / "scratch")) == [3]


def test_persistent_never_back_raises_and_keeps_scratch(tmp_path: Path) -> None:
    gone = threading.Event()

    def fault(op: str, key: str) -> None:
        if gone.is_set() and op in ("write", "open_writer"):
            raise StorageError(f"injected: bucket gone ({key})")

    persistent = FaultyStore(LocalStore(tmp_path / "persistent"), fault=fault)
    ckpt = cryosnap.Checkpointer(
        persistent, scratch=tmp_path / "scratch", keep_scratch=1, flush_retry_seconds=0.3
    )
    gone.set()
    first = ckpt.save(1, state(1))
    with pytest.raises(StorageError, match="could not be flushed"):
        first.result(timeout=30)
    second = ckpt.save(2, state(2))
    assert second.result(tier="scratch", timeout=30).step == 2
    with pytest.raises(StorageError, match="step 2 is on scratch"):
        ckpt.wait()
    ckpt.close()
    # Both versions are still on scratch (keep_scratch=1 does not drop unflushed ones).
    assert list_steps(LocalStore(tmp_path / "scratch")) == [1, 2]
    check(cryosnap.load(tmp_path / "scratch", step=1), 1)


def test_sigkill_between_scratch_commit_and_flush(
    killed_before_flush: KillBeforeFlush,
) -> None:
    run = killed_before_flush()
    persistent, (scratch,) = run.persistent, run.scratch
    assert list_steps(LocalStore(scratch)) == [1, 2]
    with cryosnap.Checkpointer(persistent, scratch=scratch, chunk_bytes=64 << 10) as ckpt:
        assert ckpt.steps() == [1, 2]
        check(ckpt.restore(), 2)  # from scratch
        ckpt.wait()  # the flush left over from the killed run
        assert ckpt.status().steps["persistent"] == (1, 2)
    shutil.rmtree(scratch)
    check(cryosnap.load(persistent), 2)


def test_damaged_scratch_copy_falls_back_to_persistent(tmp_path: Path) -> None:
    scratch, persistent = tmp_path / "scratch", tmp_path / "persistent"
    with cryosnap.Checkpointer(persistent, scratch=scratch) as ckpt:
        ckpt.save(1, state(1)).result()
    for f in (scratch / "data").iterdir():
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    with cryosnap.Checkpointer(persistent, scratch=scratch) as ckpt:
        check(ckpt.restore(step=1), 1)
        check(ckpt.restore(), 1)


def test_retention_per_tier(tmp_path: Path) -> None:
    scratch, persistent = tmp_path / "scratch", tmp_path / "persistent"
    with cryosnap.Checkpointer(persistent, scratch=scratch, keep=3, keep_scratch=1) as ckpt:
        for s in range(1, 7):
            ckpt.save(s, state(s)).result()
    assert list_steps(LocalStore(persistent)) == [4, 5, 6]
    assert list_steps(LocalStore(scratch)) == [6]
    for s in (4, 5, 6):
        check(cryosnap.load(persistent, step=s), s)
    check(cryosnap.load(scratch), 6)


def test_several_scratch_devices_split_and_capacity(tmp_path: Path) -> None:
    devs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    persistent = tmp_path / "persistent"
    big = {"a": np.random.default_rng(0).standard_normal(3_000_000)}  # 24 MB
    with cryosnap.Checkpointer(
        persistent, scratch=[Tier(devs[0]), Tier(devs[1])], chunk_bytes=1 << 20
    ) as ckpt:
        ckpt.save(1, big).result()
        np.testing.assert_array_equal(ckpt.restore()["a"], big["a"])
    used = [sum(f.stat().st_size for f in (d / "data").iterdir()) for d in devs]
    assert all(u > 0 for u in used), used  # the version's data went to both devices
    np.testing.assert_array_equal(cryosnap.load(persistent)["a"], big["a"])
    # A capacity smaller than the version: a clear error naming the scratch tier.
    with cryosnap.Checkpointer(
        tmp_path / "p2", scratch=Tier(tmp_path / "small", capacity_bytes=1 << 20)
    ) as ckpt:
        with pytest.raises(StorageError, match=r"scratch tier .* is full"):
            ckpt.save(1, big).result()
        assert ckpt.steps() == []


def test_persistent_commit_record_written_last(tmp_path: Path) -> None:
    order: list[str] = []

    def fault(op: str, key: str) -> None:
        if op in ("write", "open_writer"):
            order.append(key)

    persistent = FaultyStore(LocalStore(tmp_path / "persistent"), fault=fault)
    with cryosnap.Checkpointer(persistent, scratch=tmp_path / "scratch") as ckpt:
        ckpt.save(1, state(1)).result()
        ckpt.save(2, state(2)).result()
    commits = [i for i, k in enumerate(order) if k.endswith("COMMIT.json")]
    assert len(commits) == 2
    assert order[commits[0]].startswith("versions/000000000001")
    assert all("000000000002" not in k for k in order[: commits[0]])
    assert commits[1] == len(order) - 1


def test_bad_tier_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        Tier(tmp_path, capacity_bytes=0)
    with pytest.raises(ValueError, match="keep_scratch"):
        cryosnap.Checkpointer(tmp_path / "p", scratch=tmp_path / "s", keep_scratch=0)
    with pytest.raises(ValueError, match="scratch"):
        cryosnap.Checkpointer(tmp_path / "p", scratch=[])
    with pytest.raises(TypeError, match="storage_options"):
        cryosnap.Checkpointer(tmp_path / "p", storage_options=["x"])  # type: ignore[arg-type]


# --- regressions found in review -----------------------------------------------------------


def test_stale_manifest_on_persistent_is_not_reused(tmp_path: Path) -> None:
    """A flush that died after the manifest, scratch wiped, the step saved again: the new
    manifest replaces the stale one (manifest names are not unique, data file names are)."""
    from cryosnap._format.keys import commit_key

    scratch, persistent = tmp_path / "scratch", tmp_path / "persistent"
    with cryosnap.Checkpointer(persistent, scratch=scratch) as ckpt:
        ckpt.save(1, state(1)).result()
        ckpt.save(2, state(2)).result()
    (persistent / commit_key(2)).unlink()
    shutil.rmtree(scratch)
    with cryosnap.Checkpointer(persistent, scratch=scratch) as ckpt:
        ckpt.save(2, state(7)).result()
    check(cryosnap.load(persistent, step=2), 7)


def test_damaged_scratch_chain_is_not_committed_on_persistent(tmp_path: Path) -> None:
    from cryosnap._format.keys import manifest_key

    scratch, persistent = tmp_path / "scratch", tmp_path / "persistent"
    gate = threading.Event()

    def fault(op: str, key: str) -> None:
        if key.startswith("versions/000000000002") and op == "write":
            gate.wait(30)  # hold step 2's flush until its base's manifest is gone

    slow = FaultyStore(LocalStore(persistent), fault=fault)
    ckpt = cryosnap.Checkpointer(slow, scratch=scratch, flush_retry_seconds=1)
    ckpt.save(1, state(1)).result()
    (persistent / manifest_key(1, 0)).unlink()  # persistent lost it too: it must be copied
    pending = ckpt.save(2, state(2))
    pending.result(tier="scratch", timeout=30)
    (scratch / manifest_key(1, 0)).unlink()
    gate.set()
    with pytest.raises(cryosnap.CheckpointError, match="damaged"):
        pending.result(timeout=30)
    # The next version does not build on the damaged chain: it is full, and flushes.
    info = ckpt.save(3, state(3)).result(timeout=30)
    assert not info.incremental and info.tiers == ("scratch", "persistent")
    ckpt.close()  # the failure was delivered by result(): not raised again
    assert 2 not in list_steps(LocalStore(persistent))
    check(cryosnap.load(persistent, step=3), 3)


def test_a_lower_step_saved_last_is_kept_and_is_a_good_base(tmp_path: Path) -> None:
    """A step below the newest is refused unless a restore came first (issue 54); saved after
    one, it is kept (keep=1 never retires the version just saved) and the next builds on it."""
    scratch, persistent = tmp_path / "scratch", tmp_path / "persistent"
    with cryosnap.Checkpointer(persistent, scratch=scratch, keep=1, keep_scratch=1) as ckpt:
        ckpt.save(10, state(10)).result()
        with pytest.raises(cryosnap.StepOrderError, match="step 5"):
            ckpt.save(5, state(5))
        ckpt.restore(step=10)
        assert ckpt.save(5, state(5)).result().tiers == ("scratch", "persistent")
        ckpt.save(11, state(11)).result()
    check(cryosnap.load(persistent, step=11), 11)
    check(cryosnap.load(scratch, step=11), 11)


def test_incremental_version_fits_in_scratch_capacity(tmp_path: Path) -> None:
    big = {"w": np.random.default_rng(0).random(4 << 20)}  # 32 MiB
    tier = Tier(tmp_path / "scratch", capacity_bytes=48 << 20)
    with cryosnap.Checkpointer(tmp_path / "p", scratch=tier, keep_scratch=1) as ckpt:
        ckpt.save(1, big).result()
        big["w"][:10] += 1
        info = ckpt.save(2, big).result()
    assert info.incremental and info.written_bytes <= 1 << 20


def test_close_bounds_all_queued_flush_retries_together(tmp_path: Path) -> None:
    """One retry budget for every queued flush, not one each: a version still queued once the
    shared deadline has passed is tried once and given up, not retried for a second of its own.

    Step 2's flush is held until close() has begun and its deadline has passed, so step 3 is
    queued past the deadline however fast or slow the machine is (the attempts before then
    depend on the machine's speed, and are not what is tested)."""
    retry_seconds = 1.0
    down, closing = threading.Event(), threading.Event()
    closed_at: list[float] = []

    def fault(op: str, key: str) -> None:
        if not down.is_set() or key == "writer.lock" or op not in ("write", "open_writer"):
            return
        if key.startswith(f"data/{2:012d}"):
            assert closing.wait(30)  # a hang guard
            # close() starts the deadline first thing: past it with room to spare.
            past = closed_at[0] + retry_seconds + 0.5
            while (left := past - time.monotonic()) > 0:
                threading.Event().wait(left)
        raise StorageError("injected: persistent down")

    persistent = FaultyStore(LocalStore(tmp_path / "p"), fault=fault)
    ckpt = cryosnap.Checkpointer(
        persistent, scratch=tmp_path / "s", flush_retry_seconds=retry_seconds
    )
    down.set()
    for s in range(4):
        ckpt.save(s, {"w": np.full(10, s)}).result(tier="scratch")
    closed_at.append(time.monotonic())
    closing.set()
    with pytest.raises(StorageError, match="could not be flushed"):
        ckpt.close()
    attempts = {
        s: sum(
            1
            for op, key in persistent.ops
            if op == "open_writer" and key.startswith(f"data/{s:012d}")
        )
        for s in range(4)
    }
    assert attempts[3] == 1, attempts
    assert min(attempts.values()) >= 1, attempts  # every version was tried
    assert list_steps(LocalStore(tmp_path / "s")) == [0, 1, 2, 3]
