"""Output of the command line: aligned tables (rich on a terminal, plain text otherwise), JSON,
the one-line errors and notes on stderr, and the :class:`Invocation` being run.

Pure rendering: nothing here reads a run. rich is imported only to draw a table on a terminal.
Runs on the caller's thread.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

PROG = "cryosnap"


@dataclass(frozen=True, slots=True)
class Invocation:
    """The command line being run: its arguments (``bench`` records them) and how an error is
    reported (with ``--json`` also as one JSON object on stdout, since scripts read stdout
    only; bench's ``--json`` names a file, and its stdout is the table)."""

    args: tuple[str, ...]

    @property
    def json_errors(self) -> bool:
        return "--json" in self.args and self.args[:1] != ("bench",)

    def command(self) -> str:
        """The command line as a shell would take it."""
        return shlex.join([PROG, *self.args])

    def error(self, message: str, code: int, kind: str = "error") -> int:
        """One line on stderr (and with ``--json`` one object on stdout); returns ``code``."""
        sys.stderr.write(f"{PROG}: error: {one_line(message)}\n")
        if self.json_errors:
            doc = {"error": one_line(message), "type": kind, "exit_code": code}
            sys.stdout.write(json.dumps(doc) + "\n")
        return code


def one_line(message: str) -> str:
    return " ".join(message.split())


def note(message: str) -> None:
    sys.stderr.write(f"{PROG}: note: {one_line(message)}\n")


def print_line(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def iso_time(unix: float) -> str:
    """A Unix time as ISO 8601 in UTC, to the second."""
    return datetime.fromtimestamp(unix, timezone.utc).isoformat(timespec="seconds")


def plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def truncate(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class Column:
    title: str
    right: bool = False


@dataclass(slots=True)
class Table:
    """Rows of text cells. A *message row* has two cells: the first column and a message that
    spans the rest (a damaged version), and takes no part in the column widths."""

    columns: list[Column]
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
        from rich.table import Table as RichTable

        table = RichTable(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
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
