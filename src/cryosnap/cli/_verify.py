"""``cryosnap verify``: read and hash every chunk of one version or of every version; with
``--scratch``, of every level of the run (persistent, then each rank's scratch part), one row
per damage naming its level.

Runs on the caller's thread, over :meth:`cryosnap.Run.verify`; takes no lock.
"""

from __future__ import annotations

from cryosnap.cli._common import EXIT_DAMAGED, EXIT_OK, CliUsageError, committed, open_run
from cryosnap.cli._render import Column, Table, plural, print_json, print_line
from cryosnap.errors import CheckpointNotFoundError
from cryosnap.progress import human_bytes
from cryosnap.run import LevelCheck, Run, VerifyReport, VersionCheck


def cmd_verify(
    location: str, *, step: int | None, as_json: bool, scratch: list[str] | None = None
) -> int:
    """Verify one version or every version (of every level, given the run's ``scratch``);
    return 1 if any is damaged, else 0."""
    if scratch:
        return _verify_levels(location, scratch, step=step, as_json=as_json)
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
            _add_rows(table, c)
        table.render()
        print_line(_summary(checks))
    return EXIT_DAMAGED if damaged else EXIT_OK


def _summary(checks: tuple[VersionCheck, ...]) -> str:
    """``2 versions OK``, ``1 of 3 versions damaged``; versions retired meanwhile apart."""
    verified = [c for c in checks if not c.retired]
    damaged = [c for c in verified if not c.ok]
    if damaged:
        line = f"{len(damaged)} of {plural(len(verified), 'version')} damaged"
    else:
        line = f"{plural(len(verified), 'version')} OK"
    retired = len(checks) - len(verified)
    return line + (f"; {retired} retired while verified" if retired else "")


def _verify_levels(location: str, scratch: list[str], *, step: int | None, as_json: bool) -> int:
    if not location:
        raise CliUsageError("PATH must not be empty")
    if not all(scratch):
        raise CliUsageError("--scratch DIR must not be empty")
    run = Run(location, scratch=scratch)
    report = run.verify(step)
    if not report.versions:
        where = ", ".join(level.url for level in report.levels)
        raise CheckpointNotFoundError(f"no committed version on any level of the run ({where})")
    if as_json:
        print_json(
            {
                "path": run.url,
                "ok": report.ok,
                "damaged_levels": list(report.damaged_levels),
                "levels": [level.to_json() for level in report.levels],
                "versions": [c.to_json() for c in report.versions],
            }
        )
    else:
        _print_levels(report)
    return EXIT_OK if report.ok else EXIT_DAMAGED


def _print_levels(report: VerifyReport) -> None:
    columns = [Column("level"), Column("step", right=True), Column("status"), Column("detail")]
    table = Table(columns)
    for level in report.levels:
        for c in level.versions:
            _add_rows(table, c, level=level.name, whole=level.rank is None)
    table.render()
    for level in report.levels:
        print_line(_level_line(level))


def _add_rows(
    table: Table, c: VersionCheck, *, level: str | None = None, whole: bool = True
) -> None:
    """One row for a version that verifies, one per damage for one that does not; ``whole``:
    the version of every rank (not a scratch part, which holds one rank's part alone)."""
    first = () if level is None else (level,)
    if c.retired:
        table.add(*first, str(c.step), "RETIRED", "retired while verified (not damage)")
        return
    if c.ok:
        table.add(*first, str(c.step), "OK", _figures(c, ranks=whole))
        return
    for d in c.damage:
        # Which rank's part of a distributed version (a scratch part's level says it).
        rank = f"rank {d.rank}: " if d.rank is not None and (c.world_size or 1) > 1 else ""
        table.add(*first, str(c.step), "DAMAGED", rank + d.error)


def _figures(c: VersionCheck, *, ranks: bool) -> str:
    size = f"{plural(c.leaves or 0, 'leaf', 'leaves')}, {human_bytes(c.logical_bytes or 0)}"
    if not ranks:
        return size
    return f"{plural(c.world_size or 0, 'rank')}, {size}"


def _level_line(level: LevelCheck) -> str:
    if not level.versions:
        return f"{level.name}: no version ({level.url})"
    return f"{level.name}: {_summary(level.versions)}"
