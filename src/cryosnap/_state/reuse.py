"""Reusing the last flatten of a state whose structure did not change (:class:`FlattenCache`):
one scan (a state dict's tensors as one list), each tensor's metadata read once (its
fingerprint and addresses), then the last skeleton and blob layout, with no node built per
leaf (flatten.py uses them).

Pure; the caller's thread (one cache per Checkpointer, behind a lock).
docs/design/state-trees.md ("Reusing the last flatten") has the why.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from cryosnap._format.skeleton import MAX_DEPTH, Json
from cryosnap._state.torch_import import loaded_torch

__all__ = [
    "CONTIGUOUS",
    "DATA",
    "Copies",
    "OFFSET",
    "Entry",
    "FlattenCache",
    "PackBuffers",
    "Scan",
    "inline_places",
    "metadata",
    "patched",
    "scan",
    "storage_address",
    "storage_of",
    "storages",
    "unique",
]

# A pack's copies: one row (source address, nbytes, offset in the pack) per tensor, in
# offset order.
Copies: TypeAlias = "np.ndarray[Any, np.dtype[np.int64]]"

# Leaves a skeleton holds inline, without a blob (torch.Size too).
_INLINE = frozenset((int, float, bool, str, complex, type(None)))


@dataclass(slots=True)
class Scan:
    """One walk of a state in flatten's order: its shape (container types and keys, leaf
    types), its inline leaves, its tensors and its stateful objects (path, object)."""

    shape: list[Any]
    inline: list[Any]
    tensors: list[Any]
    stateful: list[tuple[tuple[str | int, ...], Any]]


class _Other(Exception):
    """A leaf a reused flatten does not cover (arrays, bytes, files, subclasses...)."""


def scan(state: Any) -> Scan | None:
    """Walk ``state`` as flatten does (dict order, list order, ``state_dict()`` of stateful
    objects); None if it holds anything but containers, inline scalars and plain tensors, or
    nests deeper than a skeleton may (flatten then says what is wrong)."""
    found = Scan([], [], [], [])
    torch = loaded_torch()
    plain = frozenset((torch.Tensor, torch.nn.Parameter)) if torch is not None else frozenset()
    size = torch.Size if torch is not None else None
    try:
        _walk(state, (), found, 0, plain, size)
    except _Other:
        return None
    return found


def _walk(
    obj: Any,
    path: tuple[str | int, ...],
    found: Scan,
    depth: int,
    plain: frozenset[type],
    size: Any,
) -> None:
    if depth > MAX_DEPTH:
        raise _Other
    tp = type(obj)
    if tp in _INLINE or tp is size:
        found.shape.append(tp)
        found.inline.append(obj)
    elif tp is dict or tp is OrderedDict:
        keys = list(obj)
        if not set(map(type, keys)) <= {str, int}:
            raise _Other
        values = list(obj.values())
        if values and set(map(type, values)) <= plain:  # a state dict: its tensors in bulk
            found.shape.append((tp, keys, len(values)))
            found.tensors += values
            return
        found.shape.append((tp, keys, -1))
        for k, v in zip(keys, values, strict=True):
            _walk(v, (*path, k), found, depth + 1, plain, size)
    elif tp is list or tp is tuple:
        found.shape.append((tp, len(obj)))
        for i, v in enumerate(obj):
            _walk(v, (*path, i), found, depth + 1, plain, size)
    elif tp in plain:
        found.shape.append(tp)
        found.tensors.append(obj)
    elif callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        found.shape.append(tp)
        found.stateful.append((path, obj))
        _walk(obj.state_dict(), path, found, depth + 1, plain, size)
    else:
        raise _Other


# Where a tensor's metadata (:func:`metadata`) holds its contiguity, then its storage offset
# (elements) and its address; the fields before OFFSET are its fingerprint.
CONTIGUOUS, OFFSET, DATA = 5, 7, 8


def metadata(tensors: list[Any]) -> list[tuple[Any, ...]] | None:
    """Each tensor's fingerprint, what decides its skeleton node and blob (type, Parameter or
    not; dtype, shape, device, requires_grad, contiguity, layout), then its storage offset and
    its data_ptr, in one pass (each tensor read once: 20,000 small ones cost 46 ms this way and
    68 ms in three passes here, their metadata out of the CPU's caches; the offset, an int,
    instead of the storage's address saves making a storage object per tensor, ~4 ms of 26
    warm); None if one has no storage. :func:`storages` gives the storages' addresses."""
    try:
        return [
            (
                type(t),
                t.dtype,
                t.shape,
                t.device,
                t.requires_grad,
                t.is_contiguous(),
                t.layout,
                t.storage_offset(),
                t.data_ptr(),
            )
            for t in tensors
        ]
    except (RuntimeError, NotImplementedError):
        return None


def storage_address(data: int, offset: int, itemsize: int) -> int:
    """The address of the storage of a tensor at ``data`` (its data_ptr), ``offset`` elements
    of ``itemsize`` bytes into it (0: none), without making a storage object."""
    return data - offset * itemsize if data else 0


def storage_of(m: tuple[Any, ...]) -> int:
    """The address of the storage of the tensor whose :func:`metadata` is ``m`` (0: none)."""
    return storage_address(m[DATA], m[OFFSET], m[1].itemsize)


def storages(meta: list[tuple[Any, ...]]) -> list[int]:
    """The addresses of the tensors' storages, by their :func:`metadata`."""
    return [storage_of(m) for m in meta]


def unique(ptrs: list[int]) -> list[int] | None:
    """``ptrs`` if no two are the same and none is 0 (storages of their own), else None."""
    return ptrs if len(set(ptrs)) == len(ptrs) and 0 not in ptrs else None


