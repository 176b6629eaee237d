"""The public surface: each public namespace's ``__all__`` is sorted, complete and importable
(as httpx checks its own), and importing cryosnap pulls in neither torch nor typer."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
import types
from typing import Any

import pytest

import cryosnap

PUBLIC = [
    "cryosnap",
    "cryosnap.errors",
    "cryosnap.policy",
    "cryosnap.plan",
    "cryosnap.storage",
    "cryosnap.dist",
    "cryosnap.testing",
    "cryosnap.dcp",
    "cryosnap.integrations.torch",
]


def _public_modules() -> list[str]:
    """Every module of the package whose dotted name has no segment starting with ``_``."""
    return sorted(
        m.name
        for m in pkgutil.walk_packages(cryosnap.__path__, "cryosnap.")
        if not any(seg.startswith("_") for seg in m.name.split("."))
    )


def test_the_listed_namespaces_are_public_modules() -> None:
    assert set(PUBLIC) - {"cryosnap"} <= set(_public_modules())


@pytest.mark.parametrize("name", ["cryosnap", *_public_modules()])
def test_all_is_sorted_and_every_name_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"
    for item in exported:
        assert getattr(module, item) is not None, f"{name}.{item}"
    # Complete: every public class and function the module defines is exported.
    defined = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and (inspect.isclass(v) or inspect.isfunction(v))
        and getattr(v, "__module__", None) == name
    }
    assert defined <= set(exported), f"{name}.__all__ lacks {sorted(defined - set(exported))}"


def test_the_root_exports_every_public_name_it_defines() -> None:
    public = {
        n
        for n, v in vars(cryosnap).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    public.discard("annotations")  # from __future__
    assert public <= set(cryosnap.__all__), sorted(public - set(cryosnap.__all__))


def test_every_error_is_in_errors_and_derives_from_checkpoint_error() -> None:
    from cryosnap import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.CheckpointError), name
        assert name in errors.__doc__, f"{name} is not drawn in the tree of errors.py"
    for name in errors.__all__:
        assert getattr(cryosnap, name, None) is getattr(errors, name) or name in (
            "CheckpointError",
        ), f"cryosnap.{name}"


def test_importing_cryosnap_imports_neither_torch_nor_typer() -> None:
    code = (
        "import sys, cryosnap\n"
        "print(sorted(m for m in ('torch', 'typer', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_errors_carry_the_step_and_path_they_name(tmp_path: Any) -> None:
    import numpy as np

    run = tmp_path / "run"
    cryosnap.save(run, {"x": np.arange(4)}, step=3)
    with pytest.raises(cryosnap.CheckpointNotFoundError) as missing:
        cryosnap.load(run, step=5)
    assert missing.value.step == 5 and missing.value.path == str(run)
    [manifest] = (run / "versions" / "000000000003").glob("rank-*.json")
    manifest.write_bytes(manifest.read_bytes() + b" ")
    with pytest.raises(cryosnap.IntegrityError) as damaged:
        cryosnap.load(run, step=3)
    assert damaged.value.step == 3
    assert damaged.value.path == "versions/000000000003/rank-00000.json"
    assert cryosnap.CheckpointError("no step").step is None


def test_tier_is_the_former_name_of_device() -> None:
    """``Tier`` (the first releases' name) and ``Device`` are one class: old code keeps working."""
    assert cryosnap.Tier is cryosnap.Device
    assert cryosnap.Tier("/tmp/x") == cryosnap.Device("/tmp/x")
