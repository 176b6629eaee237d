"""Snapshots (_run/capture/snapshot.py): an eager capture that would first allocate its staging
clones the state and copies the clones on the capture thread. The choice is made for CUDA state only
(tests/gpu covers it there); here the clone-and-capture path runs on CPU tensors, forced."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap._run.capture.capturer import Capturer
from cryosnap._run.capture.snapshot import cuda_bytes, snapshot, would_allocate
from cryosnap._run.capture.staging import StagingPool
from cryosnap._state import Blob, FlatState
from cryosnap._state.flatten import flatten

torch = pytest.importorskip("torch")

MIB = 1 << 20


def _flat(*sizes: int) -> FlatState:
    blobs = [Blob(("k", i), n, np.zeros(n, np.uint8)) for i, n in enumerate(sizes)]
    return FlatState({"t": "dict"}, blobs, len(sizes), sum(sizes))


def test_would_allocate_only_when_the_idle_slabs_fall_short_and_the_budget_allows() -> None:
    pool = StagingPool(slab_bytes=MIB, budget_bytes=None)
    assert would_allocate(_flat(MIB, 10), pool)  # nothing allocated yet: the first save
    slabs = [pool.acquire(), pool.acquire()]
    for s in slabs:
        pool.release(s)
    assert pool.room_bytes() == 2 * MIB
    assert not would_allocate(_flat(MIB, 10), pool)  # the slabs are there
    assert would_allocate(_flat(3 * MIB), pool)  # more than they hold
    assert not would_allocate(_flat(0), pool)  # nothing to copy
    full = StagingPool(slab_bytes=MIB, budget_bytes=MIB)
    held = full.acquire()
    # At its budget: a capture waits for the writer instead of allocating.
    assert not would_allocate(_flat(2 * MIB), full)
    full.release(held)


def test_snapshot_clones_what_the_program_may_change_and_nothing_else() -> None:
    live_t = torch.arange(1000, dtype=torch.float32)
    live_a = np.arange(50, dtype=np.int64)
    state = {"t": live_t, "a": live_a, "b": b"immutable", "n": 3}
    flat = flatten(state)
    snap = snapshot(flat)
    assert snap.skeleton is flat.skeleton and len(snap.blobs) == len(flat.blobs)
    assert cuda_bytes(flat) == {}
    for old, new in zip(flat.blobs, snap.blobs, strict=True):
        assert (old.key, old.nbytes) == (new.key, new.nbytes)
        if isinstance(old.source, bytes):
            assert new is old
            continue
        assert new.private and not old.private
        assert bytes(new.host_view()) == bytes(old.host_view())
    live_t += 1
    live_a += 1
    # The clones hold the bytes as they were at the snapshot.
    got = {bytes(b.host_view()) for b in snap.blobs}
    assert torch.arange(1000, dtype=torch.float32).numpy().tobytes() in got
    assert np.arange(50, dtype=np.int64).tobytes() in got


def _forced(monkeypatch: pytest.MonkeyPatch, taken: list[int]) -> threading.Event:
    """Make every eager capture go through a snapshot (on the CPU, where it is never chosen);
    the capture thread is held until the caller changed the state."""
    release = threading.Event()

    def _snapshot(self: Capturer, job: Any) -> FlatState:
        taken.append(job.step)
        return snapshot(job.flat)

    original = Capturer._capture_lazy

    def _capture_lazy(self: Capturer, job: Any, hooks: list[Any], snap: Any = None) -> None:
        assert release.wait(30)
        original(self, job, hooks, snap)

    monkeypatch.setattr(Capturer, "_snapshot", _snapshot)
    monkeypatch.setattr(Capturer, "_capture_lazy", _capture_lazy)
    return release


def test_an_eager_save_through_a_snapshot_keeps_the_state_as_it_was_at_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []
    release = _forced(monkeypatch, taken)
    gen = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(3 * MIB // 4, generator=gen),
        "small": torch.arange(7),
        "arr": np.ones((64, 64), np.float32),
        "step": 5,
    }
    expect = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    expect["arr"] = state["arr"].copy()
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        pending = ckpt.save(0, state)  # returns with the capture thread not started yet
        assert taken == [0] and ckpt._capturer.snapshots == 1
        assert not pending.done()
        state["w"].mul_(-1.0)  # the program goes on: these changes are not in version 0
        state["small"].add_(100)
        state["arr"][:] = 7
        release.set()
        info = pending.result()
        assert info.stall_seconds >= 0 and info.captured_bytes == info.logical_bytes
    got = cryosnap.load(tmp_path / "run", step=0)
    assert torch.equal(got["w"], expect["w"]) and torch.equal(got["small"], expect["small"])
    assert np.array_equal(got["arr"], expect["arr"]) and got["step"] == 5


def test_a_failure_in_a_snapshot_capture_reaches_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []
    _forced(monkeypatch, taken).set()

    def broken(*args: Any, **kwargs: Any) -> int:
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr("cryosnap._run.capture.capturer.capture_to_slabs", broken)
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        pending = ckpt.save(0, {"w": torch.zeros(1000)})
        with pytest.raises(cryosnap.CheckpointError, match="step 0: copying") as info:
            pending.result()  # as from a lazy capture
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(cryosnap.CheckpointNotFoundError):
            cryosnap.load(tmp_path / "run", step=0)
