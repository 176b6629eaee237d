"""``into=``: check a target tree against a skeleton, find the leaves a reader may fill
directly, and fill the others in place once every chunk verified (:func:`apply_into`).

Pure (a copy to a GPU and the files of ``cryosnap.File`` leaves, written by files.py, aside);
runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cryosnap import _native
from cryosnap._format.columns import Columns
from cryosnap._format.skeleton import (
    Json,
    dict_columns,
    dict_items,
    dict_keys,
    format_path,
)
from cryosnap._state import dtensor
from cryosnap._state.device import copy_to_device
from cryosnap._state.dtypes import NP_DTYPES, itemsize, np_dtype, require_torch
from cryosnap._state.files import File, FileWrites, check_file_into
from cryosnap._state.flatten import _DTYPE_NAMES, dtype_name, is_stateful
from cryosnap._state.restore_columns import ColumnTargets
from cryosnap._state.torch_import import loaded_torch
from cryosnap.errors import StateMismatchError


def check_into(skeleton: Json, into: Any) -> None:
    """Check that ``into`` can take the saved tree; raise :class:`StateMismatchError` if not.

    Nothing is filled here: :func:`apply_into` does that once every byte has been read and
    verified, so a mismatch or a corrupt chunk leaves ``into`` untouched.
    """
    _check(skeleton, into, (), None)


def _mismatch(path: tuple[str | int, ...], what: str) -> StateMismatchError:
    return StateMismatchError(f"into= does not match the checkpoint at {format_path(path)}: {what}")


def _fillable(into: Any) -> bool:
    torch = loaded_torch()
    return isinstance(into, np.ndarray) or (torch is not None and isinstance(into, torch.Tensor))


def _is_object(into: Any) -> bool:
    kind = type(into)
    if kind in _PLAIN_VALUES:
        return False  # the common case, without two failed attribute lookups
    torch = loaded_torch() if _PLAIN_TORCH else None
    if torch is not None:
        _PLAIN_VALUES.update((torch.Tensor, torch.nn.Parameter))
        _PLAIN_TORCH.clear()
        if kind in _PLAIN_VALUES:
            return False
    return is_stateful(into) and not isinstance(into, (dict, list, tuple))


# Types that are no stateful object (torch's added once a tensor is met: cryosnap never
# imports torch itself).
_PLAIN_VALUES: set[type] = {dict, list, tuple, np.ndarray, str, int, float, bool, bytes, type(None)}
_PLAIN_TORCH = [True]


def _check_optimizer(inner: Json, into: Any, path: tuple[str | int, ...]) -> None:
    # Optimizer.load_state_dict refuses other group/parameter counts; find out before any
    # leaf is filled.
    saved = dict(dict_items(inner, format_path(path)))
    groups = saved.get("param_groups", {}).get("v", [])
    sizes = []
    for g in groups:
        params = dict(dict_items(g, format_path(path))).get("params", {})
        sizes.append(len(params.get("v", [])))
    have = [len(g["params"]) for g in into.param_groups]
    if sizes != have:
        raise _mismatch(
            path, f"saved optimizer has parameter groups of sizes {sizes}, into= has {have}"
        )


def _check(node: Json, into: Any, path: tuple[str | int, ...], match: _Match | None) -> None:
    """Check ``into`` against ``node`` at ``path``; with ``match``, note on the way which of
    its leaves a restore may fill directly (:func:`direct_targets`): one walk for both, each
    tensor's attributes read once."""
    t = node["t"]
    torch = loaded_torch()
    if t == "stateful" or _is_object(into):
        if not _is_object(into):
            raise _mismatch(path, f"saved a stateful object, into= has {type(into).__name__}")
        inner = node["v"] if t == "stateful" else node
        if inner.get("t") not in ("dict", "odict"):
            raise _mismatch(path, f"saved a {inner.get('t')} leaf, into= has a stateful object")
        if torch is not None and isinstance(into, torch.nn.Module):
            # Module.load_state_dict copies parameter by parameter and reports mismatches only
            # at the end: check keys and shapes up front so a mismatch changes nothing.
            _check(inner, into.state_dict(), path, None)  # load_state_dict fills it
        elif torch is not None and isinstance(into, torch.optim.Optimizer):
            _check_optimizer(inner, into, path)
        return
    if t in ("dict", "odict"):
        if not isinstance(into, dict):
            raise _mismatch(path, f"saved a dict, into= has {type(into).__name__}")
        where = format_path(path)
        saved = dict_keys(node, where)
        known = set(saved)
        if into.keys() != known or len(known) != len(saved):
            missing = [k for k in saved if k not in into]
            extra = [k for k in into if k not in known]
            if missing or extra:
                raise _mismatch(path, f"keys missing from into=: {missing}, unexpected: {extra}")
        cols = dict_columns(node, where) if "cols" in node else None
        if (
            cols is not None
            and torch is not None
            and _check_columns(node, cols, saved, into, match)
        ):
            return
        plain = torch.Tensor if torch is not None else None
        names, descrs = _DTYPE_NAMES, NP_DTYPES
        for k, v in dict_items(node, where):
            x = into[k]
            # A state dict's tensors and a dict's arrays, checked here without a call each
            # (what _check_leaf checks of them; a descr not parsed yet takes the long way).
            kind = type(x)
            if kind is plain:
                if (
                    v.get("t") == "torch"
                    and names.get(x.dtype) == v.get("dtype")
                    and list(x.shape) == v.get("shape")
                ):
                    if match is not None:
                        match.tensor(v, x)
                    continue
            elif kind is np.ndarray and v.get("t") == "numpy":
                want = descrs.get(v["dtype"]) if type(v.get("dtype")) is str else None
                if (
                    want is not None
                    and want == x.dtype
                    and list(x.shape) == v.get("shape")
                    and x.flags.writeable
                ):
                    if match is not None:
                        match.array(v, x)
                    continue
            _check(v, x, (*path, k), match)
        return
    if t in ("list", "tuple"):
        if not isinstance(into, (list, tuple)):
            raise _mismatch(path, f"saved a {t}, into= has {type(into).__name__}")
        if len(into) != len(node["v"]):
            raise _mismatch(path, f"saved {len(node['v'])} items, into= has {len(into)}")
        for i, v in enumerate(node["v"]):
            _check(v, into[i], (*path, i), match)
        return
    _check_leaf(t, node, into, path)
    if match is not None:
        match.leaf(node, into)


