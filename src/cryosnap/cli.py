"""The ``cryosnap`` command line: ``ls``, ``inspect``, ``verify``, ``diff``, ``export``, ``gc``,
``rm``, ``plan``, ``bench`` and ``import-dcp``.

Owns argument parsing (typer), rendering (rich tables when stdout is a terminal, plain aligned
text otherwise, JSON with ``--json``) and exit codes. ``ls``, ``inspect``, ``verify``, ``diff``,
``gc`` and ``rm`` are thin commands over :class:`cryosnap.Run` (which reads without a lock;
``gc`` and ``rm`` delete under the run's write lock, as a writer does); ``export`` goes through
:mod:`cryosnap.export`; ``import-dcp`` saves a version through :func:`cryosnap.dcp.import_dcp`
(a Checkpointer: the write lock too). ``bench`` renders what :mod:`cryosnap.benchmark`
measures.

Exit codes::

    0  success
    1  corruption found: verify found damage, or any IntegrityError
    2  usage errors, missing checkpoints and every other CheckpointError
    3  an unexpected internal error (a bug: please report it)
    130  interrupted (Ctrl-C)

Every error is one line on stderr, ``cryosnap: error: ...``, never a traceback
(``CRYOSNAP_TRACEBACK=1`` shows the traceback of an internal error).

typer and rich (the ``cli`` extra) are imported here only, when the command line runs, so
``import cryosnap`` never pulls them in. Runs on the caller's thread; no collectives.
"""

# No ``from __future__ import annotations`` here: typer reads the annotations of the command
# functions at runtime, and they are defined inside _build_app() where typer is a local name.

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np

from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
)
from .export import ExportError, ExportResult, check_out, committed_steps, export
from .manifest import MAX_STEP
from .progress import human_bytes
from .run import Run
from .storage import Store, open_store

if TYPE_CHECKING:
    import typer

__all__ = ["main"]

PROG = "cryosnap"

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


class CliUsageError(Exception):
    """A usage error found by a command itself (an empty PATH; export's bad OUT, a leaf the
    format cannot hold)."""


# ---------------------------------------------------------------------------------------------
# entry point


def main(argv: list[str] | None = None) -> int:
    """Run the command line and return its exit code.

    With ``argv`` given (tests, embedding) the exit code is returned. With ``argv`` None the
    arguments come from ``sys.argv`` and the process exits with the code: that is what the
    ``cryosnap`` console script (``cryosnap.cli:main``) does.
    """
    code = _run(sys.argv[1:] if argv is None else list(argv))
    if argv is None:
        sys.exit(code)
    return code


def _run(args: list[str]) -> int:
    global _JSON_ERRORS, _ARGS
    _ARGS = list(args)
    # With --json, an error is also one JSON object on stdout (scripts read stdout only); bench's
    # --json names a file, and its stdout is the table.
    _JSON_ERRORS = "--json" in args and args[:1] != ["bench"]
    try:
        import typer
    except ImportError:
        _error("the command line needs the 'cli' extra: pip install -e '.[cli]'", EXIT_USAGE)
        return EXIT_USAGE
    click_exc = _click_exceptions()
    command = typer.main.get_command(_build_app())
    try:
        # standalone_mode=False: click raises instead of printing a multi-line usage block and
        # calling sys.exit, so every error is rendered here as one line.
        if not args:  # a bare `cryosnap`: the help is the answer, but it is still a usage error
            command.main(args=["--help"], prog_name=PROG, standalone_mode=False)
            return EXIT_USAGE
        rv = command.main(args=args, prog_name=PROG, standalone_mode=False)
    except CliUsageError as exc:
        return _error(str(exc), EXIT_USAGE, "usage")
    except IntegrityError as exc:
        return _error(str(exc), EXIT_DAMAGED, type(exc).__name__)
    except CheckpointError as exc:
        return _error(str(exc), EXIT_USAGE, type(exc).__name__)
    except click_exc.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        return _error(exc.format_message() + hint, EXIT_USAGE, "usage")
    except click_exc.ClickException as exc:
        return _error(exc.format_message(), int(exc.exit_code), "usage")
    except typer.Abort:
        return _error("aborted", EXIT_INTERRUPTED, "interrupted")
    except SystemExit as exc:  # typer exits itself on a broken stdout pipe
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Exception as exc:
        if os.environ.get("CRYOSNAP_TRACEBACK"):
            raise
        return _error(
            f"internal error: {type(exc).__name__}: {exc} "
            "(run with CRYOSNAP_TRACEBACK=1 to see the traceback)",
            EXIT_INTERNAL,
            "internal",
        )
    # typer returns the code of a typer.Exit (verify's 1, --help's 0, Ctrl-C's 130) or the
    # command's None.
    return rv if isinstance(rv, int) else EXIT_OK


def _click_exceptions() -> Any:
    """The click exception module: vendored as ``typer._click`` by recent typer releases."""
    try:
        return importlib.import_module("typer._click.exceptions")
    except ImportError:  # older typer depends on click itself
        return importlib.import_module("click.exceptions")


def _one_line(message: str) -> str:
    return " ".join(message.split())


_JSON_ERRORS = False
_ARGS: list[str] = []  # the command line being run (bench records it)


