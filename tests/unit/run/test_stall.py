"""SaveInfo.stall_seconds counts the whole ``save()`` call, eager or lazy: every moment the
save's own callbacks (the policy clock, the policy's ``saved``) see from inside the call lies
within the stall it reports. No timing is asserted: only the order of the clock readings."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import cryosnap


class _Clock:
    """A policy clock that ticks one second per reading and notes when (perf_counter) each
    reading was taken."""

    def __init__(self) -> None:
        self.now = 0.0
        self.taken: list[float] = []

    def __call__(self) -> float:
        self.taken.append(time.perf_counter())
        self.now += 1.0
        return self.now


class _Listener:
    """A save policy that saves when asked and notes what each save reported."""

    def __init__(self) -> None:
        self.saved_at: dict[int, tuple[float, float]] = {}  # step -> (now, perf_counter)
        self.durable_stall: dict[int, float] = {}

    def should_save(self, step: int, *, now: float) -> bool:
        return True

    def saved(self, step: int, *, now: float, stall_seconds: float) -> None:
        self.saved_at[step] = (now, time.perf_counter())

    def durable(self, step: int, *, now: float, seconds: float, stall_seconds: float) -> None:
        self.durable_stall[step] = stall_seconds


@pytest.mark.parametrize("lazy", [False, True])
def test_the_stall_is_the_whole_save_call(tmp_path: Path, lazy: bool) -> None:
    clock, policy = _Clock(), _Listener()
    state = {f"w{i}": np.random.default_rng(i).random(1 << 16) for i in range(40)}
    with cryosnap.Checkpointer(tmp_path, clock=clock, policy=policy) as ckpt:
        for step in range(3):
            first = len(clock.taken)  # the next reading is the save's first
            start = clock.now
            info = ckpt.save(step, state, lazy=lazy).result()
            saved_now, saved_at = policy.saved_at[step]
            # perf_counter: from the save's first clock reading to its policy's "saved" call,
            # both inside save(), lies within the stall.
            assert info.stall_seconds >= saved_at - clock.taken[first] > 0
            # The policy clock: the stall the policy hears spans those readings too.
            assert policy.durable_stall[step] >= saved_now - (start + 1.0) >= 1.0
