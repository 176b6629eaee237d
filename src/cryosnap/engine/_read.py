"""Read: restore or verify one rank's part of a version (:func:`read_part`,
:func:`verify_part`).

Every claimed size is checked before anything is allocated; ``into=`` is filled only after
every chunk verified. Runs on the caller's thread (plus the fetch's read pool and a prefault
thread); no collectives here. docs/design/read-path.md has the steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cryosnap import _native
from cryosnap._format.chunks import merkle_root, value_runs
from cryosnap._format.commit import CommitRecord, ManifestRef
from cryosnap._format.manifest import (
    FILES_FORMAT_VERSION,
    NUMPY_PACKED_FORMAT_VERSION,
    PACKED_FORMAT_VERSION,
    Manifest,
)
from cryosnap._format.skeleton import blob_keys, format_path
from cryosnap._located import located
from cryosnap._state import (
    Blob,
    DeviceFeed,
    DeviceMove,
    FlatState,
    Place,
    Restorer,
    apply_into,
    check_into,
    direct_targets,
)
from cryosnap._state.gc import paused_gc
from cryosnap._units import human_bytes
from cryosnap.engine._claims import check_chain_claims, check_used_files
from cryosnap.engine._limits import ReadLimits
from cryosnap.engine._records import read_commit, read_manifest
from cryosnap.engine._resolved import (
    ResolvedBlob,
    ResolvedPart,
    chain_coded,
    chain_manifests,
    resolve,
)
from cryosnap.engine._select import cut_part, keys_skeleton, renumbered, spread_paths
from cryosnap.engine.fetch import ColdFiles, Fetched, Mapped, placer, prefaulting, read_blobs
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    IntegrityError,
    KeyNotFoundError,
    PartNotFoundError,
    StateMismatchError,
)
from cryosnap.storage import Store, decoded

__all__ = [
    "PartNotFoundError",
    "resolve_part",
    "caller_stacklevel",
    "read_part",
    "read_selection",
    "verify_part",
]

log = logging.getLogger("cryosnap")


class ProgressLine(Protocol):
    """What a long read reports to: ``update(nbytes)`` as chunks arrive, ``close()`` at the
    end (``cryosnap.progress.Progress`` is one)."""

    def update(self, nbytes: int) -> None: ...

    def close(self) -> None: ...


# ``progress(label, total_bytes)``: a line for one read, made by the caller's choice (the
# engine draws nothing itself).
ProgressFactory = Callable[[str, int], ProgressLine]


_PREFAULT_MIN_BYTES = 1 << 20


@contextlib.contextmanager
def _prefaulted(views: Sequence[memoryview]) -> Iterator[None]:
    """Write zeros over freshly allocated ``views`` on a background thread (``memset``
    releases the GIL) until the block ends; the block must not touch ``views``."""
    big = [v for v in views if v.nbytes >= _PREFAULT_MIN_BYTES and v.contiguous and not v.readonly]
    with prefaulting([(_native.address_of(v), v.nbytes) for v in big], touch=_native.zero):
        yield


def _open_part(
    store: Store, step: int, rank: int, record: CommitRecord | None = None
) -> tuple[CommitRecord, Manifest, ManifestRef, str]:
    """The commit record of ``step`` (``record``, when the caller has it), rank's manifest and
    its ref, and where it is (for messages); a rank the version has no part for is
    :func:`_no_part`'s error."""
    record = record if record is not None else read_commit(store, step)
    if rank >= record.world_size:
        raise _no_part(store, record, rank)
    manifest, ref = read_manifest(store, record, rank)
    return record, manifest, ref, f"step {step}, tier {store.url}: {ref.key}"


