"""Deltas between two versions: the document a delta file carries (:func:`delta_document`,
what ``cryosnap export --since`` writes beside the changed leaves) and
:func:`apply_delta`, which turns a state that is version A into version B, checked against
the roots the document records of both, bit for bit.

Reads the delta file, hashes the state's leaves (xxh3-128, in the chunks of the format) and
changes the state only once the state is proven A and every leaf of the delta proven B's;
reads no run. The caller's thread; torch is imported only for a ``.safetensors`` delta or a
torch leaf. docs/design/lineage.md has the document and the checks.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cryosnap._format.chunks import validate_chunk_bytes
from cryosnap._format.limits import MAX_DEPTH, MAX_NDIM
from cryosnap._format.skeleton import decode_key, encode_key, format_path
from cryosnap._lineage import DeltaParts, Key, LeafRoot, value_root
from cryosnap._state import Restorer
from cryosnap._state.torch_import import import_torch, loaded_torch
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    IntegrityError,
    StateMismatchError,
)

__all__ = [
    "DELTA_FORMAT",
    "DELTA_KEY",
    "Delta",
    "apply_delta",
    "delta_document",
    "read_delta",
]

# The name of the document in a delta file: a metadata key of a .safetensors file, an array
# (its UTF-8 bytes) of a .npz file. No leaf of a delta may have this path.
DELTA_KEY = "__cryosnap_delta__"
DELTA_FORMAT = "cryosnap-delta"
_VERSION = 1

_STORED = frozenset(("torch", "numpy", "bytes", "bytearray"))  # as tensors of the file
_INLINE = frozenset(("npscalar", "size", "int", "float", "bool", "complex", "str", "none"))
_KINDS = _STORED | _INLINE
_CONTAINERS = frozenset(("dict", "odict", "list", "tuple"))
_FLAGS = ("param", "grad")  # a torch leaf's, as its skeleton node has them
_ROOT_HEX = re.compile(r"[0-9a-f]{32}")


# ---------------------------------------------------------------------------------------------
# the document


def delta_document(parts: DeltaParts, run: str) -> dict[str, Any]:
    """The JSON document of a delta from ``parts`` (of the run at ``run``): both steps, their
    chunk sizes and roots per leaf, the removed leaves, and per changed or added leaf its keys
    from the root and the containers on the way; a scalar leaf's saved node (its value; an
    array's is a tensor of the file)."""
    leaves: dict[str, Any] = {}
    for path, _value in parts.values:
        keys, kinds = parts.keys[path]
        entry: dict[str, Any] = {"keys": [encode_key(k) for k in keys], "containers": kinds}
        if parts.roots[1][path].kind in _STORED:
            entry["stored"] = "tensor"
            node = parts.nodes[path]
            if node.get("order") == "F":  # an array saved in Fortran order
                entry["order"] = "F"
            flags = [f for f in _FLAGS if node.get(f) is True]
            if flags and node.get("t") == "torch":  # an nn.Parameter, requires_grad
                entry["flags"] = flags
        else:
            entry["stored"] = "node"
            entry["node"] = parts.nodes[path]
        leaves[path] = entry
    return {
        "format": DELTA_FORMAT,
        "version": _VERSION,
        "run": run,
        "rank": parts.rank,
        "a": _side(parts.a, parts.chunk_bytes[0], parts.roots[0]),
        "b": _side(parts.b, parts.chunk_bytes[1], parts.roots[1]),
        "removed": list(parts.removed),
        "leaves": leaves,
    }


def _side(step: int, chunk_bytes: int, roots: dict[str, LeafRoot]) -> dict[str, Any]:
    return {
        "step": step,
        "chunk_bytes": chunk_bytes,
        "roots": {path: root.to_json() for path, root in roots.items()},
    }


@dataclass(frozen=True, slots=True)
class _Leaf:
    """One changed or added leaf of a delta, as its document describes it."""

    keys: tuple[Key, ...]
    containers: tuple[str, ...]
    node: dict[str, Any] | None  # a scalar's node; None: a tensor of the file
    fortran: bool = False  # an array B holds in Fortran order (load() builds it so)
    flags: tuple[str, ...] = ()  # of _FLAGS: B's tensor is an nn.Parameter, requires grad


