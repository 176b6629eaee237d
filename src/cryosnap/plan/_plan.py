"""``plan()``: the per-level intervals that minimise the expected waste, and the baselines.

Owns :class:`Plan`, :class:`LevelPlan`, :class:`Simulation`, :func:`simulate`,
:func:`waste_profile`, and the choice between the analytic optimum and the simulated search.
Pure computation; runs on the caller's thread. docs/design/planning.md has the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from cryosnap import _validate
from cryosnap.plan._model import (
    FailureClass,
    LevelCost,
    Problem,
    Schedule,
    analytic_schedule,
    daly_interval,
    first_order,
    optimal_base_seconds,
)
from cryosnap.plan._search import EVERY_LADDER, Grid, build_grid, search
from cryosnap.plan._simulate import Trace, failure_traces, simulate_waste

__all__ = [
    "Curve",
    "LevelPlan",
    "Plan",
    "Simulation",
    "first_order_waste",
    "plan",
    "search_grid",
    "simulate",
    "waste_profile",
]

Method = Literal["auto", "analytic", "search"]


@dataclass(frozen=True, slots=True)
class Simulation:
    """How the simulator estimates a waste: ``traces`` independent failure traces of
    ``failures_per_trace`` failures on average each, drawn from ``seed``."""

    seed: int = 0
    traces: int = 4
    failures_per_trace: int = 500

    def __post_init__(self) -> None:
        _validate.integer(self.seed, "Simulation.seed", minimum=0)
        _validate.positive_int(self.traces, "Simulation.traces")
        _validate.positive_int(self.failures_per_trace, "Simulation.failures_per_trace")

    def traces_for(self, problem: Problem) -> list[Trace]:
        return failure_traces(
            problem,
            seed=self.seed,
            traces=self.traces,
            failures_per_trace=self.failures_per_trace,
        )


@dataclass(frozen=True, slots=True)
class LevelPlan:
    """One level of a plan: it takes every ``every``-th version of the level below (1 for the
    first level: every version), i.e. every ``every_versions``-th version overall,
    ``interval_seconds`` of computation apart."""

    name: str
    every: int
    every_versions: int
    interval_seconds: float


@dataclass(frozen=True, slots=True)
class Plan:
    """The recommended schedule, its expected waste (fraction of wall-clock time lost to
    checkpoints, rework and restarts) and two baselines: every version to every level (at its
    own best interval), and one level only, the persistent (last) one, at Daly's interval.

    ``waste_model`` says how the three wastes were estimated: "first-order" (the analytic
    model) or "simulated" (the simulator on the traces of ``simulation``, the same for all
    three; ``simulation`` is None for a first-order plan). ``simulated`` counts the schedules
    simulated out of ``grid_size`` (0 and 0: analytic)."""

    levels: tuple[LevelPlan, ...]
    base_interval_seconds: float
    expected_waste: float
    every_version_interval_seconds: float
    every_version_waste: float
    young_daly_interval_seconds: float
    young_daly_waste: float
    method: Literal["analytic", "search"]
    waste_model: Literal["first-order", "simulated"]
    simulated: int = 0
    grid_size: int = 0
    simulation: Simulation | None = None

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.base_interval_seconds, tuple(lv.every for lv in self.levels))

    def last_level(self, version: int) -> int:
        """The index of the slowest level the ``version``-th version (counted from 1) goes
        to: every version goes to level 0, and to level ``j`` too when ``every_versions`` of
        level ``j`` divides ``version``."""
        _validate.integer(version, "version", minimum=1)
        out = 0
        for j, lv in enumerate(self.levels):
            if version % lv.every_versions == 0:
                out = j
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "levels": [
                {
                    "name": lv.name,
                    "every": lv.every,
                    "every_versions": lv.every_versions,
                    "interval_seconds": lv.interval_seconds,
                }
                for lv in self.levels
            ],
            "base_interval_seconds": self.base_interval_seconds,
            "expected_waste": self.expected_waste,
            "every_version": {
                "interval_seconds": self.every_version_interval_seconds,
                "waste": self.every_version_waste,
            },
            "young_daly": {
                "level": self.levels[-1].name,
                "interval_seconds": self.young_daly_interval_seconds,
                "waste": self.young_daly_waste,
            },
            "method": self.method,
            "waste_model": self.waste_model,
            "simulated": self.simulated,
            "grid_size": self.grid_size,
            "simulation": None
            if self.simulation is None
            else {
                "seed": self.simulation.seed,
                "traces": self.simulation.traces,
                "failures_per_trace": self.simulation.failures_per_trace,
            },
        }


def plan(
    levels: Sequence[LevelCost],
    failures: Sequence[FailureClass],
    *,
    method: Method = "auto",
    simulation: Simulation | None = None,
    max_every: int = 1000,
    analytic_max_waste: float = 0.1,
    base_points: int = 13,
) -> Plan:
    """The per-level intervals that minimise the expected waste of a run.

    ``levels`` fastest first (the first takes every version); ``failures`` with the lowest
    level each one is survived by. ``method="auto"`` takes the first-order analytic optimum
    when every class is exponential and its predicted waste is at most ``analytic_max_waste``,
    and searches otherwise (``"analytic"`` or ``"search"`` force one). The search simulates
    with ``simulation`` (default ``Simulation()``) over a grid of ``base_points`` base
    intervals and integer multiples up to ``max_every`` between adjacent levels."""
    problem = Problem.of(levels, failures)
    if method not in ("auto", "analytic", "search"):
        _validate.bad_value(method, "method", "'auto', 'analytic' or 'search'")
    _validate.positive_int(max_every, "max_every")
    limit = _validate.fraction(analytic_max_waste, "analytic_max_waste")
    if simulation is not None and not isinstance(simulation, Simulation):
        _validate.wrong_type(simulation, "simulation", "a Simulation or None")
    analytic = analytic_schedule(problem, max_every=max_every)
    if method == "auto":
        fits = problem.exponential and first_order(problem, analytic) <= limit
        method = "analytic" if fits else "search"
    if method == "analytic":
        return _analytic_plan(problem, analytic)
    return _search_plan(
        problem, analytic, simulation or Simulation(), max_every=max_every, base_points=base_points
    )


def _levels(problem: Problem, schedule: Schedule) -> tuple[LevelPlan, ...]:
    return tuple(
        LevelPlan(lv.name, every, n, t)
        for lv, every, n, t in zip(
            problem.levels,
            schedule.every,
            schedule.every_versions,
            schedule.interval_seconds,
            strict=True,
        )
    )


def _young_daly(problem: Problem) -> tuple[Problem, Schedule]:
    """The last (persistent) level alone, every failure restarting from it, Daly's interval."""
    single = problem.single_level(len(problem.levels) - 1)
    mtbf = 1.0 / float(problem.rates.sum())
    return single, Schedule(daly_interval(single.levels[0].save_seconds, mtbf), (1,))


