"""Accuracy of cryosnap.plan: Young/Daly against the exact one-level optimum, the simulator
against closed forms, the first-order multi-level plan and the surrogate-driven search against
an exhaustive simulated search of the same grid. Prints tables; asserts nothing.

    .venv/bin/python bench/bench_plan.py            # ~1-2 min on one core
    .venv/bin/python bench/bench_plan.py --quick    # fewer seeds, smaller traces

The exact one-level model (exponential failures striking during work, saves and restarts):
the expected wall time of a segment of ``T + C`` is ``M e^(R/M) (e^((T+C)/M) - 1)``
(Daly 2006), so the waste is ``1 - T / that``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

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
    young_interval,
)

HOUR, DAY = 3600.0, 86400.0


def exact_waste(t: float, c: float, r: float, m: float) -> float:
    return 1.0 - t / (m * math.exp(r / m) * math.expm1((t + c) / m))


def exact_optimum(c: float, r: float, m: float) -> float:
    lo, hi = 0.05 * young_interval(c, m), 5.0 * young_interval(c, m)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if exact_waste(a, c, r, m) < exact_waste(b, c, r, m):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2.0


def one_level() -> None:
    print("## One level: interval error against the exact optimum (C = save, M = MTBF)\n")
    print("| C/M | Young error | Daly error | waste at Young / optimum | at Daly / optimum |")
    print("|---:|---:|---:|---:|---:|")
    for c, m in [(10, 1e5), (60, DAY), (60, 6 * HOUR), (300, 2 * HOUR), (600, HOUR)]:
        best = exact_optimum(c, 2 * c, m)
        y, d = young_interval(c, m), daly_interval(c, m)
        w = exact_waste(best, c, 2 * c, m)
        print(
            f"| {c / m:.4f} | {y / best - 1:+.2%} | {d / best - 1:+.3%} | "
            f"{exact_waste(y, c, 2 * c, m) / w:.4f} | {exact_waste(d, c, 2 * c, m) / w:.5f} |"
        )
    print()


def simulator(failures_per_trace: int) -> None:
    print("## Simulator against closed forms\n")
    sim = Simulation(seed=1, traces=4, failures_per_trace=failures_per_trace)
    c, r, m = 60.0, 120.0, 6 * HOUR
    levels, fails = [LevelCost("p", c, r)], [FailureClass("f", m, "p")]
    ts = [daly_interval(c, m) * k for k in (0.5, 1.0, 2.0)]
    got = simulate(levels, fails, [Schedule(t, (1,)) for t in ts], simulation=sim)
    print("| one level, T / Daly | simulated | exact | error |")
    print("|---:|---:|---:|---:|")
    for k, t, w in zip((0.5, 1.0, 2.0), ts, got, strict=True):
        e = exact_waste(t, c, r, m)
        print(f"| {k} | {w:.4%} | {e:.4%} | {w / e - 1:+.2%} |")
    print("\n| three levels, MTBFs x | simulated | first-order | simulated / first-order |")
    print("|---:|---:|---:|---:|")
    for scale in (1, 10, 100):
        fails3 = classes("exponential", scale)
        s = plan(LEVELS, fails3, method="analytic").schedule
        w = simulate(LEVELS, fails3, [s], simulation=sim)[0]
        f = first_order_waste(LEVELS, fails3, s)
        print(f"| {scale} | {w:.3%} | {f:.3%} | {w / f:.3f} |")
    print()


LEVELS = [
    LevelCost("scratch", 2.0, 4.0),
    LevelCost("partner", 10.0, 20.0),
    LevelCost("persistent", 60.0, 120.0),
]


def classes(dist: str | Weibull, scale: float = 1.0) -> list[FailureClass]:
    spec = [("crash", HOUR, "scratch"), ("node", 6 * HOUR, "partner"), ("outage", 2 * DAY, 2)]
    if isinstance(dist, str):
        return [FailureClass(n, m * scale, s) for n, m, s in spec]
    return [FailureClass(n, m * scale, s, dist) for n, m, s in spec]


def search_vs_exhaustive(seeds: int, sim_kw: dict[str, int], base_points: int) -> None:
    print(
        f"## Search against exhaustive simulation of the same grid "
        f"({sim_kw['traces']} traces x {sim_kw['failures_per_trace']} failures, "
        f"{base_points} base intervals)\n"
    )
    print(
        "| failures | seeds | grid | simulated (mean) | gap mean | gap max | "
        "every version / plan | analytic plan / best |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, dist in [("exponential", "exponential"), ("Weibull 0.7", Weibull(0.7))]:
        fails = classes(dist)
        grid = search_grid(LEVELS, fails, base_points=base_points)
        schedules = grid.schedules()
        gaps, counts, ev, an = [], [], [], []
        t_search = t_all = 0.0
        for seed in range(seeds):
            sim = Simulation(seed=seed, **sim_kw)
            t0 = time.perf_counter()
            p = plan(LEVELS, fails, method="search", simulation=sim, base_points=base_points)
            t1 = time.perf_counter()
            w = simulate(LEVELS, fails, schedules, simulation=sim)
            t2 = time.perf_counter()
            t_search, t_all = t_search + t1 - t0, t_all + t2 - t1
            a = plan(LEVELS, fails, method="analytic").schedule
            wa = simulate(LEVELS, fails, [a], simulation=sim)[0]
            gaps.append(p.expected_waste / w.min() - 1)
            counts.append(p.simulated)
            ev.append(p.every_version_waste / p.expected_waste)
            an.append(wa / w.min())
        print(
            f"| {name} | {seeds} | {grid.size} | {np.mean(counts):.0f} | "
            f"{np.mean(gaps):.3%} | {np.max(gaps):.3%} | {np.mean(ev):.2f}x | "
            f"{np.mean(an):.3f}x |"
        )
        print(
            f"|   (seconds: search {t_search / seeds:.2f} per plan, exhaustive "
            f"{t_all / seeds:.2f} per grid) | | | | | | | |"
        )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds, smaller traces")
    args = parser.parse_args()
    one_level()
    simulator(500 if args.quick else 5000)
    if args.quick:
        search_vs_exhaustive(3, {"traces": 2, "failures_per_trace": 300}, 7)
    else:
        search_vs_exhaustive(10, {"traces": 2, "failures_per_trace": 300}, 7)
        search_vs_exhaustive(5, {"traces": 4, "failures_per_trace": 500}, 13)


if __name__ == "__main__":
    main()
