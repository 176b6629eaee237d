"""The ``cryosnap`` command line: ``ls``, ``inspect``, ``verify``, ``diff``, ``export``, ``gc``,
``plan``, ``bench`` and ``import-dcp``.

Owns argument parsing (typer), rendering (rich tables when stdout is a terminal, plain aligned
text otherwise, JSON with ``--json``) and exit codes; the export formats are
:mod:`cryosnap.export`'s. Every command but ``gc`` and ``import-dcp`` only reads a run, through
:mod:`cryosnap.engine` and :mod:`cryosnap.export`, and takes no lock; ``gc`` deletes versions
and takes the run's write lock, as a writer does; ``import-dcp`` saves a version through
:func:`cryosnap.dcp.import_dcp` (a Checkpointer: the write lock too). It knows nothing of the
on-disk layout beyond the manifest and commit record types and the skeleton's node types
(:mod:`cryosnap.tree`), which ``inspect`` and ``diff`` walk without reading any data.
``bench`` renders what :mod:`cryosnap.benchmark` measures.

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

from . import engine
from .chunks import chunk_count
from .engine import ResolvedPart
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
)
from .export import ExportError, ExportResult, check_out, committed_steps, export
from .lock import acquire_run_lock
from .manifest import MAX_STEP, Manifest
from .progress import human_bytes
from .storage import Store, open_store
from .tree import iter_leaves

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
        help="List, inspect, verify, diff, export and garbage-collect cryosnap checkpoints; "
        "plan intervals; benchmark against the peers.",
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
        """List, inspect, verify, diff, export and garbage-collect cryosnap checkpoints."""

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


def _open(location: str) -> Store:
    if not location:
        raise CliUsageError("PATH must not be empty")
    return open_store(location)


# ---------------------------------------------------------------------------------------------
# ls


def cmd_ls(location: str, *, as_json: bool) -> None:
    """One row per committed version; a damaged commit record is a row, not an abort."""
    store = _open(location)
    versions: list[dict[str, Any]] = []
    for step in committed_steps(store):
        try:
            record = engine.read_commit(store, step)
        except CheckpointNotFoundError:
            continue  # removed by retention while we were listing
        except (CheckpointFormatError, IntegrityError) as exc:
            versions.append({"step": step, "damaged": True, "error": _one_line(str(exc))})
            continue
        versions.append(
            {
                "step": step,
                "damaged": False,
                "created": iso_time(record.created_unix),
                "created_unix": record.created_unix,
                "world_size": record.world_size,
                "leaves": record.leaves,
                "logical_bytes": record.logical_bytes,
                "written_bytes": record.written_bytes,
                "data_files": len(record.data_files),
                "chunk_bytes": record.chunk_bytes,
            }
        )
    if as_json:
        _print_json({"path": store.url, "versions": versions})
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


@dataclass(frozen=True, slots=True)
class LeafInfo:
    """One leaf of a manifest skeleton, as ``inspect`` shows it."""

    path: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    nbytes: int
    chunks: int
    blob: int | None
    shared_with: str | None
    value: str | None
    packed_with: str | None = None  # the first leaf of the pack of small tensors it lies in

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": self.shape,
            "bytes": self.nbytes,
            "chunks": self.chunks,
            "blob": self.blob,
            "shared_with": self.shared_with,
            "packed_with": self.packed_with,
            "value": self.value,
        }


# Element sizes of torch dtypes, so inspect never imports torch (slow) for the common ones.
_TORCH_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "complex32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def _torch_itemsize(name: str) -> int | None:
    if name in _TORCH_ITEMSIZE:
        return _TORCH_ITEMSIZE[name]
    if name.startswith("float8"):
        return 1
    try:
        import torch
    except ImportError:
        return None
    dtype = getattr(torch, name, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def _numpy_dtype(descr: Any) -> np.dtype[Any] | None:
    """The numpy dtype of a manifest ``dtype`` descr; None if it is not one.

    JSON turned the tuples of a structured descr into lists: ``[name, type, shape?]`` per field,
    where ``type`` may itself be a structured descr.
    """

    def as_descr(d: Any) -> Any:
        return [as_field(f) for f in d] if isinstance(d, list) else d

    def as_field(f: Any) -> Any:
        if not isinstance(f, list) or len(f) < 2:
            return f
        name, kind, *shape = f
        name = tuple(name) if isinstance(name, list) else name
        return (name, as_descr(kind), *(tuple(x) if isinstance(x, list) else x for x in shape))

    try:
        dtype: np.dtype[Any] = np.lib.format.descr_to_dtype(as_descr(descr))
    except (TypeError, ValueError, KeyError):
        return None
    return dtype


def _dtype_name(descr: Any) -> str:
    dtype = _numpy_dtype(descr)
    return str(dtype) if dtype is not None else repr(descr)


def _inline_value(node: dict[str, Any]) -> str | None:
    """The display text of a value held in the skeleton itself (no blob)."""
    t = node.get("t")
    v: Any = node.get("v")
    try:
        if t == "none":
            return "None"
        if t in ("int", "bool"):
            return str(v)
        if t == "str":
            return repr(v)
        if t == "float":
            return repr(float.fromhex(v))
        if t == "complex":
            return repr(complex(float.fromhex(v[0]), float.fromhex(v[1])))
        if t == "size":
            return f"torch.Size({list(v)})"
        if t == "npscalar":
            dtype = _numpy_dtype(node.get("dtype"))
            if dtype is None:
                return None
            return str(np.frombuffer(bytes.fromhex(node["hex"]), dtype=dtype)[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return "<malformed>"
    return None


def describe_leaves(manifest: Manifest) -> list[LeafInfo]:
    """Every leaf of one rank's manifest, from its skeleton alone: no data is read."""
    found = list(iter_leaves(manifest.skeleton))
    owner: dict[int, str] = {}  # blob -> the first leaf that uses it
    leaves: list[LeafInfo] = []
    for path, node in found:
        t = str(node.get("t"))
        blob: int | None = None
        nbytes = 0
        chunks = 0
        shared_with: str | None = None
        packed_with: str | None = None
        if "b" in node:
            b = node["b"]
            if type(b) is not int or not 0 <= b < len(manifest.blobs):
                raise CheckpointFormatError(f"leaf {path}: invalid blob reference {b!r:.40}")
            blob = b
            nbytes = manifest.blobs[b].nbytes
            if b in owner:
                # Packed leaves share a blob, not memory (their chunks count once).
                if "at" in node:
                    packed_with = owner[b]
                else:
                    shared_with = owner[b]
            else:
                owner[b] = path
                chunks = chunk_count(nbytes, manifest.chunk_bytes)
        shape = node.get("shape")
        shape = list(shape) if isinstance(shape, list) else None
        dtype: str | None = None
        if t == "torch":
            dtype = str(node.get("dtype"))
            if "view" in node or "at" in node:
                # A view into a storage shared with other tensors, or a leaf packed with
                # others into one blob: its own elements only.
                own = _own_bytes(node)
                if own is not None:
                    nbytes = own
        elif t in ("numpy", "npscalar"):
            dtype = _dtype_name(node.get("dtype"))
            if t == "npscalar":
                shape = []
                hex_value = node.get("hex")
                nbytes = len(hex_value) // 2 if isinstance(hex_value, str) else 0
        elif t in ("bytes", "bytearray"):
            shape = [nbytes]
        leaves.append(
            LeafInfo(
                path,
                t,
                dtype,
                shape,
                nbytes,
                chunks,
                blob,
                shared_with,
                _inline_value(node),
                packed_with,
            )
        )
    return leaves


