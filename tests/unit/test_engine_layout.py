"""The engine package's imports point one way: its modules import only the layers below the
engine and the engine modules listed before them, never the orchestration above it; the same
holds inside its ``read`` subpackage."""

from __future__ import annotations

import ast
from pathlib import Path

import cryosnap.engine

ENGINE = Path(cryosnap.engine.__file__).parent
# Each module may import the ones before it (not necessarily all of them), never one after.
ORDER = ["_records", "_resolved", "_select", "_retire", "_write", "read", "_fetch", "_read"]
ORDER.append("__init__")
READ_ORDER = ["_plan", "_verify", "_mapped", "_gather", "_execute", "__init__"]
# What the engine may import from the rest of cryosnap: the layers below it.
BELOW = {
    "_gc",
    "_native",
    "capture",
    "chunks",
    "errors",
    "manifest",
    "policy",
    "progress",
    "storage",
    "tree",
}


def _relative_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            if node.module:
                out.append((node.level, node.module.split(".")[0]))
            else:  # from .. import x: each name is a module of that package
                out += [(node.level, a.name) for a in node.names]
    return out


def test_every_engine_module_is_placed_in_the_order() -> None:
    found = [p.stem for p in ENGINE.glob("*.py")] + [p.name for p in ENGINE.glob("*/")]
    assert sorted(n for n in found if n != "__pycache__") == sorted(ORDER)
    assert sorted(p.stem for p in (ENGINE / "read").glob("*.py")) == sorted(READ_ORDER)


def test_engine_modules_import_one_way() -> None:
    for name in ORDER:
        path = ENGINE / name / "__init__.py" if name == "read" else ENGINE / f"{name}.py"
        for level, module in _relative_imports(path):
            if level == 1 and name != "read":
                assert ORDER.index(module) < ORDER.index(name), f"{name} imports {module}"
            elif level == 1:
                assert module in READ_ORDER, f"read imports {module}"
            else:
                assert module in BELOW, f"engine/{name}.py imports cryosnap.{module}"


def test_read_modules_import_one_way() -> None:
    for name in READ_ORDER:
        for level, module in _relative_imports(ENGINE / "read" / f"{name}.py"):
            where = f"engine/read/{name}.py imports {'.' * level}{module}"
            if level == 1:
                assert READ_ORDER.index(module) < READ_ORDER.index(name), where
            elif level == 2:
                assert ORDER.index(module) < ORDER.index("read"), where
            else:
                assert module in BELOW, where


def test_no_absolute_import_of_cryosnap_inside_the_engine() -> None:
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("cryosnap"), path.name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("cryosnap") for a in node.names), path.name
