"""Deltas: ``export(since=)`` writes only the changed leaves and the roots of both versions;
``cryosnap.apply_delta`` takes a state from A to B bit for bit, refuses a wrong base and any
hostile document before changing anything."""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import cryosnap
from cryosnap.errors import (
    CheckpointFormatError,
    ExportError,
    IntegrityError,
    StateMismatchError,
)
from cryosnap.export import export
from tests.unit.lineage_support import counting, lineages, save_versions
from tests.unit.support import assert_same, snapshot

KEY = "__cryosnap_delta__"


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        if isinstance(value, (dict, list, tuple)):
            out |= _leaves(value, f"{prefix}{key}/")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _assert_leaves_same(expected: Any, actual: Any) -> None:
    want, got = _leaves(expected), _leaves(actual)
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        assert_same(value, got[path], path)


# ---------------------------------------------------------------------------------------------
# round trips


@settings(max_examples=10)
@given(lineages(), st.data())
def test_a_delta_takes_a_to_b_bit_for_bit(lineage: Any, data: st.DataObject) -> None:
    _round_trip(lineage, data)


@pytest.mark.deep
@settings(max_examples=120)
@given(lineages(versions=6), st.data())
def test_delta_campaign(lineage: Any, data: st.DataObject) -> None:
    _round_trip(lineage, data)


def _round_trip(lineage: Any, data: st.DataObject) -> None:
    first, edits = lineage
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        steps = save_versions(run, first, edits)
        a, b = sorted(data.draw(st.lists(st.sampled_from(steps), min_size=2, max_size=2)))
        out = Path(tmp) / "delta.safetensors"
        result = export(run, out, step=b, since=a)
        state = cryosnap.load(run, step=a)
        before = _leaves(state)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            applied = cryosnap.apply_delta(state, out)
        want = cryosnap.load(run, step=b)
        _assert_leaves_same(want, applied)
        changed = {p for p, _v in cryosnap.Run(run).changes(a, b)}
        assert result.leaves == len(changed)
        after = _leaves(applied)
        for path, old in before.items():
            new = after.get(path)
            if path not in changed:  # untouched leaves are the state's own objects
                assert new is old or path not in after, path
            elif _fits(old, new):  # changed in place
                assert new is old, path


def _fits(old: Any, new: Any) -> bool:
    """Whether ``apply_delta`` fills ``old`` in place with ``new``: one type, dtype, shape,
    grad flag, and memory order."""
    if type(old) is not type(new) or not isinstance(old, (torch.Tensor, np.ndarray)):
        return False
    if (old.dtype, old.shape) != (new.dtype, new.shape):
        return False
    if isinstance(old, torch.Tensor):
        return bool(old.requires_grad == new.requires_grad)
    return _fortran(old) == _fortran(new)


def _fortran(arr: np.ndarray) -> bool:
    return arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous


