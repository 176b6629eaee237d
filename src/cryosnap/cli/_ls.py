"""``cryosnap ls``: one row per committed version, from the commit records, with the bytes of
data files each keeps alive: written by it, read from earlier versions, and pinned (read from
versions that are gone); and its marks (mark records, and "unhealthy" from the manifests'
statistics); and where the run was forked from.

Runs on the caller's thread, over :meth:`cryosnap.Run.summary`; takes no lock.
"""

from __future__ import annotations

from typing import Any

from cryosnap.cli._common import committed, open_run
from cryosnap.cli._fork import lineage_doc, print_lineage
from cryosnap.cli._render import Column, Table, iso_time, one_line, print_json
from cryosnap.errors import CheckpointFormatError, CheckpointNotFoundError, IntegrityError
from cryosnap.progress import human_bytes
from cryosnap.run import Run, VersionSpace, VersionSummary


def cmd_ls(location: str, *, as_json: bool) -> None:
    """One row per committed version; a damaged commit record is a row, not an abort."""
    run = open_run(location)
    versions = _versions(run)
    lineage = run.lineage()
    if as_json:
        print_json({"path": run.url, **lineage_doc(lineage), "versions": versions})
        return
    print_lineage(run, lineage, forks=False)
    table = Table(
        [
            Column("step", right=True),
            Column("created"),
            Column("world", right=True),
            Column("leaves", right=True),
            Column("logical", right=True),
            Column("written", right=True),
            Column("files", right=True),
            Column("owns", right=True),
            Column("reads", right=True),
            Column("pins", right=True),
        ]
    )
    # A marks column only where a version has one: the table of an unmarked run fits as before.
    marked = any(v.get("marks") for v in versions)
    if marked:
        table.columns.append(Column("marks"))
    for v in versions:
        if v["damaged"]:
            table.add(str(v["step"]), f"DAMAGED: {v['error']}")
            continue
        table.add(
            str(v["step"]),
            v["created"],
            str(v["world_size"]),
            str(v["leaves"]),
            human_bytes(v["logical_bytes"]),
            human_bytes(v["written_bytes"]),
            str(v["data_files"]),
            human_bytes(v["owned_bytes"]),
            human_bytes(v["referenced_bytes"]),
            human_bytes(v["pinned_bytes"]),
            *([",".join(v["marks"]) or "-"] if marked else []),
        )
    table.render()


def _versions(run: Run) -> list[dict[str, Any]]:
    versions: list[dict[str, Any]] = []
    steps = committed(run)
    # A damaged commit record has no figures (its row says DAMAGED); the others keep theirs.
    space = {s.step: s for s in run.space()}
    for step in steps:
        try:
            summary = run.summary(step)
        except CheckpointNotFoundError:
            continue  # removed by retention while we were listing
        except (CheckpointFormatError, IntegrityError) as exc:
            versions.append({"step": step, "damaged": True, "error": one_line(str(exc))})
            continue
        try:
            marks = sorted(run.marks(step))
        except CheckpointNotFoundError:
            continue
        except (CheckpointFormatError, IntegrityError):
            marks = []  # a damaged manifest: verify says so; the record's figures still show
        versions.append({**_version_doc(summary, space.get(step)), "marks": marks})
    return versions


def _version_doc(summary: VersionSummary, space: VersionSpace | None) -> dict[str, Any]:
    return {
        "step": summary.step,
        "damaged": False,
        "created": iso_time(summary.created_unix),
        "created_unix": summary.created_unix,
        "world_size": summary.world_size,
        "leaves": summary.leaves,
        "logical_bytes": summary.logical_bytes,
        "written_bytes": summary.written_bytes,
        "data_files": summary.data_files,
        "chunk_bytes": summary.chunk_bytes,
        "owned_bytes": space.owned_bytes if space else 0,
        "referenced_bytes": space.referenced_bytes if space else 0,
        "pinned_bytes": space.pinned_bytes if space else 0,
    }
