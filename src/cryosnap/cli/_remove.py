"""``cryosnap gc`` and ``cryosnap rm``: delete versions and every file no remaining one needs.

Runs on the caller's thread, over :meth:`cryosnap.Run.gc` and :meth:`cryosnap.Run.remove`,
which take the run's write lock as a writer does (``--dry-run`` takes none).
"""

from __future__ import annotations

from cryosnap.cli._common import committed, open_run
from cryosnap.cli._render import plural, print_json, print_line
from cryosnap.progress import human_bytes


def cmd_gc(location: str, *, keep: int, dry_run: bool = False, as_json: bool = False) -> None:
    """Keep the newest ``keep`` versions; delete the rest and every file none of them needs
    (with ``dry_run``, only say what would go)."""
    run = open_run(location)
    committed(run)  # a missing run is a usage error, not an empty success
    removal = run.gc(keep=keep, dry_run=dry_run)
    if as_json:
        print_json(
            {
                "path": run.url,
                "dry_run": dry_run,
                "deleted_steps": list(removal.removed),
                "kept_steps": list(removal.kept),
                "freed_bytes": removal.freed_bytes,
                "data_files_deleted": len(removal.data_files),
                "incomplete_files_deleted": len(removal.incomplete),
                "still_read_bytes": removal.still_read_bytes,
            }
        )
        return
    verb = ("would delete", "would free") if dry_run else ("deleted", "freed")
    kept_files = (
        f" ({human_bytes(removal.still_read_bytes)} of their data stays: kept versions or forks "
        "read it)"
        if removal.still_read_bytes
        else ""
    )
    incomplete = (
        f", including {plural(len(removal.incomplete), 'file')} left by saves that never committed"
        if removal.incomplete
        else ""
    )
    print_line(
        f"{verb[0]} {plural(len(removal.removed), 'version')}, kept "
        f"{plural(len(removal.kept), 'version')}; {verb[1]} {human_bytes(removal.freed_bytes)}"
        f"{incomplete}{kept_files}"
    )


def cmd_rm(location: str, *, step: int, dry_run: bool = False, as_json: bool = False) -> None:
    """Delete version ``step`` and every file no remaining version needs (with ``dry_run``,
    only say what would go)."""
    run = open_run(location)
    removal = run.remove(step, dry_run=dry_run)
    if as_json:
        print_json(
            {
                "path": run.url,
                "dry_run": dry_run,
                "step": step,
                "kept_steps": list(removal.kept),
                "freed_bytes": removal.freed_bytes,
                "manifests_deleted": len(removal.manifests),
                "data_files_deleted": len(removal.data_files),
            }
        )
        return
    verb = ("would remove", "would free") if dry_run else ("removed", "freed")
    print_line(
        f"{verb[0]} step {step}, kept {plural(len(removal.kept), 'version')}; {verb[1]} "
        f"{human_bytes(removal.freed_bytes)} ({plural(len(removal.data_files), 'data file')})"
    )