def _every_version(problem: Problem) -> Schedule:
    ones = (1,) * len(problem.levels)
    if len(ones) == 1:
        return analytic_schedule(problem)
    return Schedule(optimal_base_seconds(problem, ones), ones)


def _analytic_plan(problem: Problem, schedule: Schedule) -> Plan:
    single, daly = _young_daly(problem)
    every = _every_version(problem)
    return Plan(
        levels=_levels(problem, schedule),
        base_interval_seconds=schedule.base_seconds,
        expected_waste=first_order(problem, schedule),
        every_version_interval_seconds=every.base_seconds,
        every_version_waste=first_order(problem, every),
        young_daly_interval_seconds=daly.base_seconds,
        young_daly_waste=first_order(single, daly),
        method="analytic",
        waste_model="first-order",
    )


def _search_plan(
    problem: Problem,
    analytic: Schedule,
    simulation: Simulation,
    *,
    max_every: int,
    base_points: int,
) -> Plan:
    traces = simulation.traces_for(problem)
    grid = build_grid(problem, base_points=base_points, max_every=max_every)

    def evaluate(points: list[tuple[int, ...]]) -> np.ndarray:
        return simulate_waste(problem, [grid.schedule(p) for p in points], traces)

    # The "every version to every level" row (multiple 1 is the first value on every axis) is
    # simulated first: it is a baseline, and the search can then never end up worse than it.
    ones_row = [(b,) + (0,) * (len(grid.shape) - 1) for b in range(len(grid.base_seconds))]
    found = search(grid, evaluate, start=[grid.nearest(analytic), *ones_row], seed=simulation.seed)
    every_point = min(ones_row, key=found.simulated.__getitem__)
    single, daly = _young_daly(problem)
    single_traces = [replace(t, survive=np.zeros_like(t.survive)) for t in traces]
    best = grid.schedule(found.best)
    return Plan(
        levels=_levels(problem, best),
        base_interval_seconds=best.base_seconds,
        expected_waste=found.waste,
        every_version_interval_seconds=grid.base_seconds[every_point[0]],
        every_version_waste=found.simulated[every_point],
        young_daly_interval_seconds=daly.base_seconds,
        young_daly_waste=float(simulate_waste(single, [daly], single_traces)[0]),
        method="search",
        waste_model="simulated",
        simulated=len(found.simulated),
        grid_size=grid.size,
        simulation=simulation,
    )


