"""``cryosnap plan``: per-level checkpoint intervals from save costs and failure rates.

Parses the ``NAME=VALUE`` options into :mod:`cryosnap.plan`'s inputs, or the job's shape and
the machine's rates into a predicted save (:func:`cryosnap.plan.predict`, whose level costs
then feed the plan), prints the plan beside the baselines and draws the waste curves
(matplotlib, when ``--plot`` is given). Pure but for the plot file; runs on the caller's thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from cryosnap.bench import measure_rates
from cryosnap.cli._common import CliUsageError, check_image_out
from cryosnap.cli._render import Column, Table, note, print_json, print_line
from cryosnap.plan import (
    CostPrediction,
    FailureClass,
    JobShape,
    LevelCost,
    Machine,
    Plan,
    Simulation,
    Weibull,
    parse_bytes,
    parse_rate,
    parse_seconds,
    plan,
    predict,
    waste_profile,
)
from cryosnap.progress import human_bytes

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class JobArgs:
    """The job's shape as given on the command line (None: not given)."""

    ranks: int | None = None
    ranks_per_node: int | None = None
    state_bytes: str | None = None
    replicated_bytes: str | None = None
    scratch: bool = True
    partner: str | None = None

    def given(self) -> bool:
        return any(getattr(self, f) is not None for f in ("ranks", "ranks_per_node", "state_bytes"))


@dataclass(frozen=True)
class RateArgs:
    """The machine's rates as given on the command line (None: not given)."""

    memcpy_bandwidth: str | None = None
    hash_bandwidth: str | None = None
    local_bandwidth: str | None = None
    pfs_bandwidth: str | None = None
    node_bandwidth: str | None = None
    latency: str | None = None
    cores_per_node: int | None = None
    local_read_bandwidth: str | None = None
    measure: str | None = None

    def given(self) -> list[str]:
        return [
            "--" + f.name.replace("_", "-")
            for f in fields(self)
            if getattr(self, f.name) is not None
        ]


def cmd_plan(
    costs: list[str],
    mtbfs: list[str],
    restarts: list[str],
    weibulls: list[str],
    *,
    job: JobArgs | None = None,
    rates: RateArgs | None = None,
    method: str = "auto",
    seed: int = 0,
    plot: str | None = None,
    as_json: bool = False,
) -> None:
    """Print the recommended interval per level and the expected waste against the baselines;
    with ``plot``, also draw the waste against each level's interval. With the job's shape
    (``job``, ``rates``), first the predicted stall and time to durable per level, whose
    costs feed the plan (no ``mtbfs``: the prediction alone)."""
    if method not in ("auto", "analytic", "search"):
        raise CliUsageError(f"--method must be auto, analytic or search, got {method!r}")
    if plot:
        check_image_out(plot)
    predicted = _plan_prediction(costs, job or JobArgs(), rates or RateArgs())
    prediction, direct = predicted if predicted is not None else (None, None)
    if prediction is not None and not mtbfs:
        if plot:
            raise CliUsageError("--plot needs --mtbf: without failures there is no plan to draw")
        if restarts or weibulls:
            raise CliUsageError("--restart and --weibull need --mtbf")
        _print_prediction(prediction, None, None, as_json=as_json)
        return
    try:
        given = prediction.level_costs() if prediction is not None else None
        levels, failures = _plan_inputs(costs, mtbfs, restarts, weibulls, levels=given)
        chosen: Any = method  # checked above: one of plan()'s methods
        result = plan(levels, failures, method=chosen, simulation=Simulation(seed=seed))
    except (TypeError, ValueError) as exc:
        raise CliUsageError(str(exc)) from None
    written = _plan_plot(levels, failures, result, plot) if plot else None
    if prediction is not None:
        other = _without_scratch(direct, failures, method, seed) if direct else None
        _print_prediction(prediction, levels, result, as_json=as_json, plot=written, other=other)
        return
    if as_json:
        print_json(_plan_doc(levels, result, written))
        return
    _plan_render(levels, result)


def _plan_doc(levels: list[LevelCost], result: Plan, written: str | None) -> dict[str, Any]:
    doc = result.to_dict()
    for entry, level in zip(doc["levels"], levels, strict=True):
        entry.update(save_seconds=level.save_seconds, restart_seconds=level.restart_seconds)
    doc["plot"] = written
    return doc


# ---------------------------------------------------------------------------------------------
# the job's shape


Alternative = tuple[CostPrediction, list[LevelCost], Plan]


