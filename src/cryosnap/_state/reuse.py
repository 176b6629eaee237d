"""Reusing the last flatten of a state whose structure did not change: a layer in front of
the flattener (:meth:`FlattenCache.flatten`). One scan (a state dict's tensors as one list),
each tensor's metadata read once (its fingerprint and addresses), then, when they match, the
last skeleton and blob layout with no node built per leaf; otherwise one call of the
flattener, which it remembers for the next save.

Pure; the caller's thread (one cache per Checkpointer, behind a lock).
docs/design/state-trees.md ("Reusing the last flatten") has the why.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from cryosnap._format.skeleton import MAX_DEPTH, Json, format_path
from cryosnap._state.flatten import (
    Blob,
    DeferredPacks,
    FlatState,
    Flattener,
    alone_blob,
    copies_of,
    fill_packs,
    mutated_storages,
    pack_options,
)
from cryosnap._state.gc import paused_gc
from cryosnap._state.tensor_meta import (
    CONTIGUOUS,
    DATA,
    OFFSET,
    Copies,
    metadata,
    storage_of,
    storages,
    unique,
)
from cryosnap._state.torch_import import loaded_torch

__all__ = [
    "Entry",
    "FlattenCache",
    "PackBuffers",
    "Scan",
    "inline_places",
    "patched",
    "scan",
]

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

    def flatten(
        self,
        state: Any,
        *,
        allow_pickle: bool = False,
        pack_bytes: int = 0,
        pack_apart: object = None,
        defer_packs: bool = False,
    ) -> FlatState:
        """:func:`~cryosnap._state.flatten.flatten` of ``state``, reusing the last flatten made
        here when the state's structure did not change (the same result), and remembering
        this one for the next. ``defer_packs``: a reused flatten's packs are filled by
        ``result.deferred.fill()`` (a lazy capture's thread), not here; nothing may read them
        before."""
        pack, apart = pack_options(pack_bytes, pack_apart)
        key = (allow_pickle, pack, apart)
        with paused_gc():
            found = scan(state) if loaded_torch() is not None else None
            if found is not None:
                matched = self.match(key, found)
                if matched is not None:
                    self.hit()
                    flat = _reused(*matched, found, defer=defer_packs)
                    # Freed before the collector resumes: its first pass would walk each of
                    # their objects (20,000 tensors' metadata: ~6 ms of a save).
                    del matched, found
                    return flat
            flattener = Flattener(allow_pickle, pack, apart)
            flat = flattener.run(state)
            self.keep(_entry(key, found, flattener, flat) if found is not None else None)
            return flat

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


def _reused(
    entry: Entry,
    meta: list[tuple[Any, ...]],
    copies: list[Copies] | None,
    found: Scan,
    *,
    defer: bool = False,
) -> FlatState:
    """The flat state of ``found`` laid out as ``entry`` says: its skeleton (the inline
    leaves that changed re-encoded), a blob per tensor alone, the packs filled anew.
    ``meta``: the tensors' (reuse.metadata); ``copies``: each pack's copies by address, if the
    tensors lie where the entry's last ones did (then kept for the next save, if they can be
    made). ``defer``: the packs an optimizer of the state mutates every tensor of, filled by
    copies, are left to ``deferred.fill()`` (:class:`DeferredPacks`)."""
    skeleton = entry.skeleton
    encode = Flattener(False).inline
    for (at, node), value in zip(entry.places, found.inline, strict=True):
        fresh = encode(value)
        if fresh != node:
            skeleton = patched(skeleton, at, fresh)
    torch = sys.modules["torch"]
    tensors, uint8 = found.tensors, torch.uint8
    if copies is None:
        copies = _pack_copies(entry, meta)
        entry.last[:] = [(meta, copies)]
    blobs: list[Blob] = []
    packs = 0
    later: list[tuple[Any, Copies]] = []
    now: list[tuple[Any, Copies]] = []
    deferred: dict[int, list[int]] = {}  # blob -> its tensors' storages
    kept: list[int] = []  # the indices of the tensors of the deferred packs
    mutated: dict[int, set[int]] = {}
    if defer and copies is not None:
        optimizers = [o for _p, o in found.stateful if isinstance(o, torch.optim.Optimizer)]
        mutated = {id(o): mutated_storages(o, torch) for o in optimizers}
    guarded: set[int] = set().union(*mutated.values()) if mutated else set()
    hold: list[Any] = []  # contiguous copies the fills read, alive until filled
    with torch.no_grad():
        for path, size, members in entry.blobs:
            if members is None:  # size: the tensor's index
                t = tensors[size]
                x = t if meta[size][CONTIGUOUS] else t.contiguous()
                blobs.append(alone_blob(t, x, x.nbytes, path, storage_of(meta[size]), uint8))
                continue
            pack = entry.buffers.take(packs, size, torch)
            where = [storage_of(meta[i]) for i, _n, _at in members] if guarded else []
            if copies is not None and where and guarded.issuperset(where):
                later.append((pack, copies[packs]))
                deferred[len(blobs)] = where
                kept += [i for i, _n, _at in members]
            elif copies is not None:
                # The tensors (alive in ``found``) lie where the copies read.
                now.append((pack, copies[packs]))
            else:
                fill = [(tensors[i].contiguous(), n, at) for i, n, at in members]
                now.append((pack, copies_of([(t.data_ptr(), n, at) for t, n, at in fill])))
                hold.append(fill)
            packs += 1
            blobs.append(Blob(path, size, pack, 0, True))
        fill_packs(now)
        del hold
    stateful = [(format_path(path), obj) for path, obj in found.stateful]
    flat = FlatState(skeleton, blobs, entry.leaves, entry.logical_bytes, stateful, entry.packed)
    if later:
        keep = [tensors[i].untyped_storage() for i in kept]
        flat.deferred = DeferredPacks(later, keep, deferred, mutated)
    return flat


def _pack_copies(entry: Entry, meta: list[tuple[Any, ...]]) -> list[Copies] | None:
    """Each pack's :data:`Copies` for tensors of ``meta``; None if a packed tensor is not
    contiguous (its bytes are then a fresh copy's, at a new address)."""
    out = []
    for _path, _size, members in entry.blobs:
        if members is None:
            continue
        if not all(meta[i][CONTIGUOUS] for i, _n, _at in members):
            return None
        out.append(copies_of([(meta[i][DATA], n, at) for i, n, at in members]))
    return out


def _entry(
    key: tuple[Any, ...], found: Scan, flattener: Flattener, flat: FlatState
) -> Entry | None:
    """What the next flatten of a state of this structure may reuse, or None where reuse
    does not cover it: every blob a tensor alone or a pack (no shared storage, no array,
    bytes or file), no complex tensor (lazy conjugation is no part of the fingerprint), the
    scan's tensors those the flatten met."""
    tensors = flattener.tensors
    if flat.files or len(tensors) != len(found.tensors):
        return None
    if [t.data_ptr() for _n, t, _p in tensors] != [t.data_ptr() for t in found.tensors]:
        return None
    meta = metadata(found.tensors)
    if any(t.is_complex() for t in found.tensors) or meta is None:
        return None
    if unique(storages(meta)) is None:
        return None
    members: list[list[tuple[int, int, int]]] = [[] for _ in flat.blobs]
    alone: list[int] = [-1] * len(flat.blobs)
    for i, (node, t, _path) in enumerate(tensors):
        b = node["b"]
        if "view" in node:
            return None
        if "at" in node:
            members[b].append((i, t.nbytes, node["at"]))
        else:
            alone[b] = i
    blobs: list[tuple[tuple[str | int, ...], int, list[tuple[int, int, int]] | None]] = []
    for b, blob in enumerate(flat.blobs):
        if members[b]:
            blobs.append((blob.key, blob.nbytes, members[b]))
        elif alone[b] >= 0:
            blobs.append((blob.key, alone[b], None))
        else:
            return None  # bytes, an array, a pickle: not a tensor's
    places = inline_places(flat.skeleton)
    if len(places) != len(found.inline):
        return None
    return Entry(
        key,
        found.shape,
        [m[:OFFSET] for m in meta],
        flat.skeleton,
        places,
        blobs,
        flat.leaves,
        flat.logical_bytes,
        flat.packed,
        PackBuffers(sum(1 for _path, _size, members in blobs if members is not None)),
    )
