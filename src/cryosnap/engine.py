"""The write, resolve and read pipelines of one version on one tier.

Write (:class:`PartWriter`, then :func:`commit_version`): hash the chunks of each captured
batch; compare them with the *base* version (the previous one) chunk by chunk: an unchanged run
becomes one ``Inherited`` reference; a chunk whose content is already stored (earlier in this
version, or in a kept version) becomes a reference to where it lies; only new content is
appended to the version's one packed data file (``writev``: many buffers, few syscalls). Then
fsync, the rank's manifest, and last the commit record. Until the commit record exists the
version is invisible; a crash at any point leaves only unreferenced files that retention removes.

Resolve (:func:`resolve`): follow a manifest's chain of bases back to a full version, checking
each manifest against the hash its successor recorded, and produce per chunk its data file,
offset and hash (numpy arrays; no data is read). The chain is applied in a compact form (per
chunk an id into the chain's stored chunks); per-blob arrays are built for the last version only.

Read (:func:`read_part`): allocate every leaf empty (an incremental version's fresh pages are
faulted in on another core while its chain resolves), resolve, read each data file in large
contiguous runs straight into the leaves (``preadv``; scattered chunks by windowed gathers),
verify every chunk's hash, then build the tree. ``into=`` is checked before any byte is read and
filled only after every chunk verified.

Retire (:func:`retire`): reference-counted retention: a data file or manifest is deleted only
when no kept version needs it.

Writes run on the Checkpointer's background thread, reads on the caller's; no collectives here.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import queue
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ._gc import paused_gc
from .capture import Piece
from .chunks import HASH_BYTES, chunk_count, hash_chunks, merkle_root
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
)
from .manifest import (
    STORED,
    BaseRef,
    BlobEntry,
    CommitRecord,
    Manifest,
    ManifestRef,
    commit_key,
    data_key,
    manifest_key,
    now_unix,
    step_of_commit_key,
)
from .policy import KeepLast, RetentionPolicy, VersionInfo, as_retention
from .progress import Progress, human_bytes
from .storage import Store
from .storage.base import BlobWriter, TruncatedError
from .storage.tiers import Placement
from .tree import FlatState, Restorer, apply_into, blob_paths, check_into

__all__ = [
    "IO_BATCH_BYTES",
    "MAX_CHAIN",
    "PartResult",
    "PartWriter",
    "ResolvedBlob",
    "ResolvedPart",
    "RetirePlan",
    "chain_manifests",
    "commit_version",
    "list_steps",
    "newest_restorable",
    "read_commit",
    "read_manifest",
    "read_part",
    "resolve",
    "resolve_version",
    "plan_retire",
    "retire",
    "step_exists",
    "verify_part",
]

log = logging.getLogger("cryosnap")

# Bytes handed to one writev/preadv call: large enough for sequential bandwidth.
IO_BATCH_BYTES = 64 << 20
_READ_THREADS = max(2, min(8, os.cpu_count() or 2))
# Pieces of a data file at most this far apart are read in one go, the gap thrown away.
_GAP_BYTES = 64 << 10
# A blob whose chunks lie in more runs than this, averaging less than _GAP_BYTES each, is
# read by windowed gathers.
_FRAGMENTED_RUNS = 256
_GATHER_WINDOW_BYTES = 4 << 20
# A chain longer than this is refused as malformed (full_every keeps real chains far shorter).
MAX_CHAIN = 4096

# New bytes of a version are placed on scratch devices in groups of this size.
_PLACE_BYTES = 4 << 20

_Loc = tuple[str, int]  # (data file key, byte offset) of one stored chunk


# ---------------------------------------------------------------------------------------------
# resolved versions


@dataclass(slots=True)
class ResolvedBlob:
    """Where each chunk of one blob lies and what it hashes to."""

    path: str
    nbytes: int
    files: np.ndarray[Any, np.dtype[np.int32]]  # per chunk: index into ResolvedPart.files
    offsets: np.ndarray[Any, np.dtype[np.int64]]  # per chunk: byte offset in that file
    hashes: np.ndarray[Any, np.dtype[np.uint8]]  # (chunks, 16)


@dataclass(slots=True)
class ResolvedPart:
    """One rank's part of a version with its chain of bases applied."""

    manifest: Manifest
    key: str
    xxh3: str
    files: list[str]
    blobs: list[ResolvedBlob]
    chain: tuple[int, ...]  # steps whose manifests resolution needed, oldest first
    _by_path: dict[str, int] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def depth(self) -> int:
        return len(self.chain)

    def blob_index(self, path: str) -> int | None:
        if not self._by_path:
            self._by_path = {b.path: i for i, b in enumerate(self.blobs)}
        return self._by_path.get(path)

    def used_files(self) -> list[str]:
        used: set[int] = set()
        for b in self.blobs:
            used.update(np.unique(b.files).tolist())
        return sorted(self.files[i] for i in used)

    def locations(self) -> dict[bytes, _Loc]:
        """Content index of this version: chunk hash -> where it is stored."""
        index: dict[bytes, _Loc] = {}
        for b in self.blobs:
            raw = b.hashes.tobytes()
            for i in range(len(b.offsets)):
                index.setdefault(
                    raw[i * HASH_BYTES : (i + 1) * HASH_BYTES],
                    (self.files[int(b.files[i])], int(b.offsets[i])),
                )
        return index