def _plan_prediction(
    costs: list[str], job: JobArgs, rates: RateArgs
) -> tuple[CostPrediction, CostPrediction | None] | None:
    """The predicted save of the job's shape and, with scratch, the same save straight to the
    shared level (the alternative the plan is compared with); None when no shape is given
    (``--cost``)."""
    if not job.given():
        rated = rates.given() + (["--replicated-bytes"] if job.replicated_bytes else [])
        rated += (["--no-scratch"] if not job.scratch else []) + (
            ["--partner"] if job.partner is not None else []
        )
        if rated:
            raise CliUsageError(
                f"{rated[0]} describes a job's shape: give --ranks, --ranks-per-node and "
                "--state-bytes with it"
            )
        return None
    if costs:
        raise CliUsageError(
            "give either --cost (each level's save cost) or the job's shape (--ranks ...), "
            "not both: with the shape, the costs are predicted"
        )
    if rates.measure is not None:
        rates = _measured(rates)
    missing = [
        o
        for o, v in (
            ("--ranks", job.ranks),
            ("--ranks-per-node", job.ranks_per_node),
            ("--state-bytes", job.state_bytes),
            ("--memcpy-bandwidth", rates.memcpy_bandwidth),
            ("--hash-bandwidth", rates.hash_bandwidth),
            ("--local-bandwidth", rates.local_bandwidth if job.scratch else "-"),
            ("--pfs-bandwidth", rates.pfs_bandwidth),
        )
        if v is None
    ]
    if missing:
        raise CliUsageError(f"the job's shape needs {', '.join(missing)} as well")
    assert job.ranks is not None and job.ranks_per_node is not None and job.state_bytes
    if job.ranks_per_node > job.ranks:
        raise CliUsageError(
            f"--ranks-per-node {job.ranks_per_node} is more than --ranks {job.ranks}"
        )
    shape = JobShape(
        job.ranks,
        job.ranks_per_node,
        _size(job.state_bytes, "--state-bytes"),
        _size(job.replicated_bytes or "0", "--replicated-bytes"),
    )
    if rates.latency is None:
        note("no --latency: the commit's collectives are taken to cost nothing")
    machine = Machine(
        _rate(rates.memcpy_bandwidth, "--memcpy-bandwidth"),
        _rate(rates.hash_bandwidth, "--hash-bandwidth"),
        _rate(rates.local_bandwidth or rates.pfs_bandwidth, "--local-bandwidth"),
        _rate(rates.pfs_bandwidth, "--pfs-bandwidth"),
        _rate(rates.node_bandwidth, "--node-bandwidth") if rates.node_bandwidth else math.inf,
        _duration(rates.latency or "0", "--latency"),
        cores_per_node=rates.cores_per_node,
        local_read_bytes_per_second=(
            _rate(rates.local_read_bandwidth, "--local-read-bandwidth")
            if rates.local_read_bandwidth
            else None
        ),
    )
    try:
        chosen = predict(shape, machine, scratch=job.scratch, partner=_partner(job.partner))
    except (TypeError, ValueError) as exc:
        raise CliUsageError(str(exc)) from None
    return chosen, predict(shape, machine, scratch=False) if job.scratch else None


def _measured(rates: RateArgs) -> RateArgs:
    """``rates`` with the ones not given measured on this machine (``--measure DIR``): the
    capture copy, the hashing, and the disk under DIR for both the scratch and the shared level
    (one machine's figure: give --pfs-bandwidth for a shared file system elsewhere)."""
    assert rates.measure is not None
    got = measure_rates(rates.measure)
    found = {
        "memcpy_bandwidth": got.memcpy_bytes_per_second,
        "hash_bandwidth": got.hash_bytes_per_second,
        "local_bandwidth": got.write_bytes_per_second,
        "local_read_bandwidth": got.read_bytes_per_second,
        "pfs_bandwidth": got.write_bytes_per_second,
    }
    used: dict[str, Any] = {
        k: f"{v / 1e6:.0f}MB/s" for k, v in found.items() if getattr(rates, k) is None
    }
    if used:
        told = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in used.items())
        note(f"measured at {got.folder}: {told}")
    return replace(rates, **used)


def _without_scratch(
    direct: CostPrediction, failures: list[FailureClass], method: str, seed: int
) -> Alternative:
    """The plan of the save straight to the shared level: every failure is then survived by
    the shared level alone."""
    (persistent,) = direct.level_costs()
    moved = [
        FailureClass(f.name, f.mtbf_seconds, persistent.name, f.distribution) for f in failures
    ]
    chosen: Any = method
    return (
        direct,
        [persistent],
        plan([persistent], moved, method=chosen, simulation=Simulation(seed=seed)),
    )


def _size(text: str, option: str) -> int:
    value = parse_bytes(text)
    if value is None:
        raise CliUsageError(f"{option}: {text!r} is not a size (e.g. 4GiB, 300MB, 1048576)")
    return value


def _rate(text: str | None, option: str) -> float:
    value = parse_rate(text or "")
    if value is None or not (math.isfinite(value) and value > 0):
        raise CliUsageError(f"{option}: {text!r} is not a positive rate (e.g. 2GB/s, 800MiB/s)")
    return value


def _duration(text: str, option: str) -> float:
    value = parse_seconds(text)
    if value is None or not math.isfinite(value):
        raise CliUsageError(f"{option}: {text!r} is not a duration (e.g. 5us, 2ms, 0.1s)")
    return value


