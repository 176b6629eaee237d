"""``cryosnap diff``: which leaves changed between two versions, and how many bytes.

Runs on the caller's thread, over :meth:`cryosnap.Run.diff` (from the chunk hashes; packed
small tensors read where they differ); takes no lock.
"""

from __future__ import annotations

from cryosnap.cli._common import open_run
from cryosnap.cli._render import Column, Table, plural, print_json, print_line
from cryosnap.progress import human_bytes


def cmd_diff(location: str, a: int, b: int, *, rank: int, as_json: bool) -> None:
    """Per leaf: added, removed or changed between steps ``a`` and ``b``, with changed bytes."""
    run = open_run(location)
    diff = run.diff(a, b, rank=rank)
    rows = [leaf.to_json() for leaf in diff.leaves]
    changed_total, logical = diff.changed_bytes, diff.logical_bytes
    if as_json:
        print_json(
            {
                "path": run.url,
                "a": a,
                "b": b,
                "changed_bytes": changed_total,
                "logical_bytes": logical,
                "leaves": rows,
            }
        )
        return
    table = Table([Column("leaf"), Column("status"), Column("changed", right=True)])
    for r in rows:
        nbytes = r["changed_bytes"]
        detail = "" if nbytes is None else human_bytes(nbytes)
        if "changed_chunks" in r:
            detail += f" ({r['changed_chunks']}/{r['chunks']} chunks)"
        table.add(r["path"], r["status"], detail)
    table.render()
    share = 100.0 * changed_total / logical if logical else 0.0
    print_line(
        f"{plural(len(rows), 'leaf', 'leaves')} differ; {human_bytes(changed_total)} of "
        f"{human_bytes(logical)} changed ({share:.2f}%)"
    )
