"""The Checkpointer with policies: should_save, metrics and retention, preemption signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._format.limits import MAX_STEP
from cryosnap.policy import Adaptive, EveryNSteps, KeepAny, KeepBest, KeepEvery
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore


def test_should_save_asks_the_policy(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path, policy=EveryNSteps(3)) as ckpt:
        due = [s for s in range(10) if ckpt.should_save(s)]
        assert due == [0, 3, 6, 9]
        for s in due:
            ckpt.save(s, {"s": s})
    with (
        cryosnap.Checkpointer(tmp_path / "none") as ckpt,
        pytest.raises(ValueError, match="needs a save policy"),
    ):
        ckpt.should_save(1)
    with pytest.raises(TypeError, match="policy must be a save policy"):
        cryosnap.Checkpointer(tmp_path / "bad", policy=3)  # type: ignore[arg-type]


def test_metrics_are_stored_and_keep_best_retains_by_them(tmp_path: Path) -> None:
    losses = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.2, 5: 0.8, 6: 0.95}
    with cryosnap.Checkpointer(tmp_path, keep=KeepBest(2, metric="loss")) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, {"w": np.full(100, step)}, metrics={"loss": loss}).result()
    # The two best (4, 2) plus the newest (6), always kept.
    assert engine.list_steps(LocalStore(tmp_path)) == [2, 4, 6]
    assert engine.read_commit(LocalStore(tmp_path), 4).metrics == {"loss": 0.2}
    assert cryosnap.load(tmp_path, step=2)["w"][0] == 2


def test_keep_any_of_every_n_and_last(tmp_path: Path) -> None:
    from cryosnap.policy import KeepLast

    with cryosnap.Checkpointer(tmp_path, keep=KeepAny(KeepEvery(4), KeepLast(2))) as ckpt:
        for step in range(1, 11):
            ckpt.save(step, {"w": np.full(1000, step)}).result()
    assert engine.list_steps(LocalStore(tmp_path)) == [4, 8, 9, 10]
    for s in (4, 8, 9, 10):
        assert cryosnap.load(tmp_path, step=s)["w"][0] == s


@pytest.mark.parametrize(
    ("metrics", "error"),
    [
        ({"loss": float("nan")}, ValueError),
        ({"loss": "low"}, TypeError),
        ({1: 0.5}, TypeError),
        ([0.5], TypeError),
    ],
)
def test_bad_metrics_are_refused(tmp_path: Path, metrics: object, error: type) -> None:
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(error, match="metrics"):
            ckpt.save(1, {"x": 1}, metrics=metrics)  # type: ignore[arg-type]
        ckpt.save(1, {"x": 1}, metrics={"loss": np.float32(0.5)}).result()
    assert engine.read_commit(LocalStore(tmp_path), 1).metrics == {"loss": 0.5}


def test_bad_signals_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SIGKILL cannot be handled"):
        cryosnap.Checkpointer(tmp_path, handle_signals=(signal.SIGKILL,))
    with pytest.raises(ValueError, match="is not a signal"):
        cryosnap.Checkpointer(tmp_path, handle_signals=(MAX_STEP,))
    with pytest.raises(TypeError, match="handle_signals"):
        cryosnap.Checkpointer(tmp_path, handle_signals=signal.SIGTERM)  # type: ignore[arg-type]


def test_preemption_signal_in_process(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with cryosnap.Checkpointer(
        tmp_path, policy=EveryNSteps(1000), handle_signals=(signal.SIGUSR1,)
    ) as ckpt:
        assert not ckpt.preempted
        assert ckpt.should_save(0) and not ckpt.should_save(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ckpt.preempted
        assert ckpt.should_save(2)  # the final save is due
    assert signal.getsignal(signal.SIGUSR1) == before


_PREEMPTED = textwrap.dedent(
    """
    import signal, sys, time
    import numpy as np
    import cryosnap
    from cryosnap.policy import EveryNSteps

    run = sys.argv[1]
    with cryosnap.Checkpointer(
        run, policy=EveryNSteps(1000), handle_signals=(signal.SIGTERM,)
    ) as ckpt:
        w = np.zeros(1000)
        for step in range(1, 100_000):
            w += 1
            if step == 5:
                print("ready", flush=True)
            if ckpt.should_save(step):
                ckpt.save(step, {"w": w, "step": step})
            if ckpt.preempted:
                break
            time.sleep(0.01)
        ckpt.wait()
    print("saved", step, flush=True)
    """
)


def test_sigterm_saves_and_exits(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PREEMPTED, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    step = int(out.split()[-1])
    assert step >= 5
    got = cryosnap.load(tmp_path)
    assert got["step"] == step and got["w"][0] == step


def test_adaptive_interval_follows_the_checkpoint_cost(tmp_path: Path) -> None:
    """A loop whose checkpoints get slower: the adaptive interval grows with them.

    Time is a fake clock the loop advances (5 ms a step) and the store's commit advances (the
    checkpoint's cost), so the policy's decisions do not depend on the machine's speed.
    """
    now = [0.0]
    delay = [0.002]

    def fault(op: str, key: str) -> None:
        if op == "writer.commit":
            now[0] += delay[0]

    store = FaultyStore(LocalStore(tmp_path), fault=fault)
    policy = Adaptive(max_overhead=0.05, warmup_steps=3)
    intervals = {}
    with cryosnap.Checkpointer(store, policy=policy, keep=2, clock=lambda: now[0]) as ckpt:
        w = np.zeros(10_000)
        for step in range(400):
            if step == 150:
                intervals["cheap"] = policy.interval
                delay[0] = 0.04
            now[0] += 0.005
            w += 1
            if ckpt.should_save(step):
                ckpt.save(step, {"w": w}).result()
        intervals["costly"] = policy.interval
    assert intervals["costly"] > intervals["cheap"], intervals
    # Never saving faster than versions become durable: 40 ms per version at 5 ms per step.
    assert intervals["costly"] >= 8, intervals


def test_a_failing_retention_policy_does_not_stop_the_writer(tmp_path: Path) -> None:
    class Broken:
        def select(self, versions: object) -> set[int]:
            raise RuntimeError("user policy bug")

    with cryosnap.Checkpointer(tmp_path, keep=Broken()) as ckpt:  # type: ignore[arg-type]
        for step in (1, 2, 3):
            ckpt.save(step, {"w": np.full(100, step)}).result(timeout=30)
    assert engine.list_steps(LocalStore(tmp_path)) == [1, 2, 3]


def test_signal_handlers_of_two_runs_close_in_any_order(tmp_path: Path) -> None:
    original = signal.getsignal(signal.SIGUSR2)
    a = cryosnap.Checkpointer(tmp_path / "a", handle_signals=(signal.SIGUSR2,))
    b = cryosnap.Checkpointer(tmp_path / "b", handle_signals=(signal.SIGUSR2,))
    a.close()
    os.kill(os.getpid(), signal.SIGUSR2)
    assert b.preempted and not a.preempted
    b.close()
    assert signal.getsignal(signal.SIGUSR2) == original