def _read_verified(
    store: Store,
    step: int,
    *,
    rank: int,
    allow_pickle: bool,
    into: Any = None,
    progress: ProgressFactory | None = None,
    keys: Sequence[str | int] | None = None,
    device: Any = None,
    limits: ReadLimits,
    record: CommitRecord | None = None,
) -> tuple[ResolvedPart, Restorer, Fetched]:
    """Resolve one rank's part, allocate its leaves, read and verify every chunk into them
    (reported to a line ``progress`` makes, if given). ``keys``: only these top-level keys
    (:mod:`._select`): the other keys' chunks are neither read nor verified, and the
    restorer's skeleton holds these keys only. ``device`` (a ``torch.device`` other than the
    CPU, without ``into``): each blob's torch leaves are copied there as soon as the blob
    verified, while the reads go on (:func:`_pipelined`); the restorer's leaves are then
    those copies (``restorer.moved``). ``limits``: the read's, taken at its entry.

    With ``into`` on a store with a local path, the leaves :func:`direct_targets` picks are not
    allocated: their chunks are verified, and the returned :class:`Fetched` reads them into
    ``into``'s own memory when the caller is ready (:func:`read_part`, through apply_into).
    Reading a local file twice from the page cache costs less than a fresh copy of the
    state: its pages to fault in, then a second copy into ``into``. Elsewhere a read is a
    request to a remote store: the leaves are read once and copied."""
    with paused_gc():
        record, manifest, ref, where = _open_part(store, step, rank, record)
        skeleton, index = manifest.skeleton, list(range(len(manifest.blobs)))
        if keys is not None:
            skeleton, index = renumbered(keys_skeleton(skeleton, keys, where), len(index))
        targets: dict[int, Any] = {}
        if into is not None:
            if store.capabilities.local_path is not None:
                # into= is checked on the way.
                targets = _direct_targets(skeleton, into, where, limits.direct_min_bytes)
            else:
                _check_into(skeleton, into, where)
        chain = chain_manifests(store, manifest, ref.key, ref.xxh3)
        # Coded data files (a persistent level's codec) are read as their plain bytes through
        # the store's reads: neither mapped nor read cold (both would see the frames).
        store = decoded(store, chain_coded(chain))
        # Every size, offset and count the chain claims is checked before any allocation.
        checked = check_chain_claims(store, chain, set(record.data_files))
        sizes = [manifest.blobs[i].nbytes for i in index]
        restorer = Restorer(skeleton, sizes, allow_pickle=allow_pickle)
        laid = _lay_out(
            store, manifest, ref, chain, restorer, targets, where, keys, index, limits.cold_share
        )
        part, views, mapped, cold, placed = laid
        check_used_files(store, part, checked)
        move: DeviceMove | None = None
        feed: DeviceFeed | None = None
        if device is not None and into is None and _pipelined(device):
            # Not wrapped: running out of device memory is no damage of the version.
            move = restorer.device_move(device)
            feed = DeviceFeed(move.groups)
        # Still paused: the fetch makes a view or two per piece (tens of thousands for a state
        # of many small leaves, none in a cycle), and each collection they would set off walks
        # every object allocated above, holding the GIL the read threads hash under.
        fetch = functools.partial(
            read_blobs,
            store,
            part,
            views,
            direct=restorer.direct,
            mapped=mapped,
            placed=placed,
            cold=cold,
            on_ready=feed.ready if feed is not None else None,
            limits=limits,
        )
        total = manifest.logical_bytes if keys is None else sum(sizes)
        fetched = _fetch_reported(
            fetch, feed, progress, f"cryosnap: restoring step {step}", total, where
        )
        if feed is not None and move is not None:
            feed.close()
            log.debug(
                "%s: %d of %d blobs copied to %s after the reads",
                where,
                feed.late,
                len(move.groups),
                device,
            )
            restorer.install(move)
    return part, restorer, fetched


_Laid = tuple[ResolvedPart, list[Any], "Mapped | None", "ColdFiles | None", Sequence[bool]]