@dataclass(frozen=True, slots=True)
class Delta:
    """A delta file read and checked: ``a`` and ``b`` the steps, ``chunk_bytes`` and
    ``roots`` of each, ``removed`` the paths B lacks, ``values`` the leaves B changed or
    added (B's tree order), each already checked against its root in B."""

    path: str
    run: str
    a: int
    b: int
    chunk_bytes: tuple[int, int]
    roots: tuple[dict[str, LeafRoot], dict[str, LeafRoot]]
    removed: tuple[str, ...]
    leaves: dict[str, _Leaf]
    values: dict[str, Any]


def _bad(where: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"delta {where}: {what}", path=where)


def _parse_roots(doc: Any, where: str, side: str) -> tuple[int, int, dict[str, LeafRoot]]:
    if not isinstance(doc, dict) or set(doc) != {"step", "chunk_bytes", "roots"}:
        raise _bad(where, f"{side!r} is not {{step, chunk_bytes, roots}}")
    step, cb, roots = doc["step"], doc["chunk_bytes"], doc["roots"]
    if type(step) is not int or step < 0:
        raise _bad(where, f"{side}.step is not a step: {step!r:.40}")
    try:
        cb = validate_chunk_bytes(cb)
    except (TypeError, ValueError) as exc:
        raise _bad(where, f"{side}.chunk_bytes: {exc}") from None
    if not isinstance(roots, dict):
        raise _bad(where, f"{side}.roots is not an object")
    return (
        step,
        cb,
        {path: _parse_root(r, where, f"{side}.roots[{path!r:.80}]") for path, r in roots.items()},
    )


