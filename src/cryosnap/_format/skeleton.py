"""The skeleton: the state tree as JSON nodes (docs/FORMAT.md, "The skeleton"), its key codec
and the walks that read it without building anything (leaves, blob owners, depth).

Pure: no I/O, no torch, no numpy arrays built. Runs on whichever thread calls it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cryosnap._format import columns
from cryosnap._format.limits import MAX_DEPTH, MAX_ELEMENTS, MAX_NDIM
from cryosnap.errors import CheckpointFormatError

__all__ = [
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_NDIM",
    "Json",
    "blob_keys",
    "blob_paths",
    "check_depth",
    "decode_key",
    "dict_columns",
    "dict_items",
    "dict_keys",
    "encode_key",
    "format_path",
    "iter_leaves",
]

Json = Any  # a JSON-compatible value (dict / list / str / int / float / bool / None)

_CONTAINERS = frozenset(("dict", "odict", "list", "tuple"))
_NESTING = _CONTAINERS | {"stateful"}

# Python ints beyond this many bits are written as hex strings: JSON readers (Python's included)
# refuse numbers of more than a few thousand digits.
_BIG_INT_BITS = 63


def encode_key(key: str | int) -> Json:
    """A dict key as stored: a string, an int, or ``{"int": hex}`` for a huge int."""
    if type(key) is int and key.bit_length() > _BIG_INT_BITS:
        return {"int": hex(key)}
    return key


def decode_key(key: Json, where: str) -> str | int:
    """The dict key ``encode_key`` stored; ``CheckpointFormatError`` for anything else."""
    if type(key) in (str, int):
        return key  # type: ignore[no-any-return]
    if isinstance(key, dict) and isinstance(key.get("int"), str) and len(key) == 1:
        try:
            return int(key["int"], 16)
        except ValueError:
            pass
    raise CheckpointFormatError(f"{where}: invalid key {key!r:.80}")


def dict_items(node: Json, where: str) -> list[tuple[str | int, Json]]:
    """The decoded ``(key, child)`` pairs of a dict node, validated; the leaves of a node in
    columns as the nodes they stand for (:meth:`columns.Columns.nodes`)."""
    keys = node.get("k")
    cols = dict_columns(node, where)
    vals = cols.nodes() if cols is not None else node.get("v")
    if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
        raise CheckpointFormatError(f"{where}: malformed dict node")
    if set(map(type, keys)) <= _PLAIN_KEYS:  # the common case, decoded as they are
        return list(zip(keys, vals, strict=True))
    return [(decode_key(k, where), v) for k, v in zip(keys, vals, strict=True)]


def dict_keys(node: Json, where: str) -> list[str | int]:
    """The decoded keys of a dict node (its children are not looked at)."""
    keys = node.get("k")
    if not isinstance(keys, list):
        raise CheckpointFormatError(f"{where}: malformed dict node")
    if set(map(type, keys)) <= _PLAIN_KEYS:
        return keys
    return [decode_key(k, where) for k in keys]


def dict_columns(node: Json, where: str) -> columns.Columns | None:
    """The columns of a dict node stored in columns (parsed once, kept in the node), or None
    for a node of one child node per key."""
    raw = node.get("cols")
    if raw is None:
        return None
    keys = node.get("k")
    if "v" in node or not isinstance(keys, list):
        raise CheckpointFormatError(f"{where}: malformed dict node")
    if type(raw) is not columns.Columns:
        raw = node["cols"] = columns.parse(raw, len(keys), where)
    elif raw.count != len(keys):
        raise CheckpointFormatError(f"{where}: malformed dict node")
    return raw


_PLAIN_KEYS = frozenset((str, int))


def format_path(path: tuple[str | int, ...]) -> str:
    """Human form of a leaf path: keys joined by ``/``; the root itself is ``<root>``."""
    return "/".join(_key_text(p) for p in path) if path else "<root>"


def _key_text(key: str | int) -> str:
    # str() of an int of thousands of digits is refused (and useless in a message).
    return hex(key) if type(key) is int and key.bit_length() > _BIG_INT_BITS else str(key)


def iter_leaves(node: Json, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str, Json]]:
    """``(path, node)`` of every leaf of a skeleton, in tree order (reads no data).

    Containers and stateful nodes are walked, everything else is a leaf; a malformed container
    raises :class:`CheckpointFormatError` naming where.
    """
    where = format_path(path)
    if not isinstance(node, dict):
        raise CheckpointFormatError(f"leaf {where}: malformed node {node!r:.80}")
    t = node.get("t")
    if t in ("dict", "odict"):
        for k, v in dict_items(node, where):
            yield from iter_leaves(v, (*path, k))
    elif t in ("list", "tuple"):
        vals = node.get("v")
        if not isinstance(vals, list):
            raise CheckpointFormatError(f"{where}: malformed {t} node")
        for i, v in enumerate(vals):
            yield from iter_leaves(v, (*path, i))
    elif t == "stateful":
        yield from iter_leaves(node.get("v"), path)
    else:
        yield where, node


def _nests(node: dict[str, Any]) -> bool:
    t = node.get("t")
    return isinstance(t, str) and t in _NESTING


def check_depth(skeleton: Json, where: str) -> None:
    """Refuse a skeleton nested deeper than :data:`MAX_DEPTH` (walked without recursion), and
    parse the columns of the dict nodes stored in columns (:func:`dict_columns`: malformed
    columns are refused here, once)."""
    stack: list[tuple[Json, int]] = [(skeleton, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CheckpointFormatError(f"{where}: state nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict):
            continue  # malformed: the walk that meets it says so
        t = node.get("t")
        if "cols" in node and t in ("dict", "odict"):
            dict_columns(node, where)  # leaves only: nothing nests below
            continue
        if isinstance(t, str) and t in _CONTAINERS:  # a list there is not hashable
            vals = node.get("v")
            if isinstance(vals, list):
                if depth >= MAX_DEPTH:  # every child is too deep, a leaf as well
                    stack.extend((v, depth + 1) for v in vals if isinstance(v, dict))
                    continue
                # Only nodes that nest go on the stack: a state dict's 20,000 leaves are each
                # looked at once, not pushed and popped.
                stack.extend((v, depth + 1) for v in vals if type(v) is dict and _nests(v))
        elif t == "stateful":
            stack.append((node.get("v"), depth + 1))


def blob_keys(skeleton: Json, nblobs: int) -> list[tuple[str | int, ...]]:
    """The key path of the leaf that first refers to each blob, as :func:`flatten` names a
    blob's owner (``Blob.key``); a blob no leaf refers to is a :class:`CheckpointFormatError`."""
    keys: list[tuple[str | int, ...] | None] = [None] * nblobs
    stack: list[tuple[Json, tuple[str | int, ...]]] = [(skeleton, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            raise CheckpointFormatError(f"leaf {format_path(path)}: malformed node")
        t = node.get("t")
        if t in ("dict", "odict"):
            items = dict_items(node, format_path(path))
            stack.extend(((v, (*path, k)) for k, v in reversed(items)))
        elif t in ("list", "tuple"):
            vals = node.get("v")
            if not isinstance(vals, list):
                raise CheckpointFormatError(f"{format_path(path)}: malformed {t} node")
            stack.extend(((v, (*path, i)) for i, v in reversed(list(enumerate(vals)))))
        elif t == "stateful":
            stack.append((node.get("v"), path))
        else:
            b = node.get("b")
            if type(b) is int and 0 <= b < nblobs and keys[b] is None:
                keys[b] = path
    missing = [i for i, k in enumerate(keys) if k is None]
    if missing:
        raise CheckpointFormatError(f"blob {missing[0]} is referenced by no leaf")
    return [k for k in keys if k is not None]


def blob_paths(skeleton: Json, nblobs: int) -> list[str]:
    """The leaf path that first refers to each blob (what messages and diffs name)."""
    paths = [""] * nblobs
    for where, node in iter_leaves(skeleton):
        b = node.get("b")
        if type(b) is int and 0 <= b < nblobs and not paths[b]:
            paths[b] = where
    return paths
