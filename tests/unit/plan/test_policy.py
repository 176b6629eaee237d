"""cryosnap.policy: save-frequency and retention policies, driven by a fake clock.

No test sleeps or reads the wall clock: every ``now`` is passed explicitly, so the policies
are deterministic here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cryosnap.policy import (
    Adaptive,
    EveryNSeconds,
    EveryNSteps,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
    SavePolicy,
    VersionInfo,
    as_retention,
)

# ---------------------------------------------------------------------------------------------
# EveryNSteps


def test_every_n_steps() -> None:
    policy = EveryNSteps(5)
    assert [s for s in range(21) if policy.should_save(s, now=0.0)] == [0, 5, 10, 15, 20]


def test_every_n_steps_offset() -> None:
    policy = EveryNSteps(5, offset=2)
    assert [s for s in range(21) if policy.should_save(s, now=0.0)] == [2, 7, 12, 17]


def test_every_n_steps_ignores_feedback() -> None:
    policy = EveryNSteps(3)
    policy.saved(0, now=1.0, stall_seconds=0.5)
    policy.durable(0, now=2.0, seconds=1.5, stall_seconds=0.5)
    assert policy.should_save(3, now=3.0)
    assert not policy.should_save(4, now=3.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n": 0}, ValueError, r"n=0 is invalid: allowed is a positive int"),
        ({"n": -3}, ValueError, r"n=-3 is invalid"),
        ({"n": 2.5}, TypeError, r"n must be a positive int, got 2\.5 \(float\)"),
        ({"n": True}, TypeError, r"n must be a positive int, got True \(bool\)"),
        ({"n": 2, "offset": "1"}, TypeError, r"offset must be an int, got '1' \(str\)"),
    ],
)
def test_every_n_steps_validation(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        EveryNSteps(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# EveryNSeconds


def test_every_n_seconds_first_call_starts_the_clock() -> None:
    policy = EveryNSeconds(10.0)
    assert not policy.should_save(0, now=100.0)
    assert not policy.should_save(1, now=109.9)
    assert policy.should_save(2, now=110.0)
    policy.saved(2, now=110.5, stall_seconds=0.5)
    # The period runs from the should_save that granted the save, not from its end.
    assert not policy.should_save(3, now=119.9)
    assert policy.should_save(4, now=120.0)


def test_every_n_seconds_saves_once_after_a_long_pause() -> None:
    policy = EveryNSeconds(1.0)
    policy.should_save(0, now=0.0)
    assert policy.should_save(1, now=50.0)
    assert not policy.should_save(2, now=50.5)
    assert policy.should_save(3, now=51.0)


def test_every_n_seconds_manual_save_restarts_the_period() -> None:
    policy = EveryNSeconds(10.0)
    policy.should_save(0, now=0.0)
    policy.saved(7, now=8.0, stall_seconds=1.0)  # not asked for: started at 7.0
    assert not policy.should_save(8, now=16.9)
    assert policy.should_save(9, now=17.0)


@pytest.mark.parametrize(
    ("seconds", "error"),
    [(0, ValueError), (-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
     ("5", TypeError), (True, TypeError), (None, TypeError)],
)  # fmt: skip
def test_every_n_seconds_validation(seconds: object, error: type) -> None:
    fragment = "seconds must be" if error is TypeError else "seconds=.* is invalid"
    with pytest.raises(error, match=rf"{fragment}.* a positive, finite number of seconds"):
        EveryNSeconds(seconds)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Adaptive: unit behaviour with a hand-driven fake clock

ITER_S = 0.1


def _clean_iterations(
    policy: Adaptive, start: int, stop: int, t0: float
) -> tuple[list[int], float]:
    """Run steps [start, stop) of ITER_S each with nothing in flight; return saves and clock."""
    asked = []
    now = t0
    for step in range(start, stop):
        if policy.should_save(step, now=now):
            asked.append(step)
        now += ITER_S
    return asked, now


def test_adaptive_protocols() -> None:
    for policy in (EveryNSteps(1), EveryNSeconds(1.0), Adaptive()):
        assert isinstance(policy, SavePolicy)
    for keep in (KeepLast(1), KeepEvery(1), KeepBest(1), KeepAny(KeepLast(1))):
        assert isinstance(keep, RetentionPolicy)


def test_adaptive_warmup_then_waits_for_the_first_measurement() -> None:
    policy = Adaptive(0.05, warmup_steps=10)
    assert (policy.interval, policy.overhead) == (10, None)
    asked, now = _clean_iterations(policy, 100, 110, 0.0)  # the count starts at the first call
    assert asked == []
    assert policy.should_save(110, now=now)
    now += 0.2
    policy.saved(110, now=now, stall_seconds=0.2)
    # In flight and not measured yet: no second save, whatever the step.
    for step in range(111, 150):
        now += ITER_S
        assert not policy.should_save(step, now=now)
    policy.durable(110, now=now, seconds=4.1, stall_seconds=0.2)
    now += ITER_S
    policy.should_save(150, now=now)  # closes the measurement
    # Cost: the 0.2 s stall (the in-flight iterations ran at full speed); d = 4.1 s.
    assert policy.cost_seconds == pytest.approx(0.2)
    assert policy.iteration_seconds == pytest.approx(ITER_S)
    assert policy.durable_seconds == pytest.approx(4.1)
    assert policy.interval == 41  # max(ceil(0.2 / (0.05 * 0.1)) = 40, ceil(4.1 / 0.1) = 41)
    assert policy.overhead == pytest.approx(0.2 / (41 * ITER_S))
    assert policy.overhead is not None and policy.overhead <= 0.05
    # The next save comes `interval` steps after the previous one.
    assert not policy.should_save(150, now=now)
    assert policy.should_save(151, now=now + ITER_S)


def test_adaptive_counts_interference_and_lazy_stalls() -> None:
    policy = Adaptive(0.1, warmup_steps=3)
    _, now = _clean_iterations(policy, 0, 3, 0.0)
    assert policy.should_save(3, now=now)
    now += 0.05
    policy.saved(3, now=now, stall_seconds=0.05)
    # Three iterations run 50% slower while the write is in flight.
    for step in (4, 5, 6):
        now += ITER_S * 1.5
        policy.should_save(step, now=now)
    policy.durable(3, now=now, seconds=0.5, stall_seconds=0.05)
    now += ITER_S
    policy.should_save(7, now=now)
    # extra = 0.05 stall + 3 * 0.05 slowdown (the last interval ran at full speed)
    assert policy.cost_seconds == pytest.approx(0.2)
    # A lazy save reports a larger total stall at durable time; it wins over the spacing.
    policy.should_save(8, now=now + ITER_S)
    policy.saved(8, now=now + ITER_S + 0.01, stall_seconds=0.01)
    policy.durable(8, now=now + ITER_S + 0.02, seconds=0.02, stall_seconds=5.0)
    policy.should_save(9, now=now + 2 * ITER_S)
    assert policy.cost_seconds == pytest.approx(5.0)  # a rise is believed at once


def test_adaptive_iteration_time_ignores_slow_first_iterations() -> None:
    policy = Adaptive(warmup_steps=50)
    now = 0.0
    spacings = [30.0, 5.0] + [ITER_S] * 20  # compilation, autotuning, then steady
    for step, dt in enumerate(spacings):
        policy.should_save(step, now=now)
        now += dt
    assert policy.iteration_seconds == pytest.approx(ITER_S)


def test_adaptive_durable_before_saved() -> None:
    policy = Adaptive(0.05, warmup_steps=2)
    _, now = _clean_iterations(policy, 0, 2, 0.0)
    assert policy.should_save(2, now=now)
    # The background finished before save() returned to report the stall.
    policy.durable(2, now=now + 0.1, seconds=0.1, stall_seconds=0.1)
    policy.saved(2, now=now + 0.1, stall_seconds=0.1)
    policy.should_save(3, now=now + 0.2)
    assert policy.cost_seconds == pytest.approx(0.1)
    assert policy.interval == 20


def test_adaptive_failed_save_is_not_waited_for() -> None:
    policy = Adaptive(0.05, warmup_steps=2)
    _, now = _clean_iterations(policy, 0, 2, 0.0)
    assert policy.should_save(2, now=now)
    policy.saved(2, now=now + 0.01, stall_seconds=0.01)
    policy.failed(2, now=now + 0.5)
    _, now = _clean_iterations(policy, 3, 4, now + 0.01)
    assert policy.interval == 2  # measured: cost 0.01 s -> ceil(0.01 / 0.005)
    assert policy.should_save(4, now=now)  # due: the failed save is not waited for
    policy.saved(4, now=now + 0.01, stall_seconds=0.01)
    policy.durable(4, now=now + 0.01, seconds=0.01, stall_seconds=0.01)
    asked, _ = _clean_iterations(policy, 5, 7, now + 0.01)
    assert asked == [6]


def test_adaptive_lost_notification_does_not_stop_saving() -> None:
    policy = Adaptive(0.05, warmup_steps=5)
    _, now = _clean_iterations(policy, 0, 5, 0.0)
    assert policy.should_save(5, now=now)
    policy.saved(5, now=now, stall_seconds=0.0)  # durable() never comes
    asked, _ = _clean_iterations(policy, 6, 200, now)
    assert asked[0] == 5 + 10 * 5


def test_adaptive_waits_for_the_previous_save_but_max_steps_does_not() -> None:
    policy = Adaptive(0.5, warmup_steps=2, min_steps=5, max_steps=8)
    _, now = _clean_iterations(policy, 0, 2, 0.0)
    assert policy.should_save(2, now=now)
    policy.saved(2, now=now, stall_seconds=0.01)
    policy.durable(2, now=now, seconds=0.01, stall_seconds=0.01)
    asked, now = _clean_iterations(policy, 3, 8, now)
    assert asked == [7]
    assert policy.interval == 5  # cheap: min_steps
    policy.saved(7, now=now, stall_seconds=0.01)  # this one is slow to become durable
    asked, now = _clean_iterations(policy, 8, 15, now)
    assert asked == []  # due at 12, but the save of step 7 is in flight
    assert policy.should_save(15, now=now)  # max_steps since the last save


def test_adaptive_max_and_min_steps_clamp_the_interval() -> None:
    for kwargs, expected in (({"max_steps": 7}, 7), ({"min_steps": 500}, 500)):
        policy = Adaptive(0.05, warmup_steps=2, **kwargs)
        _, now = _clean_iterations(policy, 0, 2, 0.0)
        policy.should_save(2, now=now)
        policy.saved(2, now=now + 1.0, stall_seconds=1.0)  # ideal k = 200
        policy.durable(2, now=now + 1.0, seconds=1.0, stall_seconds=1.0)
        policy.should_save(3, now=now + 1.0 + ITER_S)
        assert policy.interval == expected


def test_adaptive_restarts_the_count_after_a_rollback() -> None:
    policy = Adaptive(0.05, warmup_steps=2)
    _, now = _clean_iterations(policy, 0, 2, 0.0)
    policy.should_save(2, now=now)
    policy.saved(2, now=now, stall_seconds=0.01)
    policy.durable(2, now=now, seconds=0.01, stall_seconds=0.01)
    _, now = _clean_iterations(policy, 3, 4, now)
    # Restored to step 0: saves resume 2 steps later, not at step 4 + 2.
    asked, _ = _clean_iterations(policy, 0, 3, now)
    assert asked == [2]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_overhead": 0}, ValueError, r"max_overhead=0 .* a fraction in \(0, 1\)"),
        ({"max_overhead": 5}, ValueError, r"max_overhead=5 is invalid"),
        ({"max_overhead": "5%"}, TypeError, r"max_overhead must be .* got '5%'"),
        ({"min_steps": 0}, ValueError, r"min_steps=0 is invalid: allowed is a positive int"),
        ({"max_steps": 0}, ValueError, r"max_steps=0 is invalid: allowed is a positive int"),
        ({"max_steps": 1.5}, TypeError, r"max_steps must be a positive int or None"),
        ({"min_steps": 10, "max_steps": 5}, ValueError, r"max_steps=5 is smaller than min"),
        ({"warmup_steps": -1}, ValueError, r"warmup_steps=-1 is invalid: allowed is an int >= 0"),
    ],
)
def test_adaptive_validation(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Adaptive(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Adaptive: a simulated training loop


@dataclass(frozen=True)
class Phase:
    steps: int
    stall: float  # seconds the caller blocks per save
    write: float  # background seconds from the end of the stall until durable
    slowdown: float  # extra fraction of an iteration while a write is in flight


@dataclass
class Run:
    time: float = 0.0
    overhead: float = 0.0
    saves: list[int] = field(default_factory=list)
    costs: list[float] = field(default_factory=list)  # true overhead of each save
    phase_time: list[float] = field(default_factory=list)
    phase_overhead: list[float] = field(default_factory=list)
    phase_max_cost: list[float] = field(default_factory=list)
    intervals: list[int] = field(default_factory=list)  # policy.interval at each phase's end
    queued: int = 0  # saves started while the previous one was in flight


def simulate(policy: Adaptive, phases: Sequence[Phase]) -> Run:
    """A training loop of ITER_S iterations on a fake clock, saving when the policy says so.

    Each save blocks for ``stall``, then writes in the background for ``write`` seconds, and
    every iteration that starts while the write is in flight runs ``slowdown`` slower. The
    loop reports exactly what a Checkpointer would: saved() when save() returns, durable()
    at the moment the write finished.
    """
    run = Run()
    step = 0
    inflight: tuple[int, float, float, float] | None = None  # step, start, durable at, stall
    for phase in phases:
        t0, o0, n0 = run.time, run.overhead, len(run.costs)
        for _ in range(phase.steps):
            if policy.should_save(step, now=run.time):
                run.queued += inflight is not None
                start = run.time
                run.time += phase.stall
                run.overhead += phase.stall
                run.saves.append(step)
                run.costs.append(phase.stall)
                policy.saved(step, now=run.time, stall_seconds=phase.stall)
                inflight = (step, start, run.time + phase.write, phase.stall)
            dt = ITER_S
            if inflight is not None and inflight[2] > run.time:
                dt += ITER_S * phase.slowdown
                run.overhead += ITER_S * phase.slowdown
                run.costs[-1] += ITER_S * phase.slowdown
            run.time += dt
            if inflight is not None and inflight[2] <= run.time:
                saved_step, start, at, stall = inflight
                policy.durable(saved_step, now=at, seconds=at - start, stall_seconds=stall)
                inflight = None
            step += 1
        run.phase_time.append(run.time - t0)
        run.phase_overhead.append((run.overhead - o0) / (run.time - t0))
        run.phase_max_cost.append(max(run.costs[n0:], default=0.0))
        run.intervals.append(policy.interval)
    return run


def _ideal_interval(cost: float, durable: float, max_overhead: float) -> int:
    return max(math.ceil(cost / (max_overhead * ITER_S) - 1e-9), math.ceil(durable / ITER_S))


def test_adaptive_simulation_bounds_overhead_and_retunes() -> None:
    max_overhead = 0.05
    policy = Adaptive(max_overhead, warmup_steps=20)
    phases = [
        Phase(4000, stall=0.05, write=0.3, slowdown=0.2),  # moderate
        Phase(8000, stall=0.5, write=2.0, slowdown=0.2),  # storage got 10x slower
        Phase(4000, stall=0.02, write=0.1, slowdown=0.2),  # and then fast
    ]
    run = simulate(policy, phases)

    # The bound holds over the run, relaxed by the first checkpoint only: it is taken after
    # the warm-up, before its cost can be known, and is charged to the few seconds before it.
    warmup_allowance = run.costs[0] / run.time
    assert run.overhead / run.time <= max_overhead + warmup_allowance
    # Per phase, relaxed by one checkpoint at the new cost: the first one after a change is
    # paid at the old interval (the policy cannot know the cost before measuring it).
    for overhead, seconds, cost in zip(
        run.phase_overhead, run.phase_time, run.phase_max_cost, strict=True
    ):
        assert overhead <= max_overhead + cost / seconds
    # Saves never queue behind one another.
    assert run.queued == 0

    # The interval re-tunes to the cost of each phase: its true per-save overhead is
    # stall + the slowed iterations, and the write must finish within the interval.
    k1, k2, k3 = run.intervals
    assert k2 > 5 * k1 and k3 < k2 / 5
    for k, phase, cost in zip(run.intervals, phases, run.phase_max_cost, strict=True):
        ideal = _ideal_interval(cost, phase.stall + phase.write, max_overhead)
        assert ideal - 1 <= k <= ideal + 1, (k, ideal)
    # In steady state the bound holds without any allowance.
    gaps = [b - a for a, b in zip(run.saves, run.saves[1:], strict=False)]
    assert gaps[-1] == k3
    assert policy.overhead is not None and policy.overhead <= max_overhead


def test_adaptive_simulation_interval_covers_a_slow_write() -> None:
    # Tiny stall, long write, no interference: the overhead term alone would save every step;
    # the time to durable keeps saves from queueing.
    policy = Adaptive(0.05, warmup_steps=10)
    run = simulate(policy, [Phase(3000, stall=0.001, write=5.0, slowdown=0.0)])
    assert run.queued == 0
    assert policy.interval >= math.ceil(5.001 / ITER_S)
    assert run.overhead / run.time <= 0.05


@given(
    stall=st.floats(0.0, 2.0),
    write=st.floats(0.0, 5.0),
    slowdown=st.floats(0.0, 1.0),
    max_overhead=st.sampled_from([0.01, 0.05, 0.2]),
)
def test_adaptive_simulation_property(
    stall: float, write: float, slowdown: float, max_overhead: float
) -> None:
    policy = Adaptive(max_overhead, warmup_steps=10)
    run = simulate(policy, [Phase(2000, stall=stall, write=write, slowdown=slowdown)])
    assert run.queued == 0
    # One allowance for the warm-up checkpoint (see the test above).
    assert run.overhead / run.time <= max_overhead + run.phase_max_cost[0] / run.time + 1e-9


# ---------------------------------------------------------------------------------------------
# retention


def _v(step: int, **metrics: float) -> VersionInfo:
    return VersionInfo(step, metrics)


def test_version_info_is_a_frozen_read_only_value() -> None:
    metrics = {"loss": 1.0}
    info = VersionInfo(3, metrics)
    metrics["loss"] = 2.0
    assert info.metrics["loss"] == 1.0
    assert info == VersionInfo(3, {"loss": 1.0})
    assert hash(info) == hash(VersionInfo(3, {"loss": 1.0}))
    with pytest.raises(AttributeError):
        info.step = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        info.metrics["loss"] = 0.0  # type: ignore[index]
    with pytest.raises(TypeError, match=r"step must be an int, got '3' \(str\)"):
        VersionInfo("3")  # type: ignore[arg-type]


def test_keep_last() -> None:
    versions = [_v(s) for s in (30, 10, 20, 40)]
    assert KeepLast(2).select(versions) == {30, 40}
    assert KeepLast(10).select(versions) == {10, 20, 30, 40}
    assert KeepLast(1).select([]) == set()


def test_keep_every() -> None:
    assert KeepEvery(100).select([_v(s) for s in (0, 50, 100, 150, 200)]) == {0, 100, 200}


def test_keep_best() -> None:
    versions = [
        _v(1, loss=0.9, acc=0.1),
        _v(2, loss=0.5, acc=0.4),
        _v(3, acc=0.9),  # no loss: not a candidate for loss
        _v(4, loss=0.7, acc=0.3),
        _v(5, loss=math.nan),  # a NaN is never the best
        _v(6, loss=0.5),  # ties go to the newer version
    ]
    assert KeepBest(1).select(versions) == {6}
    assert KeepBest(2).select(versions) == {2, 6}
    assert KeepBest(2, metric="acc", mode="max").select(versions) == {3, 2}
    assert KeepBest(9).select(versions) == {1, 2, 4, 6}


def test_keep_any() -> None:
    versions = [_v(s, loss=1.0 / (s + 1)) for s in range(0, 1000, 100)]
    policy = KeepAny(KeepLast(2), KeepEvery(500), KeepBest(1, mode="max"))
    assert policy.select(versions) == {800, 900, 0, 500}


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: KeepLast(0), ValueError, r"n=0 is invalid: allowed is a positive int"),
        (lambda: KeepLast(1.0), TypeError, r"n must be a positive int, got 1\.0"),  # type: ignore[arg-type]
        (lambda: KeepEvery(-5), ValueError, r"n_steps=-5 is invalid"),
        (lambda: KeepBest(0), ValueError, r"k=0 is invalid"),
        (lambda: KeepBest(1, metric=""), ValueError, r"metric='' .* a non-empty str"),
        (lambda: KeepBest(1, metric=3), TypeError, r"metric must be a non-empty str"),  # type: ignore[arg-type]
        (lambda: KeepBest(1, mode="lowest"), ValueError, r"mode must be 'min' or 'max'"),  # type: ignore[arg-type]
        (lambda: KeepAny(), ValueError, r"at least one"),
        (lambda: KeepAny(KeepLast(1), 3), TypeError, r"KeepAny argument 1 .* got 3"),  # type: ignore[arg-type]
    ],
)
def test_retention_validation(make: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()  # type: ignore[operator]


def test_as_retention() -> None:
    assert as_retention(None) is None
    last = as_retention(3)
    assert isinstance(last, KeepLast) and last.n == 3
    best = KeepBest(2)
    assert as_retention(best) is best
    for bad, error in ((0, ValueError), (-1, ValueError), (True, TypeError), ("3", TypeError)):
        with pytest.raises(error, match=r"keep.* None, a positive int or a retention"):
            as_retention(bad)  # type: ignore[arg-type]


_metric_values = st.floats(allow_nan=True, allow_infinity=True)
_versions = st.lists(
    st.builds(
        VersionInfo,
        st.integers(0, 10**6),
        st.dictionaries(st.sampled_from(["loss", "acc"]), _metric_values),
    ),
    max_size=30,
    unique_by=lambda v: v.step,
)
_policies: st.SearchStrategy[RetentionPolicy] = st.deferred(
    lambda: st.one_of(
        st.builds(KeepLast, st.integers(1, 10)),
        st.builds(KeepEvery, st.integers(1, 10**5)),
        st.builds(
            KeepBest,
            st.integers(1, 10),
            st.sampled_from(["loss", "acc"]),
            st.sampled_from(["min", "max"]),
        ),
        st.lists(_policies, min_size=1, max_size=3).map(lambda ps: KeepAny(*ps)),
    )
)


@given(_versions, _policies)
def test_selection_is_a_subset_of_the_given_steps(
    versions: list[VersionInfo], policy: RetentionPolicy
) -> None:
    assert policy.select(versions) <= {v.step for v in versions}


@given(_versions, st.integers(1, 40))
def test_keep_last_keeps_exactly_the_newest(versions: list[VersionInfo], n: int) -> None:
    kept = KeepLast(n).select(versions)
    steps = sorted(v.step for v in versions)
    assert kept == set(steps[len(steps) - min(n, len(steps)) :])


@given(_versions, st.integers(1, 40), st.sampled_from(["min", "max"]))
def test_keep_best_keeps_the_k_best(versions: list[VersionInfo], k: int, mode: str) -> None:
    kept = KeepBest(k, "loss", mode).select(versions)  # type: ignore[arg-type]
    value = {
        v.step: v.metrics["loss"]
        for v in versions
        if not math.isnan(v.metrics.get("loss", math.nan))
    }
    assert kept <= value.keys()
    assert len(kept) == min(k, len(value))
    sign = 1.0 if mode == "min" else -1.0
    for s in kept:
        for other in value.keys() - kept:
            assert sign * value[s] <= sign * value[other]


@given(_versions, st.lists(_policies, min_size=1, max_size=4))
def test_keep_any_is_the_union(
    versions: list[VersionInfo], policies: list[RetentionPolicy]
) -> None:
    union: set[int] = set()
    for policy in policies:
        union |= policy.select(versions)
    assert KeepAny(*policies).select(versions) == union
