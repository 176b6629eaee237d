"""The search over schedules: the grid, the learned surrogate, and the search driven by both.

Owns :class:`Grid` and :func:`search`, which finds the grid point of least simulated waste
while simulating a small part of the grid. Pure computation (numpy); runs on the caller's
thread. docs/design/planning.md has the steps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cryosnap import _validate
from cryosnap.plan._model import Problem, Schedule, analytic_schedule

__all__ = ["EVERY_LADDER", "Grid", "SearchResult", "search", "build_grid"]

# Candidate multiples between adjacent levels: roughly geometric (ratio ~1.4), integers.
EVERY_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True, slots=True)
class Grid:
    """The schedules a search chooses from: ``base_seconds`` times the per-level candidate
    ``every`` values (``every[0]`` is always ``(1,)``)."""

    base_seconds: tuple[float, ...]
    every: tuple[tuple[int, ...], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.base_seconds), *(len(e) for e in self.every[1:]))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def schedule(self, index: Sequence[int]) -> Schedule:
        rest = tuple(self.every[j + 1][k] for j, k in enumerate(index[1:]))
        return Schedule(self.base_seconds[index[0]], (1, *rest))

    def indices(self) -> list[tuple[int, ...]]:
        """Every grid point, in row-major order."""
        return list(itertools.product(*(range(n) for n in self.shape)))

    def schedules(self) -> list[Schedule]:
        """Every schedule of the grid, in the order of :meth:`indices`."""
        return [self.schedule(i) for i in self.indices()]

    def nearest(self, schedule: Schedule) -> tuple[int, ...]:
        """The grid point closest to ``schedule`` in log-interval space."""
        out = [_closest(self.base_seconds, schedule.base_seconds)]
        out += [_closest(self.every[j], n) for j, n in enumerate(schedule.every) if j > 0]
        return tuple(out)

    def log_coordinates(self, indices: np.ndarray) -> np.ndarray:
        """Grid points as log-intervals scaled to [-1, 1] per axis: the surrogate's inputs."""
        axes = [np.log(np.asarray(self.base_seconds))]
        axes += [np.log(np.asarray(e, dtype=np.float64)) for e in self.every[1:]]
        cols = []
        for d, axis in enumerate(axes):
            lo, hi = float(axis.min()), float(axis.max())
            span = (hi - lo) / 2 or 1.0
            cols.append((axis[indices[:, d]] - (lo + hi) / 2) / span)
        return np.stack(cols, axis=1)


def _closest(values: Sequence[float], x: float) -> int:
    logs = np.log(np.asarray(values, dtype=np.float64))
    return int(np.argmin(np.abs(logs - math.log(x))))


def build_grid(
    problem: Problem, *, base_points: int = 13, base_span: float = 8.0, max_every: int = 1000
) -> Grid:
    """The grid around the first-order optimum ``(T*, n*)`` (computed with each class's rate
    ``1 / MTBF`` whatever its distribution): ``base_points`` base intervals from
    ``T* / base_span`` to ``T* * base_span`` (geometric, ``T*`` in the middle when the count
    is odd); per level, the values of :data:`EVERY_LADDER` up to ``max(32, 4 n*)`` (capped
    at ``max_every``) plus ``n*`` itself."""
    _validate.integer(base_points, "base_points", minimum=1)
    span = _validate.number(base_span, "base_span", allowed="a number >= 1")
    if span < 1:
        _validate.bad_value(base_span, "base_span", "a number >= 1")
    ref = analytic_schedule(problem, max_every=max_every)
    ratios = span ** np.linspace(-1.0, 1.0, base_points) if base_points > 1 else np.ones(1)
    bases = tuple(float(ref.base_seconds * r) for r in ratios)
    every: list[tuple[int, ...]] = [(1,)]
    for n in ref.every[1:]:
        top = min(max_every, max(32, 4 * n))
        every.append(tuple(sorted({v for v in EVERY_LADDER if v <= top} | {n})))
    return Grid(bases, tuple(every))


# ---------------------------------------------------------------------------------------------
# the surrogate


def _quadratic_features(x: np.ndarray) -> np.ndarray:
    """``[1, x_i, x_i * x_j (i <= j)]`` for each row of ``x``."""
    cols = [np.ones(len(x)), *(x[:, i] for i in range(x.shape[1]))]
    for i, j in itertools.combinations_with_replacement(range(x.shape[1]), 2):
        cols.append(x[:, i] * x[:, j])
    return np.stack(cols, axis=1)


