"""``cryosnap export``: one version as a ``.pt``, ``.safetensors`` or ``.npz`` file; with
``--since A``, a delta (the leaves changed since step A, for ``cryosnap.apply_delta``).

Runs on the caller's thread, over :func:`cryosnap.export.export` (which reads the run through
:func:`cryosnap.load`, a delta only its changed leaves, and takes no lock).
"""

from __future__ import annotations

from cryosnap.cli._common import CliUsageError, newest_intact, open_run
from cryosnap.cli._render import note, plural, print_json, print_line
from cryosnap.errors import CheckpointError
from cryosnap.export import ExportError, ExportResult, check_out, export
from cryosnap.progress import human_bytes


def cmd_export(
    location: str,
    out: str,
    *,
    step: int | None = None,
    rank: int = 0,
    since: int | None = None,
    force: bool = False,
    as_json: bool = False,
    allow_pickle: bool = False,
) -> None:
    """Write one version (default: the newest whose commit record reads); an existing OUT is
    replaced only with ``force``. ``since``: the delta from that step."""
    try:
        _path, fmt = check_out(out, force=force)  # a bad OUT is refused before the run opens
    except (ValueError, TypeError) as exc:
        raise CliUsageError(str(exc)) from exc
    if since is not None and fmt == ".pt":
        raise CliUsageError(f"cannot export a delta to {out}: --since writes .safetensors or .npz")
    if not location:
        raise CliUsageError("PATH must not be empty")
    if step is None:
        step = newest_intact(open_run(location))
    try:
        result = export(
            location,
            out,
            step=step,
            rank=rank,
            force=force,
            allow_pickle=allow_pickle,
            since=since,
        )
    except (ExportError, ValueError) as exc:  # ValueError: --rank of a DCP version
        raise CliUsageError(str(exc)) from exc
    except CheckpointError as exc:
        raise _in_cli_words(exc) from None
    _export_notes(result)
    if as_json:
        doc = {
            "path": result.path,
            "step": result.step,
            "rank": result.rank,
            "out": str(result.out),
            "format": result.format,
            "leaves": result.leaves,
            "skipped": list(result.skipped),
            "bytes": result.bytes,
        }
        if result.since is not None:
            doc |= {"since": result.since, "removed": list(result.removed)}
        print_json(doc)
        return
    if result.since is not None:
        print_line(
            f"exported the changes of step {result.step} since step {result.since} of "
            f"{result.path} to {result.out} ({plural(result.leaves, 'leaf', 'leaves')} added or "
            f"changed, {len(result.removed)} removed, {human_bytes(result.bytes)})"
        )
        return
    print_line(
        f"exported step {result.step} of {result.path} to {result.out} "
        f"({plural(result.leaves, 'leaf', 'leaves')}, {human_bytes(result.bytes)})"
    )


def _in_cli_words(exc: CheckpointError) -> CheckpointError:
    """A pickled leaf refused: the library's ``allow_pickle=True`` is ``--allow-pickle`` here."""
    text = str(exc)
    if type(exc) is not CheckpointError or "allow_pickle=True" not in text:
        return exc
    flag = "--allow-pickle (only for a run you trust)"
    return CheckpointError(text.replace("allow_pickle=True", flag), step=exc.step, path=exc.path)


def _export_notes(result: ExportResult) -> None:
    skipped = result.skipped
    if skipped:
        note(
            f"{plural(len(skipped), 'None leaf', 'None leaves')} left out of {result.out.name} "
            "(.npz has no None): " + ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        )
    if result.numpy_leaves:
        note(
            f"{plural(len(result.numpy_leaves), 'leaf', 'leaves')} with numpy values "
            f"(first: {result.numpy_leaves[0]}), which torch.load(weights_only=True) refuses: "
            "load with weights_only=False or allow them with "
            "torch.serialization.add_safe_globals"
        )