def simulate(
    levels: Sequence[LevelCost],
    failures: Sequence[FailureClass],
    schedules: Sequence[Schedule],
    *,
    simulation: Simulation | None = None,
) -> np.ndarray:
    """The simulated waste of each schedule (the same failure traces for all)."""
    problem = Problem.of(levels, failures)
    traces = (simulation or Simulation()).traces_for(problem)
    return simulate_waste(problem, list(schedules), traces)


def first_order_waste(
    levels: Sequence[LevelCost], failures: Sequence[FailureClass], schedule: Schedule
) -> float:
    """The first-order expected waste of ``schedule`` (docs/PLANNING.md, "The model"); it
    reads each class's rate as ``1 / MTBF`` whatever its distribution."""
    return first_order(Problem.of(levels, failures), schedule)


def search_grid(
    levels: Sequence[LevelCost],
    failures: Sequence[FailureClass],
    *,
    base_points: int = 13,
    max_every: int = 1000,
) -> Grid:
    """The grid :func:`plan` searches with the same arguments (for an exhaustive check)."""
    return build_grid(Problem.of(levels, failures), base_points=base_points, max_every=max_every)


@dataclass(frozen=True, slots=True)
class Curve:
    """Expected waste against one level's interval, the other levels as planned."""

    level: str
    interval_seconds: tuple[float, ...]
    waste: tuple[float, ...]


def waste_profile(
    levels: Sequence[LevelCost],
    failures: Sequence[FailureClass],
    result: Plan,
    *,
    points: int = 17,
) -> tuple[Curve, ...]:
    """One curve per level: the waste as that level's interval varies around the plan's (the
    first level's by a factor of up to 8 either way, carrying the levels above with it; the
    others through their integer multiples), estimated as the plan's wastes were."""
    problem = Problem.of(levels, failures)
    _validate.integer(points, "points", minimum=2)
    schedules = [_vary_base(result, points)]
    schedules += [_vary_every(result, j) for j in range(1, len(problem.levels))]
    if result.simulation is None:
        wastes = [[first_order(problem, s) for s in row] for row in schedules]
    else:
        traces = result.simulation.traces_for(problem)
        wastes = [simulate_waste(problem, row, traces).tolist() for row in schedules]
    return tuple(
        Curve(lv.name, tuple(s.interval_seconds[j] for s in row), tuple(w))
        for j, (lv, row, w) in enumerate(zip(problem.levels, schedules, wastes, strict=True))
    )


def _vary_base(result: Plan, points: int) -> list[Schedule]:
    every = result.schedule.every
    ratios = 8.0 ** np.linspace(-1.0, 1.0, points)
    return [Schedule(float(result.base_interval_seconds * r), every) for r in ratios]


def _vary_every(result: Plan, level: int) -> list[Schedule]:
    s = result.schedule
    top = max(32, 4 * s.every[level])
    values = sorted({v for v in EVERY_LADDER if v <= top} | {s.every[level]})
    return [Schedule(s.base_seconds, (*s.every[:level], v, *s.every[level + 1 :])) for v in values]