def _error(message: str, code: int, kind: str = "error") -> int:
    """One line on stderr (and with ``--json`` one object on stdout); returns ``code``."""
    sys.stderr.write(f"{PROG}: error: {_one_line(message)}\n")
    if _JSON_ERRORS:
        doc = {"error": _one_line(message), "type": kind, "exit_code": code}
        sys.stdout.write(json.dumps(doc) + "\n")
    return code


def _note(message: str) -> None:
    sys.stderr.write(f"{PROG}: note: {_one_line(message)}\n")


# ---------------------------------------------------------------------------------------------
# the typer app: thin wrappers that parse, then call the commands below


def _build_app() -> "typer.Typer":
    import typer

    app = typer.Typer(
        name=PROG,
        help="List, inspect, verify, diff, export, remove and garbage-collect cryosnap "
        "checkpoints; plan intervals; benchmark against the peers.",
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    def show_version(value: bool) -> None:
        if value:
            from . import __version__

            _print(f"{PROG} {__version__}")
            raise typer.Exit(0)

    @app.callback()
    def root(
        version: Annotated[
            bool,
            typer.Option(
                "--version", is_eager=True, callback=show_version, help="Print the version."
            ),
        ] = False,
    ) -> None:
        """List, inspect, verify, diff, export, remove and garbage-collect cryosnap checkpoints."""

    path_arg = typer.Argument(help="The run: a directory or an fsspec URL (memory://, s3://...).")
    json_opt = typer.Option("--json", help="Machine-readable output (JSON) on stdout.")
    rank_opt = typer.Option("--rank", min=0, help="Which rank's part of the version.")

    @app.command("ls")
    def ls_command(
        path: Annotated[str, path_arg],
        json_output: Annotated[bool, json_opt] = False,
    ) -> None:
        """List the committed versions of a run."""
        cmd_ls(path, as_json=json_output)

    @app.command("inspect")
    def inspect_command(
        path: Annotated[str, path_arg],
        step: Annotated[
            int | None,
            typer.Option("--step", min=0, max=MAX_STEP, help="The version (default: latest)."),
        ] = None,
        rank: Annotated[int, rank_opt] = 0,
        json_output: Annotated[bool, json_opt] = False,
    ) -> None:
        """Show the leaves of a version (paths, dtypes, shapes, sizes) without reading data."""
        cmd_inspect(path, step=step, rank=rank, as_json=json_output)

    @app.command("verify")
    def verify_command(
        path: Annotated[str, path_arg],
        step: Annotated[
            int | None,
            typer.Option(
                "--step", min=0, max=MAX_STEP, help="The version (default: every version)."
            ),
        ] = None,
        json_output: Annotated[bool, json_opt] = False,
    ) -> None:
        """Read every chunk of every rank and check its hash; exit 1 if anything is damaged."""
        code = cmd_verify(path, step=step, as_json=json_output)
        if code:
            raise typer.Exit(code)

    @app.command("export")
    def export_command(
        path: Annotated[str, path_arg],
        out: Annotated[str, typer.Argument(help="Output file: .pt, .safetensors or .npz.")],
        step: Annotated[
            int | None,
            typer.Option("--step", min=0, max=MAX_STEP, help="The version (default: latest)."),
        ] = None,
        rank: Annotated[int, rank_opt] = 0,
        force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
        json_output: Annotated[bool, json_opt] = False,
    ) -> None:
        """Write one version as a .pt, .safetensors or .npz file."""
        cmd_export(path, out, step=step, rank=rank, force=force, as_json=json_output)

    @app.command("diff")
    def diff_command(
        path: Annotated[str, path_arg],
        a: Annotated[int, typer.Argument(min=0, max=MAX_STEP, help="The older step.")],
        b: Annotated[int, typer.Argument(min=0, max=MAX_STEP, help="The newer step.")],
        rank: Annotated[int, rank_opt] = 0,
        json_output: Annotated[bool, json_opt] = False,
    ) -> None:
        """Which leaves changed between two versions, and how many bytes (reads no data)."""
        cmd_diff(path, a, b, rank=rank, as_json=json_output)

    @app.command("gc")
    def gc_command(
        path: Annotated[str, path_arg],
        keep: Annotated[
            int, typer.Option("--keep", min=1, help="How many of the newest versions to keep.")
        ],
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Show what would be deleted; delete nothing.")
        ] = False,
        json_output: Annotated[bool, json_opt] = False,
    ) -> None:
        """Delete all but the newest K versions and every file no kept version needs."""
        cmd_gc(path, keep=keep, dry_run=dry_run, as_json=json_output)

    @app.command("rm")
    def rm_command(
        path: Annotated[str, path_arg],
        step: Annotated[
            int, typer.Option("--step", min=0, max=MAX_STEP, help="The version to delete.")
        ],
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Show what would be deleted; delete nothing.")
        ] = False,
        json_output: Annotated[bool, json_opt] = False,
    ) -> None:
        """Delete one version and every file no remaining version needs (a later version
        built on it still restores)."""
        cmd_rm(path, step=step, dry_run=dry_run, as_json=json_output)

    @app.command("demo")
    def demo_command(
        directory: Annotated[
            str,
            typer.Option(
                "--dir",
                help="Work directory: new, empty or an earlier demo run's (another non-empty "
                "directory is refused, exit 2).",
            ),
        ] = "demo-run",
        steps: Annotated[
            int, typer.Option("--steps", min=1, help="Training steps (at least 2 * every + 2).")
        ] = 200,
        every: Annotated[
            int, typer.Option("--every", min=1, help="Checkpoint every N steps.")
        ] = 20,
        seed: Annotated[
            int | None, typer.Option("--seed", help="Seed of the random kill step.")
        ] = None,
        json_output: Annotated[
            bool,
            typer.Option("--json", help="Progress on stderr, the summary as JSON on stdout."),
        ] = False,
    ) -> None:
        """Train, SIGKILL, resume, check bit-exact against an uninterrupted run (needs torch)."""
        from . import demo

        argv = ["--dir", directory, "--steps", str(steps), "--every", str(every)]
        if seed is not None:
            argv += ["--seed", str(seed)]
        if json_output:
            argv.append("--json")
        code = demo.main(argv)
        if code:
            raise typer.Exit(code)

    _add_plan_command(app)
    _add_bench_command(app)
    _add_import_dcp_command(app)
    return app


