"""``Run.history`` and ``Run.changes``: held against brute-force loads of every version, and
measured (the data bytes read) to prove that only the leaf's chunks are read, each distinct
content once."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap import engine
from cryosnap.errors import CheckpointError, CheckpointNotFoundError, KeyNotFoundError
from tests.unit.lineage_support import (
    counting,
    differs,
    leaf_at,
    lineages,
    nest,
    save_versions,
)
from tests.unit.support import assert_same


def _paths(tree: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(value, dict):
            out += _paths(value, path + "/")
    return out


# ---------------------------------------------------------------------------------------------
# against brute force


@settings(max_examples=12)
@given(lineages(), st.data())
def test_history_and_changes_match_loading_every_version(lineage: Any, data: st.DataObject) -> None:
    _check_lineage(lineage, data)


@pytest.mark.deep
@settings(max_examples=150)
@given(lineages(versions=6), st.data())
def test_history_and_changes_campaign(lineage: Any, data: st.DataObject) -> None:
    _check_lineage(lineage, data)


def _check_lineage(lineage: Any, data: st.DataObject) -> None:
    first, edits = lineage
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # kinds and shapes change on purpose
        path = Path(tmp) / "run"
        steps = save_versions(path, first, edits)
        run = cryosnap.Run(path)
        loaded = {s: run.load(s) for s in steps}
        every = sorted({p for tree in loaded.values() for p in _paths(tree)})
        for leaf in every:
            expected = [
                (s, leaf_at(loaded[s], leaf)[1]) for s in steps if leaf_at(loaded[s], leaf)[0]
            ]
            got = list(run.history(leaf))
            assert [s for s, _v in got] == [s for s, _v in expected]
            for (_s, want), (_t, value) in zip(expected, got, strict=True):
                assert_same(want, value, leaf)
        a, b = sorted(data.draw(st.lists(st.sampled_from(steps), min_size=2, max_size=2)))
        _check_changes(run, loaded, a, b)


def _check_changes(run: cryosnap.Run, loaded: dict[int, Any], a: int, b: int) -> None:
    old = dict(_leaves(loaded[a]))
    want = [(p, v) for p, v in _leaves(loaded[b]) if p not in old or differs(old[p], v)]
    got = list(run.changes(a, b))
    assert [p for p, _v in got] == [p for p, _v in want]
    for (p, value), (_q, expected) in zip(got, want, strict=True):
        assert_same(expected, value, p)
    removed = {row.path for row in run.diff(a, b).leaves if row.status == "removed"}
    assert removed == set(old) - {p for p, _v in _leaves(loaded[b])}


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}/")
        else:
            out.append((f"{prefix}{key}", value))
    return out


# ---------------------------------------------------------------------------------------------
# what is read


def _weights_run(path: Path) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Six versions: ``big`` changes every version, ``w`` at steps 0 and 3 only, ``tiny``
    (packed with ``step``) never."""
    big = torch.zeros(1 << 18)  # 1 MiB
    w = torch.zeros(64, 1024)  # 256 KiB
    held: dict[int, torch.Tensor] = {}
    with cryosnap.Checkpointer(path, chunk_bytes=64 << 10) as ckpt:
        for step in range(6):
            big += 1
            if step in (0, 3):
                w = w + 1
            held[step] = w
            state = {"big": big.clone(), "layer": {"w": w, "tiny": np.ones(3)}, "step": step}
            ckpt.save(step, state).result()
    return list(range(6)), held


def test_history_reads_the_leafs_chunks_only_and_each_content_once(tmp_path: Path) -> None:
    steps, held = _weights_run(tmp_path / "run")
    store = counting(tmp_path / "run")
    run = cryosnap.Run(store)
    with engine.read_limits(gap_bytes=0):
        got = list(run.history("layer/w"))
    assert [s for s, _v in got] == steps
    for step, value in got:
        assert torch.equal(value, held[step])
    # Two distinct contents (steps 0-2, 3-5): each read once, its bytes and nothing else.
    assert store.total == 2 * held[0].nbytes
    assert got[0][1] is got[1][1] is got[2][1]
    assert got[3][1] is got[5][1] and got[3][1] is not got[0][1]


def test_history_of_steps_reads_only_those(tmp_path: Path) -> None:
    _steps, held = _weights_run(tmp_path / "run")
    store = counting(tmp_path / "run")
    with engine.read_limits(gap_bytes=0):
        got = list(cryosnap.Run(store).history("layer/w", steps=[4, 1]))
    assert [s for s, _v in got] == [1, 4]
    assert torch.equal(got[1][1], held[4])
    assert store.total == 2 * held[0].nbytes


def test_a_subtree_is_built_as_load_builds_it(tmp_path: Path) -> None:
    _weights_run(tmp_path / "run")
    run = cryosnap.Run(tmp_path / "run")
    for step, value in run.history("layer"):
        assert_same(run.load(step)["layer"], value)
    (_s, whole), *_ = run.history("<root>", steps=[2])
    assert_same(run.load(2), whole)


def test_changes_read_only_what_changed(tmp_path: Path) -> None:
    _weights_run(tmp_path / "run")
    store = counting(tmp_path / "run")
    run = cryosnap.Run(store)
    with engine.read_limits(gap_bytes=0):
        got = dict(run.changes(1, 2))
    assert list(got) == ["big", "step"]
    assert store.total == (1 << 18) * 4
    assert torch.equal(got["big"], torch.full((1 << 18,), 3.0))
    store.reset()
    with engine.read_limits(gap_bytes=0):
        got = dict(run.changes(2, 3))
    assert list(got) == ["big", "layer/w", "step"]
    assert store.total == (1 << 18) * 4 + 64 * 1024 * 4


