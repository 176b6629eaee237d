"""Health marks: a version holding NaN or Inf is "unhealthy" and skipped by
``restore(healthy=True)`` / ``load(healthy=True)``; user marks (``Checkpointer.mark``) are
committed records that survive kills, never damage a version, go with their version
(retention, ``remove``) and choose what ``restore(mark=)`` takes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap._format.marks import mark_key


def _state(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(1000, value, np.float32), "b": np.arange(3.0)}


def _save_steps(path: Path, values: dict[int, float], **options: object) -> None:
    with cryosnap.Checkpointer(path, **options) as ckpt:  # type: ignore[arg-type]
        for step, value in values.items():
            ckpt.save(step, _state(value)).result()


def test_a_nan_version_is_unhealthy_and_skipped(tmp_path: Path) -> None:
    _save_steps(tmp_path, {1: 1.0, 2: 2.0, 3: float("nan"), 4: float("inf")})
    run = cryosnap.Run(tmp_path)
    assert [run.marks(s) for s in (1, 2, 3, 4)] == [set(), set(), {"unhealthy"}, {"unhealthy"}]
    assert run.stats(3)["w"].nan == 1000 and run.stats(4)["w"].inf == 1000
    assert cryosnap.load(tmp_path)["w"][0] == np.inf  # the newest, as before
    with pytest.warns(UserWarning, match=r"restoring past step\(s\) 4, 3 .*unhealthy"):
        assert cryosnap.load(tmp_path, healthy=True)["w"][0] == 2.0
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(UserWarning, match="4, 3"):
            state = ckpt.restore(healthy=True)
        assert state["w"][0] == 2.0 and ckpt.restored_step == 2
        assert ckpt.restore()["w"][0] == np.inf  # the default is as before: the newest


def test_no_healthy_version_is_an_error(tmp_path: Path) -> None:
    _save_steps(tmp_path, {1: float("nan")})
    with (
        pytest.warns(UserWarning, match="step"),
        pytest.raises(cryosnap.CheckpointNotFoundError, match="is healthy"),
    ):
        cryosnap.load(tmp_path, healthy=True)


def test_user_marks_choose_the_restore(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).result()
        ckpt.mark(2, "eval_ok")
        ckpt.mark(2, "best")
        ckpt.mark(2, "eval_ok")  # again: the same mark
        with pytest.warns(UserWarning, match=r"past step\(s\) 3 .*without the mark 'eval_ok'"):
            assert ckpt.restore(mark="eval_ok")["w"][0] == 2.0
        with pytest.raises(ValueError, match="conflicts"):
            ckpt.restore(1, mark="eval_ok")
        with pytest.raises(ValueError, match="conflicts"):
            ckpt.restore(1, healthy=True)
        with pytest.raises(cryosnap.CheckpointNotFoundError, match="only a committed version"):
            ckpt.mark(9, "eval_ok")
        for bad in ("", "a/b", "../x", "x" * 65, "unhealthy", ".hidden"):
            with pytest.raises(ValueError, match="label"):
                ckpt.mark(1, bad)
        with pytest.raises(TypeError, match="label"):
            ckpt.mark(1, 3)  # type: ignore[arg-type]
    run = cryosnap.Run(tmp_path)
    assert run.marks(2) == {"eval_ok", "best"} and run.marks(3) == set()
    with pytest.warns(UserWarning, match="without the mark 'best'"):
        assert cryosnap.load(tmp_path, mark="best")["w"][0] == 2.0
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        run.marks(7)
    assert run.verify().ok


def test_marks_go_with_their_version(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path, keep=2, chunk_bytes=4096) as ckpt:
        ckpt.save(1, _state(1)).result()
        ckpt.mark(1, "eval_ok")
        ckpt.save(2, _state(2)).result()
        ckpt.mark(2, "eval_ok")
        ckpt.save(3, _state(3)).result()
        ckpt.wait()
    assert not (tmp_path / mark_key(1, "eval_ok")).exists()  # retired with step 1
    assert (tmp_path / mark_key(2, "eval_ok")).exists()
    run = cryosnap.Run(tmp_path)
    run.remove(2)
    assert not (tmp_path / mark_key(2, "eval_ok")).exists()
    # A version saved again at a removed step does not carry a mark a kill left behind.
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        ckpt.mark(3, "eval_ok")
    kept = (tmp_path / mark_key(3, "eval_ok")).read_bytes()
    run.remove(3)
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, _state(30)).result()
    (tmp_path / mark_key(3, "eval_ok")).write_bytes(kept)  # as if its delete was killed
    assert cryosnap.Run(tmp_path).marks(3) == set()


_CHILD = """
import sys, numpy as np, cryosnap
path, label = sys.argv[1], sys.argv[2]
with cryosnap.Checkpointer(path) as ckpt:
    print("open", flush=True)
    for i in range(1000000):
        ckpt.mark(1, f"{label}{i % 50}")
        if i == 0:
            print("marked", flush=True)
