"""The failure model of the planner and the first-order analytic optimum.

Owns :class:`LevelCost`, :class:`FailureClass`, :class:`Weibull`, :class:`Schedule`, their
validation, and the closed forms (Young, Daly, the nested multi-level waste and its minimiser).
Pure: no I/O, no threads, no clock; runs on the caller's thread.
docs/design/planning.md has the schedule's shape; docs/PLANNING.md the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise, product
from typing import Literal, TypeAlias

import numpy as np

from cryosnap import _validate

__all__ = [
    "FailureClass",
    "LevelCost",
    "Problem",
    "Schedule",
    "Weibull",
    "analytic_schedule",
    "daly_interval",
    "first_order",
    "optimal_base_seconds",
    "young_interval",
]


def _name(value: object, what: str) -> str:
    if not isinstance(value, str):
        _validate.wrong_type(value, what, "a non-empty str")
    if not value.strip():
        _validate.bad_value(value, what, "a non-empty str")
    return value


@dataclass(frozen=True, slots=True)
class LevelCost:
    """What one storage level costs the run: ``save_seconds`` per version it takes (the time
    the run loses to it), ``restart_seconds`` to recover from it after a failure."""

    name: str
    save_seconds: float
    restart_seconds: float

    def __post_init__(self) -> None:
        _name(self.name, "LevelCost.name")
        save = _validate.seconds(self.save_seconds, f"save_seconds of level {self.name!r}")
        restart = _validate.seconds(
            self.restart_seconds, f"restart_seconds of level {self.name!r}", allow_zero=True
        )
        object.__setattr__(self, "save_seconds", save)
        object.__setattr__(self, "restart_seconds", restart)


@dataclass(frozen=True, slots=True)
class Weibull:
    """Weibull inter-arrival times of the given ``shape`` (< 1: failures come in bursts, as on
    most HPC systems; 1: exponential; > 1: wear-out), scaled to the class's MTBF."""

    shape: float

    def __post_init__(self) -> None:
        shape = _validate.number(self.shape, "Weibull.shape", allowed="a positive finite number")
        if shape <= 0:
            _validate.bad_value(self.shape, "Weibull.shape", "a positive finite number")
        object.__setattr__(self, "shape", shape)


Distribution: TypeAlias = Literal["exponential"] | Weibull


@dataclass(frozen=True, slots=True)
class FailureClass:
    """A kind of failure: its mean time between failures and ``survives``, the lowest level
    (name or index, fastest first) whose versions outlive it. A process crash is survived by
    node-local scratch; a node loss by a partner copy or the persistent level; a system-wide
    outage by the persistent level only."""

    name: str
    mtbf_seconds: float
    survives: str | int
    distribution: Distribution = "exponential"

    def __post_init__(self) -> None:
        _name(self.name, "FailureClass.name")
        mtbf = _validate.seconds(self.mtbf_seconds, f"mtbf_seconds of failure {self.name!r}")
        object.__setattr__(self, "mtbf_seconds", mtbf)
        if self.distribution != "exponential" and not isinstance(self.distribution, Weibull):
            _validate.bad_value(
                self.distribution,
                f"distribution of failure {self.name!r}",
                "'exponential' or a Weibull(shape)",
            )

    @property
    def shape(self) -> float:
        """The Weibull shape of the inter-arrival times (1.0 for exponential)."""
        return self.distribution.shape if isinstance(self.distribution, Weibull) else 1.0


@dataclass(frozen=True, slots=True)
class Schedule:
    """A nested multi-level schedule: a version every ``base_seconds`` of computation, to the
    first level; level ``j`` takes every ``every[j]``-th version of level ``j - 1``
    (``every[0]`` is 1)."""

    base_seconds: float
    every: tuple[int, ...]

    def __post_init__(self) -> None:
        base = _validate.seconds(self.base_seconds, "base_seconds")
        object.__setattr__(self, "base_seconds", base)
        if not isinstance(self.every, tuple) or not self.every:
            _validate.wrong_type(self.every, "every", "a non-empty tuple of ints")
        for j, n in enumerate(self.every):
            _validate.positive_int(n, f"every[{j}]")
        if self.every[0] != 1:
            _validate.bad_value(self.every, "every", "a tuple whose first item is 1")

    @property
    def every_versions(self) -> tuple[int, ...]:
        """``N_j``: level ``j`` holds every ``N_j``-th version."""
        return tuple(int(n) for n in np.cumprod(self.every))

    @property
    def interval_seconds(self) -> tuple[float, ...]:
        """Compute seconds between two versions on each level."""
        return tuple(n * self.base_seconds for n in self.every_versions)