def _check_columns(
    node: Json,
    cols: Columns,
    keys: list[str | int],
    into: dict[Any, Any],
    match: _Match | None,
) -> bool:
    """Check a dict node in columns against ``into``'s dict (its keys checked) in bulk, and
    with ``match`` note its leaves as :class:`ColumnTargets`: True when every leaf of ``into``
    is a plain CPU tensor of the saved dtype and shape (contiguous, with ``match``); False,
    nothing noted, for anything else, which the walk leaf by leaf then checks and names."""
    torch = require_torch()
    plains = (torch.Tensor, torch.nn.Parameter)
    xs = [into[k] for k in keys]
    if not set(map(type, xs)) <= set(plains):
        return False
    rows: list[tuple[Any, ...]]
    try:
        if match is None:
            rows = [(x.dtype, x.shape) for x in xs]
        else:
            # Every attribute read once: the metadata of 20,000 tensors is out of the CPU's
            # caches, so each pass over them costs (x.is_cpu: x.device makes an object).
            rows = [
                (
                    x.dtype,
                    x.shape,
                    x.is_cpu,
                    x.layout,
                    x.is_contiguous(),
                    x.is_inference() or x.is_neg(),
                    x.data_ptr(),
                )
                for x in xs
            ]
    except RuntimeError:  # a layout without strides or memory (sparse...): leaf by leaf
        return False
    if not rows:
        return match is None
    dtypes, shapes, *rest = zip(*rows, strict=True)
    if not cols.same_shapes(shapes):  # type: ignore[arg-type]
        return False
    kinds_of = set(dtypes)
    names = {d: dtype_name(d) for d in kinds_of}
    if not cols.same_dtypes(dtypes, names):
        return False
    if match is None:
        return True
    on_cpu, layouts, contiguous, flagged, ptrs = rest
    if not all(on_cpu) or set(layouts) != {torch.strided} or not all(contiguous) or any(flagged):
        return False
    # A conjugate view holds other values than its bytes: only complex tensors can be one.
    if any("complex" in n for n in cols.dtypes) and any(x.is_conj() for x in xs):
        return False
    # into='s own dtypes, which the columns name: their element sizes, and each leaf's bytes
    # from its shape (into='s, as checked).
    size = {names[d]: itemsize(d) for d in kinds_of}
    item = np.array([size.get(n, 1) for n in cols.dtypes], np.int64)[cols.dtype]
    found = ColumnTargets(node, cols, xs, item, cols.elements() * item, np.array(ptrs, np.int64))
    return match.columns(found)


