"""``cryosnap bench``: cryosnap against its peers on this machine, rendered as a table, with
``--json`` (every sample to a file) and ``--plot``.

:mod:`cryosnap.bench` does the measuring; this module checks the arguments before any time is
spent, shows progress on stderr and renders. Runs on the caller's thread.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from cryosnap.cli._common import CliUsageError, check_image_out
from cryosnap.cli._render import PROG, Column, Table, print_line, truncate
from cryosnap.progress import human_bytes


def cmd_bench(
    *,
    size: str | None = None,
    workload: str = "dense",
    repeat: int = 3,
    warmup: int = 1,
    json_file: str | None = None,
    plot: str | None = None,
    directory: str | None = None,
    tensors: int = 20_000,
    steps: int = 20,
    step_seconds: float = 1.0,
    cold: bool = True,
    wide: bool = False,
    ranks: str | None = None,
    command: str = PROG + " bench",
) -> None:
    """Run :func:`cryosnap.bench.run`, print the table, write ``--json`` and ``--plot``
    (``command``: the command line, recorded in the JSON; ``wide``: every column, the table
    is otherwise within 100 columns).

    Every argument is checked before anything is measured: a bad one costs no benchmark time.
    """
    from cryosnap import bench

    if workload == "scale":
        asked = {"--size": size is not None, "--plot": plot is not None, "--wide": wide}
        extra = [name for name, given in asked.items() if given]
        if extra:
            raise CliUsageError(f"{', '.join(extra)}: does not apply to --workload scale")
        _bench_scale(ranks, json_file, directory)
        return
    if ranks is not None:
        raise CliUsageError("--ranks applies to --workload scale only")
    if json_file == "-":
        raise CliUsageError("--json needs a FILE except with --workload scale")
    try:
        config = bench.BenchConfig(
            workload=workload,
            size_bytes=None if size is None else bench.parse_size(size),
            repeat=repeat,
            warmup=warmup,
            directory=None if directory is None else Path(directory),
            tensors=tensors,
            steps=steps,
            step_seconds=step_seconds,
            cold=cold,
        )
        bench.require_torch()
        if plot:
            bench.check_plot_available()
            check_image_out(plot)
    except (bench.BenchError, bench.MissingDependencyError) as exc:
        raise CliUsageError(str(exc)) from None
    if json_file:
        _check_out(json_file, "--json")
    show = _BenchProgress()
    try:
        result = bench.run(config, command=command, progress=show)
    finally:
        show.close()
    _render(result, wide=wide)
    if json_file:
        try:
            with open(json_file, "w") as f:
                json.dump(result.to_json(), f, indent=2)
                f.write("\n")
        except OSError as exc:
            raise CliUsageError(f"--json {json_file}: cannot write: {exc}") from None
        print_line(f"wrote {json_file}")
    if plot:
        try:
            bench.plot(result, plot)
        except (OSError, ValueError) as exc:
            raise CliUsageError(f"--plot {plot}: cannot write the plot: {exc}") from None
        print_line(f"wrote {plot}")


def _bench_scale(ranks: str | None, json_file: str | None, directory: str | None) -> None:
    """The scale workload: a table (and ``--json FILE``), or with a bare ``--json`` the JSON
    alone on stdout, ``{"scale": [figures per world size]}``."""
    from cryosnap import bench as _scale
    from cryosnap.errors import BenchError

    try:
        sizes = list(_scale.SCALE_RANKS) if ranks is None else _scale.parse_ranks(ranks)
    except BenchError as exc:
        raise CliUsageError(str(exc)) from None
    if directory is not None and not os.path.isdir(directory):
        raise CliUsageError(f"--dir {directory!r} is not an existing directory")
    if json_file not in (None, "-"):
        _check_out(json_file, "--json")
    figures = []
    for n in sizes:
        figures.append(
            _scale.measure_scale(
                n,
                directory=None if directory is None else Path(directory),
                progress=lambda what: print(f"{PROG} bench: {what}", file=sys.stderr, flush=True),
            )
        )
    doc = {"scale": [f.to_json() for f in figures]}
    if json_file == "-":
        print(json.dumps(doc, indent=2))
        return
    table = Table(
        [
            Column("ranks", right=True),
            Column("sent/rank", right=True),
            Column("received/rank", right=True),
            Column("received, but leader", right=True),
            Column("rounds", right=True),
            Column("leader CPU", right=True),
            Column("restore read/rank", right=True),
            Column("metadata/rank", right=True),
            Column("save", right=True),
        ]
    )
    for f in figures:
        table.add(
            str(f.ranks),
            human_bytes(f.max_sent_bytes_per_rank),
            human_bytes(f.max_received_bytes_per_rank),
            human_bytes(f.max_received_bytes_but_leader),
            str(f.rounds),
            f"{f.leader_seconds * 1e3:.1f} ms",
            human_bytes(f.restore_read_bytes_per_rank),
            human_bytes(f.metadata_bytes_per_rank),
            f"{f.save_seconds:.2f} s",
        )
    print_line(
        "per save, the largest figure of any rank (the leader, rank 0, receives O(N)); restore "
        "read and metadata: any rank but the leader; ranks simulated (cryosnap.testing)"
    )
    table.render()
    if json_file:
        try:
            with open(json_file, "w") as out:
                json.dump(doc, out, indent=2)
                out.write("\n")
        except OSError as exc:
            raise CliUsageError(f"--json {json_file}: cannot write: {exc}") from None
        print_line(f"wrote {json_file}")


def _render(result: Any, *, wide: bool = False) -> None:
    """The summary's first two lines, the table, then the rest of the summary."""
    summary = result.summary()
    for line in summary[:2]:
        print_line(line)
    print_line()
    tables = result.tables(wide=wide)
    for columns, rows in tables:
        table = Table([Column(title, right=right) for title, right in columns])
        for row in rows:
            table.add(*row)
        table.render()
        print_line()
    if len(tables) > 1:
        print_line("--wide: one table, peers by name, peak memory of the restores too")
    for line in summary[2:]:
        print_line(line)


def _check_out(out: str, option: str) -> None:
    """Refuse an output that could not be written before spending minutes measuring."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise CliUsageError(f"{option} {out}: no such directory {folder}")
    if os.path.isdir(out):
        raise CliUsageError(f"{option} {out}: is a directory")


class _BenchProgress:
    """Progress on stderr: one line redrawn in place on a terminal; elsewhere a line every
    30 seconds and one at the end (logs stay short)."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self._width = 0

    def __call__(self, step: Any) -> None:
        line = f"{PROG} bench: {step.done}/{step.total} {step.what} ({step.elapsed_seconds:.0f} s)"
        if self._tty:
            text = truncate(line, 120)
            sys.stderr.write("\r" + text.ljust(self._width))
            self._width = len(text)
        elif step.done == step.total or step.elapsed_seconds - self._last >= 30:
            self._last = step.elapsed_seconds
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._tty and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