def _lay_out(
    store: Store,
    manifest: Manifest,
    ref: ManifestRef,
    chain: list[tuple[Manifest, str, str]],
    restorer: Restorer,
    targets: dict[int, Any],
    where: str,
    keys: Sequence[str | int] | None,
    index: list[int],
    cold_share: float,
) -> _Laid:
    """Resolve the part and give each leaf its memory: fresh allocations on a store that
    cannot map its files; over the mapped data files where it can (cold files read with
    direct I/O into fresh aligned leaves; cold: less than ``cold_share`` of their pages
    cached). The part, the leaves' views, the mapping, the cold files and which leaves lie
    over the mapping."""
    n = len(manifest.blobs)
    if getattr(store, "map_file", None) is None:
        views = _allocate(restorer, where, targets)
        fresh = [v for v, direct in zip(views, restorer.direct, strict=True) if not direct]
        # The leaves are allocated before the chain is applied so that the kernel maps
        # their fresh pages (a cost as large as reading the data from the page cache) on
        # another core while this one resolves the chain.
        with _prefaulted(fresh if manifest.base is not None else ()):
            paths = spread_paths(restorer.blob_paths, index, n)
            part = resolve(store, manifest, ref.key, ref.xxh3, chain=chain, paths=paths)
        return (part if keys is None else cut_part(part, index)), views, None, None, ()
    # Resolved first: where each blob lies decides which leaves are built over the
    # mapped data files (no allocation, no copy). The leaf paths come from the
    # allocation's walk (resolving names none).
    part = resolve(store, manifest, ref.key, ref.xxh3, chain=chain, paths=[""] * n)
    part = part if keys is None else cut_part(part, index)
    # Cold data files (out of the page cache) are not mapped: read with direct I/O,
    # their large blobs into fresh aligned leaves (faulting the file in page by page
    # through a mapping is slower than the disk).
    cold = ColdFiles(store, part, cold_share=cold_share)
    mapped = Mapped(store, part, skip=cold.files)
    views = _allocate(restorer, where, targets, placer(mapped.place, cold))
    # Only the leaves over the mapped files are verified where they lie; the fresh
    # ones are read into.
    placed = [p and i not in cold.fresh for i, p in enumerate(restorer.placed)]
    for blob, path in zip(part.blobs, restorer.blob_paths, strict=True):
        blob.path = path
    return part, views, mapped, cold, placed


def _fetch_reported(
    fetch: Callable[..., Fetched],
    feed: DeviceFeed | None,
    progress: ProgressFactory | None,
    title: str,
    total: int,
    where: str,
) -> Fetched:
    """Run ``fetch``, its bytes reported to a line ``progress`` makes (if given); a pipelined
    copy to a device (``feed``) is stopped when it fails; out of memory is named."""
    try:
        try:
            if progress is None:
                return fetch()
            line = progress(title, total)
            try:
                return fetch(on_bytes=line.update)
            finally:
                line.close()
        except MemoryError as exc:
            raise CheckpointFormatError(f"{where}: out of memory while reading its chunks") from exc
    except BaseException:
        if feed is not None:
            feed.abort()
        raise


def _pipelined(device: Any) -> bool:
    """Whether a restore to ``device`` copies each blob there as soon as it verified (a
    device other than the CPU: its copies overlap the reads) rather than once all did."""
    return bool(device.type != "cpu")


# Per blob index, which chunks a caller does not need the bytes of (True: skip).
SkipMask = np.ndarray[Any, np.dtype[np.bool_]]


@dataclass(frozen=True, slots=True)
class FlatPart:
    """:func:`read_flat`'s result: the part as it was flattened, and what describes it."""

    flat: FlatState
    record: CommitRecord
    manifest: Manifest
    # Per blob, the (chunks, 16) chunk hashes the part records (verified against the chain).
    hashes: list[np.ndarray[Any, np.dtype[np.uint8]]]


