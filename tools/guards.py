"""The guards `make lint` runs beside ruff and import-linter (issue 57): sizes and paths.

- sizes: no function over 100 lines and no class over 400 in src/, tests/, bench/ and
  examples/, but those in ALLOWED (each with its reason);
- paths: every backticked repository path in README.md, docs/**/*.md and the docstrings of
  src/ exists (a path moved or deleted leaves no stale name behind).

Each failure names the offender and its size (or the path and where it is named); exit 1.
Usage: python tools/guards.py [sizes] [paths] (both by default), from the repository root.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 400
TREES = ("src", "tests", "bench", "examples", "tools")

# "path:qualified.name" -> why it may be longer. Keep it short: a long function is split by
# route, not allowed.
ALLOWED: dict[str, str] = {}


def _sources() -> Iterator[Path]:
    for tree in TREES:
        yield from sorted((ROOT / tree).rglob("*.py"))


def _sized(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, str, int, int]]:
    """(kind, qualified name, first line, lines) of every function and class, nested too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            end = node.end_lineno or node.lineno
            name = f"{prefix}{node.name}"
            yield kind, name, node.lineno, end - first + 1
            yield from _sized(node, f"{name}.")
        else:
            yield from _sized(node, prefix)


def check_sizes() -> list[str]:
    problems = []
    seen: set[str] = set()
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for kind, name, line, lines in _sized(tree):
            limit = MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES
            key = f"{rel}:{name}"
            if key in ALLOWED:
                seen.add(key)
                continue
            if lines > limit:
                problems.append(f"{rel}:{line}: {kind} {name} is {lines} lines (at most {limit})")
    problems += [
        f"tools/guards.py: ALLOWED names {k}, which is no longer there"
        for k in sorted(set(ALLOWED) - seen)
    ]
    return problems


# A path in backticks: segments of a file name, the first one a folder of the repository
# (`docs/FORMAT.md`), of src/ (`cryosnap/run.py`) or of the package (`_run/writer.py`).
_BACKTICKED = re.compile(r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+/?)`")
_BASES = (ROOT, ROOT / "src", ROOT / "src" / "cryosnap")


# A bare path to a file of the repository's own folders (`docs/design/levels.md has the why`).
_BARE = re.compile(
    r"(?<![\w/.`-])((?:docs|tests|bench|examples|src|tools)/[A-Za-z0-9_./\-]*\.(?:md|py|sh|toml|json))\b"
)


# Words that say a path is gone on purpose ("the former `bench/x.py`", "removed ... `y.py`").
_GONE = re.compile(r"\b(former|removed|deleted)\b[^`]{0,40}$")


def _named_paths(text: str) -> Iterator[tuple[int, str]]:
    found = [(m.start(), m.group(1)) for m in _BACKTICKED.finditer(text)]
    found += [(m.start(), m.group(1)) for m in _BARE.finditer(text)]
    for at, named in found:
        first = named.split("/", 1)[0]
        if first in (".", "..") or not any((base / first).is_dir() for base in _BASES):
            continue
        if _GONE.search(text[max(0, at - 60) : at]):
            continue
        yield text.count("\n", 0, at) + 1, named


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                yield node.body[0].lineno, doc


def _exists(named: str) -> bool:
    return any((base / named.rstrip("/")).exists() for base in _BASES)


def check_paths() -> list[str]:
    problems = []
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for doc in docs:
        rel = doc.relative_to(ROOT).as_posix()
        for line, named in _named_paths(doc.read_text(encoding="utf-8")):
            if not _exists(named):
                problems.append(f"{rel}:{line}: names `{named}`, which does not exist")
    for path in sorted((ROOT / "src").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for start, doc in _docstrings(path):
            for line, named in _named_paths(doc):
                if not _exists(named):
                    problems.append(
                        f"{rel}:{start + line - 1}: a docstring names `{named}`, which does "
                        "not exist"
                    )
    return problems


def main(argv: list[str]) -> int:
    which = argv or ["sizes", "paths"]
    checks = {"sizes": check_sizes, "paths": check_paths}
    problems = [p for name in which for p in checks[name]()]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
