"""cryosnap.integrations._base.RunSaver: the callback base the framework integrations share.

Driven here as a framework callback drives it (begin, step_end per optimizer step, end),
without a framework: the save policy decides (``Adaptive`` included), a preemption signal saves
the step, then reaches the handler installed before cryosnap's; a run holding another
training's versions is refused, a resumed one continues under its run id.
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap.checkpointer import run_id_of
from cryosnap.integrations._base import RunSaver, split_step
from cryosnap.policy import Adaptive, EveryNSteps


def _saver(run: Path, **kwargs: Any) -> RunSaver:
    options: dict[str, Any] = {
        "every_n_steps": None,
        "policy": None,
        "save_on_train_end": True,
        "handle_signals": (),
        "run_id": None,
        "resume_hint": "resume it",
        "checkpointer_options": {},
    }
    options.update(kwargs)
    return RunSaver(run, **options)


def _state(step: int) -> Any:
    return lambda: {"w": np.full(4, step, dtype=np.float32)}


def _train(saver: RunSaver, start: int, stop: int) -> list[bool]:
    saver.begin(start)
    preempted = [saver.step_end(s, _state(s)) for s in range(start + 1, stop + 1)]
    saver.end(stop, _state(stop))
    return preempted


def _steps(run: Path) -> list[int]:
    with cryosnap.Checkpointer(run) as ckpt:
        return ckpt.steps()


def test_every_n_steps_and_the_last_step_are_saved_under_one_run_id(tmp_path: Path) -> None:
    run = tmp_path / "run"
    saver = _saver(run, every_n_steps=3)
    assert _train(saver, 0, 7) == [False] * 7
    assert _steps(run) == [3, 6, 7]
    first_id = run_id_of(run)
    assert first_id is not None and len(first_id) == 32
    # Resumed from its newest step: continues under the same id.
    _train(_saver(run, every_n_steps=3), 7, 10)
    assert _steps(run) == [3, 6, 7, 9, 10]
    assert run_id_of(run) == first_id
    # The same step ended twice (micro-batches of one optimizer step) asks the policy once.
    saver = _saver(run, every_n_steps=1)
    saver.begin(10)
    assert not saver.step_end(11, _state(11))
    assert not saver.step_end(11, _state(11))
    saver.end(11, _state(11))
    assert _steps(run)[-1] == 11


def test_the_checkpointer_policy_decides_adaptive_included(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ticks = iter(range(10_000))
    _train(
        _saver(
            run,
            policy=Adaptive(0.5, warmup_steps=4, max_steps=5),
            save_on_train_end=False,
            checkpointer_options={"clock": lambda: float(next(ticks))},
        ),
        0,
        12,
    )
    steps = _steps(run)
    assert steps[0] == 5  # the warm-up (4 steps after the first should_save, at step 1)
    assert len(steps) >= 2 and all(b - a <= 5 for a, b in itertools.pairwise(steps))
    with pytest.raises(TypeError, match="one of every_n_steps= and policy="):
        _saver(run, every_n_steps=2, policy=EveryNSteps(2))
    with pytest.raises(ValueError, match="every_n_steps=0"):
        _saver(run, every_n_steps=0)


def test_a_new_training_into_a_used_run_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(_saver(run, every_n_steps=2), 0, 4)
    with pytest.raises(
        cryosnap.CheckpointExistsError, match=r"already holds steps 2, 4.*resume it"
    ):
        _saver(run, every_n_steps=2).begin(0)
    with pytest.raises(cryosnap.CheckpointExistsError, match=r"step 2.*newer steps 4"):
        _saver(run, every_n_steps=2).begin(2)
    # A given run id that is not the run's: the Checkpointer's own check names both.
    with pytest.raises(cryosnap.CheckpointError, match=r"run_id='mine'"):
        _saver(run, every_n_steps=2, run_id="mine").begin(4)
    assert _steps(run) == [2, 4]


def test_preemption_saves_the_step_then_passes_the_signal_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        saver = _saver(run, every_n_steps=100, handle_signals=(signal.SIGUSR1,))
        saver.begin(0)
        assert not saver.step_end(1, _state(1))
        signal.raise_signal(signal.SIGUSR1)
        assert seen == []  # cryosnap's handler took it: the program's waits for the save
        assert saver.step_end(2, _state(2))
        assert seen == [signal.SIGUSR1]  # passed on once step 2 was durable
        assert saver.preempted_at == 2 and saver.ckpt is None
        assert _steps(run) == [2]
        assert cryosnap.load(run)["w"].tolist() == [2.0] * 4
        saver.end(2, _state(2))  # the framework's train-end hook: nothing left to do
        assert _steps(run) == [2]
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_split_step() -> None:
    assert split_step("runs/x@40") == ("runs/x", 40)
    assert split_step("s3://b/runs/x@0") == ("s3://b/runs/x", 0)
    assert split_step("runs/x") == ("runs/x", None)
    assert split_step("runs/a@b") == ("runs/a@b", None)
    assert split_step("@4") == ("@4", None)
