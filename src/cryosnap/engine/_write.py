"""Write: stream one rank's part of a version (:class:`PartWriter`); the commit record that
makes the version visible is built from every rank's summary by the writer (_writer.py,
``CommitRecord.of_parts``).

Hash the chunks of each captured batch; compare them with the *base* version (the previous one)
chunk by chunk: an unchanged run becomes one ``Inherited`` reference; a chunk whose content is
already stored (earlier in this version, or in a kept version) becomes a reference to where it
lies; only new content is appended to the version's one packed data file (``writev``: many
buffers, few syscalls) by an I/O thread of its own (:class:`_Appender`). Then fsync, the rank's
manifest, and last the commit record. Until the commit record exists the version is invisible;
a crash at any point leaves only unreferenced files that retention removes.

Replicated blobs (identical on every rank) are split among the ranks (:func:`assign_shares`):
a rank writes only the new chunks of its share and refers to the other ranks' data files for
the rest, once the ranks told each other where their shares lie (_replicated.py does that).

Runs on the Checkpointer's background writer thread (and the I/O threads it starts); no
collectives here.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .._gc import paused_gc
from ..chunks import (
    HASH_BYTES,
    chunk_count,
    hash_chunks_released,
    hash_each_released,
    merkle_root,
    value_runs,
)
from ..errors import CheckpointError, CheckpointExistsError
from ..manifest import (
    FORMAT_VERSION,
    INHERITED,
    PACKED_FORMAT_VERSION,
    STORED,
    BaseRef,
    BlobEntry,
    Lineage,
    Manifest,
    ManifestRef,
    Replicated,
    commit_key,
    data_key,
    manifest_key,
    now_unix,
)
from ..storage import Store
from ..storage.base import BlobWriter
from ..storage.tiers import Placement
from ..tree import FlatState
from ._resolved import ResolvedPart, _Loc, _resolve_one
from .items import Hashed, Item, Piece, Unchanged

__all__ = ["Owners", "PartResult", "PartWriter", "assign_shares"]

log = logging.getLogger("cryosnap")

# New bytes of a version are placed on scratch devices in groups of this size.
_PLACE_BYTES = 4 << 20

# The Merkle root of a blob of no chunks.
_EMPTY_ROOT = merkle_root(b"")

# A new blob of at least _ALIGN_MIN_BYTES starts at a multiple of _ALIGN_BYTES in its data file
# (a cache line; any element's alignment): a restore from a mapped file builds its leaf over
# the file's pages only if the leaf's elements are aligned (engine/_fetch.py, Mapped). Smaller
# blobs are packed as they come: padding them would cost more than their copy.
_ALIGN_BYTES = 64
_ALIGN_MIN_BYTES = 4096
_ZEROS = memoryview(bytes(_ALIGN_BYTES))


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
        if self.base is None:
            return own
        # The files the base's chunks lie in (as ResolvedPart.used_files, one numpy call for
        # every blob of a state of many small leaves, not one each).
        base = self.base
        files = [b.files for b in base.blobs]
        used = np.unique(np.concatenate(files)).tolist() if files else []
        return own | {base.files[i] for i in used}

    @property
    def depth(self) -> int:
        """Versions in this version's chain, itself included (as ResolvedPart.depth)."""
        return len(self.chain())

    def chain(self) -> tuple[int, ...]:
        return (
            (self.manifest.step,) if self.base is None else (*self.base.chain, self.manifest.step)
        )

    def chain_keys(self) -> tuple[str, ...]:
        """The keys of the manifests of :meth:`chain` (this rank's), oldest first."""
        return (self.ref.key,) if self.base is None else (*self.base.chain_keys, self.ref.key)


# -- shares: which rank writes which chunks of the replicated blobs of a version --------------
#
# Blobs saved as replicated are identical on every rank and written once in total, split among
# the ranks by bytes. Every rank computes the same split from the blob sizes alone, with no
# communication: the replicated blobs are laid end to end (in the order the caller gives, the
# same on every rank) and cut into ``world_size`` ranges of equal bytes; a chunk belongs to the
# range its first byte falls in. Cuts land on chunk boundaries, so a rank's share differs from
# ``1/world_size`` of the bytes by less than one chunk per cut.

