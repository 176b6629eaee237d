"""``cryosnap verify``: read and hash every chunk of one version or of every version.

Runs on the caller's thread, over :meth:`cryosnap.Run.verify`; takes no lock.
"""

from __future__ import annotations

from cryosnap.cli._common import EXIT_DAMAGED, EXIT_OK, committed, open_run
from cryosnap.cli._render import Column, Table, plural, print_json, print_line
from cryosnap.progress import human_bytes


def cmd_verify(location: str, *, step: int | None, as_json: bool) -> int:
    """Verify one version or every version; return 1 if any is damaged, else 0."""
    run = open_run(location)
    if step is None:
        committed(run)
    report = run.verify(step)
    checks, damaged = report.versions, report.damaged
    if as_json:
        print_json({"path": run.url, "ok": report.ok, "versions": [c.to_json() for c in checks]})
    else:
        table = Table([Column("step", right=True), Column("status"), Column("detail")])
        for c in checks:
            if c.ok:
                ranks = "1 rank" if c.world_size == 1 else f"{c.world_size} ranks"
                detail = f"{ranks}, {c.leaves} leaves, {human_bytes(c.logical_bytes or 0)}"
                table.add(str(c.step), "OK", detail)
            else:
                table.add(str(c.step), "DAMAGED", "; ".join(c.errors))
        table.render()
        if damaged:
            print_line(f"{len(damaged)} of {plural(len(checks), 'version')} damaged")
        else:
            print_line(f"{plural(len(checks), 'version')} OK")
    return EXIT_DAMAGED if damaged else EXIT_OK