def _shape_text(shape: list[int] | None) -> str:
    return "" if shape is None else str(tuple(shape))


def cmd_inspect(location: str, *, step: int | None, rank: int, as_json: bool) -> None:
    """The leaves of one version (default: the latest), read from its manifest."""
    store = _open(location)
    if step is None:
        step = committed_steps(store)[-1]
    record = engine.read_commit(store, step)
    manifest, _ref = engine.read_manifest(store, record, rank)
    leaves = describe_leaves(manifest)
    totals = {
        "leaves": len(leaves),
        "blobs": len(manifest.blobs),
        "chunks": sum(leaf.chunks for leaf in leaves),
        "logical_bytes": manifest.logical_bytes,
    }
    if as_json:
        _print_json(
            {
                "path": store.url,
                "step": step,
                "rank": rank,
                "world_size": record.world_size,
                "created": iso_time(manifest.created_unix),
                "chunk_bytes": manifest.chunk_bytes,
                "leaves": [leaf.to_json() for leaf in leaves],
                "totals": totals,
            }
        )
        return
    _print(
        f"step {step} of {store.url}, rank {rank} of {record.world_size}, created "
        f"{iso_time(manifest.created_unix)}, chunks of {human_bytes(manifest.chunk_bytes)}"
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


@dataclass(frozen=True, slots=True)
class VersionCheck:
    """The outcome of verifying every rank of one version."""

    step: int
    errors: tuple[str, ...]
    world_size: int | None = None
    leaves: int | None = None
    logical_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ok": self.ok,
            "world_size": self.world_size,
            "leaves": self.leaves,
            "logical_bytes": self.logical_bytes,
            "errors": list(self.errors),
        }