def _check_leaf(t: Any, node: Json, into: Any, path: tuple[str | int, ...]) -> None:
    torch = loaded_torch()
    if t == "file" or isinstance(into, File):
        check_file_into(t, into, path)
        return
    if isinstance(into, (dict, list, tuple)):
        raise _mismatch(path, f"saved a {t} leaf, into= has a {type(into).__name__}")
    if t == "torch" and torch is not None and isinstance(into, torch.Tensor):
        into, layout = dtensor.check_into(node, into, path)
        if layout is not None:
            raise _mismatch(path, layout)
        dtype = dtype_name(into.dtype)
        if list(into.shape) != node["shape"] or dtype != node["dtype"]:
            raise _mismatch(
                path,
                f"saved {node['dtype']}{node['shape']}, into= has {dtype}{list(into.shape)}",
            )
        return
    if t == "numpy" and isinstance(into, np.ndarray):
        saved_dtype = np_dtype(node["dtype"], format_path(path))
        if list(into.shape) != node["shape"] or into.dtype != saved_dtype:
            raise _mismatch(
                path,
                f"saved {saved_dtype}{node['shape']}, into= has {into.dtype}{list(into.shape)}",
            )
        if not into.flags.writeable:
            raise _mismatch(path, "into= array is read-only")
        return
    if _fillable(into):
        raise _mismatch(path, f"saved a {t} leaf, into= has {type(into).__name__}")
    # Scalars, strings, bytes, None: nothing to fill in place; the loaded value replaces them.


def direct_targets(skeleton: Json, into: Any, *, min_bytes: int = 0) -> dict[int, Any]:
    """Check ``into`` as :func:`check_into` does (raising what it raises) and return the leaves
    of at least ``min_bytes`` that a restore may read straight into: ``id`` of the skeleton
    node -> ``into``'s tensor or array; and, whatever their size, the packed leaves whose
    tensor the restore may fill from the pack's memory with a plain copy of bytes
    (``Restorer.fill_packs``). One walk does both: each tensor's attributes are read once.

    Those are the tensors and arrays :func:`apply_into` would fill by a plain copy (not those
    inside stateful objects, which ``load_state_dict`` fills), that are on the CPU, C-contiguous,
    writable, non-empty, of a plain type (``torch.Tensor``, ``nn.Parameter``, ``np.ndarray``;
    no inference tensor) and not a view of a shared saved storage, and whose memory overlaps
    no other leaf's that apply_into fills: where two overlap, the order of their copies decides
    what is left, so both keep the copy.
    """
    match = _Match(min_bytes)
    _check(skeleton, into, (), match)
    if match.unknown:
        return {}  # a leaf whose memory cannot be told: every leaf keeps the copy
    spans = np.array(match.spans, np.int64).reshape(-1, 3)
    if match.cols:
        spans = np.concatenate([spans, *(c.spans() for c in match.cols)])
    shared = _overlapping(spans)
    found: dict[int, Any] = {
        key: leaf for i, (key, leaf) in enumerate(match.found) if i not in shared
    }
    for c in match.cols:
        if shared and not c.apart(shared):
            # Some of its leaves overlap: those keep the copy, the others are noted leaf by
            # leaf (the restorer then walks its nodes).
            found.update(c.leaf_targets(shared))
        else:
            found[id(c.cols_node)] = c
    return found


