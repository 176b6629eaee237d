"""Retention, readers and flushes under storage faults (issue #10): nothing committed is lost.

Each test here failed on the code before the fix it names: a retention pass that fails part-way
left the content index pointing at deleted files; a reader racing the writer's retention took
a retired version for a damaged one; a flush copied bit rot to the persistent tier.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._run.capture.capturer import Capturer
from cryosnap.errors import CheckpointError, StorageError
from cryosnap.storage import LocalStore, TimeoutStore
from cryosnap.testing import FaultyStore


def _state(step: int, n: int = 64 << 10) -> dict[str, np.ndarray]:
    """Content that repeats: step 0's bytes come back at every multiple of 3."""
    rng = np.random.default_rng(step % 3)
    return {"w": rng.integers(0, 255, n, dtype=np.uint8), "b": np.full(16, step % 3)}


class _FailsAfterDelete(FaultyStore):
    """Deletes take effect, then some report a failure (a timeout after the server acted)."""

    def __init__(self, inner: LocalStore, fails: Callable[[str], bool]) -> None:
        super().__init__(inner)
        self.fails = fails

    def delete(self, key: str) -> None:
        super().delete(key)
        if self.fails(key):
            raise StorageError(f"injected: deleting {key} failed after taking effect")


def test_a_retention_pass_that_fails_midway_loses_no_version(tmp_path: Path) -> None:
    """keep=1, one data file delete fails after taking effect: the next version that saves
    step 0's content again must not de-duplicate against the file that is gone."""
    failed: list[str] = []

    def fails(key: str) -> bool:
        if key.startswith("data/") and not failed:
            failed.append(key)
            return True
        return False

    store = _FailsAfterDelete(LocalStore(tmp_path), fails)
    with cryosnap.Checkpointer(store, keep=1, chunk_bytes=4096) as ckpt:
        for step in range(7):
            ckpt.save(step, _state(step)).result()
            got = cryosnap.load(tmp_path, step=step)
            np.testing.assert_array_equal(got["w"], _state(step)["w"])
    assert failed


@pytest.mark.parametrize("seed", [1, 2])
def test_random_failing_deletes_never_break_a_saved_version(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)

    def fault(op: str, key: str) -> None:
        if op == "delete" and rng.random() < 0.1:
            raise StorageError(f"injected: deleting {key} failed")

    # 10% of deletes fail before taking effect, 10% after.
    store = _FailsAfterDelete(LocalStore(tmp_path), lambda key: rng.random() < 0.1)
    store.fault = fault
    with cryosnap.Checkpointer(store, keep=2, chunk_bytes=4096, full_every=4) as ckpt:
        for step in range(40):
            ckpt.save(step, _state(step)).result()
            # Every version kept right now loads, including the one just saved.
            for s in engine.list_steps(LocalStore(tmp_path)):
                np.testing.assert_array_equal(cryosnap.load(tmp_path, step=s)["w"], _state(s)["w"])
    # Later passes finish what failed ones left: only what the kept versions need remains.
    with cryosnap.Checkpointer(tmp_path, keep=2, chunk_bytes=4096) as ckpt:
        ckpt.save(100, _state(100)).result()
    local = LocalStore(tmp_path)
    kept = [engine.read_commit(local, s) for s in engine.list_steps(local)]
    assert set(local.list("data")) == {f for r in kept for f in r.data_files}


class _SlowDataDeletes(FaultyStore):
    """Deletes of data files wait until ``go`` is set (a large file the kernel frees slowly)."""

    def __init__(self, inner: LocalStore) -> None:
        super().__init__(inner)
        self.go = threading.Event()
        self.waiting = threading.Event()

    def delete(self, key: str) -> None:
        if key.startswith("data/"):
            self.waiting.set()
            assert self.go.wait(30), "the test never let the delete go on"
        super().delete(key)


def test_a_version_is_reported_before_the_files_it_retires_are_deleted(tmp_path: Path) -> None:
    """keep=1: when result() returns, the dropped version is no longer listed (its commit
    record went first) although its data files are still being deleted; they are gone before
    the writer's next version, and every listed version loads meanwhile."""
    store = _SlowDataDeletes(LocalStore(tmp_path))
    with cryosnap.Checkpointer(store, keep=1, chunk_bytes=4096, incremental=False) as ckpt:
        ckpt.save(0, _state(0)).result()
        old = set(LocalStore(tmp_path).list("data"))
        info = ckpt.save(1, _state(1)).result(timeout=30)  # not held up by the delete
        assert info.step == 1
        assert store.waiting.wait(30)
        assert ckpt.steps() == [1]
        assert set(LocalStore(tmp_path).list("data")) >= old  # not deleted yet
        np.testing.assert_array_equal(cryosnap.load(tmp_path)["w"], _state(1)["w"])
        # wait() returns once the writer is done: the folder then holds what keep says.
        waiter = threading.Thread(target=ckpt.wait)
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()
        store.go.set()
        waiter.join(30)
        assert not waiter.is_alive()
        local = LocalStore(tmp_path)
        assert not old & set(local.list("data"))
        ckpt.save(2, _state(2)).result()
        assert engine.list_steps(local) == [2]