def fit_surrogate(x: np.ndarray, waste: np.ndarray) -> np.ndarray:
    """Least-squares coefficients of the quadratic model of ``log(waste)`` at points ``x``."""
    y = np.log(np.maximum(waste, 1e-12))
    coef: np.ndarray = np.linalg.lstsq(_quadratic_features(x), y, rcond=None)[0]
    return coef


def predict_surrogate(coef: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The surrogate's waste at points ``x``."""
    waste: np.ndarray = np.exp(_quadratic_features(x) @ coef)
    return waste


# ---------------------------------------------------------------------------------------------
# the search


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The best grid point found, and every simulated point with its waste."""

    best: tuple[int, ...]
    waste: float
    simulated: dict[tuple[int, ...], float]


Evaluate = Callable[[list[tuple[int, ...]]], np.ndarray]


def search(
    grid: Grid,
    evaluate: Evaluate,
    *,
    start: Sequence[tuple[int, ...]] = (),
    seed: int = 0,
    rounds: int = 4,
    batch: int | None = None,
) -> SearchResult:
    """The grid point of least ``evaluate`` (simulated waste), found as the module docstring
    says. ``start`` points are simulated first (the caller's baselines)."""
    every_point = np.array(grid.indices(), dtype=np.int64).reshape(grid.size, len(grid.shape))
    coords = grid.log_coordinates(every_point)
    features = _quadratic_features(coords[:1]).shape[1]
    batch = batch or 2 * features
    rng = np.random.default_rng(seed)
    seen: dict[tuple[int, ...], float] = {}

    def run(points: Sequence[tuple[int, ...]]) -> None:
        fresh = list(dict.fromkeys(p for p in points if p not in seen))
        if fresh:
            seen.update(zip(fresh, evaluate(fresh).tolist(), strict=True))

    sample = rng.choice(grid.size, size=min(grid.size, 3 * features), replace=False)
    run([*start, *(tuple(int(v) for v in every_point[k]) for k in sample)])
    for _ in range(rounds):
        before = min(seen.values())
        run(_surrogate_candidates(grid.shape, every_point, coords, seen, batch))
        if min(seen.values()) >= before:
            break
    best = _pattern_search(grid, seen, run)
    return SearchResult(best, seen[best], dict(seen))


def _surrogate_candidates(
    shape: tuple[int, ...],
    every_point: np.ndarray,
    coords: np.ndarray,
    seen: dict[tuple[int, ...], float],
    batch: int,
) -> list[tuple[int, ...]]:
    """The ``batch`` unsimulated points the surrogate ranks best. The model is fitted to the
    better half of the simulated points (at least 2x as many as it has coefficients): the
    waste surface is far from quadratic at its edges, and only the basin matters."""
    points = sorted(seen, key=seen.__getitem__)
    features = _quadratic_features(coords[:1]).shape[1]
    keep = points[: max(2 * features, len(points) // 2)]
    flat = np.ravel_multi_index(tuple(np.array(keep).T), shape)
    coef = fit_surrogate(coords[flat], np.array([seen[p] for p in keep]))
    ranked = np.argsort(predict_surrogate(coef, coords), kind="stable")
    out: list[tuple[int, ...]] = []
    for k in ranked.tolist():
        point = tuple(int(v) for v in every_point[k])
        if point not in seen:
            out.append(point)
            if len(out) == batch:
                break
    return out


def _pattern_search(
    grid: Grid,
    seen: dict[tuple[int, ...], float],
    run: Callable[[Sequence[tuple[int, ...]]], None],
) -> tuple[int, ...]:
    """Move to the best neighbour (one step along any set of axes) until none is better."""
    steps = [s for s in itertools.product((-1, 0, 1), repeat=len(grid.shape)) if any(s)]
    best = min(seen, key=seen.__getitem__)
    while True:
        around = [tuple(b + d for b, d in zip(best, s, strict=True)) for s in steps]
        around = [p for p in around if all(0 <= v < n for v, n in zip(p, grid.shape, strict=True))]
        run(around)
        nxt = min([best, *around], key=seen.__getitem__)
        if nxt == best:
            return best
        best = nxt
