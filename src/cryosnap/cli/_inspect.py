"""``cryosnap inspect``: the leaves of one version (paths, dtypes, shapes, sizes), no data read.

Runs on the caller's thread, over :meth:`cryosnap.Run.info`; takes no lock.
"""

from __future__ import annotations

from cryosnap.cli._common import newest_intact, open_run
from cryosnap.cli._render import Column, Table, iso_time, plural, print_json, print_line, truncate
from cryosnap.progress import human_bytes
from cryosnap.run import VersionInfo


def cmd_inspect(location: str, *, step: int | None, rank: int, as_json: bool) -> None:
    """The leaves of one version (default: the newest whose commit record reads), read from
    its manifest."""
    run = open_run(location)
    if step is None:
        step = newest_intact(run)
    info = run.info(step, rank=rank)
    leaves = info.leaves
    totals = {
        "leaves": len(leaves),
        "blobs": info.blobs,
        "chunks": sum(leaf.chunks for leaf in leaves),
        "logical_bytes": info.rank_bytes,
    }
    if as_json:
        print_json(
            {
                "path": run.url,
                "step": step,
                "rank": rank,
                "world_size": info.world_size,
                "created": iso_time(info.created_unix),
                "chunk_bytes": info.chunk_bytes,
                "leaves": [leaf.to_json() for leaf in leaves],
                "totals": totals,
            }
        )
        return
    print_line(
        f"step {step} of {run.url}, rank {rank} of {info.world_size}, created "
        f"{iso_time(info.created_unix)}, chunks of {human_bytes(info.chunk_bytes)}"
    )
    _leaf_table(info).render()
    print_line(
        f"{plural(totals['leaves'], 'leaf', 'leaves')}, {plural(totals['blobs'], 'blob')}, "
        f"{plural(totals['chunks'], 'chunk')}, {human_bytes(totals['logical_bytes'])} stored"
    )


def _shape_text(shape: list[int] | None) -> str:
    return "" if shape is None else str(tuple(shape))


def _leaf_table(info: VersionInfo) -> Table:
    table = Table(
        [
            Column("path"),
            Column("kind"),
            Column("dtype"),
            Column("shape"),
            Column("bytes", right=True),
            Column("chunks", right=True),
            Column("value / note"),
        ]
    )
    for leaf in info.leaves:
        note = f"shares storage with {leaf.shared_with}" if leaf.shared_with else ""
        if leaf.packed_with:
            note = f"packed with {leaf.packed_with}"
        if leaf.value is not None:
            note = truncate(leaf.value)
        table.add(
            leaf.path,
            leaf.kind,
            leaf.dtype or "",
            _shape_text(leaf.shape),
            human_bytes(leaf.nbytes) if leaf.blob is not None or leaf.nbytes else "",
            str(leaf.chunks) if leaf.blob is not None else "",
            note,
        )
    return table