def test_readers_never_fail_while_the_writer_retires(tmp_path: Path) -> None:
    """keep=1: each commit retires the version before it; a reader asking for the newest one
    lists again instead of reporting a retired version as damaged or missing."""
    with cryosnap.Checkpointer(tmp_path, keep=1, chunk_bytes=4096) as ckpt:
        ckpt.save(0, _state(0)).result()
        stop = threading.Event()
        errors: list[BaseException] = []
        reads = [0]

        def reader() -> None:
            while not stop.is_set():
                try:
                    got = cryosnap.load(tmp_path)
                    assert got["b"][0] in (0, 1, 2)
                    reads[0] += 1
                except BaseException as exc:
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for step in range(1, 80):
                ckpt.save(step, _state(step)).result()
        finally:
            stop.set()
            for t in threads:
                t.join()
    assert not errors, errors[:1]
    assert reads[0] > 0


def test_an_explicit_step_retired_while_read_is_not_found(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, _state(0), step=0)
    # Another chunk size: step 1 is a full version, so retiring step 0 deletes its data.
    cryosnap.save(tmp_path, _state(1), step=1, chunk_bytes=4096)

    def fault(op: str, key: str) -> None:
        # The writer retires step 0 after the reader has read its manifest.
        if op.startswith("read_") and key.startswith("data/"):
            engine.retire(LocalStore(tmp_path), drop=[0], protect=[1])

    store = FaultyStore(LocalStore(tmp_path), fault=fault)
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="retention while it was read"):
        cryosnap.load(store, step=0)


def test_a_flush_never_certifies_bytes_it_did_not_check(tmp_path: Path) -> None:
    """Bit rot on scratch before the flush: the flush fails, persistent never claims the
    version, and scratch keeps its copy."""
    gate = threading.Event()

    def fault(op: str, key: str) -> None:
        if op == "open_writer" and key.startswith("data/"):
            gate.wait(30)

    persistent = FaultyStore(LocalStore(tmp_path / "p"), fault=fault)
    scratch = tmp_path / "s"
    with cryosnap.Checkpointer(
        persistent, scratch=scratch, chunk_bytes=4096, keep_scratch=1
    ) as ckpt:
        pending = ckpt.save(0, _state(0))
        pending.result(tier="scratch")
        (data,) = (scratch / "data").iterdir()
        # Flip a byte in place (the flusher may already be looking at the file's size).
        with open(data, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)[0]
            f.seek(5000)
            f.write(bytes([byte ^ 0xFF]))
        gate.set()
        with pytest.raises(CheckpointError, match="do not match the hashes"):
            pending.result(timeout=60)
        assert engine.list_steps(LocalStore(tmp_path / "p")) == []
        assert ckpt.status().not_persistent == (0,)
        # Later versions do not build on the damaged chain, and they do reach persistent.
        ckpt.save(1, _state(1)).result(timeout=60)
    assert engine.list_steps(LocalStore(tmp_path / "p")) == [1]
    assert engine.list_steps(LocalStore(scratch)) == [0, 1]


def test_flushed_versions_are_verified_across_chains_and_dedup(tmp_path: Path) -> None:
    """The verifying copy handles incremental chains, de-duplicated chunks that point into
    older files, and short last chunks: every version reaches persistent intact."""
    with cryosnap.Checkpointer(
        tmp_path / "p", scratch=tmp_path / "s", chunk_bytes=4096, full_every=3
    ) as ckpt:
        for step in range(8):
            state = _state(step, n=(64 << 10) + 123)
            state["dup"] = np.tile(state["w"][:4096], 5)
            ckpt.save(step, state).result(timeout=60)
    for step in range(8):
        got = cryosnap.load(tmp_path / "p", step=step)
        np.testing.assert_array_equal(got["w"], _state(step, n=(64 << 10) + 123)["w"])