def read_flat(
    store: Store,
    step: int,
    *,
    rank: int = 0,
    skip: Callable[[FlatState, Manifest], dict[int, SkipMask]] | None = None,
    limits: ReadLimits | None = None,
) -> FlatPart:
    """One rank's part of ``step`` as it was flattened: the manifest's skeleton and every blob
    read and verified into a buffer of its own (no tensor is built, whatever the leaves are).

    What a hand-off needs to write the version again elsewhere, for instance split across the
    ranks on the persistent level (levels.py); the record and manifest come along for their
    metrics and replicated keys. ``skip(flat, manifest)`` (no byte read yet)
    names chunks whose bytes are not needed: they are neither read nor verified, their bytes
    in the buffers are undefined, and the caller takes their recorded hashes from
    :attr:`FlatPart.hashes` (a rank writing only its share of the replicated state).
    ``limits``: as :func:`read_part`'s."""
    limits = limits if limits is not None else ReadLimits.current()
    with paused_gc():
        record = read_commit(store, step)
        if rank >= record.world_size:
            raise _no_part(store, record, rank)
        manifest, part, keys, where = resolve_part(store, record, rank)
        try:
            buffers = [np.empty(b.nbytes, dtype=np.uint8) for b in manifest.blobs]
        except MemoryError as exc:
            raise CheckpointFormatError(f"{where}: out of memory for its blobs") from exc
    blobs = [
        Blob(key, b.nbytes, buf) for key, b, buf in zip(keys, manifest.blobs, buffers, strict=True)
    ]
    flat = FlatState(
        manifest.skeleton,
        blobs,
        manifest.leaves,
        manifest.logical_bytes,
        # Each version may hold what the ones before it may: 3 (files) says nothing of packs,
        # so taken as packed it is written 3 again; 4 (columns) nothing of either: its
        # columns write it 4 again; 5 (numpy packs) is written 5 again.
        packed=manifest.format_version >= PACKED_FORMAT_VERSION,
        files=manifest.format_version >= FILES_FORMAT_VERSION,
        numpy_packed=manifest.format_version >= NUMPY_PACKED_FORMAT_VERSION,
    )
    skipped = skip(flat, manifest) if skip is not None else {}
    wanted, views = _wanted(part, [b.data for b in buffers], skipped, manifest.chunk_bytes)
    read_blobs(store, wanted, views, direct=[False] * len(views), limits=limits)
    return FlatPart(flat, record, manifest, [b.hashes for b in part.blobs])


def read_blob(
    store: Store, part: ResolvedPart, blob: int, *, limits: ReadLimits | None = None
) -> bytes:
    """The bytes of blob ``blob`` of ``part``, every chunk read and verified (what ``diff``
    reads of a pack of small tensors to compare one of them). ``limits``: as
    :func:`read_part`'s."""
    buf = memoryview(bytearray(part.blobs[blob].nbytes))
    one = dataclasses.replace(part, blobs=[part.blobs[blob]], _by_path={})
    read_blobs(store, one, [buf], direct=[False], limits=limits)
    return bytes(buf)


def read_selection(
    store: Store,
    part: ResolvedPart,
    skeleton: Any,
    *,
    allow_pickle: bool = False,
    limits: ReadLimits | None = None,
) -> Any:
    """Build ``skeleton``, nodes of ``part``'s version whose blob references are numbered as
    ``part``'s blobs (``renumbered`` and ``cut_part`` make both: the lineage's history and
    changes), from those blobs alone: each read, every chunk verified, before the tree is
    built. Nothing is mapped: the bytes come through the store's reads. ``limits``: as
    :func:`read_part`'s."""
    limits = limits if limits is not None else ReadLimits.current()
    where = f"step {part.step}, tier {store.url}: {part.key}"
    with located(step=part.step, path=store.url), paused_gc():
        restorer = Restorer(skeleton, [b.nbytes for b in part.blobs], allow_pickle=allow_pickle)
        views = _allocate(restorer, where, {})
        read_blobs(store, part, views, direct=restorer.direct, limits=limits)
        try:
            return restorer.build()
        except (MemoryError, RecursionError) as exc:
            raise CheckpointFormatError(f"{where}: cannot build the leaves ({exc!r:.120})") from exc


