"""Selective restore: some top-level keys of a saved state (``keys=``, or the keys saved as
replicated), or one subtree named by its leaf path (:func:`find_subtree`, the lineage's
``history``), as a skeleton of their own whose blobs are numbered anew, with the indices of
the manifest's blobs they are, so that only those are resolved, read and verified.

Pure (no I/O); the caller's thread.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

from cryosnap._format.columns import Columns
from cryosnap._format.skeleton import _key_text, dict_items, encode_key, iter_leaves
from cryosnap.engine._resolved import ResolvedPart
from cryosnap.errors import CheckpointFormatError, KeyNotFoundError, StateMismatchError

__all__ = [
    "ROOT_PATH",
    "closest_paths",
    "cut_part",
    "find_subtree",
    "keys_skeleton",
    "renumbered",
    "spread_paths",
    "validate_keys",
]

Key = str | int


def validate_keys(keys: object, name: str = "keys") -> tuple[Key, ...] | None:
    """``keys`` as a tuple of top-level keys (None stays None); raised on the caller's thread."""
    if keys is None:
        return None
    if not isinstance(keys, (list, tuple)) or not all(
        type(k) is str or type(k) is int for k in keys
    ):
        raise TypeError(
            f"{name} must be None or a list or tuple of top-level keys (str or int), "
            f"got {keys!r:.120}"
        )
    if not keys:
        raise ValueError(f"{name}=[] selects nothing: name at least one top-level key")
    if len(set(keys)) != len(keys):
        raise ValueError(f"{name}={list(keys)!r:.120} names a key twice")
    return tuple(keys)


def keys_skeleton(skeleton: Any, keys: Sequence[Key], where: str, *, asked: bool = True) -> Any:
    """The skeleton of ``keys`` only: the root dict node with those keys, in that order.

    ``asked``: the keys come from the caller (a root that is no dict is a
    :class:`StateMismatchError`, a key the state lacks a :class:`KeyNotFoundError`), else
    from the manifest itself (either is a :class:`CheckpointFormatError`)."""
    if not isinstance(skeleton, dict) or skeleton.get("t") not in ("dict", "odict"):
        kind = skeleton.get("t") if isinstance(skeleton, dict) else type(skeleton).__name__
        if not asked:
            raise CheckpointFormatError(
                f"{where}: names replicated keys of a state that is no dict"
            )
        raise StateMismatchError(
            f"{where}: keys={list(keys)!r:.120} selects top-level keys of a dict, but the "
            f"saved state is a {kind}"
        )
    items = dict(dict_items(skeleton, where))
    missing = [k for k in keys if k not in items]
    if missing and not asked:
        raise CheckpointFormatError(f"{where}: replicated keys {missing!r:.120} are not saved")
    if missing:
        raise KeyNotFoundError(
            f"{where}: the saved state has no top-level key {missing[0]!r:.80}; "
            f"it has {list(items)!r:.300}"
        )
    return {**skeleton, "k": [encode_key(k) for k in keys], "v": [items[k] for k in keys]}


def renumbered(skeleton: Any, nblobs: int) -> tuple[Any, list[int]]:
    """``skeleton`` with the blobs its leaves refer to numbered 0.. in their saved order, and
    those blobs' indices among the ``nblobs`` saved. A reference out of range stays invalid
    (the restorer names it)."""
    used: set[int] = set()
    _blob_refs(skeleton, used, nblobs)
    index = sorted(used)
    new = {b: i for i, b in enumerate(index)}
    return _remap(skeleton, new), index


def _blob_refs(node: Any, used: set[int], nblobs: int) -> None:
    stack = [node]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # malformed: the restorer's walk says where
        t, v = node.get("t"), node.get("v")
        cols = node.get("cols")
        if isinstance(cols, Columns):  # parsed with the manifest
            used.update(cols.b[cols.b < nblobs].tolist())
        elif t in ("dict", "odict", "list", "tuple") and isinstance(v, list):
            stack.extend(v)
        elif t == "stateful":
            stack.append(v)
        elif type(b := node.get("b")) is int and 0 <= b < nblobs:
            used.add(b)


