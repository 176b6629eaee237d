"""What the commands share: the exit codes, the usage error a command raises itself, opening
the run a command names, and checking an output file before any time is spent.

Runs on the caller's thread; opening a run only lists it (:class:`cryosnap.Run`).
"""

from __future__ import annotations

import os

from cryosnap.cli._render import note
from cryosnap.errors import CheckpointFormatError, CheckpointNotFoundError, IntegrityError
from cryosnap.run import Run

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


class CliUsageError(Exception):
    """A usage error found by a command itself (an empty PATH; export's bad OUT, a leaf the
    format cannot hold). Never leaves the command line: it becomes exit 2 and one line."""


def open_run(location: str) -> Run:
    if not location:
        raise CliUsageError("PATH must not be empty")
    return Run(location)


def committed(run: Run) -> list[int]:
    """The run's committed steps; a run without any is an error (nothing to show)."""
    steps = run.steps()
    if not steps:
        raise CheckpointNotFoundError(f"no committed version in {run.url}")
    return steps


def newest_intact(run: Run) -> int:
    """The newest committed step whose commit record reads, as :func:`cryosnap.load` falls
    back past a damaged one; each damaged one skipped is named on stderr. When none reads,
    the newest (the command then fails on it, naming the damage)."""
    steps = committed(run)
    skipped = False
    for step in reversed(steps):
        try:
            run.summary(step)
        except CheckpointNotFoundError:
            continue  # retired by the run's writer since the listing
        except (CheckpointFormatError, IntegrityError) as exc:
            note(f"skipping damaged step {step} in {run.url}: {exc}")
            skipped = True
            continue
        if skipped:
            note(f"using step {step}, the newest version whose commit record reads")
        return step
    return steps[-1]


def check_image_out(out: str, option: str = "--plot") -> None:
    """Refuse a plot that could not be written before spending time computing it."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise CliUsageError(f"{option} {out}: no such directory {folder}")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # the command says so once its figures are printed
    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if ext not in kinds:
        raise CliUsageError(
            f"{option} {out}: unknown image format {ext!r} (use one of: {', '.join(sorted(kinds))})"
        )
