"""``cryosnap plan``: per-level checkpoint intervals from save costs and failure rates.

Parses the ``NAME=VALUE`` options into :mod:`cryosnap.plan`'s inputs, prints its plan beside
the baselines and draws the waste curves (matplotlib, when ``--plot`` is given). Pure but for
the plot file; runs on the caller's thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cryosnap.cli._common import CliUsageError, check_image_out
from cryosnap.cli._render import Column, Table, note, print_json, print_line
from cryosnap.plan import FailureClass, LevelCost, Plan, Simulation, Weibull, plan, waste_profile

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def cmd_plan(
    costs: list[str],
    mtbfs: list[str],
    restarts: list[str],
    weibulls: list[str],
    *,
    method: str = "auto",
    seed: int = 0,
    plot: str | None = None,
    as_json: bool = False,
) -> None:
    """Print the recommended interval per level and the expected waste against the baselines;
    with ``plot``, also draw the waste against each level's interval."""
    if method not in ("auto", "analytic", "search"):
        raise CliUsageError(f"--method must be auto, analytic or search, got {method!r}")
    if plot:
        check_image_out(plot)
    try:
        levels, failures = _plan_inputs(costs, mtbfs, restarts, weibulls)
        chosen: Any = method  # checked above: one of plan()'s methods
        result = plan(levels, failures, method=chosen, simulation=Simulation(seed=seed))
    except (TypeError, ValueError) as exc:
        raise CliUsageError(str(exc)) from None
    written = _plan_plot(levels, failures, result, plot) if plot else None
    if as_json:
        doc = result.to_dict()
        for entry, level in zip(doc["levels"], levels, strict=True):
            entry.update(save_seconds=level.save_seconds, restart_seconds=level.restart_seconds)
        doc["plot"] = written
        print_json(doc)
        return
    _plan_render(levels, result)


# ---------------------------------------------------------------------------------------------
# the options


def _plan_seconds(text: str, option: str, item: str, *, allow_zero: bool = False) -> float:
    """``"90"``, ``"1.5h"``, ``"7d"`` as seconds; a usage error naming the option otherwise."""
    body, scale = text.strip(), 1.0
    if body[-1:].lower() in _UNITS:
        body, scale = body[:-1], _UNITS[body[-1].lower()]
    try:
        value = float(body) * scale
    except ValueError:
        value = float("nan")
    if not (np.isfinite(value) and (value > 0 or (allow_zero and value == 0))):
        allowed = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
        raise CliUsageError(f"{option} {item}: {text!r} is not {allowed} (units s, m, h, d)")
    return value


def _plan_pairs(values: list[str], option: str, shape: str) -> list[tuple[str, str]]:
    """``NAME=VALUE`` items in order; a repeated NAME or a missing ``=`` is a usage error."""
    out: list[tuple[str, str]] = []
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise CliUsageError(f"{option} expects {shape}, got {item!r}")
        if any(name.strip() == seen for seen, _ in out):
            raise CliUsageError(f"{option} {name.strip()} is given twice")
        out.append((name.strip(), value.strip()))
    return out


def _plan_inputs(
    costs: list[str], mtbfs: list[str], restarts: list[str], weibulls: list[str]
) -> tuple[list[LevelCost], list[FailureClass]]:
    if not costs:
        raise CliUsageError("give at least one --cost LEVEL=SECONDS (fastest level first)")
    if not mtbfs:
        raise CliUsageError("give at least one --mtbf CLASS=SECONDS:LEVEL")
    save = {
        n: _plan_seconds(v, "--cost", n) for n, v in _plan_pairs(costs, "--cost", "LEVEL=SECONDS")
    }
    restart = {
        n: _plan_seconds(v, "--restart", n, allow_zero=True)
        for n, v in _plan_pairs(restarts, "--restart", "LEVEL=SECONDS")
    }
    _plan_known(restart, save, "--restart", "level")
    levels = [LevelCost(n, s, restart.get(n, s)) for n, s in save.items()]
    shapes = _plan_shapes(weibulls)
    failures = []
    for name, value in _plan_pairs(mtbfs, "--mtbf", "CLASS=SECONDS:LEVEL"):
        seconds, sep, level = value.rpartition(":")
        if not sep or not seconds or not level:
            raise CliUsageError(f"--mtbf expects CLASS=SECONDS:LEVEL, got {name}={value!r}")
        _plan_known({level: None}, save, f"--mtbf {name}", "level")
        mean = _plan_seconds(seconds, "--mtbf", name)
        if name in shapes:
            failures.append(FailureClass(name, mean, level, Weibull(shapes[name])))
        else:
            failures.append(FailureClass(name, mean, level))
    _plan_known(shapes, {f.name: None for f in failures}, "--weibull", "failure class")
    missing = [n for n in save if n not in restart]
    if missing:
        note(f"no --restart for {', '.join(missing)}: using the save cost as the restart cost")
    return levels, failures


