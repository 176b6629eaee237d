"""``cryosnap fork``: a new run whose first version is a version of another (sharing its data
files on one file system, copying only what the version reads elsewhere); and the lineage lines
``cryosnap ls`` and ``cryosnap log`` print (where a run was forked from, and its forks).

Runs on the caller's thread, over :meth:`cryosnap.Run.fork` and :meth:`cryosnap.Run.lineage`;
``fork`` takes the new run's write lock while it is made.
"""

from __future__ import annotations

import os
from typing import Any

from cryosnap.cli._common import CliUsageError, committed, open_run
from cryosnap.cli._render import print_json, print_line
from cryosnap.progress import human_bytes
from cryosnap.run import Run, RunLineage


def cmd_fork(location: str, dest: str, *, step: int | None, as_json: bool) -> None:
    """Fork version ``step`` (default: the newest) of the run at ``location`` into ``dest``."""
    if not dest:
        raise CliUsageError("DEST must not be empty")
    run = open_run(location)
    if step is None:
        step = committed(run)[-1]
    fork = run.fork(step, dest)
    summary = fork.summary(step)
    written = sum(s.owned_bytes for s in fork.space())
    shared = fork.lineage().ancestors != ()
    if as_json:
        print_json(
            {
                "path": run.url,
                "fork": fork.url,
                "step": step,
                "shared": shared,
                "logical_bytes": summary.logical_bytes,
                "data_bytes_written": written,
            }
        )
        return
    how = (
        "sharing its data files"
        if shared
        else f"copying {human_bytes(written)} of data it reads (another file system or store)"
    )
    print_line(
        f"forked step {step} of {run.url} ({human_bytes(summary.logical_bytes)}) into "
        f"{fork.url}, {how}"
    )


def lineage_doc(lineage: RunLineage) -> dict[str, Any]:
    """The lineage as JSON: where the run was forked from, its ancestors, its known forks."""
    return {
        "forked_from": None
        if lineage.parent is None
        else {"path": lineage.parent, "step": lineage.step},
        "ancestors": list(lineage.ancestors),
        "forks": [{"path": f, "from": p, "step": s} for f, p, s in lineage.forks],
    }


def print_lineage(run: Run, lineage: RunLineage, *, forks: bool) -> None:
    """One line for the parent and, with ``forks``, one per known fork (nothing for a run
    that was neither forked nor forked from)."""
    if lineage.parent is not None:
        print_line(f"{run.url}: forked from {lineage.parent} at step {lineage.step}")
        for ancestor in lineage.ancestors[1:]:
            print_line(f"  whose ancestor is {ancestor}")
    if forks:
        for fork, parent, step in lineage.forks:
            via = "" if parent == lineage_root(run) else f" (via {parent})"
            print_line(f"  fork: {fork} from step {step}{via}")


def lineage_root(run: Run) -> str:
    """The run's location as holds name it (a directory's real path)."""
    return os.path.realpath(run.url) if "://" not in run.url else run.url