def _parse_root(doc: Any, where: str, name: str) -> LeafRoot:
    if not isinstance(doc, dict) or set(doc) != {"kind", "dtype", "shape", "root"}:
        raise _bad(where, f"{name} is not {{kind, dtype, shape, root}}")
    kind, dtype, shape, root = doc["kind"], doc["dtype"], doc["shape"], doc["root"]
    if kind not in _KINDS:
        raise _bad(where, f"{name}: unknown kind {kind!r:.40}")
    if dtype is not None and not isinstance(dtype, str):
        raise _bad(where, f"{name}: dtype {dtype!r:.40} is not a string")
    if shape is not None and (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise _bad(where, f"{name}: shape {shape!r:.60} is not a list of sizes")
    if not isinstance(root, str) or not _ROOT_HEX.fullmatch(root):
        raise _bad(where, f"{name}: root {root!r:.60} is not 32 hex digits")
    return LeafRoot(kind, dtype, None if shape is None else tuple(shape), root)


def _parse_leaf(path: str, doc: Any, root: LeafRoot, where: str) -> _Leaf:
    name = f"leaves[{path!r:.80}]"
    if not isinstance(doc, dict):
        raise _bad(where, f"{name} is not an object")
    keys, kinds, stored = doc.get("keys"), doc.get("containers"), doc.get("stored")
    if not isinstance(keys, list) or not isinstance(kinds, list):
        raise _bad(where, f"{name}: keys and containers are not lists")
    if len(keys) != len(kinds) or len(keys) > MAX_DEPTH:
        raise _bad(where, f"{name}: {len(keys)} keys for {len(kinds)} containers")
    if not all(k in _CONTAINERS for k in kinds):
        raise _bad(where, f"{name}: a container is none of {sorted(_CONTAINERS)}")
    decoded = tuple(decode_key(k, f"delta {where}: {name}") for k in keys)
    for key, kind in zip(decoded, kinds, strict=True):
        if kind in ("list", "tuple") and (type(key) is not int or key < 0):
            raise _bad(where, f"{name}: key {key!r:.40} of a {kind} is not an index")
    if format_path(decoded) != path:
        raise _bad(where, f"{name}: its keys make the path {format_path(decoded)!r:.120}")
    if stored == "tensor" and root.kind in _STORED:
        fortran = doc.get("order") == "F" and root.kind == "numpy"
        flags = doc.get("flags", [])
        expected = {"keys", "containers", "stored"} | ({"order"} if fortran else set())
        expected |= {"flags"} if "flags" in doc else set()
        if set(doc) == expected and _good_flags(flags, root):
            return _Leaf(decoded, tuple(kinds), None, fortran, tuple(flags))
    node = doc.get("node")
    if (
        stored != "node"
        or root.kind not in _INLINE
        or set(doc) != {"keys", "containers", "stored", "node"}
        or not isinstance(node, dict)
        or node.get("t") != root.kind
        or "b" in node
    ):
        raise _bad(where, f"{name}: not a {root.kind} leaf as a delta stores one")
    return _Leaf(decoded, tuple(kinds), node)


_Parsed = tuple[
    str,
    tuple[int, int],
    tuple[int, int],
    tuple[dict[str, LeafRoot], dict[str, LeafRoot]],
    tuple[str, ...],
    dict[str, _Leaf],
]


def _good_flags(flags: Any, root: LeafRoot) -> bool:
    if flags == []:
        return True
    return (
        root.kind == "torch"
        and isinstance(flags, list)
        and all(f in _FLAGS for f in flags)
        and len(set(flags)) == len(flags)
    )


def _parse(doc: Any, where: str) -> _Parsed:
    """The parts of a delta document, every field checked: a document that is not one, or
    whose parts disagree (a leaf neither kept, changed nor removed), is refused."""
    expected = {"format", "version", "run", "rank", "a", "b", "removed", "leaves"}
    if not isinstance(doc, dict) or set(doc) != expected or doc["format"] != DELTA_FORMAT:
        raise _bad(where, f"holds no {DELTA_FORMAT} document of the fields {sorted(expected)}")
    if doc["version"] != _VERSION:
        raise _bad(where, f"is of version {doc['version']!r:.20}; this cryosnap reads {_VERSION}")
    a, cb_a, roots_a = _parse_roots(doc["a"], where, "a")
    b, cb_b, roots_b = _parse_roots(doc["b"], where, "b")
    removed, leaves = doc["removed"], doc["leaves"]
    if not isinstance(removed, list) or not all(isinstance(p, str) for p in removed):
        raise _bad(where, "removed is not a list of leaf paths")
    if not isinstance(leaves, dict):
        raise _bad(where, "leaves is not an object")
    stray = [p for p in removed if p not in roots_a or p in roots_b]
    stray += [p for p in leaves if p not in roots_b]
    if stray:
        raise _bad(where, f"names the leaf {stray[0]!r:.120}, which is outside its versions")
    kept = [p for p in roots_b if p not in leaves]
    if set(roots_a) - set(removed) != set(kept) | (set(leaves) & set(roots_a)) or any(
        roots_a.get(p) != roots_b[p] for p in kept
    ):
        raise _bad(where, f"its leaves do not take step {a} to step {b}")
    parsed = {p: _parse_leaf(p, leaves[p], roots_b[p], where) for p in leaves}
    run = doc["run"] if isinstance(doc["run"], str) else ""
    return run, (a, b), (cb_a, cb_b), (roots_a, roots_b), tuple(removed), parsed


# ---------------------------------------------------------------------------------------------
# reading a delta file


def read_delta(delta: str | os.PathLike[str]) -> Delta:
    """The delta file ``delta`` (``.safetensors`` or ``.npz``, as ``cryosnap export --since``
    wrote it) read, its document checked and each of its leaves checked against its root in
    B (IntegrityError: the file is damaged). Nothing else is touched."""
    if not isinstance(delta, (str, os.PathLike)):
        raise TypeError(f"delta must be the path of a delta file, got {type(delta).__name__}")
    path = Path(os.fspath(delta))
    where = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".safetensors", ".npz"):
        raise ValueError(f"delta={where!r}: a delta is a .safetensors or .npz file")
    try:
        text, tensors = _read_safetensors(path) if suffix == ".safetensors" else _read_npz(path)
        doc = json.loads(text)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise _bad(where, f"cannot be read as a delta ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # safetensors' own errors
        if isinstance(exc, CheckpointError):
            raise
        raise _bad(where, f"cannot be read as a delta ({type(exc).__name__}: {exc})") from exc
    run, steps, cbs, roots, removed, leaves = _parse(doc, where)
    wanted = {p for p, leaf in leaves.items() if leaf.node is None}
    if set(tensors) != wanted:
        odd = sorted(set(tensors) ^ wanted)
        raise _bad(where, f"its tensors and its document disagree on {odd[0]!r:.120}")
    values = {p: _value(p, leaf, tensors.get(p), roots[1][p], where) for p, leaf in leaves.items()}
    for p, value in values.items():
        if value_root(value, cbs[1]) != roots[1][p]:
            raise IntegrityError(
                f"delta {where}: leaf {p} does not match its root in step {steps[1]} "
                "(the file is damaged or was edited)",
                path=where,
            )
    return Delta(where, run, steps[0], steps[1], cbs, roots, removed, leaves, values)


def _read_safetensors(path: Path) -> tuple[str, dict[str, Any]]:
    from safetensors import safe_open

    try:
        import_torch()
        framework = "pt"
    except ImportError:
        framework = "np"
    with safe_open(str(path), framework=framework) as f:
        meta = f.metadata() or {}
        if DELTA_KEY not in meta:
            raise KeyError(f"no {DELTA_KEY} in its metadata: not a delta")
        names = f.keys()
        return meta[DELTA_KEY], {name: f.get_tensor(name) for name in names}


def _read_npz(path: Path) -> tuple[str, dict[str, Any]]:
    with np.load(path, allow_pickle=False) as npz:
        names = list(npz.files)
        if DELTA_KEY not in names:
            raise KeyError(f"no {DELTA_KEY} in it: not a delta")
        raw = npz[DELTA_KEY]
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise ValueError(f"{DELTA_KEY} is not a byte array")
        return raw.tobytes().decode("utf-8"), {n: npz[n] for n in names if n != DELTA_KEY}


def _value(path: str, leaf: _Leaf, tensor: Any, root: LeafRoot, where: str) -> Any:
    """The value of one leaf of B: a scalar's node decoded, or the file's tensor as the kind
    the root records (its bytes are checked against the root after)."""
    try:
        if leaf.node is not None:
            restorer = Restorer(leaf.node, [], allow_pickle=False)
            restorer.allocate()
            return restorer.build()
        torch = loaded_torch()
        if root.kind == "torch":
            if torch is None or not isinstance(tensor, torch.Tensor):
                tensor = import_torch().from_numpy(np.array(tensor, copy=True))
            # safetensors' own tensor as it is: bfloat16 and float8 have no numpy dtype.
            return _flagged(tensor, leaf.flags)
        arr = tensor if isinstance(tensor, np.ndarray) else tensor.numpy()
        if root.kind in ("bytes", "bytearray"):
            data = arr.tobytes()
            return data if root.kind == "bytes" else bytearray(data)
        dtype = np.lib.format.descr_to_dtype(_descr(root.dtype))
        out = np.array(arr, copy=True).astype(dtype, copy=False).reshape(root.shape or ())
        return np.asfortranarray(out) if leaf.fortran else out
    except (CheckpointError, ImportError):
        raise
    except Exception as exc:  # a hostile node or tensor: whatever it breaks, said once
        raise _bad(where, f"leaf {path}: {type(exc).__name__}: {exc}") from exc


def _flagged(t: Any, flags: tuple[str, ...]) -> Any:
    """``t`` as B's node says: an ``nn.Parameter``, requiring grad."""
    if "param" in flags:
        return import_torch().nn.Parameter(t, requires_grad="grad" in flags)
    return t.requires_grad_(True) if "grad" in flags else t


def _descr(text: str | None) -> Any:
    """A numpy descr from its :class:`LeafRoot` text (a record's is JSON)."""
    if text is None:
        raise ValueError("an array leaf without a dtype")
    if text.startswith("["):
        return _as_descr(json.loads(text))
    return text


def _as_descr(d: Any) -> Any:
    if not isinstance(d, list):
        return d
    return [
        tuple(
            _as_descr(x) if i == 1 else tuple(x) if isinstance(x, list) else x
            for i, x in enumerate(f)
        )
        for f in d
    ]


# ---------------------------------------------------------------------------------------------
# applying a delta


def apply_delta(state: Any, delta: str | os.PathLike[str]) -> Any:
    """Turn ``state``, version A of a run, into version B with the delta file ``delta`` that
    ``cryosnap export RUN OUT --step B --since A`` wrote, and return it.

    ``state``: a tree of dict / list / tuple as :func:`cryosnap.load` returns it (torch
    tensors on any device, numpy arrays, scalars; a module's ``state_dict()`` shares its
    tensors, so the module is updated through it). A changed leaf is copied into the
    state's own tensor or array when its dtype and shape are B's (and its type, grad flag
    or memory order: a Parameter stays one), else replaced; added
    leaves are inserted, removed ones deleted with the containers their removal empties;
    dicts and lists are changed in place, tuples rebuilt.

    Before anything changes, every leaf of ``state`` is hashed as the format hashes its
    chunks and compared with A's roots: a state that is not A (another step, an edited
    leaf, a missing or extra leaf) raises :class:`~cryosnap.errors.StateMismatchError` and
    is left as it was; the delta's own leaves are checked against B's roots
    (:class:`~cryosnap.errors.IntegrityError`), its document field by field
    (:class:`~cryosnap.errors.CheckpointFormatError`). After applying, every leaf is hashed
    again and must match B's roots bit for bit (else IntegrityError: the state is then
    changed, a leaf shares memory in a way B's does not). Containers are not compared:
    the roots are the leaves' (an empty container of B, holding no leaf, is not carried).
    """
    parsed = read_delta(delta)
    leaves = _state_leaves(state)
    _check(leaves, parsed, before=True)
    for path in reversed(parsed.removed):
        state = _drop(state, leaves[path][0], path)
    for path, value in parsed.values.items():
        known = leaves.get(path)
        if known is not None and _fill(known[1], value):
            continue
        leaf = parsed.leaves[path]
        keys = leaf.keys if known is None else known[0]
        state = _put(state, keys, leaf.containers, value, path)
    if state is _MISSING:  # B holds no leaf at all
        state = {}
    _check(_state_leaves(state), parsed, before=False)
    return state


class _Missing:
    """Where a container has no value (yet): a new key, a list item removed before the end."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


def _state_leaves(state: Any) -> dict[str, tuple[tuple[Key, ...], Any]]:
    """Per leaf path of ``state`` (as the run prints paths), its keys and its value."""
    out: dict[str, tuple[tuple[Key, ...], Any]] = {}
    for keys, value in _walk(state):
        path = format_path(keys)
        if path in out:
            raise StateMismatchError(
                f"two leaves of the state have the path {path!r:.120} (a key holds '/', or int "
                "and str keys print alike): a delta cannot tell them apart"
            )
        out[path] = (keys, value)
    return out


def _walk(state: Any) -> Iterator[tuple[tuple[Key, ...], Any]]:
    stack: list[tuple[Any, tuple[Key, ...]]] = [(state, ())]
    while stack:
        node, keys = stack.pop()
        if len(keys) > MAX_DEPTH:
            raise StateMismatchError(
                f"the state is nested deeper than {MAX_DEPTH} levels at {format_path(keys)!r:.120}"
            )
        tp = type(node)
        if tp in (dict, OrderedDict):
            for k in node:
                if type(k) not in (str, int):
                    raise StateMismatchError(
                        f"{format_path(keys)}: dict key {k!r:.40} is no str or int key of a state"
                    )
            stack.extend((node[k], (*keys, k)) for k in reversed(list(node)))
        elif tp in (list, tuple):
            stack.extend((v, (*keys, i)) for i, v in reversed(list(enumerate(node))))
        else:
            yield keys, node


def _check(leaves: dict[str, tuple[tuple[Key, ...], Any]], delta: Delta, *, before: bool) -> None:
    """Every leaf of ``leaves`` against A's roots (``before``) or B's: the same paths, and
    each leaf's kind, dtype, shape and Merkle root."""
    side = 0 if before else 1
    roots, cb = delta.roots[side], delta.chunk_bytes[side]
    step = delta.a if before else delta.b
    problems = [f"leaf {p} is missing" for p in roots if p not in leaves]
    for path, (_keys, value) in leaves.items():
        if len(problems) > 3:
            break
        want = roots.get(path)
        if want is None:
            problems.append(f"leaf {path} is not in step {step}")
            continue
        got = value_root(value, cb)
        if got is None:
            problems.append(f"leaf {path}: {type(value).__name__} is no leaf a delta compares")
        elif got != want:
            if (got.kind, got.dtype, got.shape) != (want.kind, want.dtype, want.shape):
                problems.append(
                    f"leaf {path} is {got.describe()}, step {step} has {want.describe()}"
                )
            else:
                problems.append(f"leaf {path} differs from step {step}'s (its Merkle root)")
    if not problems:
        return
    what = (
        f"the state is not step {delta.a} of {delta.run}, the base of {delta.path}; nothing "
        "was changed"
        if before
        else f"after applying {delta.path}, the state is not step {delta.b} of {delta.run}"
    )
    more = " (and more)" if len(problems) > 3 else ""
    cls = StateMismatchError if before else IntegrityError
    raise cls(f"{what}: {'; '.join(problems[:3])}{more}", step=step, path=delta.run or None)


def _fill(old: Any, new: Any) -> bool:
    """Copy ``new`` into the state's own tensor or array ``old`` where the two have one dtype
    and shape (a tensor on any device; an array in the memory order B holds it in); whether
    it did."""
    torch = loaded_torch()
    if torch is not None and type(old) in (torch.Tensor, torch.nn.Parameter):
        if type(new) is not type(old) or old.requires_grad != new.requires_grad:
            return False  # replaced: B's is a Parameter, or requires grad, and A's not
        if (old.dtype, old.shape) != (new.dtype, new.shape):
            return False
        with torch.no_grad():
            old.copy_(new)
        return True
    if type(old) is np.ndarray and type(new) is np.ndarray and old.flags.writeable:
        if (old.dtype, old.shape) != (new.dtype, new.shape) or _fortran(old) != _fortran(new):
            return False  # replaced: load() of B builds it in B's order
        np.copyto(old, new)
        return True
    return False


def _fortran(arr: np.ndarray) -> bool:
    return arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous


def _new_container(kind: str | None, path: str) -> Any:
    if kind in ("dict", "odict"):
        return {} if kind == "dict" else OrderedDict()
    if kind in ("list", "tuple"):
        return [] if kind == "list" else ()
    raise StateMismatchError(f"cannot add leaf {path}: the state lacks a container on its way")


def _put(node: Any, keys: tuple[Key, ...], kinds: tuple[str, ...], value: Any, path: str) -> Any:
    """``node`` with ``value`` at ``keys`` below it (containers made of ``kinds`` where
    missing); dicts and lists changed in place, tuples rebuilt."""
    if not keys:
        return value
    if node is _MISSING:
        node = _new_container(kinds[0] if kinds else None, path)
    key, rest, below = keys[0], keys[1:], kinds[1:]
    if type(node) is tuple:
        return tuple(_put(list(node), keys, kinds, value, path))
    if type(node) in (dict, OrderedDict):
        node[key] = _put(node.get(key, _MISSING), rest, below, value, path)
        return node
    if type(node) is list and type(key) is int and 0 <= key <= len(node):
        child = node[key] if key < len(node) else _MISSING
        new = _put(child, rest, below, value, path)
        if key < len(node):
            node[key] = new
        else:
            node.append(new)
        return node
    raise StateMismatchError(
        f"cannot put leaf {path}: key {key!r:.40} does not fit the {type(node).__name__} there"
    )


def _drop(node: Any, keys: tuple[Key, ...], path: str) -> Any:
    """``node`` without the leaf at ``keys``: a dict key deleted, a list's last item popped
    (an item before the end left missing, for a leaf of B to take); a container the removal
    empties goes too (the root stays)."""
    if not keys:
        return _MISSING
    if type(node) is tuple:
        return tuple(_drop(list(node), keys, path))
    key = keys[0]
    if type(node) in (dict, OrderedDict) and key in node:
        child = _MISSING if len(keys) == 1 else _drop(node[key], keys[1:], path)
        if child is _MISSING or _emptied(child):
            del node[key]
        else:
            node[key] = child
        return node
    if type(node) is list and type(key) is int and 0 <= key < len(node):
        child = _MISSING if len(keys) == 1 else _drop(node[key], keys[1:], path)
        if key == len(node) - 1 and (child is _MISSING or _emptied(child)):
            node.pop()
        else:
            node[key] = child
        return node
    raise StateMismatchError(f"cannot remove leaf {path}: the state has no such leaf")


def _emptied(node: Any) -> bool:
    return type(node) in (dict, OrderedDict, list, tuple) and not node
