"""The skeleton's JSON text in a manifest (docs/FORMAT.md, "The skeleton", columns included),
and :class:`SkeletonTextCache`: the texts of the last skeleton encoded, kept by node identity
so that the next version's skeleton encodes only the nodes that changed.

Pure: no I/O. A cache is state its owner keeps (a VersionWriter, one per writer thread, passes
its own to each PartWriter); nothing here is global.
"""

from __future__ import annotations

import json
from typing import Any

from cryosnap._format import columns

__all__ = ["SkeletonTextCache"]

_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# Stands for a container's children while its other fields are encoded: a string no skeleton
# holds (NUL characters), checked to occur once.
_CHILDREN = "\x00cryosnap children\x00"
_CHILDREN_TEXT = _dumps(_CHILDREN)
# A container node's entry: (the node, its text, the ids of its container children kept,
# whether its text holds columns: the manifest's format_version then says so).
_Entry = tuple[Any, str, tuple[int, ...], bool]


class SkeletonTextCache:
    """The text of every container node of the last skeleton encoded, by id.

    A Checkpointer saves the same skeleton version after version, or a copy where an inline
    leaf changed (a step counter, a learning rate) that shares every other node
    (_state/reuse.py; a skeleton is never modified once made): only the containers on the
    changed path are encoded again. The whole text of a state of 20,000 leaves took 45-85 ms
    of the writer's thread per version here. Entries hold their nodes, so an id is never
    reused while it is kept, and every hit is checked by identity: a cache shared by two
    threads stays correct (each call swaps in a new table), it only keeps less.
    """

    __slots__ = ("_nodes",)

    def __init__(self) -> None:
        self._nodes: dict[int, _Entry] = {}

    def text(self, skeleton: Any) -> tuple[str, bool]:
        """``skeleton`` as JSON text, and whether it holds columns: its compact json.dumps
        text with every dict node of tensor leaves that :func:`columns.encode` takes in
        columns, with the texts of the nodes it shares with the last skeleton encoded here
        taken as they were; only this skeleton's texts are kept."""
        kept: dict[int, _Entry] = {}
        text, cols = _node_text(skeleton, self._nodes, kept)
        self._nodes = kept
        return text, cols

    def holds(self, node: Any) -> bool:
        """Whether the text of container node ``node`` is kept."""
        hit = self._nodes.get(id(node))
        return hit is not None and hit[0] is node

    def clear(self) -> None:
        """Let go of the texts kept (the owner stops: its skeleton need not outlive it)."""
        self._nodes = {}


def _is_container(node: Any) -> bool:
    return type(node) is dict and type(node.get("v")) in (list, dict)


def _node_text(
    node: Any,
    last: dict[int, _Entry],
    kept: dict[int, _Entry],
) -> tuple[str, bool]:
    hit = last.get(id(node))
    if hit is not None and hit[0] is node:
        stack = [id(node)]  # kept with the texts of its containers, for the next skeleton
        while stack:
            entry = last[stack.pop()]
            kept[id(entry[0])] = entry
            stack.extend(entry[2])
        return hit[1], hit[3]
    if not _is_container(node):
        # A leaf, or a dict node read in columns (a manifest written again).
        return _dumps(node), type(node) is dict and "cols" in node
    children = node["v"]
    if type(children) is dict:  # a stateful object's state
        inner, cols = _node_text(children, last, kept)
    elif not any(_is_container(c) for c in children):
        # Leaves only (a state dict): one call, in columns where they are all tensors.
        table = columns.encode(children) if node.get("t") in ("dict", "odict") else None
        if table is None:
            text = _dumps(node)
        else:
            text = _dumps({**{k: v for k, v in node.items() if k != "v"}, "cols": table})
        kept[id(node)] = (node, text, (), table is not None)
        return text, table is not None
    else:
        texts = [
            _node_text(c, last, kept) if _is_container(c) else (_dumps(c), False) for c in children
        ]
        inner = f"[{','.join(t for t, _c in texts)}]"
        cols = any(c for _t, c in texts)
    shell = _dumps({k: _CHILDREN if k == "v" else v for k, v in node.items()})
    if shell.count(_CHILDREN_TEXT) == 1:
        text = shell.replace(_CHILDREN_TEXT, inner)
    else:
        text, cols = _dumps(node), False  # in no columns: as it is
    below = (children,) if type(children) is dict else children
    kept[id(node)] = (node, text, tuple(id(c) for c in below if id(c) in kept), cols)
    return text, cols
