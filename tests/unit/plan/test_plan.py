"""cryosnap.plan: Young/Daly, the first-order multi-level optimum, the failure simulator, and the
surrogate-driven search against an exhaustive simulated search of the same grid.

Every simulation is seeded; nothing here reads a clock. The grids and traces are small so the
file runs in seconds; the accuracy figures in docs/PLANNING.md come from larger runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest

from cryosnap.plan import (
    FailureClass,
    LevelCost,
    Schedule,
    Simulation,
    Weibull,
    daly_interval,
    first_order_waste,
    plan,
    search_grid,
    simulate,
    waste_profile,
    young_interval,
)
from cryosnap.plan._model import Problem
from cryosnap.plan._simulate import failure_traces

HOUR = 3600.0
DAY = 86400.0


def exact_waste(interval: float, save: float, restart: float, mtbf: float) -> float:
    """One level, exponential failures, failures also during saves and restarts: the expected
    wall time of a segment of ``interval + save`` is ``M e^(R/M) (e^((T+C)/M) - 1)`` (Daly
    2006, eq. 13), so the waste is one minus the interval over that."""
    segment = mtbf * math.exp(restart / mtbf) * math.expm1((interval + save) / mtbf)
    return 1.0 - interval / segment


def exact_optimum(save: float, restart: float, mtbf: float) -> float:
    """The interval minimising :func:`exact_waste`, by golden-section search."""
    lo, hi = 0.05 * young_interval(save, mtbf), 5.0 * young_interval(save, mtbf)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if exact_waste(a, save, restart, mtbf) < exact_waste(b, save, restart, mtbf):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2.0


def three_levels() -> list[LevelCost]:
    return [
        LevelCost("scratch", 2.0, 4.0),
        LevelCost("partner", 10.0, 20.0),
        LevelCost("persistent", 60.0, 120.0),
    ]


def three_classes(distribution: str | Weibull = "exponential") -> list[FailureClass]:
    if isinstance(distribution, str):
        return [
            FailureClass("crash", HOUR, "scratch"),
            FailureClass("node", 6 * HOUR, "partner"),
            FailureClass("outage", 2 * DAY, "persistent"),
        ]
    return [
        FailureClass("crash", HOUR, "scratch", distribution),
        FailureClass("node", 6 * HOUR, "partner", distribution),
        FailureClass("outage", 2 * DAY, "persistent", distribution),
    ]


# ---------------------------------------------------------------------------------------------
# one level: Young and Daly


@pytest.mark.parametrize(("save", "mtbf"), [(60.0, DAY), (60.0, 6 * HOUR), (300.0, 2 * HOUR)])
def test_daly_is_the_optimum_of_the_exact_one_level_model(save: float, mtbf: float) -> None:
    # Why the plan uses Daly's interval for one level: it is the minimiser of the exact
    # expected run time under exponential failures to second order, where Young's is only the
    # first term. The gap grows with C/M; at C/M = 1/24 Young is 8% too long.
    best = exact_optimum(save, 2 * save, mtbf)
    assert daly_interval(save, mtbf) == pytest.approx(best, rel=0.01)
    young_error = young_interval(save, mtbf) / best - 1
    assert young_error > 0  # Young always errs long
    if save / mtbf < 0.01:
        assert young_error < 0.05


def test_daly_beyond_its_range_is_the_mtbf() -> None:
    assert daly_interval(100.0, 40.0) == 40.0


def test_one_level_plan_is_daly_and_within_5_percent_of_young() -> None:
    save, mtbf = 60.0, DAY
    result = plan([LevelCost("persistent", save, 120.0)], [FailureClass("any", mtbf, 0)])
    assert result.method == "analytic"
    assert result.base_interval_seconds == pytest.approx(daly_interval(save, mtbf), rel=1e-12)
    young = young_interval(save, mtbf)
    assert abs(result.base_interval_seconds / young - 1) < 0.05
    # One level: every version to every level and the single-level baseline are the plan.
    assert result.every_version_waste == pytest.approx(result.expected_waste)
    assert result.young_daly_waste == pytest.approx(result.expected_waste)


def test_one_level_search_lands_within_5_percent_of_the_exact_optimum_waste() -> None:
    save, restart, mtbf = 60.0, 120.0, 3 * HOUR
    result = plan(
        [LevelCost("persistent", save, restart)],
        [FailureClass("any", mtbf, "persistent")],
        method="search",
        simulation=Simulation(seed=1, traces=4, failures_per_trace=500),
    )
    optimum = exact_waste(exact_optimum(save, restart, mtbf), save, restart, mtbf)
    chosen = exact_waste(result.base_interval_seconds, save, restart, mtbf)
    assert optimum <= chosen < 1.05 * optimum


# ---------------------------------------------------------------------------------------------
# the simulator


def test_simulator_matches_the_exact_one_level_model() -> None:
    save, restart, mtbf = 60.0, 120.0, 6 * HOUR
    levels = [LevelCost("persistent", save, restart)]
    failures = [FailureClass("any", mtbf, "persistent")]
    t = daly_interval(save, mtbf)
    schedules = [Schedule(t * k, (1,)) for k in (0.5, 1.0, 2.0)]
    simulated = simulate(
        levels, failures, schedules, simulation=Simulation(seed=2, failures_per_trace=1000)
    )
    exact = [exact_waste(s.base_seconds, save, restart, mtbf) for s in schedules]
    np.testing.assert_allclose(simulated, exact, rtol=0.02)


def test_simulator_agrees_with_first_order_at_low_failure_rates_one_level() -> None:
    # Waste ~1.4%: the first-order model neglects terms of order waste^2, hence 3%.
    levels = [LevelCost("persistent", 10.0, 20.0)]
    failures = [FailureClass("any", 1e5, "persistent")]
    schedule = Schedule(young_interval(10.0, 1e5), (1,))
    sim = Simulation(seed=3, failures_per_trace=2000)
    waste = simulate(levels, failures, [schedule], simulation=sim)[0]
    assert waste == pytest.approx(first_order_waste(levels, failures, schedule), rel=0.03)


def test_simulator_agrees_with_first_order_at_low_failure_rates_three_levels() -> None:
    levels = three_levels()
    failures = [replace_mtbf(f, f.mtbf_seconds * 30) for f in three_classes()]
    schedule = plan(levels, failures, method="analytic").schedule
    sim = Simulation(seed=3, failures_per_trace=2000)
    waste = simulate(levels, failures, [schedule], simulation=sim)[0]
    assert waste == pytest.approx(first_order_waste(levels, failures, schedule), rel=0.03)


def replace_mtbf(failure: FailureClass, mtbf: float) -> FailureClass:
    return FailureClass(failure.name, mtbf, failure.survives, failure.distribution)


def test_a_failure_restarts_from_the_level_that_survives_it() -> None:
    # Scratch is free to restart from and persistent is not: crashes (survived by scratch)
    # must cost less than outages (survived only by persistent) of the same rate.
    levels = [LevelCost("scratch", 1.0, 0.0), LevelCost("persistent", 1.0, 600.0)]
    schedule = Schedule(100.0, (1, 10))
    sim = Simulation(seed=4, traces=2, failures_per_trace=300)
    mtbf = 10 * HOUR
    crash = simulate(levels, [FailureClass("f", mtbf, "scratch")], [schedule], simulation=sim)
    outage = simulate(levels, [FailureClass("f", mtbf, "persistent")], [schedule], simulation=sim)
    # Both pay 1 s per version and 1 s per 10th. Per failure, a crash loses half a base
    # interval and restarts for free; an outage half of 10 base intervals plus 600 s.
    overhead = 1 / 100 + 1 / 1000
    assert crash[0] == pytest.approx(overhead + 50 / mtbf, rel=0.1)
    assert outage[0] == pytest.approx(overhead + (500 + 600) / mtbf, rel=0.1)


@pytest.mark.parametrize(("shape", "cv"), [(1.0, 1.0), (0.5, math.sqrt(5.0)), (2.0, 0.5227)])
def test_failure_traces_have_the_mtbf_and_the_shape(shape: float, cv: float) -> None:
    problem = Problem.of([LevelCost("p", 1.0, 1.0)], [FailureClass("f", HOUR, "p", Weibull(shape))])
    (trace,) = failure_traces(problem, seed=5, traces=1, failures_per_trace=20000)
    gaps = np.diff(trace.times)
    assert gaps.mean() == pytest.approx(HOUR, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert (trace.survive == 0).all()
    again = failure_traces(problem, seed=5, traces=1, failures_per_trace=20000)[0]
    np.testing.assert_array_equal(trace.times, again.times)


# ---------------------------------------------------------------------------------------------
# the first-order multi-level optimum


def test_analytic_plan_is_the_integer_optimum_of_the_first_order_model() -> None:
    levels, failures = three_levels(), three_classes()
    result = plan(levels, failures, method="analytic")
    problem = Problem.of(levels, failures)
    best = math.inf
    for n1, n2 in itertools.product(range(1, 41), repeat=2):
        n = np.array([1.0, n1, n1 * n2])
        base = math.sqrt(2 * np.sum(problem.save_costs / n) / np.sum(problem.rates * n))
        best = min(best, first_order_waste(levels, failures, Schedule(base, (1, n1, n2))))
    assert result.expected_waste == pytest.approx(best, rel=1e-9)
    assert result.expected_waste < result.every_version_waste
    assert result.expected_waste < result.young_daly_waste


def test_a_level_no_failure_needs_is_pooled_or_pushed_out() -> None:
    # No failure is survived by scratch alone: scratch has nothing to protect against, so it
    # is pooled with the next level (every version goes on).
    levels = three_levels()
    failures = [FailureClass("node", 6 * HOUR, "partner"), FailureClass("o", 2 * DAY, 2)]
    assert plan(levels, failures, method="analytic").levels[1].every == 1
    # No failure needs persistent: it takes versions as rarely as allowed.
    only_crash = [FailureClass("crash", HOUR, "scratch")]
    result = plan(levels[::2], only_crash, method="analytic", max_every=500)
    assert result.levels[1].every == 500


def test_auto_picks_analytic_only_where_first_order_applies() -> None:
    levels = three_levels()
    assert plan(levels, three_classes(), method="auto").method == "analytic"
    sim = Simulation(traces=1, failures_per_trace=100)
    weibull = plan(levels, three_classes(Weibull(0.7)), simulation=sim, base_points=3)
    assert weibull.method == "search"
    assert weibull.waste_model == "simulated"
    # Frequent failures: a first-order waste above analytic_max_waste means search.
    busy = [replace_mtbf(f, f.mtbf_seconds / 20) for f in three_classes()]
    assert plan(levels, busy, simulation=sim, base_points=3).method == "search"


# ---------------------------------------------------------------------------------------------
# the search against an exhaustive simulation of the same grid


@pytest.mark.parametrize(
    "distribution", ["exponential", Weibull(0.7), Weibull(0.5)], ids=["exp", "weib0.7", "weib0.5"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_search_is_within_5_percent_of_exhaustive(distribution: str | Weibull, seed: int) -> None:
    levels, failures = three_levels(), three_classes(distribution)
    sim = Simulation(seed=seed, traces=2, failures_per_trace=300)
    result = plan(levels, failures, method="search", simulation=sim, base_points=7)
    grid = search_grid(levels, failures, base_points=7)
    schedules = grid.schedules()
    wastes = simulate(levels, failures, schedules, simulation=sim)
    best = float(wastes.min())
    assert best <= result.expected_waste <= 1.05 * best
    # The chosen schedule is a grid point and its waste is what the plan reports.
    chosen = schedules.index(result.schedule)
    assert wastes[chosen] == pytest.approx(result.expected_waste, rel=1e-12)
    # Never worse than every version to every level, at any base interval of the grid.
    every_version = [w for s, w in zip(schedules, wastes, strict=True) if s.every == (1, 1, 1)]
    assert result.every_version_waste == pytest.approx(min(every_version), rel=1e-12)
    assert result.expected_waste <= result.every_version_waste
    # The surrogate keeps the search to a small part of the grid.
    assert result.simulated < grid.size / 4


def test_search_is_deterministic_for_a_seed() -> None:
    levels, failures = three_levels(), three_classes(Weibull(0.7))
    sim = Simulation(seed=9, traces=1, failures_per_trace=200)
    first = plan(levels, failures, simulation=sim, base_points=5)
    assert plan(levels, failures, simulation=sim, base_points=5) == first


# ---------------------------------------------------------------------------------------------
# the Plan value and its profile


def test_last_level_follows_the_nested_schedule() -> None:
    result = plan(three_levels(), three_classes(), method="analytic")
    n1 = result.levels[1].every_versions
    n2 = result.levels[2].every_versions
    assert n2 % n1 == 0 and n2 > n1 > 1
    assert result.last_level(1) == 0
    assert result.last_level(n1) == 1
    assert result.last_level(n2) == 2
    assert result.last_level(3 * n2) == 2
    with pytest.raises(ValueError, match="version"):
        result.last_level(0)


def test_profile_has_its_minimum_at_the_analytic_plan() -> None:
    levels, failures = three_levels(), three_classes()
    result = plan(levels, failures, method="analytic")
    curves = waste_profile(levels, failures, result, points=9)
    assert [c.level for c in curves] == ["scratch", "partner", "persistent"]
    for curve, level in zip(curves, result.levels, strict=True):
        at = curve.interval_seconds.index(level.interval_seconds)
        assert min(curve.waste) == pytest.approx(curve.waste[at], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: LevelCost("s", 0.0, 1.0), ValueError, "save_seconds of level 's'"),
        (lambda: LevelCost("s", 1.0, -1.0), ValueError, "restart_seconds"),
        (lambda: LevelCost("", 1.0, 1.0), ValueError, "name"),
        (lambda: FailureClass("f", -5.0, 0), ValueError, "mtbf_seconds of failure 'f'"),
        (lambda: FailureClass("f", 5.0, 0, "gamma"), ValueError, "distribution"),  # type: ignore[arg-type]
        (lambda: Weibull(0.0), ValueError, "shape"),
        (lambda: Schedule(10.0, (2, 3)), ValueError, "first item is 1"),
        (lambda: Schedule(10.0, (1, 0)), ValueError, r"every\[1\]"),
        (
            lambda: plan([LevelCost("s", 1, 1)], [FailureClass("f", 9.0, "disk")]),
            ValueError,
            "survives of failure 'f'",
        ),
        (
            lambda: plan([LevelCost("s", 1, 1)], [FailureClass("f", 9.0, 3)]),
            ValueError,
            "survives",
        ),
        (
            lambda: plan([LevelCost("s", 1, 1), LevelCost("s", 2, 2)], [FailureClass("f", 9, 0)]),
            ValueError,
            "given twice",
        ),
        (lambda: plan([LevelCost("s", 1, 1)], []), ValueError, "failures"),
        (
            lambda: plan([LevelCost("s", 1, 1)], [FailureClass("f", 9, 0)], method="best"),  # type: ignore[arg-type]
            ValueError,
            "method",
        ),
    ],
)
def test_bad_arguments_name_what_is_wrong(
    make: Callable[[], object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make()