@dataclass(frozen=True, slots=True)
class Problem:
    """Levels and failure classes, validated, with each class's surviving level resolved to
    an index. ``rates[j]`` is the rate of the failures that level ``j`` is the lowest to
    survive (Lambda_j in docs/PLANNING.md)."""

    levels: tuple[LevelCost, ...]
    failures: tuple[FailureClass, ...]
    survive: tuple[int, ...]

    @classmethod
    def of(cls, levels: Sequence[LevelCost], failures: Sequence[FailureClass]) -> Problem:
        levels = tuple(levels)
        failures = tuple(failures)
        if not levels:
            _validate.bad_value(levels, "levels", "at least one LevelCost, fastest first")
        if not failures:
            _validate.bad_value(failures, "failures", "at least one FailureClass")
        for level in levels:
            if not isinstance(level, LevelCost):
                _validate.wrong_type(level, "levels item", "a LevelCost")
        for failure in failures:
            if not isinstance(failure, FailureClass):
                _validate.wrong_type(failure, "failures item", "a FailureClass")
        _unique([lv.name for lv in levels], "level")
        _unique([f.name for f in failures], "failure class")
        names = [lv.name for lv in levels]
        return cls(levels, failures, tuple(_resolve(f, names) for f in failures))

    @property
    def save_costs(self) -> np.ndarray:
        return np.array([lv.save_seconds for lv in self.levels], dtype=np.float64)

    @property
    def restart_costs(self) -> np.ndarray:
        return np.array([lv.restart_seconds for lv in self.levels], dtype=np.float64)

    @property
    def rates(self) -> np.ndarray:
        out = np.zeros(len(self.levels), dtype=np.float64)
        for f, s in zip(self.failures, self.survive, strict=True):
            out[s] += 1.0 / f.mtbf_seconds
        return out

    @property
    def exponential(self) -> bool:
        return all(f.distribution == "exponential" for f in self.failures)

    def single_level(self, index: int) -> Problem:
        """The same failures against level ``index`` alone (every class restarts from it)."""
        return Problem((self.levels[index],), self.failures, (0,) * len(self.failures))

    def check(self, schedule: Schedule) -> Schedule:
        if not isinstance(schedule, Schedule):
            _validate.wrong_type(schedule, "schedule", "a Schedule")
        if len(schedule.every) != len(self.levels):
            _validate.bad_value(
                schedule.every, "schedule.every", f"one entry per level ({len(self.levels)})"
            )
        return schedule


def _unique(names: list[str], what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what} name {name!r} is given twice; names must be unique")
        seen.add(name)


def _resolve(failure: FailureClass, names: list[str]) -> int:
    where = f"survives of failure {failure.name!r}"
    allowed = f"a level name ({', '.join(map(repr, names))}) or an index from 0 to {len(names) - 1}"
    s = failure.survives
    if isinstance(s, str):
        if s not in names:
            _validate.bad_value(s, where, allowed)
        return names.index(s)
    return _validate.integer(s, where, minimum=0, maximum=len(names) - 1, allowed=allowed)


# ---------------------------------------------------------------------------------------------
# one level: Young (1974) and Daly (2006)


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum: ``sqrt(2 C M)`` compute seconds between checkpoints."""
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum (FGCS 22(3), 2006, eq. 37): for ``C < 2M``,
    ``sqrt(2CM) * (1 + sqrt(x)/3 + x/9) - C`` with ``x = C / (2M)``; else ``M``."""
    c, m = save_seconds, mtbf_seconds
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


# ---------------------------------------------------------------------------------------------
# many levels: the first-order waste of a nested schedule and its minimiser