def test_keep_scratch_without_scratch_and_scratch_equal_to_persistent(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_scratch=3 needs scratch="):
        cryosnap.Checkpointer(tmp_path, keep_scratch=3)
    with pytest.raises(ValueError, match="is the persistent path itself"):
        cryosnap.Checkpointer(tmp_path, scratch=tmp_path)
    with pytest.raises(ValueError, match="is the persistent path itself"):
        cryosnap.Checkpointer(tmp_path / "run", scratch=[tmp_path / "s", tmp_path / "run"])


def test_ctrl_c_during_save_says_whether_the_version_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class InterruptAfterCapture:
        def should_save(self, step: int, *, now: float) -> bool:
            return True

        def saved(self, step: int, *, now: float, stall_seconds: float) -> None:
            raise KeyboardInterrupt

        def durable(self, step: int, *, now: float, seconds: float, stall_seconds: float) -> None:
            return None

    with cryosnap.Checkpointer(tmp_path, policy=InterruptAfterCapture()) as ckpt:
        with pytest.raises(KeyboardInterrupt) as caught:
            ckpt.save(1, _state(1))
        assert "captured before the interrupt" in "".join(caught.value.__notes__)
        ckpt.wait()
        assert ckpt.steps() == [1]

        def interrupted_copy(self: object, *args: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(Capturer, "_copy", interrupted_copy)
        with pytest.raises(KeyboardInterrupt) as caught:
            ckpt.save(2, _state(2))
        assert "interrupted during capture and is not saved" in "".join(caught.value.__notes__)
        ckpt.wait()  # the failure was delivered by save() itself
    assert engine.list_steps(LocalStore(tmp_path)) == [1]


def test_fallback_warning_points_at_the_callers_line(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, _state(0), step=0)
    cryosnap.save(tmp_path, _state(1), step=1, chunk_bytes=4096)
    (data,) = [p for p in (tmp_path / "data").iterdir() if p.name.startswith("000000000001")]
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 1  # in the last blob's bytes (the padding before a blob is never read)
    data.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="skipping damaged step 1") as record:
        cryosnap.load(tmp_path)
    assert record[0].filename == __file__


@pytest.mark.timeout(120)
def test_close_returns_when_the_persistent_tier_never_answers(tmp_path: Path) -> None:
    """A persistent tier whose writes never return (a hung mount): the flush's calls time
    out, its retries end after flush_retry_seconds, close() returns with a StorageError and
    the version stays on scratch."""
    hung = threading.Event()
    release = threading.Event()

    def fault(op: str, key: str) -> None:
        if hung.is_set() and op in ("write", "open_writer", "writer.write", "writer.commit"):
            release.wait()

    persistent = TimeoutStore(FaultyStore(LocalStore(tmp_path / "p"), fault=fault), 0.3)
    ckpt = cryosnap.Checkpointer(persistent, scratch=tmp_path / "s", flush_retry_seconds=1.0)
    try:
        hung.set()
        ckpt.save(0, _state(0)).result(tier="scratch")
        with pytest.raises(StorageError, match="could not be flushed"):
            ckpt.close()
        assert engine.list_steps(LocalStore(tmp_path / "s")) == [0]
        assert engine.list_steps(LocalStore(tmp_path / "p")) == []
    finally:
        release.set()


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize(
    "raised", [OSError(12, "Cannot allocate memory"), MemoryError(), RuntimeError("CUDA error")]
)
def test_a_capture_that_fails_fails_its_save_as_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lazy: bool, raised: Exception
) -> None:
    # What copying into staging raises (no memory for a slab, a CUDA error) is a
    # CheckpointError naming the step, its cause kept; the run goes on from the next save.
    from cryosnap._run.capture import capturer

    real = capturer.capture_to_slabs
    calls = []

    def capture(*args: object, **kwargs: object) -> int:
        calls.append(1)
        if len(calls) == 2:
            raise raised
        return real(*args, **kwargs)

    monkeypatch.setattr(capturer, "capture_to_slabs", capture)
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, _state(1), lazy=lazy).result()
        with pytest.raises(CheckpointError, match="step 2: copying the state") as info:
            ckpt.save(2, _state(2), lazy=lazy).result()
        assert info.value.__cause__ is raised
        ckpt.save(3, _state(3), lazy=lazy).result()
        assert ckpt.steps() == [1, 3]
    np.testing.assert_array_equal(cryosnap.load(tmp_path / "run", step=3)["w"], _state(3)["w"])


def test_a_failed_version_is_logged_naming_its_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The writer's log line names the step once: an error that names it already ("step 2:
    # copying the state ...") is not prefixed with it again; a store's error is.
    from cryosnap._run.capture import capturer

    real = capturer.capture_to_slabs

    def capture(*args: object, **kwargs: object) -> int:
        if len(calls) == 1:
            calls.append(1)
            raise MemoryError()
        calls.append(1)
        return real(*args, **kwargs)

    calls: list[int] = []

    def fault(op: str, key: str) -> None:
        if op == "writer.commit" and "000000000003" in key:
            raise StorageError("disk full (injected)")

    monkeypatch.setattr(capturer, "capture_to_slabs", capture)
    store = FaultyStore(LocalStore(tmp_path / "run"), fault=fault)
    with caplog.at_level(logging.ERROR, logger="cryosnap"), cryosnap.Checkpointer(store) as ckpt:
        ckpt.save(1, _state(1)).result()
        with pytest.raises(CheckpointError, match="step 2: copying"):
            ckpt.save(2, _state(2)).result()
        with pytest.raises(StorageError, match="disk full"):
            ckpt.save(3, _state(3)).result()
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert any(m.startswith("checkpoint failed: step 2: copying") for m in failed), failed
    assert "checkpoint of step 3 failed: disk full (injected)" in failed, failed
    assert not [m for m in failed if "failed: step 2:" in m and "of step 2" in m], failed