class _Match:
    """What :func:`direct_targets` collects on :func:`_check`'s walk: the leaves found
    (skeleton node id, into='s leaf), the host memory of every leaf apply_into fills (first
    byte, end, index in ``found`` or -1), and whether a leaf's memory could not be told."""

    __slots__ = ("cols", "found", "min_bytes", "next", "spans", "strided", "unknown")

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        # into= holding a tensor means torch is imported before the walk.
        torch = loaded_torch()
        self.strided = torch.strided if torch is not None else None
        self.found: list[tuple[int, Any]] = []
        self.spans: list[tuple[int, int, int]] = []
        self.unknown = False
        self.cols: list[ColumnTargets] = []
        # Indices of the leaves of dict nodes in columns (as the spans' third column) start
        # here, after every index ``found`` can reach.
        self.next = 1 << 40

    def columns(self, found: ColumnTargets) -> bool:
        """A dict node in columns whose leaves are plain contiguous CPU tensors of its dtypes
        and shapes: noted (its leaves numbered in the spans) when every non-empty one may be
        filled directly (packed, or of at least ``min_bytes``); False (nothing noted)
        otherwise."""
        nbytes = found.nbytes
        full = nbytes > 0
        if not ((nbytes >= self.min_bytes) | (found.cols.at >= 0) | ~full).all():
            return False
        found.index[full] = np.arange(self.next, self.next + int(full.sum()))
        self.next += len(nbytes)
        self.cols.append(found)
        return True

    def tensor(self, node: dict[str, Any], x: Any) -> None:
        """A plain ``torch.Tensor`` that :func:`_check` found of ``node``'s dtype and shape (a
        state dict's common leaf): what :meth:`leaf` notes of it, its attributes read once."""
        if not (x.is_cpu and x.layout == self.strided and x.is_contiguous()):
            self.leaf(node, x)
            return
        n = x.nbytes
        if not n:
            return
        lo = x.data_ptr()
        # What _direct checks of a contiguous CPU torch.Tensor of the node's dtype and shape.
        if (
            (n >= self.min_bytes or "at" in node)
            and "view" not in node
            and not x.is_inference()
            and not x.is_conj()
            and not x.is_neg()
        ):
            self.spans.append((lo, lo + n, len(self.found)))
            self.found.append((id(node), x))
        else:
            self.spans.append((lo, lo + n, -1))

    def array(self, node: dict[str, Any], x: np.ndarray[Any, Any]) -> None:
        """A plain writable numpy array that :func:`_check` found of ``node``'s dtype and
        shape: what :meth:`leaf` notes of it, without its general walk."""
        if self.unknown or not x.size:
            return
        if not x.flags.c_contiguous:
            self.leaf(node, x)
            return
        lo, n = _native.leaf_address(x), x.nbytes
        # What _direct checks of such an array.
        direct = (n >= self.min_bytes or "at" in node) and node.get("order") != "F"
        self.spans.append((lo, lo + n, len(self.found) if direct else -1))
        if direct:
            self.found.append((id(node), x))

    def leaf(self, node: dict[str, Any], into: Any) -> None:
        """Any other leaf (checked, or about to be, by :func:`_check`)."""
        if self.unknown or not _fillable(into):
            return
        try:
            span = _span(into)
        except _Unknown:
            self.unknown = True
            return
        if span is None:
            return  # on a GPU, or empty
        direct = (span[1] - span[0] >= self.min_bytes or "at" in node) and _direct(node, into)
        self.spans.append((*span, len(self.found) if direct else -1))
        if direct:
            self.found.append((id(node), into))