class _Chain:
    """A version being resolved, in compact form: per chunk of the part (every blob back to
    back) an id into tables of every chunk stored along the chain (file, offset, hash).

    Applying a manifest costs a few vectorized passes over its chunks and segments, whatever
    the number of blobs; the per-blob arrays (three gathers) are built once, at the end, for
    the version asked for only, not for every version of the chain.
    """

    __slots__ = ("_fidx", "_hashes", "_offs", "file_index", "files", "ids", "starts", "step")

    def __init__(self) -> None:
        self.files: list[str] = []
        self.file_index: dict[str, int] = {}
        self._fidx: list[np.ndarray[Any, np.dtype[np.int32]]] = []
        self._offs: list[np.ndarray[Any, np.dtype[np.int64]]] = []
        self._hashes: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
        self.ids: np.ndarray[Any, np.dtype[np.int64]] | None = None  # None: nothing applied
        self.starts = np.zeros(1, np.int64)  # first chunk of each blob in ids, and the end
        self.step = -1

    @classmethod
    def of(cls, part: ResolvedPart) -> _Chain:
        """A resolved part as the starting point (the base of a version being written)."""
        chain = cls()
        chain.files = list(part.files)
        chain.file_index = {f: i for i, f in enumerate(chain.files)}
        counts = np.fromiter((len(b.files) for b in part.blobs), np.int64, len(part.blobs))
        chain.starts = np.zeros(len(part.blobs) + 1, np.int64)
        np.cumsum(counts, out=chain.starts[1:])
        if part.blobs:
            chain._fidx.append(np.concatenate([b.files for b in part.blobs]))
            chain._offs.append(np.concatenate([b.offsets for b in part.blobs]))
            chain._hashes.append(np.concatenate([b.hashes for b in part.blobs]))
        chain.ids = np.arange(int(chain.starts[-1]), dtype=np.int64)
        chain.step = part.step
        return chain

    @property
    def stored(self) -> int:
        return sum(len(h) for h in self._hashes)

    def apply(self, manifest: Manifest, where: str) -> None:
        """Resolve ``manifest`` on top of this (its base; nothing for a full version)."""
        if (manifest.base is None) != (self.ids is None):
            raise CheckpointFormatError(f"{where}: base of step {manifest.step} does not match")
        _check_claimed_bytes(manifest, where)
        cb = manifest.chunk_bytes
        local = np.array([self._file(f) for f in manifest.data_files] or [0], np.int32)
        entries = manifest.blobs
        nb = len(entries)
        nchunks = np.fromiter((chunk_count(e.nbytes, cb) for e in entries), np.int64, nb)
        starts = np.zeros(nb + 1, np.int64)
        np.cumsum(nchunks, out=starts[1:])
        n = int(starts[-1])
        rows = np.fromiter((len(e.table) for e in entries), np.int64, nb)
        table = np.concatenate([e.table for e in entries]) if nb else np.empty((0, 4), np.int64)
        kind, a, b, c = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
        stored = kind == STORED
        counts = np.where(stored, -(-c // cb), c)
        hashes = np.frombuffer(b"".join(e.hashes for e in entries), np.uint8)
        hashes = hashes.reshape(-1, HASH_BYTES)
        if int(counts.sum()) != n or int(counts[stored].sum()) != len(hashes):
            raise CheckpointFormatError(f"{where}: segments do not cover the blobs' chunks")
        before = 0 if self.ids is None else len(self.ids)
        # Where each segment's first chunk is in [base ids..., this version's stored ids...].
        stored_counts = np.where(stored, counts, 0)
        seg_src = before + np.cumsum(stored_counts) - stored_counts
        inherited = ~stored
        if inherited.any():
            assert self.ids is not None
            blob, first = a[inherited], b[inherited]
            nbase = len(self.starts) - 1
            base_chunks = self.starts[1:] - self.starts[:-1]
            bad = blob >= nbase
            bad[~bad] = first[~bad] + c[inherited][~bad] > base_chunks[blob[~bad]]
            if bad.any():
                i = int(np.repeat(np.arange(nb), rows)[inherited][np.argmax(bad)])
                raise CheckpointFormatError(
                    f"{where}: blob {i} inherits chunks its base (step {self.step}) lacks"
                )
            seg_src[inherited] = self.starts[blob] + first
        seg_start = np.cumsum(counts) - counts
        within = np.arange(n, dtype=np.int64) - np.repeat(seg_start, counts)
        pos = np.repeat(seg_src, counts) + within
        new_ids = np.arange(self.stored, self.stored + len(hashes), dtype=np.int64)
        ext = new_ids if self.ids is None else np.concatenate([self.ids, new_ids])
        self.ids = ext[pos]
        self.starts = starts
        # The new stored chunks: file and offset of each.
        s_rows, s_counts = table[stored], counts[stored]
        s_within = np.arange(len(hashes), dtype=np.int64) - np.repeat(
            np.cumsum(s_counts) - s_counts, s_counts
        )
        self._fidx.append(np.repeat(local[s_rows[:, 1]], s_counts))
        self._offs.append(np.repeat(s_rows[:, 2], s_counts) + s_within * cb)
        self._hashes.append(hashes)
        self.step = manifest.step

    def _file(self, key: str) -> int:
        i = self.file_index.get(key)
        if i is None:
            i = self.file_index[key] = len(self.files)
            self.files.append(key)
        return i

    def part(self, manifest: Manifest, key: str, xxh3: str, chain: tuple[int, ...]) -> ResolvedPart:
        """The per-blob arrays of the version applied last."""
        assert self.ids is not None
        ids = self.ids
        if len(self._hashes) == 1 and len(ids) == len(self._hashes[0]):
            fidx, offs, hashes = self._fidx[0], self._offs[0], self._hashes[0]
            if not (ids == np.arange(len(ids))).all():
                fidx, offs, hashes = fidx[ids], offs[ids], hashes[ids]
        else:
            fidx = np.concatenate(self._fidx)[ids]
            offs = np.concatenate(self._offs)[ids]
            # 16-byte rows as one opaque item each: one gather instead of a 2-D one.
            raw = np.concatenate(self._hashes).view(f"V{HASH_BYTES}").reshape(-1)
            hashes = raw[ids].view(np.uint8).reshape(-1, HASH_BYTES)
        paths = blob_paths(manifest.skeleton, len(manifest.blobs))
        s = self.starts.tolist()
        blobs = [
            ResolvedBlob(
                paths[i],
                e.nbytes,
                fidx[s[i] : s[i + 1]],
                offs[s[i] : s[i + 1]],
                hashes[s[i] : s[i + 1]],
            )
            for i, e in enumerate(manifest.blobs)
        ]
        return ResolvedPart(manifest, key, xxh3, list(self.files), blobs, chain)


def _resolve_one(
    manifest: Manifest, key: str, xxh3: str, base: ResolvedPart | None, where: str
) -> ResolvedPart:
    if (manifest.base is None) != (base is None):
        raise CheckpointFormatError(f"{where}: base of step {manifest.step} does not match")
    chain = _Chain() if base is None else _Chain.of(base)
    chain.apply(manifest, where)
    steps = (*base.chain, manifest.step) if base is not None else (manifest.step,)
    return chain.part(manifest, key, xxh3, steps)


def memory_limit_bytes() -> int:
    """The most one restore may allocate for its leaves: this machine's physical memory. A
    version that claims more cannot be restored here whatever its data files hold, and a
    manifest that claims it (a few bytes can) must not make the reader try."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):  # no sysconf: assume a large machine
        return 1 << 40


def _check_claimed_bytes(manifest: Manifest, where: str) -> None:
    claimed = sum(b.nbytes for b in manifest.blobs)
    limit = memory_limit_bytes()
    if claimed > limit:
        raise CheckpointFormatError(
            f"{where}: step {manifest.step} claims {claimed} bytes of leaves, more than this "
            f"machine's memory ({limit} bytes)"
        )


def _check_chain_claims(
    store: Store, chain: list[tuple[Manifest, str, str]], listed: Collection[str]
) -> set[str]:
    """Check every claim of ``chain`` (newest first) against reality before anything is
    allocated or read: each manifest's claimed bytes against memory, each inherited run
    against the chunks its base has, each stored run against the real size of its data file.

    Sizes are taken once per file, for the files of the version's own manifest and of
    ``listed`` (the commit record's: all the version may read); an older manifest's other
    files may be retired (their chunks superseded) and are checked after resolution if used. A
    file that is missing is left to the read, which names the leaf. Returns the files whose
    sizes were checked."""
    sizes: dict[str, int] = {}
    wanted = set(chain[0][0].data_files) | set(listed)
    for f in {f for m, _k, _h in chain for f in m.data_files if f in wanted}:
        try:
            sizes[f] = store.size(f)
        except CheckpointNotFoundError:
            continue
    for i, (m, key, _h) in enumerate(chain):
        where = f"{store.url}: {key}"
        _check_claimed_bytes(m, where)
        if not m.blobs:
            continue
        table = np.concatenate([e.table for e in m.blobs])
        kind, a, b, c = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
        inherited = kind != STORED
        if inherited.any():
            base = chain[i + 1][0]  # a manifest with inherited runs has a base (parsed so)
            have = np.array(
                [chunk_count(e.nbytes, base.chunk_bytes) for e in base.blobs] or [0], np.int64
            )
            blob, first, count = a[inherited], b[inherited], c[inherited]
            if (blob >= len(base.blobs)).any() or (
                first + count > have[np.minimum(blob, len(have) - 1)]
            ).any():
                raise CheckpointFormatError(
                    f"{where}: inherits chunks its base (step {base.step}) does not have"
                )
        file_size = np.array([sizes.get(f, -1) for f in m.data_files] or [-1], np.int64)
        size = np.where(inherited, -1, file_size[np.where(inherited, 0, a)])
        # Offsets and sizes are below 2**47 (manifest.MAX_FILE_BYTES): the sum cannot wrap.
        past = (size >= 0) & (b + c > size)
        if past.any():
            j = int(np.argmax(past))
            f, lo, hi = m.data_files[int(a[j])], int(b[j]), int(b[j] + c[j])
            rows = np.fromiter((len(e.table) for e in m.blobs), np.int64, len(m.blobs))
            blob = int(np.searchsorted(np.cumsum(rows), j, side="right"))
            raise IntegrityError(
                f"step {chain[0][0].step}, tier {store.url}: data file {f} is truncated "
                f"({int(size[j])} bytes; {key} needs bytes {lo}-{hi}); "
                f"leaf {_leaf_path(m, blob)} cannot be read"
            )
    return set(sizes)


def _leaf_path(manifest: Manifest, blob: int) -> str:
    """The leaf path of ``blob`` for a message (its number if the skeleton does not say)."""
    try:
        return blob_paths(manifest.skeleton, len(manifest.blobs))[blob] or f"blob {blob}"
    except CheckpointError:
        return f"blob {blob}"


def _check_used_files(store: Store, part: ResolvedPart, checked: set[str]) -> None:
    """The chunks the resolved version reads from files :func:`_check_chain_claims` did not
    size (files an older manifest names that the commit record does not list) lie inside
    them too, so no read goes past a file's end or reaches the OS with an absurd offset."""
    unchecked = [i for i, f in enumerate(part.files) if f not in checked]
    if not unchecked or not part.blobs:
        return
    size = np.full(len(part.files), -1, np.int64)
    for i in unchecked:
        with contextlib.suppress(CheckpointNotFoundError):  # missing: the read names it
            size[i] = store.size(part.files[i])
    cb = part.manifest.chunk_bytes
    for b in part.blobs:
        have = size[b.files]
        ends = b.offsets + cb
        if len(ends) and b.nbytes % cb:
            ends[-1] -= cb - b.nbytes % cb  # the short last chunk
        past = (have >= 0) & (ends > have)
        if past.any():
            f = part.files[int(b.files[int(np.argmax(past))])]
            raise IntegrityError(
                f"step {part.step}, tier {store.url}: data file {f} is truncated; "
                f"leaf {b.path} cannot be read"
            )


def _load_manifest(store: Store, key: str, xxh3: str, nbytes: int | None, step: int) -> Manifest:
    try:
        data = store.read(key)
    except CheckpointNotFoundError:
        # The commit record (or a successor's base reference) names it: it is damage.
        raise IntegrityError(f"step {step}, tier {store.url}: manifest {key} is missing") from None
    if (nbytes is not None and len(data) != nbytes) or xxhash.xxh3_128_hexdigest(data) != xxh3:
        raise IntegrityError(
            f"step {step}, tier {store.url}: manifest {key} does not match its recorded hash"
        )
    return Manifest.from_json(data, f"{store.url}: {key}")


def resolve(
    store: Store,
    manifest: Manifest,
    key: str,
    xxh3: str,
    *,
    chain: list[tuple[Manifest, str, str]] | None = None,
) -> ResolvedPart:
    """Apply ``manifest``'s chain of bases (``chain``, as :func:`chain_manifests` gives it, or
    read here); reads manifests only, verified hash by hash."""
    if chain is None:
        chain = chain_manifests(store, manifest, key, xxh3)
    # Compact resolution up the chain; the per-blob arrays only for the version asked for.
    state = _Chain()
    for m, _k, _h in reversed(chain):
        state.apply(m, f"{store.url}: {_k}")
    steps = tuple(m.step for m, _k, _h in reversed(chain))
    return state.part(manifest, key, xxh3, steps)


def chain_manifests(
    store: Store, manifest: Manifest, key: str, xxh3: str
) -> list[tuple[Manifest, str, str]]:
    """``manifest`` and the manifests of its chain of bases, newest first, as (manifest, key,
    xxh3); each base is checked against the hash its successor recorded."""
    chain: list[tuple[Manifest, str, str]] = [(manifest, key, xxh3)]
    while chain[-1][0].base is not None:
        ref: BaseRef = chain[-1][0].base
        if len(chain) > MAX_CHAIN or ref.step == chain[-1][0].step:
            raise CheckpointFormatError(
                f"{store.url}: chain of step {manifest.step} is malformed at step {ref.step}"
            )
        base = _load_manifest(store, ref.key, ref.xxh3, None, manifest.step)
        if base.step != ref.step or base.rank != manifest.rank:
            raise CheckpointFormatError(f"{store.url}: {ref.key} is not step {ref.step}")
        if base.chunk_bytes != manifest.chunk_bytes:
            raise CheckpointFormatError(f"{store.url}: {ref.key} has another chunk size")
        chain.append((base, ref.key, ref.xxh3))
    return chain


def resolve_version(store: Store, step: int, *, rank: int = 0) -> ResolvedPart:
    """Read the commit record of ``step`` and resolve one rank's part."""
    record = read_commit(store, step)
    manifest, ref = read_manifest(store, record, rank)
    return resolve(store, manifest, ref.key, ref.xxh3)


# ---------------------------------------------------------------------------------------------
# write


@dataclass(slots=True)
class PartResult:
    """What one rank wrote for a version. ``resolved()`` (the version as the next one's base)
    is computed on first use: a one-shot save never needs it."""

    ref: ManifestRef
    manifest: Manifest
    base: ResolvedPart | None
    where: str
    new_index: dict[bytes, _Loc]
    logical_bytes: int
    written_bytes: int
    chunks: int
    new_chunks: int
    leaves: int
    root: bytes
    incremental: bool
    _resolved: ResolvedPart | None = None

    def resolved(self) -> ResolvedPart:
        if self._resolved is None:
            with paused_gc():
                self._resolved = _resolve_one(
                    self.manifest, self.ref.key, self.ref.xxh3, self.base, self.where
                )
        return self._resolved

    def used_files(self) -> set[str]:
        """Data files this version may read: its own plus, if incremental, its base's (a
        superset of what it inherits; the chain is bounded, so retention still reclaims)."""
        own = set(self.manifest.data_files)
        return own if self.base is None else own | set(self.base.used_files())

    @property
    def depth(self) -> int:
        """Versions in this version's chain, itself included (as ResolvedPart.depth)."""
        return len(self.chain())

    def chain(self) -> tuple[int, ...]:
        return (
            (self.manifest.step,) if self.base is None else (*self.base.chain, self.manifest.step)
        )


class _BlobBuilder:
    """Segments of one blob as its pieces arrive."""

    __slots__ = ("hashes", "segments")

    def __init__(self) -> None:
        self.segments: list[list[Any]] = []  # [0, file, offset, nbytes, [hashes]] | [1, b, f, n]
        self.hashes: list[bytes] = []

    def inherit(self, blob: int, first: int, count: int) -> None:
        last = self.segments[-1] if self.segments else None
        if last is not None and last[0] == 1 and last[1] == blob and last[2] + last[3] == first:
            last[3] += count
        else:
            self.segments.append([1, blob, first, count])

    def store(self, file: int, offset: int, nbytes: int, digest: bytes, chunk_bytes: int) -> None:
        last = self.segments[-1] if self.segments else None
        if (
            last is not None
            and last[0] == 0
            and last[1] == file
            and last[2] + last[3] == offset
            and last[3] % chunk_bytes == 0
        ):
            last[3] += nbytes
            last[4].append(digest)
        else:
            self.segments.append([0, file, offset, nbytes, [digest]])


_COMMIT = ("commit",)


class _Appender:
    """Appends buffers to one data file on a thread of its own, so hashing and diffing the
    next batch (Python, holds the GIL) overlaps writing this one (syscalls, release it).
    With a ``placement`` it reports each write's bytes and busy seconds to it."""

    def __init__(
        self, store: Store, key: str, placement: Placement | None = None, device: int = 0
    ) -> None:
        self.store = store
        self.key = key
        self.placement = placement
        self.device = device
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer: BlobWriter | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def append(self, views: list[memoryview], release: Callable[[], None], nbytes: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cryosnap-io", daemon=True)
            self._thread.start()
        self._queue.put((views, release, nbytes))
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if item is _COMMIT:
                try:
                    if self._error is None and self._writer is not None:
                        t0 = time.perf_counter()
                        self._writer.commit()
                        self._observe(0, time.perf_counter() - t0)
                except BaseException as exc:
                    self._error = exc
                continue
            views, release, nbytes = item
            try:
                if views and self._error is None:
                    t0 = time.perf_counter()
                    if self._writer is None:
                        self._writer = self.store.open_writer(self.key)
                    self._writer.write(views)
                    self._observe(nbytes, time.perf_counter() - t0)
            except BaseException as exc:
                self._error = exc
            finally:
                if self.placement is not None:
                    self.placement.done(self.device, nbytes)
                release()

    def _observe(self, nbytes: int, seconds: float) -> None:
        if self.placement is not None:
            self.placement.observe(self.device, nbytes, seconds)

    def _join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def start_commit(self) -> None:
        """Queue the fsync and rename behind the last write; ``wait_commit`` waits for it."""
        if self._thread is not None:
            self._queue.put(_COMMIT)

    def wait_commit(self) -> None:
        self._join()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        self._join()
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


class PartWriter:
    """Streams one rank's part of a version: new chunks into one packed data file (one per
    device with a ``placement`` over several scratch devices), then the manifest (durable, not
    yet committed).

    With a ``base`` the version is incremental: chunks equal to the base's at the same place
    are inherited, and ``index`` (hash -> location of content in kept versions) turns content
    seen before into references. Without one, the version is full: self-contained, with
    duplicate chunks inside it stored once. Pieces of a blob arrive in order and start on chunk
    boundaries. Runs on the background writer thread.
    """

    def __init__(
        self,
        store: Store,
        step: int,
        flat: FlatState,
        *,
        chunk_bytes: int,
        rank: int = 0,
        base: ResolvedPart | None = None,
        index: dict[bytes, _Loc] | None = None,
        placement: Placement | None = None,
    ) -> None:
        if store.exists(commit_key(step)):
            raise CheckpointExistsError(f"step {step} already exists in {store.url}")
        self.store = store
        self.step = step
        self.rank = rank
        self.flat = flat
        self.chunk_bytes = chunk_bytes
        self.base = base if base is not None and base.manifest.chunk_bytes == chunk_bytes else None
        self.index = index if self.base is not None and index is not None else {}
        token = secrets.token_hex(4)
        self.placement = placement
        if placement is None:
            keys = [data_key(step, rank, token)]
        else:
            # One data file per device; the key names its device (storage/tiers.py).
            keys = [data_key(step, rank, f"{token}-d{d}") for d in range(placement.devices)]
        # File index d is device d's data file; references to older files come after.
        self.files: list[str] = list(keys)
        self._file_index = {k: i for i, k in enumerate(keys)}
        self.new_index: dict[bytes, _Loc] = {}
        self._ios = [_Appender(store, k, placement, d) for d, k in enumerate(keys)]
        self._offsets = [0] * len(keys)
        self._device = 0  # the device taking the new bytes of the batch being diffed
        self._new_share = 1.0  # moving share of new bytes in a batch, to size placements
        self._builders = [_BlobBuilder() for _ in flat.blobs]
        self._base_blob = [
            self._match(i) if self.base is not None else None for i in range(len(flat.blobs))
        ]
        self.chunks = 0
        self.new_chunks = 0

    def _match(self, i: int) -> int | None:
        assert self.base is not None
        blob = self.flat.blobs[i]
        j = self.base.blob_index(blob.path)
        if j is None or self.base.blobs[j].nbytes != blob.nbytes:
            return None
        return j

    def _file(self, key: str) -> int:
        idx = self._file_index.get(key)
        if idx is None:
            idx = self._file_index[key] = len(self.files)
            self.files.append(key)
        return idx

    @property
    def written_bytes(self) -> int:
        return sum(self._offsets)

    def add(self, pieces: Sequence[Piece], release: Callable[[], None] = lambda: None) -> None:
        """Hash and diff ``pieces``; their new bytes are appended by the I/O thread, which
        calls ``release`` once it no longer needs the pieces' memory (also on failure)."""
        if self.placement is None:
            try:
                out = self._diff(pieces)
            except BaseException:
                release()
                raise
            self._ios[0].append(out, release, sum(v.nbytes for v in out))
            return
        groups = _split_pieces(pieces, _PLACE_BYTES, self.chunk_bytes)
        remaining = [len(groups)]
        lock = threading.Lock()

        def release_one() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                release()

        for i, group in enumerate(groups):
            queued = False
            try:
                logical = sum(p.view.nbytes for p in group)
                device = self.placement.choose(int(logical * self._new_share), reserve=logical)
                self._device = device
                out = self._diff(group)
                nbytes = sum(v.nbytes for v in out)
                # Only what the batch writes keeps its reservation of the device's capacity.
                self.placement.unreserve(device, logical - nbytes)
                if logical:
                    self._new_share = 0.5 * self._new_share + 0.5 * nbytes / logical
                self.placement.enqueue(device, nbytes)
                queued = True
                self._ios[device].append(out, release_one, nbytes)
            except BaseException:
                # Groups not handed to an I/O thread are released here (a queued one is
                # released by its thread, even when its append reports an earlier failure).
                for _ in range(len(groups) - i - (1 if queued else 0)):
                    release_one()
                raise

    def _diff(self, pieces: Sequence[Piece]) -> list[memoryview]:
        cb = self.chunk_bytes
        dev = self._device
        key, offset = self.files[dev], self._offsets[dev]
        out: list[memoryview] = []
        for p in pieces:
            view = p.view
            digests = hash_chunks(view, cb)
            n = len(digests) // HASH_BYTES
            self.chunks += n
            first = p.offset // cb
            builder = self._builders[p.blob]
            builder.hashes.append(digests)
            j = self._base_blob[p.blob]
            if j is None:
                runs: list[tuple[int, int, bool]] = [(0, n, False)]
            else:
                assert self.base is not None
                old = self.base.blobs[j].hashes[first : first + n]
                if n == 1:
                    runs = [(0, 1, digests == old.tobytes())]
                else:
                    # Runs of unchanged / changed chunks: one reference per unchanged run.
                    same = (np.frombuffer(digests, np.uint8).reshape(n, HASH_BYTES) == old).all(1)
                    edges = np.flatnonzero(np.diff(same.astype(np.int8))) + 1
                    bounds = [0, *edges.tolist(), n]
                    runs = [(a, b, bool(same[a])) for a, b in itertools.pairwise(bounds)]
            for a, b, unchanged in runs:
                if unchanged:
                    assert j is not None
                    builder.inherit(j, first + a, b - a)
                    continue
                run_start = -1  # start (in this piece) of the current run of new bytes
                for k in range(a, b):
                    digest = digests[k * HASH_BYTES : (k + 1) * HASH_BYTES]
                    lo = k * cb
                    size = min(cb, view.nbytes - lo)
                    loc = self.new_index.get(digest) or self.index.get(digest)
                    if loc is not None:
                        if run_start >= 0:
                            out.append(view[run_start:lo])
                            run_start = -1
                        builder.store(self._file(loc[0]), loc[1], size, digest, cb)
                        continue
                    if run_start < 0:
                        run_start = lo
                    self.new_index[digest] = (key, offset)
                    builder.store(dev, offset, size, digest, cb)
                    offset += size
                    self._offsets[dev] = offset
                    self.new_chunks += 1
                if run_start >= 0:
                    out.append(view[run_start : min(b * cb, view.nbytes)])
        return out

    def finish(self) -> PartResult:
        # The manifest is built while the I/O threads fsync the data, and written after.
        for io in self._ios:
            io.start_commit()
        try:
            with paused_gc():
                manifest, body = self._build()
        finally:
            try:
                for io in self._ios:
                    io.wait_commit()
            finally:
                if self.placement is not None:
                    self.placement.release()
        return self._write_manifest(manifest, body)

    def _build(self) -> tuple[Manifest, bytes]:
        cb = self.chunk_bytes
        # One segment table for the whole part (each blob gets a slice of it): a state of
        # 20,000 small tensors costs one numpy call here, not 20,000.
        rows: list[list[Any]] = []
        bounds = [0]
        for blob, builder in zip(self.flat.blobs, self._builders, strict=True):
            got = sum(len(h) for h in builder.hashes) // HASH_BYTES
            if got != chunk_count(blob.nbytes, cb):
                raise CheckpointError(
                    f"step {self.step}: leaf {blob.path} was captured incompletely"
                )
            rows.extend(g[:4] for g in builder.segments)
            bounds.append(len(rows))
        table = np.array(rows, dtype=np.int64).reshape(-1, 4)
        # data_files: the files this manifest's stored segments point to, renumbered densely.
        stored = table[:, 0] == STORED
        used = np.unique(table[stored, 1]).tolist()
        remap = np.zeros(len(self.files), np.int64)
        remap[used] = np.arange(len(used))
        table[stored, 1] = remap[table[stored, 1]]
        entries = [
            BlobEntry(
                blob.nbytes,
                merkle_root(b"".join(builder.hashes)),
                table[lo:hi],
                b"".join(b"".join(g[4]) for g in builder.segments if g[0] == STORED),
                cb,
            )
            for blob, builder, lo, hi in zip(
                self.flat.blobs, self._builders, bounds, bounds[1:], strict=False
            )
        ]
        base = self.base
        manifest = Manifest(
            step=self.step,
            rank=self.rank,
            chunk_bytes=self.chunk_bytes,
            data_files=tuple(self.files[i] for i in used),
            blobs=tuple(entries),
            skeleton=self.flat.skeleton,
            leaves=self.flat.leaves,
            logical_bytes=self.flat.logical_bytes,
            created_unix=now_unix(),
            base=None if base is None else BaseRef(base.step, base.key, base.xxh3),
        )
        return manifest, manifest.to_json()

    def _write_manifest(self, manifest: Manifest, body: bytes) -> PartResult:
        base = self.base
        mkey = manifest_key(self.step, self.rank)
        self.store.write(mkey, body)
        xxh3 = xxhash.xxh3_128_hexdigest(body)
        return PartResult(
            ref=ManifestRef(self.rank, mkey, xxh3, len(body)),
            manifest=manifest,
            base=base,
            where=f"{self.store.url}: {mkey}",
            new_index=self.new_index,
            logical_bytes=self.flat.logical_bytes,
            written_bytes=self.written_bytes,
            chunks=self.chunks,
            new_chunks=self.new_chunks,
            leaves=self.flat.leaves,
            root=merkle_root([e.root for e in manifest.blobs]),
            incremental=base is not None,
        )

    def abort(self) -> None:
        try:
            for io in self._ios:
                io.abort()
        finally:
            if self.placement is not None:
                self.placement.release()


def _split_pieces(pieces: Sequence[Piece], limit: int, chunk_bytes: int) -> list[list[Piece]]:
    """``pieces`` in groups of about ``limit`` bytes; pieces are cut on chunk boundaries."""
    step = max(limit // chunk_bytes, 1) * chunk_bytes
    groups: list[list[Piece]] = [[]]
    size = 0
    for p in pieces:
        lo, n = 0, p.view.nbytes
        while lo < n:
            room = max((step - size) // chunk_bytes, 1) * chunk_bytes
            take = min(n - lo, room)
            groups[-1].append(Piece(p.blob, p.offset + lo, p.view[lo : lo + take]))
            lo += take
            size += take
            if size >= step:
                groups.append([])
                size = 0
    return [g for g in groups if g]


def _no_fence() -> None:
    return None


def commit_version(
    store: Store,
    step: int,
    parts: Sequence[PartResult],
    *,
    chunk_bytes: int,
    metrics: dict[str, float] | None = None,
    fence: Callable[[], None] = _no_fence,
) -> CommitRecord:
    """Write the commit record that makes ``step`` visible; every part must be durable.

    ``fence()`` runs just before the record is written: it raises (``LockLostError``) when this
    writer no longer holds the run's lock, so a writer that lost it makes nothing visible.
    """
    parts = sorted(parts, key=lambda p: p.ref.rank)
    record = CommitRecord(
        step=step,
        world_size=len(parts),
        manifests=tuple(p.ref for p in parts),
        data_files=tuple(sorted({f for p in parts for f in p.used_files()})),
        logical_bytes=sum(p.logical_bytes for p in parts),
        written_bytes=sum(p.written_bytes for p in parts),
        leaves=sum(p.leaves for p in parts),
        chunk_bytes=chunk_bytes,
        root=merkle_root([p.root for p in parts]).hex(),
        created_unix=now_unix(),
        incremental=any(p.incremental for p in parts),
        chain=tuple(sorted({s for p in parts for s in p.chain()})),
        metrics=metrics or None,
    )
    fence()
    store.write(commit_key(step), record.to_json())
    log.debug("committed step %d in %s", step, store.url)
    return record


def _ignore_files(files: Collection[str]) -> None:
    return None


@dataclass(frozen=True, slots=True)
class RetirePlan:
    """What a retention pass deletes: commit records of ``dropped`` steps, then the manifests
    and data files no remaining version needs."""

    dropped: list[int]
    manifests: list[str]
    data_files: list[str]


def plan_retire(
    store: Store,
    *,
    keep: int | RetentionPolicy | None = None,
    drop: Sequence[int] = (),
    protect: Collection[int] = (),
    reserved: Collection[str] = (),
) -> RetirePlan:
    """The versions ``drop`` and those the retention policy ``keep`` does not select (an int:
    the newest ``keep``; None: no limit), except the newest version and those in ``protect``,
    and every manifest and data file that no remaining version needs, except the keys in
    ``reserved`` (files of a version whose commit record may still appear). Deletes nothing."""
    steps = list_steps(store)
    doomed = set(drop) & set(steps)
    policy = as_retention(keep)
    records: dict[int, CommitRecord] = {}
    if isinstance(policy, KeepLast):
        if len(steps) > policy.n:
            doomed.update(steps[: -policy.n])
    elif policy is not None and steps:
        records = {s: read_commit(store, s) for s in steps}
        versions = [VersionInfo(s, records[s].metrics or {}) for s in steps]
        chosen = policy.select(versions) | {steps[-1]}
        doomed.update(s for s in steps if s not in chosen)
    dropped = sorted(doomed - set(protect))
    kept = [records.get(s) or read_commit(store, s) for s in steps if s not in set(dropped)]
    needed_steps = {s for r in kept for s in (r.chain or (r.step,))}
    needed_files = {f for r in kept for f in r.data_files}
    manifests = [
        key
        for key in store.list("versions")
        if (step := _step_of_version_key(key)) is not None
        and step not in needed_steps
        and step_of_commit_key(key) is None
        and key not in reserved
    ]
    data_files = [k for k in store.list("data") if k not in needed_files and k not in reserved]
    return RetirePlan(dropped, manifests, data_files)


def retire(
    store: Store,
    *,
    keep: int | RetentionPolicy | None = None,
    drop: Sequence[int] = (),
    protect: Collection[int] = (),
    reserved: Collection[str] = (),
    fence: Callable[[], None] = _no_fence,
    before_delete: Callable[[Collection[str]], None] = _ignore_files,
) -> list[int]:
    """Carry out :func:`plan_retire`, then remove the leftovers of writes that never committed
    (``Store.remove_incomplete``). Returns the steps deleted.

    Safe to fail at any delete and to be run again: commit records go first, so a failure
    midway leaves fewer versions, never a broken one; manifests and data files go only when no
    remaining version needs them, so the next pass finishes what this one started.
    ``before_delete(files)`` is told which data files are about to go before the first of them
    is deleted (the writer drops them from its content index, so no new version can reference
    a file that a failing pass half-deleted). ``fence()`` runs before anything is deleted: a
    writer that lost the run's lock deletes nothing. Only the run's writer calls this, while
    none of its own writes on ``store`` is in progress.
    """
    plan = plan_retire(store, keep=keep, drop=drop, protect=protect, reserved=reserved)
    fence()
    for s in plan.dropped:
        store.delete(commit_key(s))
    for key in plan.manifests:
        store.delete(key)
    if plan.data_files:
        before_delete(plan.data_files)
        for key in plan.data_files:
            store.delete(key)
    for prefix in ("data", "versions"):
        for name in store.remove_incomplete(prefix):
            log.info("removed %s from %s: left by a write that never committed", name, store.url)
    return plan.dropped


def _step_of_version_key(key: str) -> int | None:
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] == "versions" and parts[1].isdigit():
        return int(parts[1])
    return None


# ---------------------------------------------------------------------------------------------
# read


def list_steps(store: Store) -> list[int]:
    """Steps with a commit record on ``store``, ascending."""
    steps = (step_of_commit_key(k) for k in store.list("versions"))
    return sorted(s for s in steps if s is not None)


def step_exists(store: Store, step: int) -> bool:
    """Whether ``step`` is committed on ``store`` (its commit record exists)."""
    return store.exists(commit_key(step))


def read_commit(store: Store, step: int) -> CommitRecord:
    key = commit_key(step)
    try:
        data = store.read(key)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"step {step} not found in {store.url}") from None
    record = CommitRecord.from_json(data, f"{store.url}: {key}")
    if record.step != step:
        raise CheckpointFormatError(
            f"{store.url}: {key} is the commit record of step {record.step}"
        )
    return record


def read_manifest(store: Store, record: CommitRecord, rank: int) -> tuple[Manifest, ManifestRef]:
    refs = [m for m in record.manifests if m.rank == rank]
    if not refs:
        raise CheckpointNotFoundError(
            f"step {record.step} in {store.url} has no rank {rank} (world size {record.world_size})"
        )
    ref = refs[0]
    manifest = _load_manifest(store, ref.key, ref.xxh3, ref.nbytes, record.step)
    if manifest.step != record.step or manifest.rank != rank:
        raise CheckpointFormatError(
            f"{store.url}: {ref.key} describes step {manifest.step} rank {manifest.rank}"
        )
    return manifest, ref


def _read_blobs(
    store: Store,
    part: ResolvedPart,
    views: Sequence[memoryview],
    *,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> None:
    """Fill ``views`` from the data files in large runs, then verify every chunk."""
    cb = part.manifest.chunk_bytes
    step = part.step
    # Per data file: (offset, blob, start in blob, nbytes), from runs of chunks that lie back
    # to back, so adjacent pieces become one preadv of many buffers.
    pieces: dict[int, list[tuple[int, int, int, int]]] = {}
    gathers: list[tuple[int, int, np.ndarray[Any, Any]]] = []  # (blob, file, chunk indices)
    for i, b in enumerate(part.blobs):
        n = len(b.files)
        if not n:
            continue
        breaks = np.flatnonzero(
            (b.files[1:] != b.files[:-1]) | (b.offsets[1:] != b.offsets[:-1] + cb)
        )
        if len(breaks) > _FRAGMENTED_RUNS and b.nbytes < (len(breaks) + 1) * _GAP_BYTES:
            # Scattered chunks (the end of an incremental chain over sparse updates): read
            # windows of each file and copy the chunks out with one vectorized gather each,
            # instead of one Python-level piece per chunk. A short last chunk goes the usual
            # way.
            whole = n if b.nbytes % cb == 0 else n - 1
            for f in np.unique(b.files[:whole]).tolist():
                gathers.append((i, f, np.flatnonzero(b.files[:whole] == f)))
            if whole < n:
                pieces.setdefault(int(b.files[-1]), []).append(
                    (int(b.offsets[-1]), i, whole * cb, b.nbytes - whole * cb)
                )
            continue
        starts = [0, *(breaks + 1).tolist()]
        ends = [*(breaks + 1).tolist(), n]
        for s, e in zip(starts, ends, strict=True):
            lo, hi = s * cb, min(e * cb, b.nbytes)
            pieces.setdefault(int(b.files[s]), []).append((int(b.offsets[s]), i, lo, hi - lo))
    # Runs: (offset, buffers, the blob of each buffer or -1 for a skipped gap). Pieces that
    # follow each other in the file join one run; so do pieces a small gap apart (the gap is
    # read into a scratch buffer): a fragmented incremental chain reads its old data files in
    # a few large reads instead of one per changed region. Runs of one file are read in
    # groups of about IO_BATCH_BYTES, each group one task that opens the file once.
    scratch = memoryview(bytearray(_GAP_BYTES))
    groups: list[tuple[str, list[tuple[int, list[memoryview], list[int]]]]] = []
    for f, plist in pieces.items():
        key = part.files[f]
        plist.sort()
        runs: list[tuple[int, list[memoryview], list[int]]] = []
        end = -1
        size = 0
        group_bytes = 0
        for offset, blob, start, nbytes in plist:
            view = views[blob][start : start + nbytes]
            gap = offset - end
            if runs and 0 <= gap <= _GAP_BYTES and size < IO_BATCH_BYTES:
                if gap:
                    runs[-1][1].append(scratch[:gap])
                    runs[-1][2].append(-1)
                runs[-1][1].append(view)
                runs[-1][2].append(blob)
                size += gap + nbytes
            else:
                # A new run: a far piece, or content stored once and used twice
                # (de-duplicated: the piece starts before the run's end).
                if group_bytes >= IO_BATCH_BYTES:
                    groups.append((key, runs))
                    runs, group_bytes = [], 0
                runs.append((offset, [view], [blob]))
                size = nbytes
            group_bytes += nbytes
            end = offset + nbytes
        if runs:
            groups.append((key, runs))

    def read(group: tuple[str, list[tuple[int, list[memoryview], list[int]]]]) -> None:
        key, runs = group
        try:
            store.read_ranges(key, [(offset, bufs) for offset, bufs, _ in runs])
        except (TruncatedError, CheckpointNotFoundError) as exc:
            what = "truncated" if isinstance(exc, TruncatedError) else "missing"
            victim = runs[0][2][0]
            if isinstance(exc, TruncatedError):
                # Name the leaf whose bytes are cut off, not the first one of the read.
                with contextlib.suppress(CheckpointError):
                    size = store.size(key)
                    for offset, bufs, owners in runs:
                        at = offset
                        for buf, blob in zip(bufs, owners, strict=True):
                            if blob >= 0 and at + buf.nbytes > size:
                                victim = blob
                                break
                            at += buf.nbytes
                        else:
                            continue
                        break
            raise IntegrityError(
                f"step {step}, tier {store.url}: data file {key} is {what}; "
                f"leaf {part.blobs[victim].path} cannot be read"
            ) from exc
        on_bytes(sum(v.nbytes for _, bufs, _owners in runs for v in bufs))

    def gather(task: tuple[int, int, np.ndarray[Any, Any]]) -> None:
        i, f, idx = task
        b, key = part.blobs[i], part.files[f]
        offs = b.offsets[idx]
        order = np.argsort(offs, kind="stable")
        idx, offs = idx[order], offs[order]
        whole = b.nbytes // cb
        dest = np.frombuffer(views[i], np.uint8)[: whole * cb].reshape(whole, cb)
        # A window never spans a gap wider than _GAP_BYTES (dead chunks of an old file are
        # not read) nor more than _GATHER_WINDOW_BYTES.
        cuts = np.flatnonzero(offs[1:] - offs[:-1] - cb > _GAP_BYTES) + 1
        cluster_end = np.append(cuts, len(offs))
        windows: list[tuple[int, int, int, int]] = []  # (first, end) chunks, (lo, hi) bytes
        lo_i = 0
        while lo_i < len(offs):
            lo = int(offs[lo_i])
            end_i = int(cluster_end[np.searchsorted(cluster_end, lo_i, side="right")])
            hi_i = int(np.searchsorted(offs, lo + _GATHER_WINDOW_BYTES - cb, side="right"))
            hi_i = max(min(hi_i, end_i), lo_i + 1)
            windows.append((lo_i, hi_i, lo, int(offs[hi_i - 1]) + cb))
            lo_i = hi_i
        per_copy = max(_GATHER_WINDOW_BYTES // cb, 1)
        buffer = np.empty(0, np.uint8)  # reused: fresh pages for every batch cost faults
        w = 0
        while w < len(windows):
            # Several windows per read_ranges call (one open), up to _GATHER_WINDOW_BYTES.
            batch = [windows[w]]
            size = windows[w][3] - windows[w][2]
            w += 1
            while w < len(windows) and size + windows[w][3] - windows[w][2] <= (
                _GATHER_WINDOW_BYTES
            ):
                size += windows[w][3] - windows[w][2]
                batch.append(windows[w])
                w += 1
            if len(buffer) < size:
                buffer = np.empty(size, np.uint8)
            slices, at = [], 0
            for _a, _b, lo, hi in batch:
                slices.append(buffer[at : at + hi - lo])
                at += hi - lo
            try:
                store.read_ranges(
                    key, [(win[2], [sl.data]) for win, sl in zip(batch, slices, strict=True)]
                )
            except (TruncatedError, CheckpointNotFoundError) as exc:
                what = "truncated" if isinstance(exc, TruncatedError) else "missing"
                raise IntegrityError(
                    f"step {step}, tier {store.url}: data file {key} is {what}; "
                    f"leaf {b.path} cannot be read"
                ) from exc
            for (a, z, lo, _hi), window in zip(batch, slices, strict=True):
                # Every byte offset of the window as the start of a chunk-long row (a view,
                # no copy): the chunks are a fancy index away.
                rows = np.lib.stride_tricks.as_strided(
                    window, shape=(len(window) - cb + 1, cb), strides=(1, 1), writeable=False
                )
                # The fancy index copies through a temporary: a window's bytes bound its
                # reads, not its chunks (de-duplicated chunks share one place), so the copy
                # goes in slices of at most a window's worth.
                for s in range(a, z, per_copy):
                    e = min(s + per_copy, z)
                    dest[idx[s:e]] = rows[offs[s:e] - lo]
                on_bytes((z - a) * cb)

    # Several reads in flight: copying out of the page cache and faulting in fresh pages run
    # on every core, and a remote store overlaps its latencies.
    tasks: list[Callable[[], None]] = [lambda g=g: read(g) for g in groups]  # type: ignore[misc]
    tasks += [lambda t=t: gather(t) for t in gathers]  # type: ignore[misc]
    if len(tasks) > 1:
        with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="cryosnap-read") as pool:
            for _ in pool.map(lambda task: task(), tasks):
                pass
    else:
        for task in tasks:
            task()
    for b, view in zip(part.blobs, views, strict=True):
        _verify_blob(store, step, cb, b, view)


def _verify_blob(
    store: Store, step: int, chunk_bytes: int, b: ResolvedBlob, view: memoryview
) -> None:
    hashes = hash_chunks(view, chunk_bytes)
    expected = b.hashes.tobytes()
    if hashes == expected:
        return
    for c in range(0, len(hashes), HASH_BYTES):
        if hashes[c : c + HASH_BYTES] != expected[c : c + HASH_BYTES]:
            chunk = c // HASH_BYTES
            lo = chunk * chunk_bytes
            hi = min(lo + chunk_bytes, b.nbytes)
            raise IntegrityError(
                f"step {step}, tier {store.url}: leaf {b.path}: chunk {chunk} "
                f"(bytes {lo}-{hi}) does not match its hash"
            )
    raise IntegrityError(f"step {step}, tier {store.url}: leaf {b.path}: wrong chunk count")


# Leaves at least this large are pre-faulted while a chain resolves, in steps of this much.
_PREFAULT_MIN_BYTES = 1 << 20
_PREFAULT_STEP_BYTES = 8 << 20


@contextlib.contextmanager
def _prefaulted(views: Sequence[memoryview]) -> Iterator[None]:
    """Write zeros over freshly allocated ``views`` on a background thread (``memset``
    releases the GIL) until the block ends; the block must not touch ``views``."""
    big = [v for v in views if v.nbytes >= _PREFAULT_MIN_BYTES and v.contiguous and not v.readonly]
    if not big:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        for v in big:
            addr = np.frombuffer(v, np.uint8).ctypes.data
            for lo in range(0, v.nbytes, _PREFAULT_STEP_BYTES):
                if stop.is_set():
                    return
                ctypes.memset(addr + lo, 0, min(_PREFAULT_STEP_BYTES, v.nbytes - lo))

    thread = threading.Thread(target=run, name="cryosnap-prefault", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _read_verified(
    store: Store,
    step: int,
    *,
    rank: int,
    allow_pickle: bool,
    into: Any = None,
    progress: bool = False,
) -> tuple[ResolvedPart, Restorer]:
    """Resolve one rank's part, allocate its leaves, read and verify every chunk into them
    (with a progress line on a terminal if ``progress``)."""
    with paused_gc():
        record = read_commit(store, step)
        manifest, ref = read_manifest(store, record, rank)
        where = f"step {step}, tier {store.url}: {ref.key}"
        if into is not None:
            _check_into(manifest, into, where)
        chain = chain_manifests(store, manifest, ref.key, ref.xxh3)
        # Every size, offset and count the chain claims is checked before any allocation.
        checked = _check_chain_claims(store, chain, set(record.data_files))
        restorer = Restorer(
            manifest.skeleton, [b.nbytes for b in manifest.blobs], allow_pickle=allow_pickle
        )
        views = _allocate(restorer, where)
        # The leaves are allocated before the chain is applied so that the kernel maps their
        # fresh pages (a cost as large as reading the data from the page cache) on another
        # core while this one resolves the chain.
        with _prefaulted(views if manifest.base is not None else ()):
            part = resolve(store, manifest, ref.key, ref.xxh3, chain=chain)
        _check_used_files(store, part, checked)
    try:
        if not progress:
            _read_blobs(store, part, views)
            return part, restorer
        line = Progress(f"cryosnap: restoring step {step}", manifest.logical_bytes)
        try:
            _read_blobs(store, part, views, on_bytes=line.update)
        finally:
            line.close()
    except MemoryError as exc:
        raise CheckpointFormatError(f"{where}: out of memory while reading its chunks") from exc
    return part, restorer


def _check_into(manifest: Manifest, into: Any, where: str) -> None:
    try:
        check_into(manifest.skeleton, into)
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        # check_into reads the skeleton as written; a malformed one fails on the way.
        raise CheckpointFormatError(f"{where}: malformed state tree ({exc!r:.120})") from exc


# What allocating a claimed leaf raises when the claim is absurd or memory runs out: Python's
# MemoryError, torch's RuntimeError, numpy's ValueError ("array is too big"), OverflowError.
_ALLOC_ERRORS = (MemoryError, RuntimeError, ValueError, OverflowError)


def _allocate(restorer: Restorer, where: str) -> list[memoryview]:
    try:
        return restorer.allocate()
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
) -> Any:
    """Read, verify and assemble one rank's state of ``step`` (optionally into ``into``)."""
    t0 = time.perf_counter()
    part, restorer = _read_verified(
        store, step, rank=rank, allow_pickle=allow_pickle, into=into, progress=True
    )
    manifest = part.manifest
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
        human_bytes(manifest.logical_bytes),
    )
    if into is None:
        return tree
    try:
        return apply_into(manifest.skeleton, tree, into)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"step {step}: filling into= failed: {exc}") from exc


def verify_part(store: Store, step: int, *, rank: int = 0) -> ResolvedPart:
    """Read every chunk of one rank's part (through its whole chain) and check every hash and
    every Merkle root; raise on the first damage found."""
    part, _restorer = _read_verified(store, step, rank=rank, allow_pickle=True)
    for b, entry in zip(part.blobs, part.manifest.blobs, strict=True):
        if merkle_root(b.hashes.tobytes()) != entry.root:
            raise IntegrityError(
                f"step {step}, tier {store.url}: leaf {b.path}: Merkle root does not match"
            )
    return part


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside cryosnap (the
    user's line that called ``load``/``restore``), however deep the call came from."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


# How often a reader starts over when the writer's retention removed versions under it.
_RELIST_LIMIT = 16


def newest_restorable(
    where: str, attempt: Callable[[int], Any], list_steps: Callable[[], Sequence[int]]
) -> Any:
    """Run ``attempt(step)`` from the newest step down; warn and fall back past damage.

    ``list_steps()`` gives the committed steps; a version that fails because the run's writer
    retired it meanwhile (its step is no longer listed) is not damage: the reader lists again
    and starts over from the newest, so a reader asking for the newest version never fails
    because an older one was deleted under it. ``where`` names the run in messages.
    """
    damaged: dict[int, str] = {}
    for _ in range(_RELIST_LIMIT):
        steps = [s for s in list_steps() if s not in damaged]
        if not steps and not damaged:
            raise CheckpointNotFoundError(f"no committed version in {where}")
        retired = False
        for step in reversed(steps):
            try:
                return attempt(step)
            except CheckpointError as exc:
                if step not in list_steps():
                    retired = True  # deleted by the writer while we read it: list again
                    break
                if not isinstance(exc, (IntegrityError, CheckpointFormatError)):
                    raise
                damaged[step] = str(exc)
                warnings.warn(
                    f"cryosnap: skipping damaged step {step} in {where}: {exc}",
                    RuntimeWarning,
                    stacklevel=caller_stacklevel(),
                )
        if not retired:
            break
    if not damaged:
        raise CheckpointNotFoundError(
            f"no version of {where} could be read: the writer kept retiring them while reading"
        )
    newest = damaged[max(damaged)]
    raise IntegrityError(f"every version in {where} is damaged; newest error: {newest}")