# ---------------------------------------------------------------------------------------------
# rendering


@dataclass(frozen=True, slots=True)
class _Column:
    title: str
    right: bool = False


@dataclass(slots=True)
class _Table:
    """Rows of text cells. A *message row* has two cells: the first column and a message that
    spans the rest (a damaged version), and takes no part in the column widths."""

    columns: list[_Column]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: str) -> None:
        self.rows.append(list(cells))

    def render(self) -> None:
        if sys.stdout.isatty() and importlib.util.find_spec("rich") is not None:
            self._render_rich()
        else:
            self._render_plain()

    def _render_plain(self) -> None:
        n = len(self.columns)
        widths = [len(c.title) for c in self.columns]
        for row in self.rows:
            if len(row) == n:
                widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
        out = sys.stdout
        out.write(self._plain_line([c.title for c in self.columns], widths) + "\n")
        for row in self.rows:
            if len(row) == n:
                out.write(self._plain_line(row, widths) + "\n")
            else:
                first = self._pad(row[0], widths[0], self.columns[0].right)
                out.write(f"{first}  {row[1]}".rstrip() + "\n")

    def _pad(self, cell: str, width: int, right: bool) -> str:
        return cell.rjust(width) if right else cell.ljust(width)

    def _plain_line(self, cells: Sequence[str], widths: Sequence[int]) -> str:
        parts = [
            self._pad(cell, w, col.right)
            for cell, w, col in zip(cells, widths, self.columns, strict=True)
        ]
        return "  ".join(parts).rstrip()

    def _render_rich(self) -> None:
        from rich import box
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for c in self.columns:
            table.add_column(c.title, justify="right" if c.right else "left")
        n = len(self.columns)
        messages: list[str] = []
        for row in self.rows:
            if len(row) == n:
                table.add_row(*(escape(cell) for cell in row))
            else:
                # rich has no column spans: a short marker in the table, the message below it.
                status, _, detail = row[1].partition(": ")
                table.add_row(escape(row[0]), f"[red]{escape(status)}[/red]", *[""] * (n - 2))
                if detail:
                    messages.append(f"[red]step {escape(row[0])}: {escape(detail)}[/red]")
        console = Console(file=sys.stdout)
        console.print(table)
        for message in messages:
            console.print(message, highlight=False)