_DAMAGE = (IntegrityError, CheckpointFormatError)


def verify_version(store: Store, step: int) -> VersionCheck:
    """Read and hash every chunk of every rank of ``step``.

    A missing commit record raises CheckpointNotFoundError (the version does not exist); any
    other failure to read it back is damage, reported rather than raised.
    """
    try:
        record = engine.read_commit(store, step)
    except _DAMAGE as exc:
        return VersionCheck(step, (_one_line(str(exc)),))
    errors: list[str] = []
    for ref in record.manifests:
        try:
            engine.verify_part(store, step, rank=ref.rank)
        except (*_DAMAGE, CheckpointNotFoundError) as exc:
            # Inside a committed version, a missing manifest or data file is damage too.
            errors.append(_one_line(str(exc)))
    return VersionCheck(step, tuple(errors), record.world_size, record.leaves, record.logical_bytes)


def cmd_verify(location: str, *, step: int | None, as_json: bool) -> int:
    """Verify one version or every version; return 1 if any is damaged, else 0."""
    store = _open(location)
    checks: list[VersionCheck] = []
    if step is not None:
        checks.append(verify_version(store, step))
    else:
        for s in committed_steps(store):
            try:
                checks.append(verify_version(store, s))
            except CheckpointNotFoundError:
                continue  # removed by retention while we were verifying
    damaged = [c for c in checks if not c.ok]
    if as_json:
        _print_json(
            {"path": store.url, "ok": not damaged, "versions": [c.to_json() for c in checks]}
        )
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
    store = _open(location)
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


def _leaf_nodes(manifest: Manifest) -> dict[str, Any]:
    return dict(iter_leaves(manifest.skeleton))


def _own_bytes(node: dict[str, Any]) -> int | None:
    """The bytes of a torch leaf's own elements (a view or a packed tensor takes fewer than
    its blob), or None where its dtype or shape is unknown."""
    shape, item = node.get("shape"), _torch_itemsize(str(node.get("dtype")))
    if not isinstance(shape, list) or item is None:
        return None
    return int(np.prod(shape, dtype=np.int64)) * item


def _packed_range(node: dict[str, Any], blob_bytes: int) -> tuple[int, int] | None:
    """The byte range a packed leaf takes in its blob, or None (not packed, or malformed)."""
    at, own = node.get("at"), _own_bytes(node)
    if type(at) is not int or own is None:
        return None
    return (at, at + own) if 0 <= at <= at + own <= blob_bytes else None


class _Packs:
    """Packs of small tensors read for ``diff`` (through the engine's reader: every chunk
    verified); the last few are kept, since a pack's tensors come one after the other (every
    tensor of a changed pack reads it once, not once per tensor)."""

    _KEEP = 8

    def __init__(self, store: Store) -> None:
        self.store = store
        self.kept: dict[tuple[int, int], bytes] = {}

    def span(self, part: ResolvedPart, b: int, span: tuple[int, int]) -> bytes:
        """The bytes ``span`` of blob ``b`` of ``part``."""
        key = (id(part), b)
        data = self.kept.get(key)
        if data is None:
            data = self.kept[key] = engine.read_blob(self.store, part, b)
            if len(self.kept) > self._KEEP:
                del self.kept[next(iter(self.kept))]
        return data[span[0] : span[1]]


def _packed_diff(
    packs: _Packs,
    path: str,
    new: tuple[ResolvedPart, int, tuple[int, int] | None],
    old: tuple[ResolvedPart, int, tuple[int, int] | None],
    comparable: bool,
) -> dict[str, Any] | None:
    """The diff row of a packed leaf, or None (unchanged). ``new`` and ``old``: the version,
    the blob and the leaf's byte range in it; ``comparable``: the two nodes are alike (dtype,
    shape, offset in the pack) and the chunk sizes the same. Where the chunks the leaf lies in
    differ (small leaves share chunks), the packs are read, verified, and the leaf's own
    bytes compared."""
    (vx, bx, rx), (vy, by, ry) = new, old
    if rx is None or ry is None or not comparable:
        size = 0 if rx is None else rx[1] - rx[0]
        return {"path": path, "status": "changed", "changed_bytes": size}
    # Alike nodes give one range, inside both blobs (_packed_range): so are its chunks.
    cb = vx.manifest.chunk_bytes
    lo, hi = rx[0] // cb, -(-rx[1] // cb)
    if (vx.blobs[bx].hashes[lo:hi] != vy.blobs[by].hashes[lo:hi]).any():
        if packs.span(vx, bx, rx) == packs.span(vy, by, ry):
            return None
        return {"path": path, "status": "changed", "changed_bytes": rx[1] - rx[0]}
    return None


