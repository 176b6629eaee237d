"""cryosnap._format.skeleton_text: a skeleton's text is its json.dumps whatever the cache keeps,
and the cache is its owner's: two writers' caches keep their own skeletons."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cryosnap._format.skeleton_text import SkeletonTextCache

_node_leaf = st.one_of(
    st.fixed_dictionaries({"t": st.just("int"), "v": st.integers()}),
    st.fixed_dictionaries({"t": st.just("str"), "v": st.text(max_size=3)}),
    st.fixed_dictionaries({"t": st.just("size"), "v": st.lists(st.integers(0, 9), max_size=3)}),
    st.fixed_dictionaries({"t": st.just("torch"), "shape": st.just([2]), "b": st.integers(0, 9)}),
)
_node_tree = st.recursive(
    _node_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda v: {"t": "list", "v": v}),
        st.lists(inner, max_size=4).map(
            lambda v: {"t": "dict", "k": [str(i) for i in range(len(v))], "v": v}
        ),
        inner.map(lambda v: {"t": "stateful", "type": "m.C", "v": v}),
    ),
    max_leaves=20,
)


def _replaced(node: Any, path: list[int], leaf: Any) -> Any:
    """A copy of ``node`` with ``leaf`` at ``path`` (indices into "v"), sharing the rest."""
    v = node.get("v")
    nested = isinstance(v, dict) or (isinstance(v, list) and all(isinstance(c, dict) for c in v))
    if not path or not nested:
        return leaf
    top = dict(node)
    if isinstance(node["v"], dict):
        top["v"] = _replaced(node["v"], path[1:], leaf)
    elif node["v"]:
        values = list(node["v"])
        i = path[0] % len(values)
        values[i] = _replaced(values[i], path[1:], leaf)
        top["v"] = values
    return top


_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


@settings(max_examples=60, deadline=None)
@given(
    _node_tree,
    st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=5), _node_leaf), max_size=6),
)
def test_the_text_is_json_dumps_for_skeletons_that_share_nodes(
    tree: Any, changes: list[tuple[list[int], Any]]
) -> None:
    """Each skeleton a copy of the last one with one node replaced (as a reused flatten
    patches an inline leaf): the text is the whole tree's json.dumps every time."""
    texts = SkeletonTextCache()
    for path, leaf in [([], None), *changes]:
        if path or leaf is not None:
            tree = _replaced(tree, path, leaf)
        assert texts.text(tree) == (_dumps(tree), False)
        assert texts.text(tree) == (_dumps(tree), False)  # the same object again


def _skeleton(n: int) -> dict[str, Any]:
    leaves = [{"t": "int", "v": i} for i in range(n)]
    layer = {"t": "list", "v": leaves}
    return {"t": "dict", "k": ["model", "step"], "v": [layer, {"t": "int", "v": 0}]}


def test_a_skeleton_encoded_again_dumps_only_what_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The text of every container it shares with the last skeleton is taken as it was."""
    from cryosnap._format import skeleton_text

    texts, first = SkeletonTextCache(), _skeleton(50)
    texts.text(first)
    dumped: list[Any] = []

    def counted(node: Any) -> str:
        dumped.append(node)
        return _dumps(node)

    monkeypatch.setattr(skeleton_text, "_dumps", counted)
    assert texts.text(first) == (_dumps(first), False)
    assert dumped == []  # the same skeleton: nothing dumped
    second = {**first, "v": [first["v"][0], {"t": "int", "v": 1}]}  # "step" changed
    assert texts.text(second) == (_dumps(second), False)
    assert all(node is not first["v"][0] for node in dumped)  # the model's text kept
    assert texts.holds(first["v"][0]) and texts.holds(second) and not texts.holds(first)


def test_each_owner_keeps_its_own_skeleton() -> None:
    """Two writers (two caches) do not evict each other's texts; clear() lets go of them."""
    mine, theirs = SkeletonTextCache(), SkeletonTextCache()
    a, b = _skeleton(5), _skeleton(7)
    assert mine.text(a) == (_dumps(a), False)
    assert theirs.text(b) == (_dumps(b), False)
    assert mine.holds(a) and mine.holds(a["v"][0]) and not mine.holds(b)
    assert theirs.holds(b) and not theirs.holds(a)
    mine.clear()
    assert not mine.holds(a) and theirs.holds(b)
    assert not SkeletonTextCache().holds(a)  # nothing shared between caches


def test_columns_are_said_and_a_manifest_encodes_alike_with_a_cache_or_without() -> None:
    from cryosnap._format.manifest import COLUMNS_FORMAT_VERSION, FORMAT_VERSION, Manifest

    leaf = {"t": "torch", "dtype": "float32", "shape": [2], "device": "cpu", "b": 0}
    state = {"t": "dict", "k": [f"w{i}" for i in range(8)], "v": [dict(leaf) for _ in range(8)]}
    text, cols = SkeletonTextCache().text(state)
    assert cols and '"cols"' in text and json.loads(text)["cols"]
    manifest = Manifest(
        step=1,
        rank=0,
        chunk_bytes=4096,
        data_files=(),
        blobs=(),
        skeleton=state,
        leaves=8,
        logical_bytes=0,
        created_unix=1.0,
    )
    texts = SkeletonTextCache()
    written, body = manifest.encode(texts)
    assert written.format_version == COLUMNS_FORMAT_VERSION > manifest.format_version
    assert manifest.format_version == FORMAT_VERSION and texts.holds(state)
    assert manifest.encode(texts) == (written, body) == manifest.encode()
    assert manifest.to_json() == body