def _remap(node: Any, new: dict[int, int]) -> Any:
    # Depth is bounded by MAX_DEPTH (checked when the manifest was parsed).
    if not isinstance(node, dict):
        return node
    t, v = node.get("t"), node.get("v")
    cols = node.get("cols")
    if isinstance(cols, Columns):
        return {**node, "cols": cols.with_blobs([new.get(b, -1) for b in cols.b.tolist()])}
    if t in ("dict", "odict", "list", "tuple") and isinstance(v, list):
        return {**node, "v": [_remap(x, new) for x in v]}
    if t == "stateful":
        return {**node, "v": _remap(v, new)}
    b = node.get("b")
    if type(b) is int:
        return {**node, "b": new.get(b, -1)}
    return node


def spread_paths(paths: Sequence[str], index: Sequence[int], nblobs: int) -> list[str]:
    """The leaf path of each of ``nblobs`` saved blobs, from ``paths`` of the selected ones."""
    out = [""] * nblobs
    for i, path in zip(index, paths, strict=True):
        out[i] = path
    return out


def cut_part(part: ResolvedPart, index: Sequence[int]) -> ResolvedPart:
    """``part`` with only the blobs ``index`` selects, in that order (what is read)."""
    return dataclasses.replace(part, blobs=[part.blobs[i] for i in index], _by_path={})


# The path of the whole state, as ``format_path`` prints the root.
ROOT_PATH = "<root>"


def find_subtree(skeleton: Any, leaf: str, where: str) -> Any | None:
    """The node of ``skeleton`` at ``leaf``, a path as ``cryosnap inspect`` prints it (keys
    joined by ``/``; :data:`ROOT_PATH` the whole state): a leaf, or a container (a subtree).
    None when no node prints so. A stateful node is the state dict it holds, as in the paths.

    Keys may hold ``/`` and an int key prints as the str of its digits: a path two nodes
    print alike is a :class:`KeyNotFoundError` saying so (the walk follows every reading of
    the path, so one of them is never picked silently)."""
    if leaf == ROOT_PATH:
        return _unwrap(skeleton)
    found: list[Any] = []
    stack: list[tuple[Any, str | None]] = [(skeleton, leaf)]
    while stack:
        node, rest = stack.pop()
        node = _unwrap(node)
        if rest is None:
            found.append(node)
            continue
        for text, child in _children(node, where):
            if rest == text:
                stack.append((child, None))
            elif rest.startswith(text + "/"):
                stack.append((child, rest[len(text) + 1 :]))
    if len(found) > 1:
        raise KeyNotFoundError(
            f"{where}: the path {leaf!r:.200} names {len(found)} nodes (a key holds '/', or "
            "int and str keys print alike); the saved state cannot be read by it"
        )
    return found[0] if found else None


def _unwrap(node: Any) -> Any:
    # A stateful node adds no key to the paths of its state dict (iter_leaves).
    while isinstance(node, dict) and node.get("t") == "stateful":
        node = node.get("v")
    return node


def _children(node: Any, where: str) -> list[tuple[str, Any]]:
    """``(key as printed, child)`` of a container node; none for a leaf."""
    if not isinstance(node, dict):
        return []
    t = node.get("t")
    if t in ("dict", "odict"):
        return [(_key_text(k), v) for k, v in dict_items(node, where)]
    if t in ("list", "tuple") and isinstance(node.get("v"), list):
        return [(str(i), v) for i, v in enumerate(node["v"])]
    return []


def closest_paths(skeleton: Any, leaf: str, count: int = 3) -> list[str]:
    """The leaf and container paths of ``skeleton`` nearest to ``leaf`` (for a message);
    the first few paths when none is near."""
    leaves = [path for path, _node in iter_leaves(skeleton)]
    paths = dict.fromkeys(leaves)
    for path in leaves:
        parts = path.split("/")
        paths.update(dict.fromkeys("/".join(parts[:i]) for i in range(1, len(parts))))
    near = difflib.get_close_matches(leaf, list(paths), n=count, cutoff=0.5)
    return near or leaves[:count]
