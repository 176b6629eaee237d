"""The engine package's imports point one way: its modules import only the layers below the
engine and the engine modules listed before them, never the orchestration above it; the same
holds inside its ``read`` subpackage."""

from __future__ import annotations

import ast
from pathlib import Path

import cryosnap.engine

ENGINE = Path(cryosnap.engine.__file__).parent
# Each module may import the ones before it (not necessarily all of them), never one after.
ORDER = [
    "items",
    "_records",
    "_resolved",
    "_select",
    "_retire",
    "write",
    "_write",
    "read",
    "_fetch",
    "_read",
    "__init__",
]
# The order inside each subpackage, as ORDER's.
PACKAGES = {
    "write": ["_differ", "_appender", "_shares", "part_writer", "__init__"],
    "read": ["_plan", "_verify", "_mapped", "_gather", "_execute", "__init__"],
}
# What the engine may import from the rest of cryosnap: the layers below it.
BELOW = {
    "_format",
    "_gc",
    "_native",
    "_units",
    "chunks",
    "errors",
    "manifest",
    "policy",
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
    packages = [p.parent.name for p in ENGINE.glob("*/__init__.py")]
    assert sorted([*(p.stem for p in ENGINE.glob("*.py")), *packages]) == sorted(ORDER)
    for package, order in PACKAGES.items():
        assert sorted(p.stem for p in (ENGINE / package).glob("*.py")) == sorted(order)


def test_engine_modules_import_one_way() -> None:
    for name in ORDER:
        if name in PACKAGES:
            continue
        for level, module in _relative_imports(ENGINE / f"{name}.py"):
            if level == 1:
                assert ORDER.index(module) < ORDER.index(name), f"{name} imports {module}"
            else:
                assert module in BELOW, f"engine/{name}.py imports cryosnap.{module}"


def test_subpackage_modules_import_one_way() -> None:
    for package, order in PACKAGES.items():
        for name in order:
            where = f"engine/{package}/{name}.py"
            for level, module in _relative_imports(ENGINE / package / f"{name}.py"):
                if level == 1:
                    assert order.index(module) < order.index(name), f"{where} imports {module}"
                elif level == 2:
                    assert ORDER.index(module) < ORDER.index(package), f"{where} imports {module}"
                else:
                    assert module in BELOW, f"{where} imports cryosnap.{module}"


def test_no_absolute_import_of_cryosnap_inside_the_engine() -> None:
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("cryosnap"), path.name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("cryosnap") for a in node.names), path.name