def _print(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def iso_time(unix: float) -> str:
    """A Unix time as ISO 8601 in UTC, to the second."""
    return datetime.fromtimestamp(unix, timezone.utc).isoformat(timespec="seconds")


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _truncate(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------
# shared helpers


def _open_store(location: str) -> Store:
    if not location:
        raise CliUsageError("PATH must not be empty")
    return open_store(location)


def _open(location: str) -> Run:
    return Run(_open_store(location))


def _committed(run: Run) -> list[int]:
    """The run's committed steps; a run without any is an error (nothing to show)."""
    steps = run.steps()
    if not steps:
        raise CheckpointNotFoundError(f"no committed version in {run.url}")
    return steps


# ---------------------------------------------------------------------------------------------
# ls


def cmd_ls(location: str, *, as_json: bool) -> None:
    """One row per committed version; a damaged commit record is a row, not an abort."""
    run = _open(location)
    versions: list[dict[str, Any]] = []
    for step in _committed(run):
        try:
            summary = run.summary(step)
        except CheckpointNotFoundError:
            continue  # removed by retention while we were listing
        except (CheckpointFormatError, IntegrityError) as exc:
            versions.append({"step": step, "damaged": True, "error": _one_line(str(exc))})
            continue
        versions.append(
            {
                "step": step,
                "damaged": False,
                "created": iso_time(summary.created_unix),
                "created_unix": summary.created_unix,
                "world_size": summary.world_size,
                "leaves": summary.leaves,
                "logical_bytes": summary.logical_bytes,
                "written_bytes": summary.written_bytes,
                "data_files": summary.data_files,
                "chunk_bytes": summary.chunk_bytes,
            }
        )
    if as_json:
        _print_json({"path": run.url, "versions": versions})
        return
    table = _Table(
        [
            _Column("step", right=True),
            _Column("created"),
            _Column("world", right=True),
            _Column("leaves", right=True),
            _Column("logical", right=True),
            _Column("written", right=True),
            _Column("files", right=True),
        ]
    )
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
        )
    table.render()


# ---------------------------------------------------------------------------------------------
# inspect


def _shape_text(shape: list[int] | None) -> str:
    return "" if shape is None else str(tuple(shape))


def cmd_inspect(location: str, *, step: int | None, rank: int, as_json: bool) -> None:
    """The leaves of one version (default: the latest), read from its manifest."""
    run = _open(location)
    if step is None:
        step = _committed(run)[-1]
    info = run.info(step, rank=rank)
    leaves = info.leaves
    totals = {
        "leaves": len(leaves),
        "blobs": info.blobs,
        "chunks": sum(leaf.chunks for leaf in leaves),
        "logical_bytes": info.rank_bytes,
    }
    if as_json:
        _print_json(
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
    _print(
        f"step {step} of {run.url}, rank {rank} of {info.world_size}, created "
        f"{iso_time(info.created_unix)}, chunks of {human_bytes(info.chunk_bytes)}"
    )
    table = _Table(
        [
            _Column("path"),
            _Column("kind"),
            _Column("dtype"),
            _Column("shape"),
            _Column("bytes", right=True),
            _Column("chunks", right=True),
            _Column("value / note"),
        ]
    )
    for leaf in leaves:
        note = f"shares storage with {leaf.shared_with}" if leaf.shared_with else ""
        if leaf.packed_with:
            note = f"packed with {leaf.packed_with}"
        if leaf.value is not None:
            note = _truncate(leaf.value)
        table.add(
            leaf.path,
            leaf.kind,
            leaf.dtype or "",
            _shape_text(leaf.shape),
            human_bytes(leaf.nbytes) if leaf.blob is not None or leaf.nbytes else "",
            str(leaf.chunks) if leaf.blob is not None else "",
            note,
        )
    table.render()
    _print(
        f"{_plural(totals['leaves'], 'leaf', 'leaves')}, {_plural(totals['blobs'], 'blob')}, "
        f"{_plural(totals['chunks'], 'chunk')}, {human_bytes(totals['logical_bytes'])} stored"
    )


# ---------------------------------------------------------------------------------------------
# verify


def cmd_verify(location: str, *, step: int | None, as_json: bool) -> int:
    """Verify one version or every version; return 1 if any is damaged, else 0."""
    run = _open(location)
    if step is None:
        _committed(run)
    report = run.verify(step)
    checks, damaged = report.versions, report.damaged
    if as_json:
        _print_json({"path": run.url, "ok": report.ok, "versions": [c.to_json() for c in checks]})
    else:
        table = _Table([_Column("step", right=True), _Column("status"), _Column("detail")])
        for c in checks:
            if c.ok:
                ranks = "1 rank" if c.world_size == 1 else f"{c.world_size} ranks"
                detail = f"{ranks}, {c.leaves} leaves, {human_bytes(c.logical_bytes or 0)}"
                table.add(str(c.step), "OK", detail)
            else:
                table.add(str(c.step), "DAMAGED", "; ".join(c.errors))
        table.render()
        if damaged:
            _print(f"{len(damaged)} of {_plural(len(checks), 'version')} damaged")
        else:
            _print(f"{_plural(len(checks), 'version')} OK")
    return EXIT_DAMAGED if damaged else EXIT_OK


# ---------------------------------------------------------------------------------------------
# export


def cmd_export(
    location: str,
    out: str,
    *,
    step: int | None = None,
    rank: int = 0,
    force: bool = False,
    as_json: bool = False,
) -> None:
    """Write one version (default: the newest) as .pt, .safetensors or .npz through
    :func:`cryosnap.export.export`; an existing OUT is replaced only with ``force``."""
    try:
        check_out(out, force=force)  # a bad OUT is refused before the run is even opened
    except (ValueError, TypeError) as exc:
        raise CliUsageError(str(exc)) from exc
    store = _open_store(location)
    if step is None:
        step = committed_steps(store)[-1]
    try:
        result = export(store, out, step=step, rank=rank, force=force)
    except (ExportError, ValueError) as exc:  # ValueError: --rank of a DCP version
        raise CliUsageError(str(exc)) from exc
    _export_notes(result)
    if as_json:
        _print_json(
            {
                "path": result.path,
                "step": result.step,
                "rank": result.rank,
                "out": str(result.out),
                "format": result.format,
                "leaves": result.leaves,
                "skipped": list(result.skipped),
                "bytes": result.bytes,
            }
        )
        return
    _print(
        f"exported step {result.step} of {result.path} to {result.out} "
        f"({_plural(result.leaves, 'leaf', 'leaves')}, {human_bytes(result.bytes)})"
    )


def _export_notes(result: ExportResult) -> None:
    skipped = result.skipped
    if skipped:
        _note(
            f"{_plural(len(skipped), 'None leaf', 'None leaves')} left out of {result.out.name} "
            "(.npz has no None): " + ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        )
    if result.numpy_leaves:
        _note(
            f"{_plural(len(result.numpy_leaves), 'leaf', 'leaves')} with numpy values "
            f"(first: {result.numpy_leaves[0]}), which torch.load(weights_only=True) refuses: "
            "load with weights_only=False or allow them with "
            "torch.serialization.add_safe_globals"
        )


# ---------------------------------------------------------------------------------------------
# import-dcp


def _add_import_dcp_command(app: "typer.Typer") -> None:
    import typer

    @app.command("import-dcp")
    def import_dcp_command(
        directory: Annotated[
            str, typer.Argument(help="A torch.distributed.checkpoint directory (FileSystemWriter).")
        ],
        path: Annotated[str, typer.Argument(help="The run to save it in (a directory or URL).")],
        step: Annotated[
            int | None,
            typer.Option(
                "--step", min=0, max=MAX_STEP, help="The version (default: after the newest)."
            ),
        ] = None,
        json_output: Annotated[
            bool, typer.Option("--json", help="Machine-readable output (JSON) on stdout.")
        ] = False,
    ) -> None:
        """Save a torch.distributed.checkpoint directory as one version of a run."""
        cmd_import_dcp(directory, path, step=step, as_json=json_output)


def cmd_import_dcp(directory: str, location: str, *, step: int | None, as_json: bool) -> None:
    """Import the DCP checkpoint ``directory`` as version ``step`` of the run at ``location``
    through :func:`cryosnap.dcp.import_dcp` (needs torch)."""
    if not directory or not location:
        raise CliUsageError("DIR and PATH must not be empty")
    try:
        from .dcp import import_dcp
    except ImportError as exc:
        raise CliUsageError(
            f"import-dcp needs torch: pip install 'cryosnap[torch]' ({exc})"
        ) from exc
    result = import_dcp(directory, location, step=step)
    if as_json:
        _print_json(
            {
                "source": result.source,
                "path": result.path,
                "step": result.step,
                "tensor_chunks": result.tensor_chunks,
                "bytes_items": result.bytes_items,
                "written_bytes": result.info.written_bytes,
            }
        )
        return
    _print(
        f"imported {result.source} as step {result.step} of {result.path} "
        f"({_plural(result.tensor_chunks, 'tensor chunk')}, "
        f"{_plural(result.bytes_items, 'bytes item')}, "
        f"{human_bytes(result.info.written_bytes)} written)"
    )


# ---------------------------------------------------------------------------------------------
# diff


def cmd_diff(location: str, a: int, b: int, *, rank: int, as_json: bool) -> None:
    """Per leaf: added, removed or changed between steps ``a`` and ``b``, with changed bytes
    (:meth:`Run.diff`: from the chunk hashes; packed small tensors read where they differ)."""
    run = _open(location)
    diff = run.diff(a, b, rank=rank)
    rows = [leaf.to_json() for leaf in diff.leaves]
    changed_total, logical = diff.changed_bytes, diff.logical_bytes
    if as_json:
        _print_json(
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
    table = _Table([_Column("leaf"), _Column("status"), _Column("changed", right=True)])
    for r in rows:
        nbytes = r["changed_bytes"]
        detail = "" if nbytes is None else human_bytes(nbytes)
        if "changed_chunks" in r:
            detail += f" ({r['changed_chunks']}/{r['chunks']} chunks)"
        table.add(r["path"], r["status"], detail)
    table.render()
    share = 100.0 * changed_total / logical if logical else 0.0
    _print(
        f"{_plural(len(rows), 'leaf', 'leaves')} differ; {human_bytes(changed_total)} of "
        f"{human_bytes(logical)} changed ({share:.2f}%)"
    )


# ---------------------------------------------------------------------------------------------
# gc


def cmd_gc(location: str, *, keep: int, dry_run: bool = False, as_json: bool = False) -> None:
    """Keep the newest ``keep`` versions; delete the rest and every file none of them needs
    (with ``dry_run``, only say what would go)."""
    run = _open(location)
    _committed(run)  # a missing run is a usage error, not an empty success
    removal = run.gc(keep=keep, dry_run=dry_run)
    if as_json:
        _print_json(
            {
                "path": run.url,
                "dry_run": dry_run,
                "deleted_steps": list(removal.removed),
                "kept_steps": list(removal.kept),
                "freed_bytes": removal.freed_bytes,
                "data_files_deleted": len(removal.data_files),
            }
        )
        return
    verb = ("would delete", "would free") if dry_run else ("deleted", "freed")
    _print(
        f"{verb[0]} {_plural(len(removal.removed), 'version')}, kept "
        f"{_plural(len(removal.kept), 'version')}; {verb[1]} {human_bytes(removal.freed_bytes)}"
    )


# ---------------------------------------------------------------------------------------------
# rm


def cmd_rm(location: str, *, step: int, dry_run: bool = False, as_json: bool = False) -> None:
    """Delete version ``step`` and every file no remaining version needs (with ``dry_run``,
    only say what would go)."""
    run = _open(location)
    removal = run.remove(step, dry_run=dry_run)
    if as_json:
        _print_json(
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
    _print(
        f"{verb[0]} step {step}, kept {_plural(len(removal.kept), 'version')}; {verb[1]} "
        f"{human_bytes(removal.freed_bytes)} ({_plural(len(removal.data_files), 'data file')})"
    )


# ---------------------------------------------------------------------------------------------
# plan: per-level intervals from costs and failure rates (cryosnap.plan does the work)


def _add_plan_command(app: "typer.Typer") -> None:
    import typer

    @app.command("plan")
    def plan_command(
        cost: Annotated[
            list[str],
            typer.Option(
                "--cost",
                metavar="LEVEL=SECONDS",
                help="Save cost of a level; repeat per level, fastest first (scratch first).",
            ),
        ],
        mtbf: Annotated[
            list[str],
            typer.Option(
                "--mtbf",
                metavar="CLASS=SECONDS:LEVEL",
                help="A failure class: mean time between failures and the lowest level that "
                "survives it; repeat per class.",
            ),
        ],
        restart: Annotated[
            list[str] | None,
            typer.Option(
                "--restart",
                metavar="LEVEL=SECONDS",
                help="Restart cost from a level (default: its save cost).",
            ),
        ] = None,
        weibull: Annotated[
            list[str] | None,
            typer.Option(
                "--weibull",
                metavar="CLASS=SHAPE",
                help="Weibull inter-arrival times for a class (default: exponential).",
            ),
        ] = None,
        method: Annotated[
            str,
            typer.Option("--method", help="auto (analytic where it applies), analytic or search."),
        ] = "auto",
        seed: Annotated[
            int, typer.Option("--seed", min=0, help="Seed of the simulated failure traces.")
        ] = 0,
        plot: Annotated[
            str | None,
            typer.Option("--plot", metavar="OUT.png", help="Plot waste against the intervals."),
        ] = None,
        json_output: Annotated[
            bool, typer.Option("--json", help="Machine-readable output (JSON) on stdout.")
        ] = False,
    ) -> None:
        """Per-level checkpoint intervals that minimise the expected waste (SECONDS may end in
        s, m, h or d)."""
        cmd_plan(
            cost,
            mtbf,
            restart or [],
            weibull or [],
            method=method,
            seed=seed,
            plot=plot,
            as_json=json_output,
        )


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _plan_seconds(text: str, option: str, item: str, *, allow_zero: bool = False) -> float:
    """``"90"``, ``"1.5h"``, ``"7d"`` as seconds; a usage error naming the option otherwise."""
    body, scale = text.strip(), 1.0
    if body[-1:].lower() in _UNITS:
        body, scale = body[:-1], _UNITS[body[-1].lower()]
    try:
        value = float(body) * scale
    except ValueError:
        value = float("nan")
    if not (np.isfinite(value) and (value > 0 or (allow_zero and value == 0))):
        allowed = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
        raise CliUsageError(f"{option} {item}: {text!r} is not {allowed} (units s, m, h, d)")
    return value


def _plan_pairs(values: list[str], option: str, shape: str) -> list[tuple[str, str]]:
    """``NAME=VALUE`` items in order; a repeated NAME or a missing ``=`` is a usage error."""
    out: list[tuple[str, str]] = []
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise CliUsageError(f"{option} expects {shape}, got {item!r}")
        if any(name.strip() == seen for seen, _ in out):
            raise CliUsageError(f"{option} {name.strip()} is given twice")
        out.append((name.strip(), value.strip()))
    return out


def _plan_inputs(
    costs: list[str], mtbfs: list[str], restarts: list[str], weibulls: list[str]
) -> tuple[list[Any], list[Any]]:
    from .plan import FailureClass, LevelCost, Weibull

    if not costs:
        raise CliUsageError("give at least one --cost LEVEL=SECONDS (fastest level first)")
    if not mtbfs:
        raise CliUsageError("give at least one --mtbf CLASS=SECONDS:LEVEL")
    save = {
        n: _plan_seconds(v, "--cost", n) for n, v in _plan_pairs(costs, "--cost", "LEVEL=SECONDS")
    }
    restart = {
        n: _plan_seconds(v, "--restart", n, allow_zero=True)
        for n, v in _plan_pairs(restarts, "--restart", "LEVEL=SECONDS")
    }
    _plan_known(restart, save, "--restart", "level")
    levels = [LevelCost(n, s, restart.get(n, s)) for n, s in save.items()]
    shapes: dict[str, float] = {}
    for name, value in _plan_pairs(weibulls, "--weibull", "CLASS=SHAPE"):
        try:
            shapes[name] = float(value)
        except ValueError:
            raise CliUsageError(f"--weibull {name}: {value!r} is not a number") from None
        if not (np.isfinite(shapes[name]) and shapes[name] > 0):
            raise CliUsageError(f"--weibull {name}: the shape must be a positive number")
    failures = []
    for name, value in _plan_pairs(mtbfs, "--mtbf", "CLASS=SECONDS:LEVEL"):
        seconds, sep, level = value.rpartition(":")
        if not sep or not seconds or not level:
            raise CliUsageError(f"--mtbf expects CLASS=SECONDS:LEVEL, got {name}={value!r}")
        _plan_known({level: None}, save, f"--mtbf {name}", "level")
        mean = _plan_seconds(seconds, "--mtbf", name)
        if name in shapes:
            failures.append(FailureClass(name, mean, level, Weibull(shapes[name])))
        else:
            failures.append(FailureClass(name, mean, level))
    _plan_known(shapes, {f.name: None for f in failures}, "--weibull", "failure class")
    missing = [n for n in save if n not in restart]
    if missing:
        _note(f"no --restart for {', '.join(missing)}: using the save cost as the restart cost")
    return levels, failures


def _plan_known(given: dict[str, Any], known: dict[str, Any], option: str, what: str) -> None:
    for name in given:
        if name not in known:
            raise CliUsageError(
                f"{option}: unknown {what} {name!r} (known: {', '.join(known) or 'none'})"
            )


def cmd_plan(
    costs: list[str],
    mtbfs: list[str],
    restarts: list[str],
    weibulls: list[str],
    *,
    method: str = "auto",
    seed: int = 0,
    plot: str | None = None,
    as_json: bool = False,
) -> None:
    """Print the recommended interval per level and the expected waste against the baselines;
    with ``plot``, also draw the waste against each level's interval."""
    from .plan import Simulation, plan

    if method not in ("auto", "analytic", "search"):
        raise CliUsageError(f"--method must be auto, analytic or search, got {method!r}")
    if plot:
        _plan_check_plot(plot)
    try:
        levels, failures = _plan_inputs(costs, mtbfs, restarts, weibulls)
        chosen: Any = method  # checked above: one of plan()'s methods
        result = plan(levels, failures, method=chosen, simulation=Simulation(seed=seed))
    except (TypeError, ValueError) as exc:
        raise CliUsageError(str(exc)) from None
    written = _plan_plot(levels, failures, result, plot) if plot else None
    if as_json:
        doc = result.to_dict()
        for entry, level in zip(doc["levels"], levels, strict=True):
            entry.update(save_seconds=level.save_seconds, restart_seconds=level.restart_seconds)
        doc["plot"] = written
        _print_json(doc)
        return
    _plan_render(levels, result)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.3g} s"
    parts = [(86400, "d"), (3600, "h"), (60, "m"), (1, "s")]
    whole = round(seconds)
    out: list[str] = []
    for size, unit in parts:
        if whole >= size or out:
            out.append(f"{whole // size}{unit}")
            whole %= size
        if len(out) == 2:
            break
    return " ".join(p for p in out if not p.startswith("0") or p == out[0])


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _plan_render(levels: list[Any], result: Any) -> None:
    table = _Table(
        [
            _Column("level"),
            _Column("takes"),
            _Column("interval", right=True),
            _Column("save", right=True),
            _Column("restart", right=True),
        ]
    )
    below = None
    for level, lv in zip(levels, result.levels, strict=True):
        if below is None:
            takes = "every version"
        elif lv.every == 1:
            takes = f"every {below} version"
        else:
            takes = f"every {_ordinal(lv.every)} {below} version"
        table.add(
            lv.name,
            takes,
            _duration(lv.interval_seconds),
            _duration(level.save_seconds),
            _duration(level.restart_seconds),
        )
        below = lv.name
    table.render()
    model = "first-order model" if result.waste_model == "first-order" else "simulated"
    _print()
    _print(f"expected waste: {result.expected_waste:.2%} ({result.method}; {model})")
    _print(
        f"every version to every level: {result.every_version_waste:.2%} "
        f"(a version every {_duration(result.every_version_interval_seconds)})"
    )
    _print(
        f"{result.levels[-1].name} alone at Young/Daly's interval: {result.young_daly_waste:.2%} "
        f"(every {_duration(result.young_daly_interval_seconds)})"
    )


def _plan_check_plot(out: str) -> None:
    """Refuse a plot that could not be written before spending time on the plan."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise CliUsageError(f"--plot {out}: no such directory {folder}")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # _plan_plot says so, once the plan is printed
    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if ext not in kinds:
        raise CliUsageError(
            f"--plot {out}: unknown image format {ext!r} (use one of: {', '.join(sorted(kinds))})"
        )


def _plan_plot(levels: list[Any], failures: list[Any], result: Any, out: str) -> str | None:
    """Draw the waste curves to ``out``; without matplotlib, say so and draw nothing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        _note("--plot needs matplotlib (pip install matplotlib); no plot written")
        return None
    from .plan import waste_profile

    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.subplots()
    for j, curve in enumerate(waste_profile(levels, failures, result)):
        (line,) = ax.plot(
            curve.interval_seconds, [100 * w for w in curve.waste], marker=".", label=curve.level
        )
        planned = result.levels[j].interval_seconds
        nearest = int(np.argmin([abs(np.log(x / planned)) for x in curve.interval_seconds]))
        ax.plot([planned], [100 * curve.waste[nearest]], "o", color=line.get_color(), ms=9)
    ax.axhline(
        100 * result.every_version_waste, ls="--", c="grey", label="every version, every level"
    )
    ax.axhline(
        100 * result.young_daly_waste, ls=":", c="black", label="Young/Daly, last level only"
    )
    ax.set_xscale("log")
    ax.set_xlabel("interval of the level (compute seconds between its versions)")
    ax.set_ylabel("expected waste (%)")
    model = "first-order model" if result.waste_model == "first-order" else "simulated"
    ax.set_title(f"cryosnap plan ({model}); circles: the plan")
    ax.legend()
    try:
        fig.savefig(out)
    except (OSError, ValueError) as exc:
        raise CliUsageError(f"--plot {out}: cannot write the plot: {exc}") from None
    return out


# ---------------------------------------------------------------------------------------------
# bench: cryosnap against its peers on this machine (cryosnap.benchmark does the measuring)


def _add_bench_command(app: "typer.Typer") -> None:
    import typer

    @app.command("bench")
    def bench_command(
        size: Annotated[
            str | None,
            typer.Option(
                "--size",
                metavar="SIZE",
                help="State size, e.g. 512MiB, 1GiB, 300MB (default 1GiB; training 288MiB).",
            ),
        ] = None,
        workload: Annotated[
            str,
            typer.Option("--workload", help="dense, many-small, sparse or training."),
        ] = "dense",
        repeat: Annotated[
            int, typer.Option("--repeat", help="Timed rounds; tables show medians.")
        ] = 3,
        warmup: Annotated[
            int, typer.Option("--warmup", help="Untimed rounds before the timed ones.")
        ] = 1,
        json_file: Annotated[
            str | None,
            typer.Option(
                "--json", metavar="FILE", help="Write machine, command, every sample to FILE."
            ),
        ] = None,
        plot: Annotated[
            str | None,
            typer.Option("--plot", metavar="OUT.png", help="Draw a bar chart (needs matplotlib)."),
        ] = None,
        directory: Annotated[
            str | None,
            typer.Option(
                "--dir",
                metavar="PATH",
                help="Where to write: a temporary folder inside it, deleted at the end "
                "(default: the system temp dir).",
            ),
        ] = None,
        tensors: Annotated[
            int, typer.Option("--tensors", help="many-small: how many tensors.")
        ] = 20_000,
        steps: Annotated[
            int, typer.Option("--steps", help="training: timed steps per method and interval.")
        ] = 20,
        step_seconds: Annotated[
            float,
            typer.Option("--step-seconds", help="training: the batch is tuned for this step time."),
        ] = 1.0,
        cold: Annotated[
            bool,
            typer.Option(
                "--cold/--no-cold",
                help="Also restore from a dropped page cache (needs root; drops it machine-wide).",
            ),
        ] = True,
    ) -> None:
        """Measure cryosnap against torch.save, safetensors, DCP (and torchsnapshot) on the same
        state, beside this machine's limits (memcpy, raw write+fsync, raw read)."""
        cmd_bench(
            size=size,
            workload=workload,
            repeat=repeat,
            warmup=warmup,
            json_file=json_file,
            plot=plot,
            directory=directory,
            tensors=tensors,
            steps=steps,
            step_seconds=step_seconds,
            cold=cold,
        )


def cmd_bench(
    *,
    size: str | None = None,
    workload: str = "dense",
    repeat: int = 3,
    warmup: int = 1,
    json_file: str | None = None,
    plot: str | None = None,
    directory: str | None = None,
    tensors: int = 20_000,
    steps: int = 20,
    step_seconds: float = 1.0,
    cold: bool = True,
) -> None:
    """Run :func:`cryosnap.benchmark.run`, print the table, write ``--json`` and ``--plot``.

    Every argument is checked before anything is measured: a bad one costs no benchmark time.
    """
    from . import benchmark

    try:
        config = benchmark.BenchConfig(
            workload=workload,
            size_bytes=None if size is None else benchmark.parse_size(size),
            repeat=repeat,
            warmup=warmup,
            directory=None if directory is None else Path(directory),
            tensors=tensors,
            steps=steps,
            step_seconds=step_seconds,
            cold=cold,
        )
        benchmark.require_torch()
        if plot:
            benchmark.check_plot_available()
            _plan_check_plot(plot)
    except (benchmark.BenchError, benchmark.MissingDependencyError) as exc:
        raise CliUsageError(str(exc)) from None
    if json_file:
        _bench_check_out(json_file, "--json")
    show = _BenchProgress()
    try:
        result = benchmark.run(config, command=_bench_command(), progress=show)
    finally:
        show.close()
    summary = result.summary()
    for line in summary[:2]:
        _print(line)
    _print()
    columns, rows = result.table()
    table = _Table([_Column(title, right=right) for title, right in columns])
    for row in rows:
        table.add(*row)
    table.render()
    _print()
    for line in summary[2:]:
        _print(line)
    if json_file:
        try:
            with open(json_file, "w") as f:
                json.dump(result.to_json(), f, indent=2)
                f.write("\n")
        except OSError as exc:
            raise CliUsageError(f"--json {json_file}: cannot write: {exc}") from None
        _print(f"wrote {json_file}")
    if plot:
        try:
            benchmark.plot(result, plot)
        except (OSError, ValueError) as exc:
            raise CliUsageError(f"--plot {plot}: cannot write the plot: {exc}") from None
        _print(f"wrote {plot}")


def _bench_check_out(out: str, option: str) -> None:
    """Refuse an output that could not be written before spending minutes measuring."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise CliUsageError(f"{option} {out}: no such directory {folder}")
    if os.path.isdir(out):
        raise CliUsageError(f"{option} {out}: is a directory")


def _bench_command() -> str:
    import shlex

    return shlex.join([PROG, *_ARGS])


class _BenchProgress:
    """Progress on stderr: one line redrawn in place on a terminal; elsewhere a line every
    30 seconds and one at the end (logs stay short)."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self._width = 0

    def __call__(self, step: Any) -> None:
        line = f"{PROG} bench: {step.done}/{step.total} {step.what} ({step.elapsed_seconds:.0f} s)"
        if self._tty:
            text = _truncate(line, 120)
            sys.stderr.write("\r" + text.ljust(self._width))
            self._width = len(text)
        elif step.done == step.total or step.elapsed_seconds - self._last >= 30:
            self._last = step.elapsed_seconds
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._tty and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