def resolve_part(
    store: Store, record: CommitRecord, rank: int
) -> tuple[Manifest, ResolvedPart, list[tuple[str | int, ...]], str]:
    """Part ``rank`` (< ``record.world_size``) of a committed version resolved, with every claim
    its chain makes checked against the store first: the manifest, the part, each blob's key
    in the state and where it is (for messages). For readers that fetch blobs themselves."""
    manifest, ref = read_manifest(store, record, rank)
    where = f"step {record.step}, tier {store.url}: {ref.key}"
    keys = blob_keys(manifest.skeleton, len(manifest.blobs))
    chain = chain_manifests(store, manifest, ref.key, ref.xxh3)
    checked = check_chain_claims(store, chain, set(record.data_files))
    part = resolve(
        store, manifest, ref.key, ref.xxh3, chain=chain, paths=[format_path(k) for k in keys]
    )
    check_used_files(store, part, checked)
    return manifest, part, keys, where


def _wanted(
    part: ResolvedPart,
    views: list[memoryview],
    skipped: dict[int, SkipMask],
    chunk_bytes: int,
) -> tuple[ResolvedPart, list[memoryview]]:
    """``part`` cut down to the runs of chunks not skipped (each a blob of its own, reading
    into its slice of the blob's buffer)."""
    if not skipped:
        return part, views
    blobs: list[ResolvedBlob] = []
    out: list[memoryview] = []
    for i, (blob, view) in enumerate(zip(part.blobs, views, strict=True)):
        mask = skipped.get(i)
        if mask is None or not mask.any():
            blobs.append(blob)
            out.append(view)
            continue
        keep = ~mask[: len(blob.hashes)]
        for a, b in value_runs(keep):
            if not keep[a]:
                continue
            lo, hi = a * chunk_bytes, min(b * chunk_bytes, blob.nbytes)
            blobs.append(
                ResolvedBlob(
                    blob.path, hi - lo, blob.files[a:b], blob.offsets[a:b], blob.hashes[a:b]
                )
            )
            out.append(view[lo:hi])
    return dataclasses.replace(part, blobs=blobs, _by_path={}), out


def _check_into(skeleton: Any, into: Any, where: str) -> None:
    try:
        check_into(skeleton, into)
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        # check_into reads the skeleton as written; a malformed one fails on the way.
        raise CheckpointFormatError(f"{where}: malformed state tree ({exc!r:.120})") from exc


def _direct_targets(skeleton: Any, into: Any, where: str, min_bytes: int) -> dict[int, Any]:
    """The leaves of ``into`` read into directly: those of at least ``min_bytes`` (smaller
    ones keep the copy)."""
    try:
        return direct_targets(skeleton, into, min_bytes=min_bytes)
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        raise CheckpointFormatError(f"{where}: malformed state tree ({exc!r:.120})") from exc


# What allocating a claimed leaf raises when the claim is absurd or memory runs out: Python's
# MemoryError, torch's RuntimeError, numpy's ValueError ("array is too big"), OverflowError.
_ALLOC_ERRORS = (MemoryError, RuntimeError, ValueError, OverflowError)


def _allocate(
    restorer: Restorer, where: str, targets: dict[int, Any], place: Place | None = None
) -> list[memoryview]:
    try:
        return restorer.allocate(targets, place)
    except CheckpointError:
        raise
    except _ALLOC_ERRORS as exc:
        raise CheckpointFormatError(
            f"{where}: cannot allocate the leaves it claims ({type(exc).__name__}: {exc})"
        ) from exc