class PackBuffers:
    """The memory of an entry's packs, kept from version to version: a fresh pack's pages
    fault in one by one as it is filled (the kernel zeroes each), which cost a state of
    20,000 small tensors 0.2 s of its 0.27 s of copying here; a kept buffer is filled again.

    A buffer is taken again only once nothing refers to it any more (no Python reference to
    the tensor, no other tensor or array on its storage): what freeing it would have waited
    for, so a version still being written keeps its packs. At most :data:`KEEP` buffers per
    pack (a version written while the next one is flattened); beyond, packs are fresh."""

    KEEP = 2

    def __init__(self, packs: int) -> None:
        self._held: list[list[Any]] = [[] for _ in range(packs)]

    def take(self, pack: int, nbytes: int, torch: Any) -> Any:
        """A uint8 CPU tensor of ``nbytes`` for the entry's pack number ``pack`` (its bytes
        are the last version's: the caller overwrites every one)."""
        held = self._held[pack]
        uses = getattr(torch._C, "_storage_Use_Count", None)
        if uses is None:  # a torch without it: who else holds a pack cannot be told
            return torch.empty(nbytes, dtype=torch.uint8)
        for buf in held:
            # References: the list's, the loop's and the argument's; uses: the tensor's and
            # the storage object's that untyped_storage() returns.
            if sys.getrefcount(buf) == 3 and uses(buf.untyped_storage()._cdata) == 2:
                return buf
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if len(held) < self.KEEP:
            held.append(buf)
        return buf


@dataclass(frozen=True, slots=True)
class Entry:
    """A flatten to reuse: what it was made with (``key``: allow_pickle, pack bytes, keys
    packed apart), the scan's shape and fingerprint, the skeleton, where each inline leaf's
    node lies in it (indices from the root; None steps into a stateful node) with that node,
    and the blobs by tensor index: ``(path, tensor, None)`` alone, ``(path, size, members)``
    a pack of ``(tensor, nbytes, offset)``; ``buffers`` the packs' memory, by pack number
    (the packs in blob order)."""

    key: tuple[Any, ...]
    shape: list[Any]
    fingerprint: list[tuple[Any, ...]]
    skeleton: Json
    places: list[tuple[list[int | None], Json]]
    blobs: list[tuple[tuple[str | int, ...], int, list[tuple[int, int, int]] | None]]
    leaves: int
    logical_bytes: int
    packed: bool
    buffers: PackBuffers
    # The metadata of the last tensors reused (:func:`metadata`) and, where every packed
    # tensor is contiguous, each pack's :data:`Copies`: while a save's tensors lie where the
    # last one's did, one list comparison stands for the fingerprint, the storages and the
    # addresses (training steps in place).
    last: list[tuple[list[tuple[Any, ...]], list[Copies] | None]] = field(default_factory=list)


class FlattenCache:
    """The last flatten a Checkpointer made, for the next one to reuse when the state's shape
    and fingerprint are the same (:func:`flatten`'s ``cache``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: Entry | None = None
        self.reused = 0  # how many flattens reused an entry (tests read it)

    def match(
        self, key: tuple[Any, ...], found: Scan
    ) -> tuple[Entry, list[tuple[Any, ...]], list[Copies] | None] | None:
        """The entry ``found`` (made with ``key``) may reuse, its tensors' metadata, and the
        entry's pack copies if they hold for these tensors (:attr:`Entry.last`); or None
        (the structure changed, or two tensors share a storage now)."""
        with self._lock:
            entry = self._entry
        if (
            entry is None
            or entry.key != key
            or len(entry.fingerprint) != len(found.tensors)
            or entry.shape != found.shape
        ):
            return None
        meta = metadata(found.tensors)
        if meta is None:
            return None
        last = entry.last[0] if entry.last else None
        if last is not None and meta == last[0]:
            return entry, meta, last[1]  # where the last ones were: all as then
        if [m[:OFFSET] for m in meta] != entry.fingerprint:
            return None
        if unique(storages(meta)) is None:
            return None
        return entry, meta, None

    def hit(self) -> None:
        with self._lock:
            self.reused += 1

    def keep(self, entry: Entry | None) -> None:
        with self._lock:
            self._entry = entry


def inline_places(skeleton: Json) -> list[tuple[list[int | None], Json]]:
    """Every leaf node of ``skeleton`` that is no tensor, in visit order, with the indices
    that lead to it from the root."""
    out: list[tuple[list[int | None], Json]] = []
    stack: list[tuple[Json, list[int | None]]] = [(skeleton, [])]
    while stack:
        node, at = stack.pop()
        t = node["t"]
        if t in ("dict", "odict", "list", "tuple"):
            for i in range(len(node["v"]) - 1, -1, -1):
                child = node["v"][i]
                if child["t"] != "torch":
                    stack.append((child, [*at, i]))
        elif t == "stateful":
            stack.append((node["v"], [*at, None]))
        elif t != "torch":
            out.append((at, node))
    return out


def patched(skeleton: Json, at: list[int | None], node: Json) -> Json:
    """A copy of ``skeleton`` with ``node`` at ``at``: only the containers on the way are
    copied, everything else is shared (a skeleton is never modified once made)."""
    if not at:
        return node
    top = dict(skeleton)
    head, rest = at[0], at[1:]
    if head is None:
        top["v"] = patched(skeleton["v"], rest, node)
    else:
        values = list(skeleton["v"])
        values[head] = patched(values[head], rest, node)
        top["v"] = values
    return top