def _partner(text: str | None) -> bool | str:
    if text is None:
        return False
    if text == "copy":
        return True
    if text == "xor" or text.startswith("rs:"):
        return text
    raise CliUsageError(f"--partner must be copy, xor or rs:K+M, got {text!r}")


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
    costs: list[str],
    mtbfs: list[str],
    restarts: list[str],
    weibulls: list[str],
    *,
    levels: list[LevelCost] | None = None,
) -> tuple[list[LevelCost], list[FailureClass]]:
    """The planner's levels (from ``--cost`` and ``--restart``, or ``levels`` predicted, whose
    restart costs ``--restart`` may replace) and failure classes."""
    if not costs and levels is None:
        raise CliUsageError(
            "give at least one --cost LEVEL=SECONDS (fastest level first), or the job's shape "
            "(--ranks, --ranks-per-node, --state-bytes and the rates)"
        )
    if not mtbfs:
        raise CliUsageError("give at least one --mtbf CLASS=SECONDS:LEVEL")
    if levels is None:
        save = {
            n: _plan_seconds(v, "--cost", n)
            for n, v in _plan_pairs(costs, "--cost", "LEVEL=SECONDS")
        }
    else:
        save = {level.name: level.save_seconds for level in levels}
    restart = {
        n: _plan_seconds(v, "--restart", n, allow_zero=True)
        for n, v in _plan_pairs(restarts, "--restart", "LEVEL=SECONDS")
    }
    _plan_known(restart, save, "--restart", "level")
    if levels is None:
        levels = [LevelCost(n, s, restart.get(n, s)) for n, s in save.items()]
    else:
        levels = [
            LevelCost(lv.name, lv.save_seconds, restart.get(lv.name, lv.restart_seconds))
            for lv in levels
        ]
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
    if missing and costs:
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


def _human_duration(seconds: float) -> str:
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
            _human_duration(lv.interval_seconds),
            _human_duration(level.save_seconds),
            _human_duration(level.restart_seconds),
        )
        below = lv.name
    table.render()
    model = "first-order model" if result.waste_model == "first-order" else "simulated"
    print_line()
    print_line(f"expected waste: {result.expected_waste:.2%} ({result.method}; {model})")
    print_line(
        f"every version to every level: {result.every_version_waste:.2%} "
        f"(a version every {_human_duration(result.every_version_interval_seconds)})"
    )
    print_line(
        f"{result.levels[-1].name} alone at Young/Daly's interval: {result.young_daly_waste:.2%} "
        f"(every {_human_duration(result.young_daly_interval_seconds)})"
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


def _print_prediction(
    prediction: CostPrediction,
    levels: list[LevelCost] | None,
    result: Plan | None,
    *,
    as_json: bool,
    plot: str | None = None,
    other: Alternative | None = None,
) -> None:
    if as_json:
        doc: dict[str, Any] = {"prediction": prediction.to_dict(), "plan": None}
        if levels is not None and result is not None:
            doc["plan"] = _plan_doc(levels, result, plot)
        if other is not None:
            doc["without_scratch"] = {
                "prediction": other[0].to_dict(),
                "plan": _plan_doc(other[1], other[2], None),
            }
        print_json(doc)
        return
    shape = prediction.shape
    print_line(
        f"{shape.ranks} ranks on {shape.nodes} nodes ({shape.ranks_per_node} per node); per "
        f"rank {human_bytes(shape.state_bytes)} of its own and "
        f"{human_bytes(shape.replicated_bytes)} replicated"
    )
    print_line(
        f"stall: {_seconds(prediction.stall_seconds)} "
        f"(copies {human_bytes(prediction.captured_bytes_per_rank)} per rank)"
    )
    table = Table(
        [
            Column("level"),
            Column("durable after", right=True),
            Column("its own part", right=True),
            Column("written per rank", right=True),
            Column("restart", right=True),
            Column("collectives", right=True),
        ]
    )
    for lv in prediction.levels:
        table.add(
            lv.name,
            _seconds(lv.durable_seconds),
            _seconds(lv.seconds),
            human_bytes(lv.written_bytes_per_rank),
            _seconds(lv.restart_seconds),
            str(lv.collectives),
        )
    table.render()
    if levels is not None and result is not None:
        print_line()
        _plan_render(levels, result)
    if other is not None and result is not None:
        _render_alternative(other, result)


def _render_alternative(other: Alternative, result: Plan) -> None:
    direct, _, alone = other
    persistent = direct.levels[0]
    print_line(
        f"without scratch (--no-scratch): stall {_seconds(direct.stall_seconds)}, durable "
        f"after {_seconds(persistent.durable_seconds)}; expected waste "
        f"{alone.expected_waste:.2%} (a version every "
        f"{_human_duration(alone.base_interval_seconds)})"
    )
    better = alone.expected_waste < result.expected_waste
    print_line(
        "recommended: "
        + ("without scratch (the lower expected waste)" if better else "the levels above")
    )


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else _human_duration(value)