def _plan_shapes(weibulls: list[str]) -> dict[str, float]:
    shapes: dict[str, float] = {}
    for name, value in _plan_pairs(weibulls, "--weibull", "CLASS=SHAPE"):
        try:
            shapes[name] = float(value)
        except ValueError:
            raise CliUsageError(f"--weibull {name}: {value!r} is not a number") from None
        if not (np.isfinite(shapes[name]) and shapes[name] > 0):
            raise CliUsageError(f"--weibull {name}: the shape must be a positive number")
    return shapes


def _plan_known(given: dict[str, Any], known: dict[str, Any], option: str, what: str) -> None:
    for name in given:
        if name not in known:
            raise CliUsageError(
                f"{option}: unknown {what} {name!r} (known: {', '.join(known) or 'none'})"
            )


# ---------------------------------------------------------------------------------------------
# the output


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.3g} s"
    parts = [(86400, "d"), (3600, "h"), (60, "m"), (1, "s")]
    whole = round(seconds)
    out: list[str] = []
    for size, unit in parts:
        if whole >= size or out:
            out.append(f"{whole // size}{unit}")
            whole %= size
        if len(out) == 2:
            break
    return " ".join(p for p in out if not p.startswith("0") or p == out[0])


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _plan_render(levels: list[LevelCost], result: Plan) -> None:
    table = Table(
        [
            Column("level"),
            Column("takes"),
            Column("interval", right=True),
            Column("save", right=True),
            Column("restart", right=True),
        ]
    )
    below = None
    for level, lv in zip(levels, result.levels, strict=True):
        if below is None:
            takes = "every version"
        elif lv.every == 1:
            takes = f"every {below} version"
        else:
            takes = f"every {_ordinal(lv.every)} {below} version"
        table.add(
            lv.name,
            takes,
            _duration(lv.interval_seconds),
            _duration(level.save_seconds),
            _duration(level.restart_seconds),
        )
        below = lv.name
    table.render()
    model = "first-order model" if result.waste_model == "first-order" else "simulated"
    print_line()
    print_line(f"expected waste: {result.expected_waste:.2%} ({result.method}; {model})")
    print_line(
        f"every version to every level: {result.every_version_waste:.2%} "
        f"(a version every {_duration(result.every_version_interval_seconds)})"
    )
    print_line(
        f"{result.levels[-1].name} alone at Young/Daly's interval: {result.young_daly_waste:.2%} "
        f"(every {_duration(result.young_daly_interval_seconds)})"
    )


def _plan_plot(
    levels: list[LevelCost], failures: list[FailureClass], result: Plan, out: str
) -> str | None:
    """Draw the waste curves to ``out``; without matplotlib, say so and draw nothing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        note("--plot needs matplotlib (pip install matplotlib); no plot written")
        return None
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.subplots()
    for j, curve in enumerate(waste_profile(levels, failures, result)):
        (line,) = ax.plot(
            curve.interval_seconds, [100 * w for w in curve.waste], marker=".", label=curve.level
        )
        planned = result.levels[j].interval_seconds
        nearest = int(np.argmin([abs(np.log(x / planned)) for x in curve.interval_seconds]))
        ax.plot([planned], [100 * curve.waste[nearest]], "o", color=line.get_color(), ms=9)
    ax.axhline(
        100 * result.every_version_waste, ls="--", c="grey", label="every version, every level"
    )
    ax.axhline(
        100 * result.young_daly_waste, ls=":", c="black", label="Young/Daly, last level only"
    )
    ax.set_xscale("log")
    ax.set_xlabel("interval of the level (compute seconds between its versions)")
    ax.set_ylabel("expected waste (%)")
    model = "first-order model" if result.waste_model == "first-order" else "simulated"
    ax.set_title(f"cryosnap plan ({model}); circles: the plan")
    ax.legend()
    try:
        fig.savefig(out)
    except (OSError, ValueError) as exc:
        raise CliUsageError(f"--plot {out}: cannot write the plot: {exc}") from None
    return out
