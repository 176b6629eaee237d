"""Per-level frequency: the MultiLevel policy and a Checkpointer that follows it (#17).

Time is a fake clock the tests advance: the policy's decisions depend on the given or measured
costs and the failure model, never on how fast this machine is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap.plan import FailureClass, LevelCost, plan
from cryosnap.policy import MultiLevel
from cryosnap.storage import LocalStore

FAILURES = [
    FailureClass("crash", 3600.0, "scratch"),  # a process crash: scratch survives
    FailureClass("outage", 7 * 86400.0, "persistent"),  # only persistent survives
]
COSTS = {"scratch": 0.5, "persistent": 30.0}


def test_the_policy_follows_the_plan() -> None:
    policy = MultiLevel(FAILURES, costs=COSTS)
    expected = plan([LevelCost("scratch", 0.5, 0.5), LevelCost("persistent", 30.0, 30.0)], FAILURES)
    k = expected.levels[1].every_versions
    assert k > 1  # persistent takes only some versions: the point of the plan
    now = 0.0
    assert policy.should_save(0, now=now)  # the first version measures every level
    assert policy.top_level(0) == 1
    policy.durable(0, now=now, seconds=1.0, stall_seconds=0.1)
    assert policy.plan is not None
    interval = policy.plan.base_interval_seconds  # type: ignore[attr-defined]
    assert interval == pytest.approx(expected.base_interval_seconds)
    due, tops = [], []
    for step in range(1, 4000):
        now += 1.0
        if policy.should_save(step, now=now):
            due.append(step)
            tops.append(policy.top_level(step))
    gaps = np.diff(due)
    assert gaps.min() >= interval - 1 and gaps.max() <= interval + 1
    # Version v (counted from 1; the first one was version 1) reaches persistent iff k | v.
    assert tops == [1 if (v % k == 0) else 0 for v in range(2, len(due) + 2)]


def test_costs_are_measured_when_not_given() -> None:
    policy = MultiLevel(FAILURES)
    assert policy.should_save(0, now=0.0) and policy.top_level(0) == 1
    assert not policy.should_save(1, now=100.0)  # waiting for the first version's figures
    policy.reached(0, level="scratch", now=1.0, seconds=0.4)
    policy.durable(0, now=1.0, seconds=0.4, stall_seconds=0.01)
    assert policy.plan is None  # persistent not measured yet
    policy.reached(0, level="persistent", now=20.0, seconds=25.0)
    assert policy.plan is not None
    assert policy.cost_seconds("scratch") == 0.4 and policy.cost_seconds("persistent") == 25.0


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="failures"):
        MultiLevel([])
    with pytest.raises(TypeError, match="FailureClass"):
        MultiLevel(["crash"])
    with pytest.raises(ValueError, match="costs key"):
        MultiLevel(FAILURES, costs={"tape": 1.0})
    with pytest.raises(ValueError, match="costs"):
        MultiLevel(FAILURES, costs={"scratch": 0.0})


def test_a_checkpointer_sends_every_kth_version_to_persistent(tmp_path: Path) -> None:
    # Outages every ~3 h and a cheap persistent level: persistent takes every 3rd version.
    failures = [FailureClass("crash", 3600.0, "scratch"), FailureClass("outage", 1e4, 1)]
    policy = MultiLevel(failures, costs={"scratch": 0.5, "persistent": 2.0})
    now = [0.0]
    saved: list[int] = []
    infos = {}
    with cryosnap.Checkpointer(
        tmp_path / "p",
        scratch=tmp_path / "s",
        keep_scratch=3,
        chunk_bytes=4096,
        policy=policy,
        clock=lambda: now[0],
    ) as ckpt:
        for step in range(2000):
            now[0] += 1.0
            if ckpt.should_save(step):
                state = {"w": np.full(4096, step, dtype=np.int64)}
                infos[step] = ckpt.save(step, state).result(timeout=60)
                saved.append(step)
        assert ckpt.status().not_persistent == ()
    k = policy.plan.levels[1].every_versions  # type: ignore[attr-defined]
    assert k == 3
    on_persistent = engine.list_steps(LocalStore(tmp_path / "p"))
    expected = [s for v, s in enumerate(saved, start=1) if v == 1 or v % k == 0]
    assert len(expected) >= 8 and on_persistent == expected
    for step in saved:
        tiers = ("scratch", "persistent") if step in expected else ("scratch",)
        assert infos[step].tiers == tiers
    # Scratch keeps the newest; the newest version restores, from scratch when persistent lacks it.
    assert engine.list_steps(LocalStore(tmp_path / "s")) == saved[-3:]
    assert cryosnap.load(tmp_path / "p")["w"][0] == expected[-1]
    with cryosnap.Checkpointer(tmp_path / "p", scratch=tmp_path / "s") as ckpt:
        assert ckpt.restore()["w"][0] == saved[-1]


def test_result_of_a_tier_a_version_does_not_go_to(tmp_path: Path) -> None:
    policy = MultiLevel(FAILURES, costs=COSTS)
    now = [0.0]
    with cryosnap.Checkpointer(
        tmp_path / "p", scratch=tmp_path / "s", policy=policy, clock=lambda: now[0]
    ) as ckpt:
        assert ckpt.should_save(0)
        ckpt.save(0, {"x": 0}).result(timeout=60)
        now[0] += 10_000
        assert ckpt.should_save(1)
        pending = ckpt.save(1, {"x": 1})
        assert pending.result(timeout=60).tiers == ("scratch",)
        with pytest.raises(ValueError, match="does not go to that tier"):
            pending.result(tier="persistent")