def read_part(
    store: Store,
    step: int,
    *,
    rank: int = 0,
    into: Any = None,
    allow_pickle: bool = False,
    replicated_only: bool = False,
    device: Any = None,
    keys: Sequence[str | int] | None = None,
    progress: ProgressFactory | None = None,
    limits: ReadLimits | None = None,
    record: CommitRecord | None = None,
) -> Any:
    """Read, verify and assemble one rank's state of ``step`` (optionally into ``into``).

    ``record``: the version's commit record as the caller already has it, not read again: a
    distributed restore's leader reads it once and gives each rank a record naming only that
    rank's manifest (:meth:`CommitRecord.for_rank`), so a rank reads O(1) metadata in N.

    ``keys``: only these top-level keys of a dict state are read and verified (damage in the
    others' chunks does not matter); a dict of them comes back, and ``into`` (a dict holding
    them) gets them filled, its other keys left as they are.
    ``replicated_only``: only the keys saved as replicated (of those, ``keys``), read from any
    saved rank's part (they are the same on every rank), whatever ``rank`` is: see
    :func:`_read_replicated`.
    ``device``: a ``torch.device`` the torch leaves go to once verified (None: the CPU; the
    facade refuses it together with ``into``, whose tensors stay where they are).
    ``progress``: makes the line the read reports its bytes to (None: none).
    ``limits``: what the read is cut by (None: :meth:`ReadLimits.current`, taken here, on
    the restoring thread, and passed down; nothing below reads the context).
    """
    with located(step=step, path=store.url):
        limits = limits if limits is not None else ReadLimits.current()
        if replicated_only:
            return _read_replicated(
                store,
                step,
                rank=rank,
                into=into,
                allow_pickle=allow_pickle,
                device=device,
                keys=keys,
                progress=progress,
                limits=limits,
            )
        # The cyclic GC stays paused until the state is built (and into= filled): building tens
        # of thousands of leaves, then planning their copies, would set off collection after
        # collection, each walking every object the restore has made (for a state of 19,984
        # tensors about 0.08-0.25 s a restore), instead of the one at the end.
        with paused_gc():
            if keys is None:
                return _read_whole(
                    store,
                    step,
                    rank=rank,
                    into=into,
                    allow_pickle=allow_pickle,
                    device=device,
                    progress=progress,
                    limits=limits,
                    record=record,
                )
            target = _into_keys(into, keys, step, "selected")
            tree = _read_whole(
                store,
                step,
                rank=rank,
                into=target,
                allow_pickle=allow_pickle,
                device=device,
                keys=keys,
                progress=progress,
                limits=limits,
                record=record,
            )
            return _put_back(into, tree, keys)


def _into_keys(into: Any, keys: Sequence[str | int], step: int, what: str) -> Any:
    """The dict of ``keys`` of ``into`` that a selective restore fills (None without into)."""
    if into is None:
        return None
    if not isinstance(into, dict) or any(k not in into for k in keys):
        raise StateMismatchError(
            f"into= must be a dict holding the {what} keys {list(keys)!r:.200} of "
            f"step {step}, got {type(into).__name__}"
            + (f" with keys {list(into)!r:.200}" if isinstance(into, dict) else "")
        )
    return {k: into[k] for k in keys}


def _put_back(into: Any, filled: Any, keys: Sequence[str | int]) -> Any:
    """``filled`` (the dict of ``keys``) into ``into``'s dict; the dict of those keys."""
    if into is None:
        return filled
    into.update(filled)
    return {k: into[k] for k in keys}


def _read_whole(
    store: Store,
    step: int,
    *,
    rank: int,
    into: Any,
    allow_pickle: bool,
    device: Any,
    keys: Sequence[str | int] | None = None,
    progress: ProgressFactory | None = None,
    limits: ReadLimits,
    record: CommitRecord | None = None,
) -> Any:
    t0 = time.perf_counter()
    part, restorer, fetched = _read_verified(
        store,
        step,
        rank=rank,
        allow_pickle=allow_pickle,
        into=into,
        progress=progress,
        keys=keys,
        device=device,
        limits=limits,
        record=record,
    )
    if device is not None and device.type != "cpu" and not restorer.moved:
        # Not wrapped: running out of device memory is no damage of the version.
        restorer.to_device(device)
    try:
        tree = restorer.build()
    except (MemoryError, RecursionError) as exc:
        raise CheckpointFormatError(
            f"step {step}, tier {store.url}: cannot build the state tree ({exc!r:.120})"
        ) from exc
    log.info(
        "restored step %d from %s in %.3f s (%s)",
        step,
        store.url,
        time.perf_counter() - t0,
        human_bytes(part.manifest.logical_bytes),
    )
    if into is None:
        return tree

    def fill() -> None:  # the leaves read straight into into=, then its packed leaves
        fetched.fill()
        restorer.fill_packs()

    try:
        return apply_into(restorer.skeleton, tree, into, fill_direct=fill)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"step {step}: filling into= failed: {exc}") from exc