"""


def _child(path: Path, label: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), label],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_a_mark_survives_a_sigkill_and_a_kill_while_marking_damages_nothing(
    tmp_path: Path,
) -> None:
    _save_steps(tmp_path, {1: 1.0})
    child = _child(tmp_path, "ok")
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "open\n"
        assert child.stdout.readline() == "marked\n"  # mark(1, "ok0") returned
        time.sleep(0.05)  # and more marks under way: killed in the middle of one
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    run = cryosnap.Run(tmp_path)
    assert "ok0" in run.marks(1)
    assert run.verify().ok
    assert cryosnap.load(tmp_path, mark="ok0")["w"][0] == 1.0
    with cryosnap.Checkpointer(tmp_path) as ckpt:  # the next writer opens and marks as before
        ckpt.mark(1, "after")
    assert {"ok0", "after"} <= cryosnap.Run(tmp_path).marks(1)


def test_ranks_agree_on_the_healthy_version(tmp_path: Path) -> None:
    """A NaN in rank 1's part only: every rank skips that version (ranks are threads)."""
    from cryosnap.dist import Coordinator
    from tests.unit.distributed.test_coordinator import run_ranks

    def save(c: Coordinator) -> None:
        with cryosnap.Checkpointer(tmp_path, comm=c) as ckpt:
            for step in (1, 2):
                bad = step == 2 and c.rank == 1
                ckpt.save(step, _state(float("nan") if bad else step + c.rank)).result()
            ckpt.mark(1, "eval_ok")

    run_ranks(3, save)
    assert cryosnap.Run(tmp_path).marks(2) == {"unhealthy"}

    def restore(c: Coordinator) -> tuple[int | None, float]:
        with cryosnap.Checkpointer(tmp_path, comm=c) as ckpt:
            state = ckpt.restore(healthy=True)
            return ckpt.restored_step, float(state["w"][0])

    # The warning filters are the process's: caught here, around every rank's thread.
    with pytest.warns(UserWarning, match=r"past step\(s\) 2"):
        assert run_ranks(3, restore) == [(1, 1.0), (1, 2.0), (1, 3.0)]


def test_a_mark_reaches_the_persistent_level(tmp_path: Path) -> None:
    """Given while the version may be on scratch only: the flush copies it after the commit
    record (or the mark found the version there already)."""
    persistent, scratch = tmp_path / "persistent", tmp_path / "scratch"
    with cryosnap.Checkpointer(persistent, scratch=str(scratch)) as ckpt:
        ckpt.save(1, _state(1)).result()
        ckpt.mark(1, "eval_ok")
        ckpt.save(2, _state(2)).result()
    assert cryosnap.Run(persistent).marks(1) == {"eval_ok"}
    with pytest.warns(UserWarning, match="without the mark"):
        assert cryosnap.load(persistent, mark="eval_ok")["w"][0] == 1.0


def test_a_mark_and_retention_never_touch_the_run_at_once(tmp_path: Path) -> None:
    """Retention's last step removes every file a write in progress leaves (``.tmp``), and
    ``mark`` writes from the caller's thread while the writer retires: both hold the levels'
    files lock, so retention never takes a mark's temporary file for a killed write's (the
    mark failed with FileNotFoundError when they met)."""
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    held: list[tuple[str, bool]] = []
    opened: list[cryosnap.Checkpointer] = []

    def watch(op: str, key: str) -> None:
        if opened and (op == "remove_incomplete" or "MARK-" in key):
            held.append((op, opened[0]._levels.files_lock.locked()))

    store = FaultyStore(LocalStore(tmp_path), fault=watch)
    with cryosnap.Checkpointer(store, keep=1, chunk_bytes=4096) as ckpt:
        opened.append(ckpt)
        for step in range(1, 5):
            ckpt.save(step, _state(step)).result()
            ckpt.mark(step, "eval_ok")
        ckpt.wait()
    assert {op for op, _ in held} >= {"remove_incomplete", "write"}
    assert all(locked for _, locked in held), held
    assert cryosnap.Run(tmp_path).marks(4) == {"eval_ok"}