def _two_versions(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    emb = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    a = {
        "model": {"emb": emb, "bias": torch.zeros(3), "head": torch.ones(2, 2)},
        "opt": {"step": 1, "lr": 0.1, "state": [np.zeros(4), np.ones(2)]},
        "old": {"gone": np.arange(3)},
    }
    cryosnap.save(path, a, step=1)
    emb2 = emb.clone()
    emb2[3] += 1  # one row of 64
    b = {
        "model": {"emb": emb2, "bias": torch.ones(3), "head": torch.ones(2, 2)},
        "opt": {"step": 2, "lr": 0.1, "state": [np.zeros(4)], "new": np.float32(7)},
        "added": {"t": torch.arange(5)},
    }
    cryosnap.save(path, b, step=2)
    return a, b


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_removed_and_added_leaves_and_what_the_file_holds(tmp_path: Path, suffix: str) -> None:
    _two_versions(tmp_path / "run")
    out = tmp_path / f"delta{suffix}"
    result = export(tmp_path / "run", out, since=1)
    assert (result.step, result.since) == (2, 1)
    assert result.removed == ("opt/state/1", "old/gone")
    if suffix == ".safetensors":
        with safe_open(str(out), framework="pt") as f:
            names = set(f.keys())
            doc = json.loads(f.metadata()[KEY])
    else:
        with np.load(out) as npz:
            names = set(npz.files) - {KEY}
            doc = json.loads(npz[KEY].tobytes())
    assert names == {"model/emb", "model/bias", "added/t"}  # scalars are in the document
    assert set(doc["leaves"]) == names | {"opt/step", "opt/new"}
    assert (doc["a"]["step"], doc["b"]["step"], doc["removed"]) == (1, 2, list(result.removed))
    assert doc["a"]["roots"]["model/head"] == doc["b"]["roots"]["model/head"]
    assert doc["a"]["roots"]["model/emb"] != doc["b"]["roots"]["model/emb"]
    state = cryosnap.load(tmp_path / "run", step=1)
    emb = state["model"]["emb"]
    out_state = cryosnap.apply_delta(state, out)
    assert out_state is state and out_state["model"]["emb"] is emb
    _assert_leaves_same(cryosnap.load(tmp_path / "run", step=2), out_state)
    assert "old" not in out_state  # emptied by its removal


def test_a_module_is_updated_through_its_state_dict(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    cryosnap.save(tmp_path / "run", model.state_dict(), step=0)
    replica = torch.nn.Linear(4, 3)
    replica.load_state_dict(model.state_dict())
    with torch.no_grad():
        model.weight.mul_(2)
    cryosnap.save(tmp_path / "run", model.state_dict(), step=1)
    export(tmp_path / "run", tmp_path / "d.safetensors", since=0)
    cryosnap.apply_delta(replica.state_dict(), tmp_path / "d.safetensors")
    assert torch.equal(replica.weight, model.weight) and torch.equal(replica.bias, model.bias)


def test_export_reads_the_changed_leaves_only(tmp_path: Path) -> None:
    big = torch.zeros(1 << 18)
    cryosnap.save(tmp_path / "run", {"big": big, "w": torch.zeros(1024)}, step=0)
    cryosnap.save(tmp_path / "run", {"big": big, "w": torch.ones(1024)}, step=1)
    store = counting(tmp_path / "run")
    export(store, tmp_path / "d.safetensors", since=0)
    assert store.total < (1 << 18) * 4 // 8  # not the 1 MiB leaf that did not change


# ---------------------------------------------------------------------------------------------
# refusals: nothing changed, nothing written


def test_a_wrong_base_is_refused_before_anything_changes(tmp_path: Path) -> None:
    _two_versions(tmp_path / "run")
    out = tmp_path / "d.safetensors"
    export(tmp_path / "run", out, since=1)
    for state in (
        cryosnap.load(tmp_path / "run", step=2),  # already B
        _edited(cryosnap.load(tmp_path / "run", step=1)),  # A with one element changed
    ):
        before, leaves = snapshot(state), _leaves(state)
        with pytest.raises(StateMismatchError) as info:
            cryosnap.apply_delta(state, out)
        assert info.value.step == 1 and info.value.path == str(tmp_path / "run")
        assert "nothing was changed" in str(info.value)
        assert snapshot(state) == before
        assert all(_leaves(state)[p] is v for p, v in leaves.items())


def _edited(state: dict[str, Any]) -> dict[str, Any]:
    state["model"]["head"][0, 0] = 5.0
    return state


def test_a_state_of_other_leaves_is_refused(tmp_path: Path) -> None:
    _two_versions(tmp_path / "run")
    export(tmp_path / "run", tmp_path / "d.npz", since=1)
    state = cryosnap.load(tmp_path / "run", step=1)
    state["extra"] = object()
    with pytest.raises(StateMismatchError, match="extra"):
        cryosnap.apply_delta(state, tmp_path / "d.npz")
    del state["extra"]
    state["model"]["bias"] = state["model"]["bias"].double()
    with pytest.raises(StateMismatchError, match=r"model/bias is torch float64 \[3\]"):
        cryosnap.apply_delta(state, tmp_path / "d.npz")


def _delta_file(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    _two_versions(tmp_path / "run")
    out = tmp_path / "d.safetensors"
    export(tmp_path / "run", out, since=1)
    with safe_open(str(out), framework="pt") as f:
        meta = dict(f.metadata())
    return out, load_file(str(out)), meta


def _edit_doc(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(meta: dict[str, Any]) -> None:
        doc = json.loads(meta[KEY])
        edit(doc)
        meta[KEY] = json.dumps(doc)

    return apply


def _set(path: list[str], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return _edit_doc(edit)


_EMB = ["leaves", "model/emb"]
HOSTILE: dict[str, Callable[[dict[str, Any]], None]] = {
    "a leaf outside B": _set(["leaves", "../../etc/passwd"], {"keys": [], "containers": []}),
    "a removed leaf A lacks": _set(["removed"], ["old/gone", "opt/state/1", "x/y"]),
    "a removed leaf B holds": _set(["removed"], ["old/gone", "opt/state/1", "model/head"]),
    "a kept leaf whose root changed": _set(["a", "roots", "model/head", "root"], "0" * 32),
    "a root that is no hex": _set(["b", "roots", "model/emb", "root"], "zz" * 16),
    "a shape of strings": _set(["b", "roots", "model/emb", "shape"], ["64", "64"]),
    "an unknown kind": _set(["b", "roots", "model/emb", "kind"], "pickle"),
    "keys of floats": _set([*_EMB, "keys"], ["model", 1.5]),
    "keys of another path": _set([*_EMB, "keys"], ["model", "head"]),
    "an index into a dict": _set([*_EMB, "containers"], ["dict", "list"]),
    "a scalar node with a blob": _set(["leaves", "opt/step", "node"], {"t": "int", "b": 0}),
    "a scalar node of another kind": _set(["leaves", "opt/step", "node"], {"t": "str", "v": "x"}),
    "a tensor leaf as a node": _set([*_EMB, "stored"], "node"),
    "chunk_bytes out of range": _set(["b", "chunk_bytes"], 12),
    "another version": _set(["version"], 2),
    "no object": lambda meta: meta.__setitem__(KEY, "[1, 2]"),
    "no JSON": lambda meta: meta.__setitem__(KEY, "{"),
    "no document": lambda meta: meta.pop(KEY),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_document_is_refused_and_the_state_untouched(tmp_path: Path, case: str) -> None:
    out, tensors, meta = _delta_file(tmp_path)
    HOSTILE[case](meta)
    save_file(tensors, str(out), metadata=meta)
    state = cryosnap.load(tmp_path / "run", step=1)
    before = snapshot(state)
    with pytest.raises(CheckpointFormatError):
        cryosnap.apply_delta(state, out)
    assert snapshot(state) == before


def test_damaged_or_extra_tensors_are_refused(tmp_path: Path) -> None:
    out, tensors, meta = _delta_file(tmp_path)
    state = cryosnap.load(tmp_path / "run", step=1)
    before = snapshot(state)
    tensors["model/bias"] = tensors["model/bias"] + 1
    save_file(tensors, str(out), metadata=meta)
    with pytest.raises(IntegrityError, match="model/bias does not match its root in step 2"):
        cryosnap.apply_delta(state, out)
    tensors = load_file(str(out))
    tensors["model/smuggled"] = torch.zeros(1)
    save_file(tensors, str(out), metadata=meta)
    with pytest.raises(CheckpointFormatError, match="model/smuggled"):
        cryosnap.apply_delta(state, out)
    assert snapshot(state) == before


def test_export_refusals_write_nothing(tmp_path: Path) -> None:
    _two_versions(tmp_path / "run")
    with pytest.raises(ValueError, match=r"\.safetensors or \.npz"):
        export(tmp_path / "run", tmp_path / "d.pt", since=1)
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        export(tmp_path / "run", tmp_path / "d.npz", since=9)
    (tmp_path / "f.bin").write_bytes(b"abc")
    cryosnap.save(tmp_path / "files", {"f": cryosnap.File(tmp_path / "f.bin"), "x": 1}, step=0)
    cryosnap.save(tmp_path / "files", {"f": cryosnap.File(tmp_path / "f.bin"), "x": 2}, step=1)
    with pytest.raises(ExportError, match="leaf f is a file leaf") as info:
        export(tmp_path / "files", tmp_path / "d.npz", since=0)
    assert info.value.step == 0 and info.value.path == str(tmp_path / "files")
    cryosnap.save(tmp_path / "bf", {"w": torch.ones(2, dtype=torch.bfloat16)}, step=0)
    cryosnap.save(tmp_path / "bf", {"w": torch.zeros(2, dtype=torch.bfloat16)}, step=1)
    with pytest.raises(ExportError, match="bfloat16"):
        export(tmp_path / "bf", tmp_path / "d.npz", since=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf", "f.bin", "files", "run"]


def test_a_delta_path_is_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="delta"):
        cryosnap.apply_delta({}, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\.safetensors or \.npz"):
        cryosnap.apply_delta({}, tmp_path / "d.pt")
    with pytest.raises(FileNotFoundError):
        cryosnap.apply_delta({}, tmp_path / "d.npz")