def _overlapping(table: np.ndarray[Any, np.dtype[np.int64]]) -> set[int]:
    """The indices (``table``'s third column, -1: none) of the spans (first byte, end,
    index) that overlap another, in bulk: sorted by first byte, a span overlaps one before it
    if it starts before the furthest end so far, and the next one if that starts before its
    end."""
    if len(table) < 2:
        return set()
    # addresses are below 2**63
    table = table[np.lexsort((table[:, 2], table[:, 1], table[:, 0]))]
    lo, hi, which = table[:, 0], table[:, 1], table[:, 2]
    hit = np.zeros(len(table), bool)
    hit[1:] = lo[1:] < np.maximum.accumulate(hi)[:-1]
    hit[:-1] |= lo[1:] < hi[:-1]
    return set(which[hit & (which >= 0)].tolist())


class _Unknown(Exception):
    """A leaf of into= whose host memory cannot be told (direct_targets then picks none)."""


def _span(leaf: Any) -> tuple[int, int] | None:
    """The bytes ``leaf`` (a tensor or array) spans in host memory; None on a GPU, empty or not
    strided (sparse)."""
    if isinstance(leaf, np.ndarray):
        if not leaf.size:
            return None
        addr, item, strides = leaf.ctypes.data, leaf.itemsize, leaf.strides
        if leaf.flags.c_contiguous:
            return addr, addr + leaf.nbytes
        shape: tuple[int, ...] = leaf.shape
    else:
        torch = require_torch()
        leaf = dtensor.fill_target(leaf)  # a DTensor's memory is its local shard's
        if leaf.device.type != "cpu" or leaf.layout != torch.strided or not leaf.numel():
            return None
        if type(leaf) not in (torch.Tensor, torch.nn.Parameter):
            raise _Unknown  # a subclass (DTensor, fake tensors...): its memory is its own business
        addr, item = leaf.data_ptr(), leaf.element_size()
        if leaf.is_contiguous():
            return addr, addr + leaf.numel() * item
        strides, shape = tuple(s * item for s in leaf.stride()), tuple(leaf.shape)
    lo = addr + sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if st < 0)
    hi = addr + item + sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if st > 0)
    return lo, hi


def _direct(node: dict[str, Any], leaf: Any) -> bool:
    """Whether a restore may read the bytes of ``node`` straight into ``leaf`` (or, packed,
    copy them there from the pack)."""
    if isinstance(leaf, np.ndarray):
        return (
            node["t"] == "numpy"
            and node.get("order") != "F"
            and type(leaf) is np.ndarray
            and leaf.flags.c_contiguous
            and leaf.flags.writeable
            and list(leaf.shape) == node["shape"]
        )
    torch = require_torch()
    return (
        node["t"] == "torch"
        and "view" not in node
        and type(leaf) in (torch.Tensor, torch.nn.Parameter)
        and leaf.layout == torch.strided
        and leaf.is_contiguous()
        and not leaf.is_inference()
        and not leaf.is_conj()
        and not leaf.is_neg()
        and dtype_name(leaf.dtype) == node["dtype"]
        and list(leaf.shape) == node["shape"]
    )


def apply_into(
    node: Json, loaded: Any, into: Any, *, fill_direct: Callable[[], None] | None = None
) -> Any:
    """Fill ``into`` from the verified ``loaded`` tree; return the tree as restored.

    The files of ``File`` leaves are written first beside their targets (``File`` paths of
    ``into``), then stateful objects get ``load_state_dict`` (the last step that can still
    refuse: the staged files are then removed), then the files replace their targets, then
    ``fill_direct`` fills the leaves that ``loaded`` shares with ``into`` (read straight into
    them: :func:`direct_targets`), then the other tensors and arrays are copied in place (those
    on a GPU in one batch through the pinned slabs of :mod:`._devcopy`) and mutable containers
    (dict, list) get the new values of their non-fillable leaves.
    """
    plan = _Plan()
    result = plan.make(node, loaded, into)
    files = plan.files
    try:
        _load_states(plan.loads)
    except BaseException:
        files.discard()
        raise
    files.commit()
    if fill_direct is not None:
        fill_direct()
    torch = loaded_torch()
    on_device = []
    direct = plan.direct
    with torch.no_grad() if torch is not None else contextlib.nullcontext():
        for dst, src in plan.fills:
            if dst is src:
                if not isinstance(dst, np.ndarray):
                    direct.append(dst)
            elif isinstance(dst, np.ndarray):
                np.copyto(dst, src)
            elif dst.device.type != "cpu":
                on_device.append((src, dst))  # one batch through pinned slabs, below
            else:
                dst.copy_(src)
    copy_to_device(on_device)
    if direct:
        # Read straight into them: what a copy_ would have done to their version counters
        # (autograd's check of the tensors it saved for backward), done here.
        torch.autograd.graph.increment_version(direct)  # type: ignore[union-attr]
    for container, key, value in plan.sets:
        container[key] = value
    return result


