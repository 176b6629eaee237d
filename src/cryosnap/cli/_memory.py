"""``cryosnap memory``: this user's memory levels on this node, and ``--clean`` to remove
the orphans a killed run that was never opened again left in shared memory.

Runs on the caller's thread over :func:`cryosnap.run.memory_levels` and
:func:`cryosnap.run.remove_orphaned_memory` (a level is held while a live process holds one of
its write locks).
"""

from __future__ import annotations

from cryosnap.cli._render import plural, print_json, print_line
from cryosnap.progress import human_bytes
from cryosnap.run import memory_levels, memory_root, remove_orphaned_memory


def cmd_memory(*, clean: bool = False, as_json: bool = False) -> None:
    """List the memory levels (run, bytes, holders; orphans marked), or remove the orphans."""
    root = str(memory_root())
    if clean:
        removed = remove_orphaned_memory()
        if as_json:
            print_json(
                {
                    "root": root,
                    "removed": [
                        {"path": str(r.path), "run": r.run, "bytes": r.nbytes} for r in removed
                    ],
                }
            )
            return
        freed = sum(r.nbytes for r in removed)
        print_line(
            f"removed {plural(len(removed), 'orphaned memory level')} from {root} "
            f"({human_bytes(freed)} freed)"
        )
        for r in removed:
            print_line(f"  {r.path}  {r.run or '?'}")
        return
    runs = memory_levels()
    lost = {r.path for r in runs if r.orphan}
    if as_json:
        print_json(
            {
                "root": root,
                "levels": [
                    {
                        "path": str(r.path),
                        "run": r.run,
                        "bytes": r.nbytes,
                        "holders": list(r.holders),
                        "orphan": r.path in lost,
                    }
                    for r in runs
                ],
            }
        )
        return
    if not runs:
        print_line(f"no memory level of this user in {root}")
        return
    for r in runs:
        who = "orphan (no live holder)" if r.path in lost else f"held by pid {list(r.holders)}"
        print_line(f"{r.path}  {human_bytes(r.nbytes)}  {r.run or '?'}  {who}")
    if lost:
        print_line(f"{plural(len(lost), 'orphan')}: remove with `cryosnap memory --clean`")