def first_order(problem: Problem, schedule: Schedule) -> float:
    """``sum_j C_j / (N_j T) + Lambda_j (N_j T / 2 + R_j)``: checkpoint overhead plus, per
    failure, half a period of the level it restarts from and that level's restart."""
    n = np.asarray(problem.check(schedule).every_versions, dtype=np.float64)
    t = schedule.base_seconds
    overhead = float(np.sum(problem.save_costs / (n * t)))
    loss = float(np.sum(problem.rates * (n * t / 2.0 + problem.restart_costs)))
    return overhead + loss


def optimal_base_seconds(problem: Problem, every: tuple[int, ...]) -> float:
    """The base interval minimising :func:`first_order` for fixed ``every``:
    ``sqrt(2 sum(C_j / N_j) / sum(Lambda_j N_j))``."""
    n = np.cumprod(np.asarray(every, dtype=np.float64))
    return math.sqrt(2.0 * float(np.sum(problem.save_costs / n)) / float(np.sum(problem.rates * n)))


def _pooled_periods(costs: np.ndarray, rates: np.ndarray) -> list[float]:
    """Per-level periods minimising ``sum C_j / P_j + Lambda_j P_j / 2`` under
    ``P_0 <= P_1 <= ...``: Young per level, ``sqrt(2 C_j / Lambda_j)``, with adjacent levels
    that violate the order pooled (pool-adjacent-violators) into one period
    ``sqrt(2 sum C / sum Lambda)``. A level no failure needs gets an infinite period."""

    def period(c: float, lam: float) -> float:
        return math.sqrt(2.0 * c / lam) if lam > 0 else math.inf

    blocks: list[tuple[float, float, int]] = []  # (cost sum, rate sum, levels pooled)
    for c, lam in zip(costs.tolist(), rates.tolist(), strict=True):
        blocks.append((c, lam, 1))
        while len(blocks) > 1 and period(*blocks[-2][:2]) > period(*blocks[-1][:2]):
            c2, l2, k2 = blocks.pop()
            c1, l1, k1 = blocks.pop()
            blocks.append((c1 + c2, l1 + l2, k1 + k2))
    return [period(c, lam) for c, lam, k in blocks for _ in range(k)]


def _ratio(hi: float, lo: float, max_every: int) -> float:
    if math.isinf(hi):
        return 1.0 if math.isinf(lo) else float(max_every)
    return min(hi / lo, float(max_every))


def analytic_schedule(problem: Problem, *, max_every: int = 1000) -> Schedule:
    """The first-order optimum. One level: Daly's interval (the optimum of the exact expected
    run time under exponential failures to second order; Young's is its first term). Several:
    the pooled per-level periods of :func:`_pooled_periods`, their ratios rounded to integers
    (both roundings of each ratio are tried, then single steps), the base interval re-optimised
    in closed form for each candidate."""
    if len(problem.levels) == 1:
        mtbf = 1.0 / float(problem.rates[0])
        return Schedule(daly_interval(problem.levels[0].save_seconds, mtbf), (1,))
    periods = _pooled_periods(problem.save_costs, problem.rates)
    ratios = [_ratio(hi, lo, max_every) for lo, hi in pairwise(periods)]
    choices = [sorted({max(1, math.floor(r)), min(max_every, math.ceil(r))}) for r in ratios]
    best = min(
        (_candidate(problem, (1, *rest)) for rest in product(*choices)),
        key=lambda s: first_order(problem, s),
    )
    return _descend(problem, best, max_every)


def _candidate(problem: Problem, every: tuple[int, ...]) -> Schedule:
    return Schedule(optimal_base_seconds(problem, every), every)


def _descend(problem: Problem, schedule: Schedule, max_every: int) -> Schedule:
    """Integer coordinate descent on ``every[1:]`` (steps of one and factors of two)."""
    best, best_waste = schedule, first_order(problem, schedule)
    improved = True
    while improved:
        improved = False
        for j in range(1, len(best.every)):
            n = best.every[j]
            for m in sorted({n - 1, n + 1, n // 2, n * 2}):
                if not 1 <= m <= max_every or m == n:
                    continue
                trial = _candidate(problem, (*best.every[:j], m, *best.every[j + 1 :]))
                waste = first_order(problem, trial)
                if waste < best_waste * (1 - 1e-12):
                    best, best_waste, improved = trial, waste, True
    return best