Owners = np.ndarray[Any, np.dtype[np.int32]]


def assign_shares(sizes: Sequence[int], world_size: int, chunk_bytes: int) -> list[Owners]:
    """For each blob of ``sizes`` bytes (in order), the rank that writes each of its chunks."""
    total = sum(sizes)
    # The first byte of ranks 1 .. world_size-1 in the blobs laid end to end.
    cuts = np.array([total * r // world_size for r in range(1, world_size)], np.int64)
    out: list[Owners] = []
    at = 0
    for nbytes in sizes:
        starts = at + np.arange(chunk_count(nbytes, chunk_bytes), dtype=np.int64) * chunk_bytes
        out.append(np.searchsorted(cuts, starts, side="right").astype(np.int32))
        at += nbytes
    return out


def owner_runs(owners: Owners, first: int, count: int) -> list[tuple[int, int, int]]:
    """Chunks ``first .. first+count-1`` as runs ``(first, count, owner)`` of one owner each."""
    if count == 0:
        return []
    part = owners[first : first + count]
    if part[0] == part[-1]:  # owners never decrease along a blob: one owner throughout
        return [(first, count, int(part[0]))]
    return [(first + a, b - a, int(part[a])) for a, b in value_runs(part)]


# A run of chunks of a replicated blob that another rank writes: [EXTERNAL, rank, first, count]
# until the ranks tell each other where their shares lie (never in a manifest).
EXTERNAL = 2


class _BlobBuilder:
    """Segments of one blob as its pieces arrive."""

    __slots__ = ("hashes", "segments")

    def __init__(self) -> None:
        # [0, file, offset, nbytes, [hashes]] | [1, blob, first, count] | [2, rank, first, count]
        self.segments: list[list[Any]] = []
        self.hashes: list[bytes] = []

    def external(self, rank: int, first: int, count: int) -> None:
        last = self.segments[-1] if self.segments else None
        if (
            last is not None
            and last[0] == EXTERNAL
            and last[1] == rank
            and last[2] + last[3] == first
        ):
            last[3] += count
        else:
            self.segments.append([EXTERNAL, rank, first, count])

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


class _Shares:
    """The part of a :class:`PartWriter` that deals with replicated state written by several
    ranks: where this rank's share lies, and references to the shares of the others."""

    step: int
    rank: int
    flat: FlatState
    chunk_bytes: int
    base: ResolvedPart | None
    files: list[str]
    shares: dict[int, Owners]
    _builders: dict[int, _BlobBuilder]
    _external: set[int]
    _base_files: np.ndarray[Any, np.dtype[np.int64]] | None

    def _file(self, key: str) -> int:
        raise NotImplementedError

    def _builder(self, i: int) -> _BlobBuilder:
        """Blob ``i``'s builder, made on first use (a blob added whole in one chunk has none:
        see ``PartWriter._diff_ones``)."""
        builder = self._builders.get(i)
        if builder is None:
            builder = self._builders[i] = _BlobBuilder()
        return builder

    def owned_locations(self) -> list[tuple[int, int, int, str, int]]:
        """Where this rank's share of the replicated blobs lies, every piece added: runs
        ``(blob, first chunk, chunks, data file, offset)`` of chunks back to back in one file
        (new, referenced or inherited: every chunk of the share)."""
        cb = self.chunk_bytes
        out: list[tuple[int, int, int, str, int]] = []
        for i, owners in self.shares.items():
            idx = np.flatnonzero(owners == self.rank)
            if not len(idx):
                continue
            files, offsets = self._chunk_locations(i)
            f, o = files[idx], offsets[idx]
            cut = (np.diff(idx) != 1) | (np.diff(f) != 0) | (np.diff(o) != cb)
            starts = [0, *(np.flatnonzero(cut) + 1).tolist()]
            for s, e in zip(starts, [*starts[1:], len(idx)], strict=True):
                out.append((i, int(idx[s]), e - s, self.files[int(f[s])], int(o[s])))
        return out

    def _chunk_locations(
        self, i: int
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """Per chunk of blob ``i``: its file (index into ``files``; -1: another rank's) and
        offset."""
        cb = self.chunk_bytes
        n = chunk_count(self.flat.blobs[i].nbytes, cb)
        files = np.full(n, -1, np.int64)
        offsets = np.zeros(n, np.int64)
        pos = 0
        for seg in self._builder(i).segments:
            if seg[0] == STORED:
                k = chunk_count(seg[3], cb)
                files[pos : pos + k] = seg[1]
                offsets[pos : pos + k] = seg[2] + np.arange(k, dtype=np.int64) * cb
            elif seg[0] == INHERITED:
                assert self.base is not None
                k = seg[3]
                src = self.base.blobs[seg[1]]
                files[pos : pos + k] = self._base_file_map()[src.files[seg[2] : seg[2] + k]]
                offsets[pos : pos + k] = src.offsets[seg[2] : seg[2] + k]
            else:
                k = seg[3]
            pos += k
        return files, offsets

    def _base_file_map(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The base's file indices as indices into ``files`` (unused ones never reach the
        manifest: it lists only the files its stored segments use)."""
        if self._base_files is None:
            assert self.base is not None
            self._base_files = np.array([self._file(f) for f in self.base.files], np.int64)
        return self._base_files

    def place_external(self, runs: Sequence[tuple[int, int, int, str, int]]) -> None:
        """The other ranks' shares: runs ``(blob, first chunk, chunks, data file, offset)``
        (their :meth:`owned_locations`) become stored segments of this part, with the hashes
        this rank computed itself (every chunk is still verified on read)."""
        cb = self.chunk_bytes
        by_blob: dict[int, list[tuple[int, int, int, str, int]]] = {}
        for run in runs:
            by_blob.setdefault(run[0], []).append(run)
        for i in sorted(self._external):
            blob = self.flat.blobs[i]
            n = chunk_count(blob.nbytes, cb)
            files = np.full(n, -1, np.int64)
            offsets = np.zeros(n, np.int64)
            for _i, first, count, key, offset in by_blob.get(i, ()):
                if first < 0 or count <= 0 or first + count > n or offset < 0:
                    raise CheckpointError(
                        f"step {self.step}: leaf {blob.path}: another rank reported chunks "
                        f"{first}..{first + count - 1} of a blob of {n} chunks"
                    )
                files[first : first + count] = self._file(key)
                offsets[first : first + count] = offset + np.arange(count, dtype=np.int64) * cb
            builder = self._builder(i)
            hashes = b"".join(builder.hashes)
            segments: list[list[Any]] = []
            for seg in builder.segments:
                if seg[0] != EXTERNAL:
                    segments.append(seg)
                    continue
                _kind, rank, first, count = seg
                f, o = files[first : first + count], offsets[first : first + count]
                if (f < 0).any():
                    raise CheckpointError(
                        f"step {self.step}: leaf {blob.path}: rank {rank} did not say where "
                        f"chunks {first}..{first + count - 1} of its share lie"
                    )
                cut = (np.diff(f) != 0) | (np.diff(o) != cb)
                starts = [0, *(np.flatnonzero(cut) + 1).tolist()]
                for s, e in zip(starts, [*starts[1:], count], strict=True):
                    c0, k = first + s, e - s
                    nbytes = min(k * cb, blob.nbytes - c0 * cb)
                    chunk_hashes = hashes[c0 * HASH_BYTES : (c0 + k) * HASH_BYTES]
                    segments.append([STORED, int(f[s]), int(o[s]), nbytes, [chunk_hashes]])
            builder.segments = segments
        self._external.clear()


class PartWriter(_Shares):
    """Streams one rank's part of a version: new chunks into one packed data file (one per
    device with a ``placement`` over several scratch devices), then the manifest (durable, not
    yet committed).

    With a ``base`` the version is incremental: chunks equal to the base's at the same place
    are inherited, and ``index`` (hash -> location of content in kept versions) turns content
    seen before into references. Without one, the version is full: self-contained, with
    duplicate chunks inside it stored once. Pieces of a blob arrive in order and start on chunk
    boundaries. Runs on the background writer thread.

    ``shares`` (blob index -> the rank that writes each of its chunks, engine._shares) marks
    replicated blobs: chunks of another rank's share are hashed (or arrive :class:`Hashed` by
    the capture, which did not copy them) and diffed against the base (unchanged runs are
    inherited) but not written; once every piece is added,
    :meth:`owned_locations` says where this rank's share lies and :meth:`place_external` takes
    where the other ranks' shares lie (external stored segments into their data files) before
    :meth:`finish`. ``replicated`` is recorded in the manifest.
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
        shares: dict[int, np.ndarray[Any, np.dtype[np.int32]]] | None = None,
        replicated: Replicated = None,
        lineage: Lineage | None = None,
    ) -> None:
        if store.exists(commit_key(step, lineage)):
            raise CheckpointExistsError(f"step {step} already exists in {store.url}")
        self.generation = 0 if lineage is None else lineage.generation
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
        self._padding = 0  # zero bytes written before blobs, to align them (_align)
        self._device = 0  # the device taking the new bytes of the batch being diffed
        self._new_share = 1.0  # moving share of new bytes in a batch, to size placements
        nblobs = len(flat.blobs)
        # Per blob, its segments as pieces arrive; a blob added whole in one piece of one chunk
        # (most small leaves) has no builder but one row of _one_rows and one hash of
        # _one_hashes, at _one_at[blob]: no object per leaf (_diff_ones).
        self._builders: dict[int, _BlobBuilder] = {}
        self._one_at = [-1] * nblobs
        self._one_rows: list[int] = []  # 4 ints per such blob: its one segment row
        self._one_hashes: list[bytes] = []
        self._got = [0] * nblobs  # chunks hashed per blob
        self._base_blob = self._match() if self.base is not None else [None] * nblobs
        self.chunks = 0
        self.new_chunks = 0
        self.shares = shares or {}
        self.replicated = replicated
        self._external: set[int] = set()  # blobs with runs another rank writes
        self._base_files: np.ndarray[Any, np.dtype[np.int64]] | None = None

    def _match(self) -> list[int | None]:
        """Per blob, the base's blob of the same path and size (None: none)."""
        assert self.base is not None
        index, old = self.base.blob_index, self.base.blobs
        out: list[int | None] = []
        for blob in self.flat.blobs:
            j = index(blob.path)
            out.append(None if j is None or old[j].nbytes != blob.nbytes else j)
        return out

    def _file(self, key: str) -> int:
        idx = self._file_index.get(key)
        if idx is None:
            idx = self._file_index[key] = len(self.files)
            self.files.append(key)
        return idx

    @property
    def written_bytes(self) -> int:
        """The new chunks' bytes (the alignment padding between them is not counted)."""
        return sum(self._offsets) - self._padding

    def _align(self, offset: int, nbytes: int, out: list[memoryview]) -> int:
        """Where a new blob of ``nbytes`` starts when its bytes would start at ``offset``:
        for one of at least _ALIGN_MIN_BYTES, the next multiple of _ALIGN_BYTES, the gap
        written as zeros (a restore from a mapped file builds such a leaf over the file's
        pages, each element aligned); ``offset`` for a smaller one."""
        pad = -offset % _ALIGN_BYTES if nbytes >= _ALIGN_MIN_BYTES else 0
        if pad:
            out.append(_ZEROS[:pad])
            self._padding += pad
        return offset + pad

    def add(self, pieces: Sequence[Item], release: Callable[[], None] = lambda: None) -> None:
        """Hash and diff ``pieces``; their new bytes are appended by the I/O thread, which
        calls ``release`` once it no longer needs the pieces' memory (also on failure).
        :class:`~cryosnap.engine.items.Unchanged` runs (found on the device) are inherited from the
        base, which must be the version the capture compared with."""
        if self.placement is None:
            try:
                before = self._offsets[0]
                out = self._diff(pieces)
            except BaseException:
                release()
                raise
            # The new bytes are the views, back to back at the end of the file.
            self._ios[0].append(out, release, self._offsets[0] - before)
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
                logical = sum(p.view.nbytes for p in group if isinstance(p, Piece))
                device = self.placement.choose(int(logical * self._new_share), reserve=logical)
                self._device = device
                before = self._offsets[device]
                out = self._diff(group)
                nbytes = self._offsets[device] - before
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

    def _diff(self, pieces: Sequence[Item]) -> list[memoryview]:
        out: list[memoryview] = []
        cb = self.chunk_bytes
        shares = self.shares
        blobs = self.flat.blobs
        ones: list[Piece] = []  # whole blobs of one chunk, not replicated: _diff_ones
        for p in pieces:
            if type(p) is Piece:
                n = p.view.nbytes
                if (
                    p.offset == 0
                    and 0 < n <= cb
                    and n == blobs[p.blob].nbytes
                    and (not shares or p.blob not in shares)
                ):
                    ones.append(p)
                    continue
            if ones:
                self._diff_ones(ones, out)
                ones = []
            if isinstance(p, Unchanged):
                self._unchanged(p)
                continue
            if isinstance(p, Hashed):
                self._hashed(p)
                continue
            owners = shares.get(p.blob) if shares else None
            if owners is None:
                self._diff_piece(p, out)
                continue
            first = p.offset // cb
            for a, count, rank in owner_runs(owners, first, chunk_count(p.view.nbytes, cb)):
                lo = (a - first) * cb
                q = Piece(p.blob, p.offset + lo, p.view[lo : lo + count * cb])
                if rank == self.rank:
                    self._diff_piece(q, out)
                else:
                    self._foreign(q, rank)
        if ones:
            self._diff_ones(ones, out)
        return out

    def _diff_ones(self, ones: list[Piece], out: list[memoryview]) -> None:
        """Whole blobs of one chunk each, not replicated (most small leaves): hashed in one
        call, each one segment, as :meth:`_diff_piece` makes it (inherited from the base,
        a reference to the same content stored before, or new bytes), kept in flat lists."""
        digests = hash_each_released([p.view for p in ones])
        dev = self._device
        key, offset = self.files[dev], self._offsets[dev]
        new_index, index = self.new_index, self.index
        got, at, rows, hashes = self._got, self._one_at, self._one_rows, self._one_hashes
        base, base_blob = self.base, self._base_blob
        new = 0
        for p, digest in zip(ones, digests, strict=True):
            blob = p.blob
            got[blob] += 1
            at[blob] = len(hashes)
            hashes.append(digest)
            if base is not None:
                j = base_blob[blob]
                # A matched base blob has the same size: one chunk too.
                if j is not None and base.blobs[j].hashes.tobytes() == digest:
                    rows += (INHERITED, j, 0, 1)
                    continue
            view = p.view
            loc = new_index.get(digest) or index.get(digest)
            if loc is not None:
                rows += (STORED, self._file(loc[0]), loc[1], view.nbytes)
                continue
            offset = self._align(offset, view.nbytes, out)
            new_index[digest] = (key, offset)
            rows += (STORED, dev, offset, view.nbytes)
            out.append(view)
            offset += view.nbytes
            new += 1
        self._offsets[dev] = offset
        self.chunks += len(ones)
        self.new_chunks += new

    def _hash_runs(self, p: Piece) -> tuple[bytes, int, int | None, list[tuple[int, int, bool]]]:
        """Hash ``p``'s chunks (kept by its blob's builder); its first chunk, its base blob,
        and runs ``(a, b, unchanged)`` of its chunks against the base."""
        digests = hash_chunks_released(p.view, self.chunk_bytes)
        first = p.offset // self.chunk_bytes
        j, runs = self._base_runs(p.blob, first, digests)
        return digests, first, j, runs

    def _base_runs(
        self, blob: int, first: int, digests: bytes
    ) -> tuple[int | None, list[tuple[int, int, bool]]]:
        """Chunks ``first ..`` of ``blob`` with hashes ``digests`` (kept by the blob's
        builder): its base blob and runs ``(a, b, unchanged)`` of them against the base."""
        n = len(digests) // HASH_BYTES
        self.chunks += n
        self._got[blob] += n
        self._builder(blob).hashes.append(digests)
        j = self._base_blob[blob]
        if j is None:
            return j, [(0, n, False)]
        assert self.base is not None
        old = self.base.blobs[j].hashes[first : first + n]
        if n == 1:
            return j, [(0, 1, digests == old.tobytes())]
        # Runs of unchanged / changed chunks: one reference per unchanged run.
        same = (np.frombuffer(digests, np.uint8).reshape(n, HASH_BYTES) == old).all(1)
        return j, [(a, b, bool(same[a])) for a, b in value_runs(same)]

    def _unchanged(self, u: Unchanged) -> None:
        """Chunks the capture found unchanged since the base: inherited, with the base's
        hashes (the chunks are the same bytes), whoever's share they are."""
        j = self._base_blob[u.blob]
        base = self.base
        if j is None or base is None or u.first + u.count > len(base.blobs[j].hashes):
            raise CheckpointError(
                f"step {self.step}: leaf {self.flat.blobs[u.blob].path}: chunks {u.first}.."
                f"{u.first + u.count - 1} were found unchanged on the device, but the base "
                f"version {'(none)' if base is None else base.step} does not hold them"
            )
        builder = self._builder(u.blob)
        builder.hashes.append(base.blobs[j].hashes[u.first : u.first + u.count].tobytes())
        builder.inherit(j, u.first, u.count)
        self.chunks += u.count
        self._got[u.blob] += u.count

    def _foreign(self, p: Piece, rank: int) -> None:
        """Chunks of a replicated blob that ``rank`` writes: hashed and diffed, not written."""
        digests = hash_chunks_released(p.view, self.chunk_bytes)
        self._external_runs(p.blob, p.offset // self.chunk_bytes, digests, rank)

    def _hashed(self, h: Hashed) -> None:
        """Chunks the capture hashed in place because other ranks write them."""
        owners = self.shares.get(h.blob)
        cb = self.chunk_bytes
        first = h.offset // cb
        count = len(h.digests) // HASH_BYTES
        runs = [] if owners is None else owner_runs(owners, first, count)
        if h.offset % cb or not runs or any(rank == self.rank for _a, _n, rank in runs):
            raise CheckpointError(
                f"step {self.step}: leaf {self.flat.blobs[h.blob].path}: chunks {first}.."
                f"{first + count - 1} were hashed as another rank's share, but rank "
                f"{self.rank} writes some of them (the capture and the writer disagree on the "
                "split of the replicated state)"
            )
        for a, n, rank in runs:
            lo = (a - first) * HASH_BYTES
            self._external_runs(h.blob, a, h.digests[lo : lo + n * HASH_BYTES], rank)

    def _external_runs(self, blob: int, first: int, digests: bytes, rank: int) -> None:
        j, runs = self._base_runs(blob, first, digests)
        builder = self._builder(blob)
        for a, b, unchanged in runs:
            if unchanged:
                assert j is not None
                builder.inherit(j, first + a, b - a)
            else:
                builder.external(rank, first + a, b - a)
                self._external.add(blob)

    def _diff_piece(self, p: Piece, out: list[memoryview]) -> None:
        cb = self.chunk_bytes
        dev = self._device
        key, offset = self.files[dev], self._offsets[dev]
        view = p.view
        digests, first, j, runs = self._hash_runs(p)
        builder = self._builder(p.blob)
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
                    if first + k == 0:  # the blob's first bytes
                        offset = self._align(offset, self.flat.blobs[p.blob].nbytes, out)
                    run_start = lo
                self.new_index[digest] = (key, offset)
                builder.store(dev, offset, size, digest, cb)
                offset += size
                self._offsets[dev] = offset
                self.new_chunks += 1
            if run_start >= 0:
                out.append(view[run_start : min(b * cb, view.nbytes)])

    # -- replicated blobs: where each rank's share lies -----------------------------------------

    def blob_root(self, i: int) -> bytes:
        """The Merkle root of blob ``i`` (every piece added)."""
        at = self._one_at[i]
        if at >= 0:
            return self._one_hashes[at]  # one chunk: its hash is the root
        builder = self._builders.get(i)
        return _EMPTY_ROOT if builder is None else merkle_root(b"".join(builder.hashes))

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
        blobs = self.flat.blobs
        nblobs = len(blobs)
        if self._external:
            path = blobs[min(self._external)].path
            raise CheckpointError(
                f"step {self.step}: leaf {path}: the chunks other ranks write were never placed"
            )
        sizes = np.fromiter((b.nbytes for b in blobs), np.int64, nblobs)
        incomplete = np.flatnonzero(np.array(self._got, np.int64) != -(-sizes // cb))
        if len(incomplete):
            path = blobs[int(incomplete[0])].path
            raise CheckpointError(f"step {self.step}: leaf {path} was captured incompletely")
        # One segment table for the whole part (each blob gets a slice of it): a state of
        # 20,000 small tensors costs a few numpy calls here, not 20,000. A blob added whole in
        # one chunk has its one row in _one_rows; the others their builder's segments.
        at = np.array(self._one_at, np.int64)
        ones = np.flatnonzero(at >= 0)
        built = [(i, b) for i, b in sorted(self._builders.items()) if self._one_at[i] < 0]
        counts = np.zeros(nblobs, np.int64)
        counts[ones] = 1
        for i, builder in built:
            counts[i] = len(builder.segments)
        bounds = np.zeros(nblobs + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        table = np.empty((int(bounds[-1]), 4), np.int64)
        one_rows = np.array(self._one_rows, np.int64).reshape(-1, 4)[at[ones]]
        table[bounds[ones]] = one_rows
        for i, builder in built:
            if builder.segments:
                table[bounds[i] : bounds[i + 1]] = [g[:4] for g in builder.segments]
        # data_files: the files this manifest's stored segments point to, renumbered densely.
        stored = table[:, 0] == STORED
        used = np.unique(table[stored, 1]).tolist()
        remap = np.zeros(len(self.files), np.int64)
        remap[used] = np.arange(len(used))
        table[stored, 1] = remap[table[stored, 1]]
        # Per blob, its Merkle root and the hashes of its stored chunks.
        roots = [_EMPTY_ROOT] * nblobs
        kept = [b""] * nblobs
        one_hashes = self._one_hashes
        for i, a, kind in zip(
            ones.tolist(), at[ones].tolist(), one_rows[:, 0].tolist(), strict=True
        ):
            roots[i] = one_hashes[a]  # one chunk: its hash is the root
            if kind == STORED:
                kept[i] = roots[i]
        for i, builder in built:
            roots[i] = merkle_root(b"".join(builder.hashes))
            kept[i] = b"".join(b"".join(g[4]) for g in builder.segments if g[0] == STORED)
        edges = bounds.tolist()
        entries = [
            BlobEntry(nbytes, root, table[lo:hi], hashes, cb)
            for nbytes, root, lo, hi, hashes in zip(
                sizes.tolist(), roots, edges, edges[1:], kept, strict=False
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
            replicated=self.replicated,
            format_version=PACKED_FORMAT_VERSION if self.flat.packed else FORMAT_VERSION,
        )
        return manifest, manifest.to_json()

    def _write_manifest(self, manifest: Manifest, body: bytes) -> PartResult:
        base = self.base
        mkey = manifest_key(self.step, self.rank, self.generation)
        if self.store.exists(mkey):
            # A step saved again (after remove, retention or a crash) whose old manifest a
            # later version may still resolve through: never overwrite it, take a name of its
            # own (the commit record names the key; retention reclaims the old one).
            mkey = f"{mkey.removesuffix('.json')}-{secrets.token_hex(4)}.json"
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


def _split_pieces(pieces: Sequence[Item], limit: int, chunk_bytes: int) -> list[list[Item]]:
    """``pieces`` in groups of about ``limit`` bytes; pieces are cut on chunk boundaries
    (unchanged and hashed runs cost nothing and stay in order)."""
    step = max(limit // chunk_bytes, 1) * chunk_bytes
    groups: list[list[Item]] = [[]]
    size = 0
    for p in pieces:
        if not isinstance(p, Piece):
            groups[-1].append(p)
            continue
        lo, n = 0, p.view.nbytes
        if size + n < step:  # the whole piece (most small leaves), not sliced
            groups[-1].append(p)
            size += n
            continue
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