def _load_states(loads: list[tuple[tuple[str | int, ...], Any, Any]]) -> None:
    for path, obj, state in loads:
        try:
            obj.load_state_dict(state)
        except Exception as exc:
            raise StateMismatchError(
                f"into= does not match the checkpoint at {format_path(path)}: "
                f"{type(obj).__name__}.load_state_dict refused it: {exc}"
            ) from exc


@dataclass(slots=True)
class _Plan:
    """What :func:`apply_into` does, collected by one walk of ``into`` beside the loaded tree:
    the stateful objects to load (path, object, state), the leaves to fill (target, source),
    the tensors the reader filled directly, the container slots to set (container, key,
    value), and the files staged."""

    loads: list[tuple[tuple[str | int, ...], Any, Any]] = field(default_factory=list)
    fills: list[tuple[Any, Any]] = field(default_factory=list)
    # into='s tensors the reader filled itself (the leaves of dict nodes in columns).
    direct: list[Any] = field(default_factory=list)
    sets: list[tuple[Any, Any, Any]] = field(default_factory=list)
    files: FileWrites = field(default_factory=FileWrites)

    def make(self, node: Json, loaded: Any, into: Any) -> Any:
        """Walk the whole tree; the tree as restored. Any failure removes the files staged."""
        try:
            return self._walk(node, loaded, into, ())
        except BaseException:
            self.files.discard()
            raise

    def _walk(self, node: Json, loaded: Any, into: Any, path: tuple[str | int, ...]) -> Any:
        t = node["t"]
        if t == "file":
            self.files.stage(into, loaded, path)
            return into
        if _is_object(into):
            inner = node["v"] if t == "stateful" else node
            self.loads.append((path, into, dtensor.for_stateful(into, inner, loaded)))
            return into
        if t in ("dict", "odict"):
            torch = loaded_torch()
            plains = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()
            where = format_path(path)
            keys = dict_keys(node, where)
            if "cols" in node and isinstance(loaded, dict):
                # In columns: read straight into into='s tensors (ColumnTargets), every one.
                xs, got = [into[k] for k in keys], [loaded[k] for k in keys]
                if all(map(operator.is_, xs, got)) and set(map(type, xs)) <= set(plains):
                    self.direct.extend(xs)
                    return into
            fills = self.fills
            children: list[Json] | None = None  # the child nodes, once one is needed
            for i, k in enumerate(keys):
                x = into[k]
                kind = type(x)
                if kind in plains or kind is np.ndarray:
                    # A state dict's tensors, a dict's arrays: filled in place (as below).
                    fills.append((x, loaded[k]))
                    continue
                if children is None:
                    children = [v for _k, v in dict_items(node, where)]
                new = self._walk(children[i], loaded[k], x, (*path, k))
                if new is not x:
                    self.sets.append((into, k, new))
            return into
        if t in ("list", "tuple"):
            items = [self._walk(v, loaded[i], into[i], (*path, i)) for i, v in enumerate(node["v"])]
            if isinstance(into, list):
                self.sets.extend(
                    (into, i, new) for i, new in enumerate(items) if new is not into[i]
                )
                return into
            return tuple(items)
        if _fillable(into):
            self.fills.append((dtensor.fill_target(into), loaded))
            return into
        return loaded
