"""``cryosnap log``: per version, its step and marks; with ``--leaf``, that leaf's statistics
recorded at save and the fraction of its chunks changed since the version before; with
``--plot``, the leaf's norm and changed fraction over the steps (matplotlib); first the run's
lineage (where it was forked from, and the forks that read its files).

Runs on the caller's thread, over :meth:`cryosnap.Run.marks`, :meth:`~cryosnap.Run.stats` and
:meth:`~cryosnap.Run.diff` (chunk hashes from the manifests; a small tensor packed with others
is read only where its pack's chunk differs); takes no lock.
"""

from __future__ import annotations

import itertools
from typing import Any

from cryosnap.cli._common import CliUsageError, check_image_out, committed, open_run
from cryosnap.cli._fork import lineage_doc, print_lineage
from cryosnap.cli._render import Column, Table, iso_time, print_json, print_line
from cryosnap.errors import CheckpointNotFoundError, StatsNotRecordedError
from cryosnap.run import Run


def cmd_log(location: str, *, leaf: str | None, as_json: bool, plot: str | None) -> None:
    """One row per version, oldest first."""
    if plot is not None:
        if leaf is None:
            raise CliUsageError("--plot draws one leaf: give --leaf PATH")
        check_image_out(plot)
    run = open_run(location)
    rows = _rows(run, leaf)
    if leaf is not None and not any(r["stats"] or r["changed_fraction"] is not None for r in rows):
        raise CliUsageError(f"--leaf {leaf}: no version of {run.url} holds that leaf")
    lineage = run.lineage()
    if as_json:
        print_json({"path": run.url, "leaf": leaf, **lineage_doc(lineage), "versions": rows})
    else:
        print_lineage(run, lineage, forks=True)
        _table(rows, leaf)
    if plot is not None and leaf is not None:
        written = _plot(rows, leaf, plot)
        if written is not None and not as_json:
            print_line(f"plot written to {written}")


def _rows(run: Run, leaf: str | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    before: int | None = None
    for step in committed(run):
        try:
            marks = sorted(run.marks(step))
            created = iso_time(run.summary(step).created_unix)
        except CheckpointNotFoundError:
            continue  # removed by retention while we were listing
        row: dict[str, Any] = {"step": step, "created": created, "marks": marks}
        if leaf is not None:
            row["stats"] = _leaf_stats(run, step, leaf)
            row["changed_fraction"] = _changed(run, before, step, leaf)
        rows.append(row)
        before = step
    return rows


def _leaf_stats(run: Run, step: int, leaf: str) -> dict[str, Any] | None:
    try:
        stats = run.stats(step).get(leaf)
    except StatsNotRecordedError:
        return None
    return None if stats is None else stats.to_json()


def _changed(run: Run, before: int | None, step: int, leaf: str) -> float | None:
    """The fraction of ``leaf``'s chunks that differ from version ``before`` (1.0: new or
    reshaped; None: ``step`` does not hold it)."""
    if leaf not in {info.path for info in run.info(step).leaves}:
        return None
    if before is None:
        return 1.0
    row = next((r for r in run.diff(before, step).leaves if r.path == leaf), None)
    if row is None:
        return 0.0
    if row.changed_chunks is not None and row.chunks:
        return row.changed_chunks / row.chunks
    return 1.0 if row.status == "added" or row.changed_bytes else 0.0


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _table(rows: list[dict[str, Any]], leaf: str | None) -> None:
    columns = [Column("step", right=True), Column("created"), Column("marks")]
    if leaf is not None:
        names = ("nan", "inf", "min", "max", "mean", "norm")
        columns += [Column(n, right=True) for n in names] + [Column("changed", right=True)]
    table = Table(columns)
    for r in rows:
        cells = [str(r["step"]), r["created"], ",".join(r["marks"]) or "-"]
        if leaf is not None:
            s = r["stats"]
            if s is None:
                cells += ["-"] * 6
            else:
                cells += [str(s["nan"]), str(s["inf"])]
                cells += [_num(s[k]) for k in ("min", "max", "mean", "norm")]
            frac = r["changed_fraction"]
            cells.append("-" if frac is None else f"{100 * frac:.1f}%")
        table.add(*cells)
    table.render()


def _plot(rows: list[dict[str, Any]], leaf: str, out: str) -> str | None:
    """The leaf's norm and changed fraction over the steps, to ``out``; without matplotlib,
    one line says so and nothing is drawn."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CliUsageError("--plot needs matplotlib (pip install matplotlib)") from None
    normed = [(r["step"], r["stats"]["norm"]) for r in rows if r["stats"]]
    changed = [
        (r["step"], r["changed_fraction"]) for r in rows if r["changed_fraction"] is not None
    ]
    unhealthy = [r["step"] for r in rows if "unhealthy" in r["marks"]]
    fig = Figure(figsize=(7.5, 5.0), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    if normed:
        top.plot(*zip(*normed, strict=True), marker=".", label="L2 norm")
    for step in unhealthy:
        top.axvline(step, color="red", alpha=0.3, lw=3)
    for r in rows:  # the user's marks, named where they are
        labels = [m for m in r["marks"] if m != "unhealthy"]
        if labels:
            top.axvline(r["step"], color="green", ls="--", lw=1)
            top.annotate(
                ",".join(labels),
                (r["step"], 1.0),
                xycoords=("data", "axes fraction"),
                ha="left",
                va="top",
                fontsize=8,
                color="green",
            )
    top.set_ylabel("L2 norm")
    top.set_title(f"{leaf}: norm of the finite elements; chunks changed (red: unhealthy)")
    if changed:
        steps, fractions = zip(*changed, strict=True)
        bottom.bar(steps, [100 * f for f in fractions], width=0.8 * _spacing(steps))
    bottom.set_ylim(0, 105)
    bottom.set_ylabel("changed since previous (%)")
    bottom.set_xlabel("step")
    try:
        fig.savefig(out)
    except (OSError, ValueError) as exc:
        raise CliUsageError(f"--plot {out}: cannot write the plot: {exc}") from None
    return out


def _spacing(steps: tuple[int, ...]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    return float(min(gaps)) if gaps else 1.0