def _no_part(store: Store, record: CommitRecord, rank: int) -> PartNotFoundError:
    """What a rank the version has no part for can do instead."""
    n, step = record.world_size, record.step
    saved = f"step {step} in {store.url} was saved by {n} rank(s): rank {rank} has no part of it"
    try:
        keys = read_manifest(store, record, 0)[0].replicated
    except CheckpointError:
        keys = None
    if keys is None:
        what = "No key of it was saved as replicated (save(..., replicated=[...]))"
    else:
        which = "the whole state" if keys is True else f"keys {list(keys)!r:.200}"
        what = (
            f"Its replicated {which} restore on any number of ranks: "
            "Checkpointer.restore(replicated_only=True)"
        )
    return PartNotFoundError(
        f"{saved}. {what}; cryosnap.load(path, step={step}, rank=r) reads saved "
        f"rank r's part (0..{n - 1}), to reshard the rest yourself (torch.distributed."
        "checkpoint's resharding is not built in)"
    )


def _read_replicated(
    store: Store,
    step: int,
    *,
    rank: int,
    into: Any,
    allow_pickle: bool,
    device: Any,
    keys: Sequence[str | int] | None = None,
    progress: ProgressFactory | None = None,
    limits: ReadLimits,
) -> Any:
    """The keys of ``step`` saved as replicated (True: the whole state; ``keys``: those of
    them), read from saved part ``rank % world_size`` (ranks spread their reads over the
    parts: they hold the same content) and verified, the other keys' chunks left unread.
    Returns a dict of those keys; ``into`` (a dict holding at least those keys) gets them
    filled, its other keys are left as they are."""
    record = read_commit(store, step)
    source = rank % record.world_size
    manifest, ref = read_manifest(store, record, source)
    where = f"step {step}, tier {store.url}: {ref.key}"
    saved = manifest.replicated
    if saved is None:
        raise CheckpointError(
            f"step {step} in {store.url} was saved without replicated=: no key of it is "
            "replicated; restore(replicated_only=True) needs a version saved with "
            "save(..., replicated=[...])"
        )
    if saved is not True:
        keys_skeleton(manifest.skeleton, list(saved), where, asked=False)
        if keys is not None and (other := [k for k in keys if k not in saved]):
            raise KeyNotFoundError(
                f"{where}: keys {other!r:.120} were not saved as replicated "
                f"(replicated keys: {list(saved)!r:.200})"
            )
    elif keys is None:  # the whole state is replicated
        return read_part(
            store,
            step,
            rank=source,
            into=into,
            allow_pickle=allow_pickle,
            device=device,
            progress=progress,
            limits=limits,
        )
    wanted = list(keys) if keys is not None else list(saved) if saved is not True else []
    _into_keys(into, wanted, step, "replicated")  # checked here to say which keys
    return read_part(
        store,
        step,
        rank=source,
        into=into,
        allow_pickle=allow_pickle,
        device=device,
        keys=wanted,
        progress=progress,
        limits=limits,
    )


def verify_part(
    store: Store, step: int, *, rank: int = 0, limits: ReadLimits | None = None
) -> ResolvedPart:
    """Read every chunk of one rank's part (through its whole chain) and check every hash and
    every Merkle root; raise on the first damage found. ``limits``: as :func:`read_part`'s."""
    limits = limits if limits is not None else ReadLimits.current()
    with located(step=step, path=store.url):
        part, _restorer, _fetched = _read_verified(
            store, step, rank=rank, allow_pickle=True, limits=limits
        )
    for b, entry in zip(part.blobs, part.manifest.blobs, strict=True):
        if merkle_root(b.hashes.tobytes()) != entry.root:
            raise IntegrityError(
                f"step {step}, tier {store.url}: leaf {b.path}: Merkle root does not match",
                step=step,
                path=store.url,
            )
    return part


# The cryosnap package's directory (this module lies in cryosnap/engine/): frames in any of
# its modules (checkpointer.py included) count as inside.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside cryosnap (the
    user's line that called ``load``/``restore``), however deep the call came from."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