def cmd_diff(location: str, a: int, b: int, *, rank: int, as_json: bool) -> None:
    """Per leaf: added, removed or changed between steps ``a`` and ``b``, with changed bytes.

    Compares chunk hashes from the two manifests (resolved through their chains): no data is
    read, and the changed bytes are those of the chunks whose content differs. A small tensor
    packed with others shares its chunk with them: where that chunk differs, it is read (from
    both versions, verified) to compare the leaf's own bytes.
    """
    store = _open(location)
    old = engine.resolve_version(store, a, rank=rank)
    new = engine.resolve_version(store, b, rank=rank)
    cb = new.manifest.chunk_bytes
    old_nodes, new_nodes = _leaf_nodes(old.manifest), _leaf_nodes(new.manifest)
    packs = _Packs(store)
    rows: list[dict[str, Any]] = []
    changed_total = 0
    for path, node in new_nodes.items():
        before = old_nodes.get(path)
        if before is None:
            rows.append({"path": path, "status": "added", "changed_bytes": None})
            continue
        blob_new, blob_old = node.get("b"), before.get("b")
        if blob_new is None or blob_old is None:
            if {k: v for k, v in node.items() if k != "b"} != {
                k: v for k, v in before.items() if k != "b"
            }:
                rows.append({"path": path, "status": "changed", "changed_bytes": 0})
            continue
        x, y = new.blobs[blob_new], old.blobs[blob_old]
        meta_same = {k: v for k, v in node.items() if k != "b"} == {
            k: v for k, v in before.items() if k != "b"
        }
        if "at" in node or "at" in before:
            # A leaf packed with others: its own bytes, where it lies in both versions.
            row = _packed_diff(
                packs,
                path,
                (new, blob_new, _packed_range(node, x.nbytes)),
                (old, blob_old, _packed_range(before, y.nbytes)),
                meta_same and old.manifest.chunk_bytes == cb,
            )
            if row is not None:
                changed_total += row["changed_bytes"]
                rows.append(row)
            continue
        if x.nbytes != y.nbytes or old.manifest.chunk_bytes != cb:
            rows.append({"path": path, "status": "changed", "changed_bytes": x.nbytes})
            changed_total += x.nbytes
            continue
        differ = np.flatnonzero((x.hashes != y.hashes).any(axis=1))
        if differ.size == 0 and meta_same:
            continue
        sizes = np.minimum(cb, x.nbytes - differ.astype(np.int64) * cb)
        nbytes = int(sizes.sum())
        changed_total += nbytes
        rows.append(
            {
                "path": path,
                "status": "changed",
                "changed_bytes": nbytes,
                "changed_chunks": int(differ.size),
                "chunks": len(x.hashes),
            }
        )
    rows.extend(
        {"path": p, "status": "removed", "changed_bytes": None}
        for p in old_nodes
        if p not in new_nodes
    )
    logical = new.manifest.logical_bytes
    if as_json:
        _print_json(
            {
                "path": store.url,
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
    store = _open(location)
    steps = committed_steps(store)  # a missing run is a usage error, not an empty success
    if dry_run:
        plan = engine.plan_retire(store, keep=keep)
        deleted, gone = plan.dropped, plan.data_files
        freed = sum(store.size(k) for k in gone)
        kept = [s for s in steps if s not in set(deleted)]
    else:
        lock = acquire_run_lock(store)
        try:
            before = {k: store.size(k) for k in store.list("data")}
            deleted = engine.retire(store, keep=keep, fence=lock.check)
            after = set(store.list("data"))
        finally:
            lock.release()
        gone = [k for k in before if k not in after]
        freed = sum(before[k] for k in gone)
        kept = engine.list_steps(store)
    if as_json:
        _print_json(
            {
                "path": store.url,
                "dry_run": dry_run,
                "deleted_steps": deleted,
                "kept_steps": kept,
                "freed_bytes": freed,
                "data_files_deleted": len(gone),
            }
        )
        return
    verb = ("would delete", "would free") if dry_run else ("deleted", "freed")
    _print(
        f"{verb[0]} {_plural(len(deleted), 'version')}, kept {_plural(len(kept), 'version')}; "
        f"{verb[1]} {human_bytes(freed)}"
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
