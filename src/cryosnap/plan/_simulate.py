"""A discrete-event simulator of a run with nested multi-level checkpoints under failures.

Owns the seeded failure traces and the simulation of many schedules against the same traces
at once (common random numbers). Waste is ``1 - progress / horizon``.
Pure computation (numpy); no I/O, no threads; runs on the caller's thread.
docs/design/planning.md has the run as the simulator plays it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cryosnap import _validate
from cryosnap.plan._model import Problem, Schedule

__all__ = ["Trace", "failure_traces", "simulate_waste"]


@dataclass(frozen=True, slots=True)
class Trace:
    """Failure times (seconds, ascending) and the lowest surviving level of each."""

    times: np.ndarray
    survive: np.ndarray
    horizon_seconds: float


def failure_traces(
    problem: Problem, *, seed: int = 0, traces: int = 4, failures_per_trace: int = 500
) -> list[Trace]:
    """``traces`` independent traces, each long enough for ``failures_per_trace`` failures
    on average; deterministic for a given ``seed``."""
    _validate.integer(seed, "seed", minimum=0)
    _validate.positive_int(traces, "traces")
    _validate.positive_int(failures_per_trace, "failures_per_trace")
    rng = np.random.default_rng(seed)
    horizon = failures_per_trace / float(problem.rates.sum())
    return [_trace(problem, rng, horizon) for _ in range(traces)]


def _trace(problem: Problem, rng: np.random.Generator, horizon: float) -> Trace:
    times: list[np.ndarray] = []
    levels: list[np.ndarray] = []
    for failure, survive in zip(problem.failures, problem.survive, strict=True):
        t = _renewals(rng, failure.mtbf_seconds, failure.shape, horizon)
        times.append(t)
        levels.append(np.full(t.size, survive, dtype=np.int64))
    all_times = np.concatenate(times)
    order = np.argsort(all_times, kind="stable")
    return Trace(all_times[order], np.concatenate(levels)[order], horizon)


def _renewals(rng: np.random.Generator, mtbf: float, shape: float, horizon: float) -> np.ndarray:
    """Arrival times in ``[0, horizon)`` of a renewal process with Weibull(shape) gaps of mean
    ``mtbf`` (shape 1: a Poisson process), conditioned on the expected count.

    The count is ``horizon / mtbf`` rounded up or down at random (unbiased, variance < 1/4,
    where a free count would vary by ``horizon / mtbf``); the ``count + 1`` gaps, the last one
    running past the end, are scaled to span the horizon exactly. For exponential gaps this is
    exactly a Poisson process given its count. A rare class (a few outages per trace) then
    adds its true rate of failures to every trace instead of a rate off by tens of percent.
    """
    expected = horizon / mtbf
    count = math.floor(expected)
    count += int(rng.random() < expected - count)
    gaps = rng.weibull(shape, count + 1)
    arrivals: np.ndarray = np.cumsum(gaps[:count]) * (horizon / float(gaps.sum()))
    return arrivals


# ---------------------------------------------------------------------------------------------
# simulation


def simulate_waste(
    problem: Problem, schedules: Sequence[Schedule], traces: Sequence[Trace]
) -> np.ndarray:
    """The waste of each schedule, averaged over ``traces`` (the same traces for all)."""
    if not schedules:
        return np.zeros(0, dtype=np.float64)
    base = np.array([problem.check(s).base_seconds for s in schedules], dtype=np.float64)
    every = np.array([s.every_versions for s in schedules], dtype=np.int64)
    costs, restarts = problem.save_costs, problem.restart_costs
    wastes = [_run(costs, restarts, base, every, trace) for trace in traces]
    mean: np.ndarray = np.mean(wastes, axis=0)
    return mean


def _wall(
    costs: np.ndarray, base: np.ndarray, every: np.ndarray, i: np.ndarray, m: np.ndarray
) -> np.ndarray:
    """Wall seconds from finishing version ``i`` to finishing version ``m``: compute plus the
    save cost of every level each version in ``(i, m]`` reaches."""
    saves = (m[:, None] // every) - (i[:, None] // every)
    wall: np.ndarray = (m - i) * base + saves @ costs
    return wall


def _reach(
    costs: np.ndarray, base: np.ndarray, every: np.ndarray, i: np.ndarray, budget: np.ndarray
) -> np.ndarray:
    """The last version finished within ``budget`` wall seconds of finishing version ``i``."""
    budget = np.maximum(budget, 0.0)
    slack = float(costs.sum())
    rate = base + (costs / every).sum(axis=1)  # mean wall seconds per version
    # The wall time of k versions is within `slack` of k * rate (each level's count of saves is
    # within one of k / N_j), which brackets the answer tightly before bisecting.
    lo = i + np.floor(np.maximum(budget - slack, 0.0) / rate).astype(np.int64)
    hi = i + np.minimum(np.floor(budget / base), np.floor((budget + slack) / rate)).astype(np.int64)
    hi = np.maximum(hi + 1, lo + 1)
    while True:
        gap = hi - lo
        if not (gap > 1).any():
            found: np.ndarray = lo
            return found
        mid = lo + gap // 2
        ok = _wall(costs, base, every, i, mid) <= budget
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid)


def _run(
    costs: np.ndarray, restarts: np.ndarray, base: np.ndarray, every: np.ndarray, trace: Trace
) -> np.ndarray:
    n = base.size
    version = np.zeros(n, dtype=np.int64)  # the version the run last finished (or restored)
    resume = np.zeros(n, dtype=np.float64)  # when it finished it (or the restart ended)
    # The newest version each level holds; -1: none (wiped). Version 0 (the initial state) is
    # everywhere: a failure before the first save restarts from the beginning.
    held = np.zeros((n, costs.size), dtype=np.int64)
    for t, survive in zip(trace.times.tolist(), trace.survive.tolist(), strict=True):
        done = _reach(costs, base, every, version, t - resume)
        newest = (done[:, None] // every) * every
        held = np.where(newest > version[:, None], newest, held)
        held[:, :survive] = -1
        kept = held[:, survive:]
        version = kept.max(axis=1)
        source = survive + np.argmax(kept == version[:, None], axis=1)  # fastest level holding it
        resume = t + restarts[source]
    budget = trace.horizon_seconds - resume
    done = _reach(costs, base, every, version, budget)
    spent = _wall(costs, base, every, version, done)
    partial = np.clip(budget - spent, 0.0, base)  # compute past the last finished version
    progress = done * base + partial
    waste: np.ndarray = 1.0 - progress / trace.horizon_seconds
    return waste