def test_changes_come_in_batches(tmp_path: Path) -> None:
    _weights_run(tmp_path / "run")
    store = counting(tmp_path / "run")
    from cryosnap import _lineage

    it = _lineage.changes(store, 2, 3, batch_bytes=1)
    assert next(it)[0] == "big"
    assert store.total >= 1 << 20 and store.total < (1 << 20) + 64 * 1024 * 4
    assert [p for p, _v in it] == ["layer/w", "step"]


# ---------------------------------------------------------------------------------------------
# leaves missing, changing, or not there at all


def _shifting_run(path: Path) -> None:
    cryosnap.save(path, {"a": np.zeros(3), "b": 1}, step=1)
    cryosnap.save(path, {"b": 2}, step=2)
    cryosnap.save(path, {"a": np.zeros((2, 2), np.float32), "b": 3}, step=3)


def test_versions_without_the_leaf_are_skipped_unless_asked_for(tmp_path: Path) -> None:
    _shifting_run(tmp_path / "run")
    run = cryosnap.Run(tmp_path / "run")
    with pytest.warns(UserWarning, match=r"changes kind, dtype or shape at step\(s\) 3") as rec:
        got = list(run.history("a"))
    assert len(rec) == 1
    assert [s for s, _v in got] == [1, 3]
    assert got[1][1].dtype == np.float32 and got[1][1].shape == (2, 2)
    with pytest.raises(KeyNotFoundError) as info:
        run.history("a", steps=[1, 2])
    exc = info.value
    assert exc.step == 2 and exc.path == run.url
    assert "'a'" in str(exc) and "step 2" in str(exc) and "'b'" in str(exc)


def test_a_leaf_no_version_holds_names_the_closest(tmp_path: Path) -> None:
    _weights_run(tmp_path / "run")
    run = cryosnap.Run(tmp_path / "run")
    with pytest.raises(KeyNotFoundError) as info:
        run.history("layer/ww")
    exc = info.value
    assert exc.step == 5 and exc.path == run.url
    assert "'layer/w'" in str(exc) and "closest" in str(exc)
    assert isinstance(exc, KeyError)


def test_an_ambiguous_path_is_refused(tmp_path: Path) -> None:
    cryosnap.save(tmp_path / "run", {"a/b": 1, "a": {"b": 2}}, step=0)
    with pytest.raises(KeyNotFoundError, match="names 2 nodes"):
        cryosnap.Run(tmp_path / "run").history("a/b")


def test_int_keys_and_stateful_nodes_print_as_inspect_prints_them(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    cryosnap.save(tmp_path / "run", {"model": model, "optim": optim}, step=0)
    run = cryosnap.Run(tmp_path / "run")
    paths = [leaf.path for leaf in run.info().leaves]
    assert "model/weight" in paths and "optim/state/0/momentum_buffer" in paths
    for leaf in ("model/weight", "optim/state/0/momentum_buffer", "optim/param_groups/0/lr"):
        ((_s, value),) = run.history(leaf)
        ok, want = leaf_at_any(run.load(0), leaf)
        assert ok
        assert_same(want, value)


def leaf_at_any(tree: Any, path: str) -> tuple[bool, Any]:
    """:func:`leaf_at` through lists and int keys (as paths print them)."""
    node = tree
    for key in path.split("/"):
        if isinstance(node, dict):
            match = [k for k in node if str(k) == key]
            if len(match) != 1:
                return False, None
            node = node[match[0]]
        elif isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return False, None
    return True, node


def test_pickled_leaves_need_allow_pickle(tmp_path: Path) -> None:
    cryosnap.save(tmp_path / "run", {"obj": {1, 2}}, step=0, allow_pickle=True)
    run = cryosnap.Run(tmp_path / "run")
    with pytest.raises(CheckpointError, match="allow_pickle"):
        list(run.history("obj"))
    assert list(run.history("obj", allow_pickle=True)) == [(0, {1, 2})]


def test_arguments_are_checked_before_anything_is_read(tmp_path: Path) -> None:
    _shifting_run(tmp_path / "run")
    run = cryosnap.Run(tmp_path / "run")
    with pytest.raises(TypeError, match="leaf"):
        run.history(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="names a step twice"):
        run.history("b", steps=[1, 1])
    with pytest.raises(TypeError, match="steps"):
        run.history("b", steps=3)  # type: ignore[arg-type]
    with pytest.raises(CheckpointNotFoundError) as info:
        run.history("b", steps=[7])
    assert info.value.step == 7
    with pytest.raises(TypeError, match="allow_pickle"):
        run.changes(1, 3, allow_pickle=1)  # type: ignore[arg-type]
    with pytest.raises(cryosnap.PartNotFoundError):
        run.changes(1, 3, rank=1)


def test_nest_builds_what_save_versions_saves(tmp_path: Path) -> None:
    state = {("x0",): 1, ("g0", "y0"): np.ones(2)}
    assert list(nest(state)) == ["x0", "g0"]
    steps = save_versions(tmp_path / "run", state, [[(("x0",), None)]])
    assert steps == [10, 20]
    assert leaf_at(cryosnap.load(tmp_path / "run"), "x0") == (False, None)


def test_a_packed_leaf_that_only_moved_in_its_pack_is_unchanged(tmp_path: Path) -> None:
    a, b = torch.ones(1), torch.full((1,), 2.0)  # 4 bytes each: packed together
    cryosnap.save(tmp_path / "run", {"a": a, "b": b}, step=0)
    cryosnap.save(tmp_path / "run", {"b": b}, step=1)  # b moves to the pack's start
    run = cryosnap.Run(tmp_path / "run")
    assert list(run.changes(0, 1)) == []
    assert [(r.path, r.status) for r in run.diff(0, 1).leaves] == [("a", "removed")]
