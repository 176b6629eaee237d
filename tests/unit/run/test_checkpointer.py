"""The Checkpointer: ordering, durability, staging budget, lazy capture, failures, the lock."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cryosnap
from cryosnap import engine
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore


def _model_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": {
            i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()
        },
    }


def _assert_matches(restored: dict[str, Any], snap: dict[str, Any]) -> None:
    for k, v in snap["model"].items():
        assert torch.equal(restored["model"][k], v), k
    for i, s in snap["opt"].items():
        for k, v in s.items():
            assert torch.equal(restored["opt"]["state"][i][k], v), (i, k)


def test_many_pending_versions_are_ordered_and_durable(tmp_path: Path) -> None:
    model, opt = _model_state()
    snaps = {}
    with cryosnap.Checkpointer(tmp_path / "run", max_inflight=3) as ckpt:
        pending = []
        for step in range(0, 40, 4):
            _train_step(model, opt)
            snaps[step] = _snapshot(model, opt)
            pending.append(ckpt.save(step, {"model": model, "opt": opt, "step": step}))
        infos = [p.result(timeout=60) for p in pending]
        assert [i.step for i in infos] == list(range(0, 40, 4))
        assert ckpt.steps() == list(range(0, 40, 4))
        assert ckpt.latest_step() == 36
    # Commit records were written in save order.
    created = [cryosnap.load(tmp_path / "run", step=s)["step"] for s in range(0, 40, 4)]
    assert created == list(range(0, 40, 4))
    for step, snap in snaps.items():
        _assert_matches(cryosnap.load(tmp_path / "run", step=step), snap)


def test_staging_budget_smaller_than_state_streams(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(300_000) for i in range(8)}  # 9.6 MB
    expected = {k: v.clone() for k, v in state.items()}
    budget = 1 << 20  # 1 MiB for ~9.6 MB of state
    with cryosnap.Checkpointer(
        tmp_path / "run", staging_bytes=budget, chunk_bytes=64 << 10
    ) as ckpt:
        pending = ckpt.save(1, state)
        assert pending.captured()
        for t in state.values():  # mutations after capture never reach the checkpoint
            t.add_(1.0)
        info = pending.result(timeout=60)
        assert ckpt._capturer.pool.allocated_bytes <= budget
    assert info.logical_bytes == sum(t.nbytes for t in expected.values())
    out = cryosnap.load(tmp_path / "run")
    for k, v in expected.items():
        assert torch.equal(out[k], v)


def test_lazy_capture_optimizer_waits_for_capture(tmp_path: Path) -> None:
    model, opt = _model_state(1)
    _train_step(model, opt)
    # A slow store keeps capture slots busy so the copy is still running at step() time.
    store = FaultyStore(LocalStore(tmp_path / "run"), bytes_per_second=20e6)
    with cryosnap.Checkpointer(store, staging_bytes=256 << 10, chunk_bytes=64 << 10) as ckpt:
        snaps = {}
        pendings = []
        for step in range(3):
            snaps[step] = _snapshot(model, opt)
            pending = ckpt.save(step, {"model": model, "opt": opt}, lazy=True)
            pendings.append(pending)
            _train_step(model, opt)  # step() blocks until the optimizer's leaves are captured
            # (what it mutates is every blob here: the loads below check that the versions
            # hold the bytes from before each step). The capture thread finishes the version
            # just after its last copy: captured() may turn true a moment after step()
            # returns (it failed once beside heavy load).
            pending.wait_captured(timeout=60)
        infos = [p.result(timeout=120) for p in pendings]
    assert all(i.stall_seconds > 0 for i in infos)
    assert not opt._optimizer_step_pre_hooks  # one-shot hooks are gone after close()
    for step, snap in snaps.items():
        _assert_matches(cryosnap.load(tmp_path / "run", step=step), snap)


def test_lazy_wait_captured_guards_other_leaves(tmp_path: Path) -> None:
    arr = np.arange(1_000_000, dtype=np.float64)
    expected = arr.copy()
    with cryosnap.Checkpointer(tmp_path / "run", chunk_bytes=64 << 10) as ckpt:
        pending = ckpt.save(5, {"a": arr}, lazy=True)
        pending.wait_captured()
        arr += 1
        pending.result(timeout=60)
    np.testing.assert_array_equal(cryosnap.load(tmp_path / "run")["a"], expected)


def test_background_failure_surfaces_in_result_and_next_save(tmp_path: Path) -> None:
    fail = threading.Event()

    def fault(op: str, key: str) -> None:
        if fail.is_set() and op == "writer.write":
            raise cryosnap.StorageError(f"writing {key} failed: disk full")

    store = FaultyStore(LocalStore(tmp_path / "run"), fault=fault)
    ckpt = cryosnap.Checkpointer(store)
    try:
        ckpt.save(1, {"w": torch.full((1000,), 1.0)}).result(timeout=30)
        fail.set()
        bad = ckpt.save(2, {"w": torch.full((1000,), 2.0)})
        with pytest.raises(cryosnap.StorageError, match="disk full"):
            bad.result(timeout=30)
        # Received already through result(): the next save does not raise it again.
        fail.clear()
        ckpt.save(3, {"w": torch.full((1000,), 3.0)}).result(timeout=30)
        # Not received by the caller: the next save() raises it.
        fail.set()
        failing = ckpt.save(4, {"w": torch.full((1000,), 4.0)})
        deadline = time.monotonic() + 30
        while not failing.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        fail.clear()
        with pytest.raises(cryosnap.StorageError):
            ckpt.save(5, {"w": torch.full((1000,), 5.0)})
        ckpt.wait()  # delivered: wait() is quiet now
    finally:
        ckpt.close()
    # The failed versions are not visible and nothing of them remains but unreferenced files.
    assert engine.list_steps(LocalStore(tmp_path / "run")) == [1, 3]


def test_failure_raised_by_wait_and_close(tmp_path: Path) -> None:
    def fault(op: str, key: str) -> None:
        if op == "write" and key.endswith("COMMIT.json"):
            raise PermissionError(13, "Permission denied")

    ckpt = cryosnap.Checkpointer(FaultyStore(LocalStore(tmp_path / "run"), fault=fault))
    ckpt.save(1, {"x": 1})
    with pytest.raises(PermissionError):
        ckpt.wait()
    ckpt.save(2, {"x": 2})
    with pytest.raises(PermissionError):
        ckpt.close()
    assert engine.list_steps(LocalStore(tmp_path / "run")) == []


def test_existing_step_and_bad_arguments(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"x": 1}).result()
        with pytest.raises(cryosnap.CheckpointExistsError):
            ckpt.save(1, {"x": 2})
        with pytest.raises(TypeError, match="step must be an int"):
            ckpt.save("3", {"x": 2})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="bad"):
            ckpt.save(4, {"bad": object()})
    for kwargs, match in [
        ({"chunk_bytes": 100}, "chunk_bytes"),
        ({"staging_bytes": 0}, "staging_bytes"),
        ({"staging_bytes": 1024}, "staging_bytes"),
        ({"max_inflight": 0}, "max_inflight"),
    ]:
        with pytest.raises(ValueError, match=match):
            cryosnap.Checkpointer(tmp_path / "other", **kwargs)


def test_restore_into_and_fallback(tmp_path: Path) -> None:
    model, opt = _model_state(2)
    _train_step(model, opt)
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(10, {"model": model, "opt": opt}).result()
        snap = _snapshot(model, opt)
        _train_step(model, opt)
        model2, opt2 = _model_state(3)
        ckpt.restore(into={"model": model2, "opt": opt2})
        for k, v in snap["model"].items():
            assert torch.equal(model2.state_dict()[k], v)
        assert ckpt.restore(10)["model"].keys() == model.state_dict().keys()


def test_second_writer_is_refused_and_reader_needs_no_lock(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"x": 1}).result()
        with pytest.raises(cryosnap.CheckpointError, match="already open for writing by pid"):
            cryosnap.Checkpointer(tmp_path / "run")
        with pytest.raises(cryosnap.CheckpointError, match="already open for writing"):
            cryosnap.save(tmp_path / "run", {"x": 2}, step=2)
        assert cryosnap.load(tmp_path / "run") == {"x": 1}
    # Released on close.
    cryosnap.save(tmp_path / "run", {"x": 2}, step=2)


def test_lock_of_killed_process_is_recovered(tmp_path: Path) -> None:
    code = (
        "import os, signal, cryosnap\n"
        f"c = cryosnap.Checkpointer({str(tmp_path / 'run')!r})\n"
        "c.save(1, {'x': 1}).result()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == -9
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.steps() == [1]
        ckpt.save(2, {"x": 2}).result()


def test_object_store_lock(tmp_path: Path) -> None:
    url = f"memory://lock-{tmp_path.name}"
    with cryosnap.Checkpointer(url) as ckpt:
        ckpt.save(1, {"x": np.arange(3)}).result()
        with pytest.raises(cryosnap.CheckpointError, match="already open for writing"):
            cryosnap.Checkpointer(url)
    with cryosnap.Checkpointer(url) as ckpt:
        assert ckpt.steps() == [1]


def test_closed_checkpointer_refuses_work(tmp_path: Path) -> None:
    ckpt = cryosnap.Checkpointer(tmp_path / "run")
    ckpt.close()
    ckpt.close()
    with pytest.raises(cryosnap.CheckpointError, match="closed"):
        ckpt.save(1, {"x": 1})


def test_result_timeout(tmp_path: Path) -> None:
    gate = threading.Event()

    def fault(op: str, key: str) -> None:
        if op == "writer.write":
            gate.wait(30)

    with cryosnap.Checkpointer(FaultyStore(LocalStore(tmp_path / "run"), fault=fault)) as ckpt:
        pending = ckpt.save(1, {"w": torch.ones(10)})
        with pytest.raises(cryosnap.CheckpointTimeoutError):
            pending.result(timeout=0.05)
        assert not pending.done()
        gate.set()
        assert pending.result(timeout=30).step == 1
