"""The diff of one part against its base, pure over chunk hashes: per blob, the segments that
cover its chunks (runs inherited from the base, references to content stored before, new
chunks) and where each new chunk lies in its data file. No I/O, no threads, no bytes.

Runs on the writer thread, inside ``PartWriter.add``; docs/design/write-path.md says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap._format.blobs import INHERITED, STORED, BlobEntry
from cryosnap._format.chunks import HASH_BYTES, merkle_root, value_runs
from cryosnap._state import Blob
from cryosnap.engine._resolved import ResolvedPart, _Loc
from cryosnap.storage._direct import BLOCK_BYTES, DIRECT_MIN_BYTES

__all__ = ["EXTERNAL", "BlobSegments", "Cursor", "Differ", "FileTable", "Write"]

# A new blob of at least ALIGN_MIN_BYTES starts at a multiple of ALIGN_BYTES in its data file
# (a cache line; any element's alignment): a restore from a mapped file builds its leaf over
# the file's pages only if the leaf's elements are aligned (engine/_fetch.py, Mapped). Smaller
# blobs are packed as they come: padding them would cost more than their copy.
ALIGN_BYTES = 64
ALIGN_MIN_BYTES = 4096

# A run of chunks of a replicated blob that another rank writes: [EXTERNAL, rank, first, count]
# until the ranks tell each other where their shares lie (never in a manifest).
EXTERNAL = 2

# The Merkle root of a blob of no chunks.
EMPTY_ROOT = merkle_root(b"")

# Bytes to append for a diffed run: (zero bytes first, start, end), start and end relative to
# the run's first byte.
Write = tuple[int, int, int]


def align_pad(offset: int, nbytes: int) -> int:
    """Zero bytes before a new blob of ``nbytes`` whose bytes would start at ``offset``."""
    return -offset % ALIGN_BYTES if nbytes >= ALIGN_MIN_BYTES else 0


def run_pad(offset: int, nbytes: int, address: int) -> int:
    """Zero bytes before a new run of ``nbytes`` that lies at ``address`` in memory and would
    start at ``offset``: a run of DIRECT_MIN_BYTES or more whose memory is ALIGN_BYTES-aligned
    starts at an offset equal to its address modulo BLOCK_BYTES, so that a direct write
    (storage/_direct.py) takes it from where it lies, past its first partial block (and the
    blob stays ALIGN_BYTES-aligned); any other as :func:`align_pad` says."""
    if nbytes >= DIRECT_MIN_BYTES and address and address % ALIGN_BYTES == 0:
        return (address - offset) % BLOCK_BYTES
    return align_pad(offset, nbytes)


class FileTable:
    """The data files a part's segments name, by index: ``keys[d]`` for d below the number of
    devices is device d's own new file; files of earlier versions are numbered after, as
    references to them come."""

    __slots__ = ("_index", "keys")

    def __init__(self, own: Sequence[str]) -> None:
        self.keys: list[str] = list(own)
        self._index = {k: i for i, k in enumerate(self.keys)}

    def index(self, key: str) -> int:
        idx = self._index.get(key)
        if idx is None:
            idx = self._index[key] = len(self.keys)
            self.keys.append(key)
        return idx


@dataclass(slots=True)
class Cursor:
    """Where the next new chunk goes: file ``file`` (an index of the :class:`FileTable`, whose
    key is ``key``) at byte ``offset``."""

    file: int
    key: str
    offset: int = 0


class BlobSegments:
    """Segments of one blob as its pieces arrive, and the hashes of its chunks so far."""

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


@dataclass(frozen=True, slots=True)
class Segments:
    """A whole part's diff, as its manifest lists it: per blob its entry, and the data files
    its stored segments name (renumbered densely, in the order of the file table)."""

    entries: list[BlobEntry]
    data_files: list[str]


def _continues(builder: BlobSegments, file: int, offset: int) -> bool:
    """Whether the blob's last segment is stored in ``file`` and ends at ``offset``."""
    last = builder.segments[-1] if builder.segments else None
    return (
        last is not None and last[0] == STORED and last[1] == file and last[2] + last[3] == offset
    )


class Differ:
    """Diffs the chunks of a part's blobs, as their hashes arrive in blob order, against the
    ``base`` (chunks equal to the base's at the same place are inherited) and the content
    ``index`` (hash -> location of content in kept versions: a reference, never a copy). New
    content is placed once (``new_index``): a later chunk of the same content refers to it.

    A blob added whole in one chunk (most small leaves) has no :class:`BlobSegments` but one
    row of ``_one_rows`` and one hash of ``_one_hashes``, at ``_one_at[blob]``: no object per
    leaf (:meth:`diff_ones`)."""

    def __init__(
        self,
        blobs: Sequence[Blob],
        *,
        chunk_bytes: int,
        base: ResolvedPart | None,
        index: dict[bytes, _Loc],
        files: FileTable,
    ) -> None:
        self.blobs = blobs
        self.chunk_bytes = chunk_bytes
        self.base = base
        self.index = index
        self.files = files
        self.new_index: dict[bytes, _Loc] = {}
        self.chunks = 0
        self.new_chunks = 0
        self.padding = 0  # zero bytes placed before blobs, to align them (align_pad)
        nblobs = len(blobs)
        self._builders: dict[int, BlobSegments] = {}
        self._one_at = [-1] * nblobs
        self._one_rows: list[int] = []  # 4 ints per such blob: its one segment row
        self._one_hashes: list[bytes] = []
        self._got = [0] * nblobs  # chunks hashed per blob
        self._base_blob = self._match() if base is not None else [None] * nblobs

    def _match(self) -> list[int | None]:
        """Per blob, the base's blob of the same path and size (None: none)."""
        assert self.base is not None
        index, old = self.base.blob_index, self.base.blobs
        out: list[int | None] = []
        for blob in self.blobs:
            j = index(blob.path)
            out.append(None if j is None or old[j].nbytes != blob.nbytes else j)
        return out

    def base_blob(self, i: int) -> int | None:
        """The base's blob that blob ``i`` is diffed against (None: none)."""
        return self._base_blob[i]

    def builder(self, i: int) -> BlobSegments:
        """Blob ``i``'s segments, made on first use (a blob diffed by :meth:`diff_ones` has
        none)."""
        builder = self._builders.get(i)
        if builder is None:
            builder = self._builders[i] = BlobSegments()
        return builder

    def _base_runs(
        self, blob: int, first: int, digests: bytes
    ) -> tuple[int | None, list[tuple[int, int, bool]]]:
        """Chunks ``first ..`` of ``blob`` with hashes ``digests`` (kept by the blob's
        builder): its base blob and runs ``(a, b, unchanged)`` of them against the base."""
        n = len(digests) // HASH_BYTES
        self.chunks += n
        self._got[blob] += n
        self.builder(blob).hashes.append(digests)
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

    def diff(
        self, blob: int, first: int, digests: bytes, nbytes: int, at: Cursor, address: int = 0
    ) -> list[Write]:
        """Chunks ``first ..`` of ``blob`` (``nbytes`` bytes at ``address`` in memory, 0:
        unknown; hashes ``digests``): their segments, new chunks placed at ``at`` (advanced
        past them); the bytes to append. A run of new chunks starts where :func:`run_pad`
        says, unless it continues the blob's previous one in the file."""
        cb = self.chunk_bytes
        files, new_index, index = self.files, self.new_index, self.index
        j, runs = self._base_runs(blob, first, digests)
        builder = self.builder(blob)
        writes: list[Write] = []
        offset = at.offset
        for a, b, unchanged in runs:
            if unchanged:
                assert j is not None
                builder.inherit(j, first + a, b - a)
                continue
            run_start = -1  # start (in this run of chunks) of the current run of new bytes
            pad = 0
            for k in range(a, b):
                digest = digests[k * HASH_BYTES : (k + 1) * HASH_BYTES]
                lo = k * cb
                size = min(cb, nbytes - lo)
                loc = new_index.get(digest) or index.get(digest)
                if loc is not None:
                    if run_start >= 0:
                        writes.append((pad, run_start, lo))
                        run_start, pad = -1, 0
                    builder.store(files.index(loc[0]), loc[1], size, digest, cb)
                    continue
                if run_start < 0:
                    if first + k == 0:  # the blob's first bytes
                        pad = run_pad(offset, self.blobs[blob].nbytes, address)
                    elif address and not _continues(builder, at.file, offset):
                        pad = run_pad(offset, nbytes - lo, address + lo)
                    offset += pad
                    self.padding += pad
                    run_start = lo
                new_index[digest] = (at.key, offset)
                builder.store(at.file, offset, size, digest, cb)
                offset += size
                self.new_chunks += 1
            if run_start >= 0:
                writes.append((pad, run_start, min(b * cb, nbytes)))
        at.offset = offset
        return writes

    def diff_ones(
        self,
        blobs: Sequence[int],
        digests: Sequence[bytes],
        at: Cursor,
        addresses: Sequence[int] | None = None,
    ) -> list[int]:
        """Whole blobs of one chunk each, not replicated (most small leaves), each one
        segment, as :meth:`diff` makes it, kept in flat lists (``addresses``: where each lies
        in memory, 0: unknown). Per blob, the zero bytes to append before its bytes, or -1
        when none are (inherited or referenced)."""
        offset = at.offset
        new_index, index, files = self.new_index, self.index, self.files
        got, one_at, rows, hashes = self._got, self._one_at, self._one_rows, self._one_hashes
        base, base_blob, sizes = self.base, self._base_blob, self.blobs
        out: list[int] = []
        where = addresses if addresses is not None else [0] * len(blobs)
        for blob, digest, address in zip(blobs, digests, where, strict=True):
            got[blob] += 1
            one_at[blob] = len(hashes)
            hashes.append(digest)
            if base is not None:
                j = base_blob[blob]
                # A matched base blob has the same size: one chunk too.
                if j is not None and base.blobs[j].hashes.tobytes() == digest:
                    rows += (INHERITED, j, 0, 1)
                    out.append(-1)
                    continue
            nbytes = sizes[blob].nbytes
            loc = new_index.get(digest) or index.get(digest)
            if loc is not None:
                rows += (STORED, files.index(loc[0]), loc[1], nbytes)
                out.append(-1)
                continue
            pad = run_pad(offset, nbytes, address)
            offset += pad
            self.padding += pad
            new_index[digest] = (at.key, offset)
            rows += (STORED, at.file, offset, nbytes)
            offset += nbytes
            out.append(pad)
        at.offset = offset
        self.chunks += len(out)
        self.new_chunks += sum(1 for pad in out if pad >= 0)
        return out

    def unchanged(self, blob: int, first: int, count: int) -> bool:
        """Chunks the capture found unchanged since the base: inherited, with the base's
        hashes (the chunks are the same bytes). False: the base does not hold them."""
        j = self._base_blob[blob]
        base = self.base
        if j is None or base is None or first + count > len(base.blobs[j].hashes):
            return False
        builder = self.builder(blob)
        builder.hashes.append(base.blobs[j].hashes[first : first + count].tobytes())
        builder.inherit(j, first, count)
        self.chunks += count
        self._got[blob] += count
        return True

    def external(self, blob: int, first: int, digests: bytes, rank: int) -> bool:
        """Chunks ``first ..`` of a replicated blob that ``rank`` writes: unchanged runs are
        inherited, the others left for ``rank`` to say where they lie. Whether any is."""
        j, runs = self._base_runs(blob, first, digests)
        builder = self.builder(blob)
        left = False
        for a, b, unchanged in runs:
            if unchanged:
                assert j is not None
                builder.inherit(j, first + a, b - a)
            else:
                builder.external(rank, first + a, b - a)
                left = True
        return left

    def relocate(self, blob: int, file: int, moves: Sequence[tuple[int, int, int, bytes]]) -> None:
        """Chunks of ``blob`` copied into file ``file`` (compaction: engine/write/_compact.py):
        ``moves`` of ``(chunk, offset, nbytes, hash)`` become stored segments there; the
        blob's other chunks keep their segments (split around the moved ones)."""
        at = self._one_at[blob]
        if at >= 0:  # one chunk: its one row
            ((k, offset, nbytes, _digest),) = moves
            assert k == 0
            self._one_rows[4 * at : 4 * at + 4] = (STORED, file, offset, nbytes)
            return
        old = self._builders[blob]
        new = BlobSegments()
        new.hashes = old.hashes
        cb = self.chunk_bytes
        moved = {k: (offset, nbytes, digest) for k, offset, nbytes, digest in moves}
        chunk = 0
        for seg in old.segments:
            n = -(-seg[3] // cb) if seg[0] == STORED else seg[3]
            if not any(chunk + j in moved for j in range(n)):
                new.segments.append(seg)
                chunk += n
                continue
            for j in range(n):
                if chunk + j in moved:
                    offset, nbytes, digest = moved[chunk + j]
                    new.store(file, offset, nbytes, digest, cb)
                elif seg[0] == STORED:
                    size = min(cb, seg[3] - j * cb)
                    new.store(seg[1], seg[2] + j * cb, size, seg[4][j], cb)
                else:
                    new.inherit(seg[1], seg[2] + j, 1)
            chunk += n
        self._builders[blob] = new

    def root(self, i: int) -> bytes:
        """The Merkle root of blob ``i`` (every chunk diffed)."""
        at = self._one_at[i]
        if at >= 0:
            return self._one_hashes[at]  # one chunk: its hash is the root
        builder = self._builders.get(i)
        return EMPTY_ROOT if builder is None else merkle_root(b"".join(builder.hashes))

    def incomplete(self) -> int | None:
        """The first blob some of whose chunks were never diffed (None: none)."""
        sizes = np.fromiter((b.nbytes for b in self.blobs), np.int64, len(self.blobs))
        short = np.flatnonzero(np.array(self._got, np.int64) != -(-sizes // self.chunk_bytes))
        return int(short[0]) if len(short) else None

    def segments(self) -> Segments:
        """Every blob's manifest entry. One segment table for the whole part (each blob gets a
        slice of it): a state of 20,000 small tensors costs a few numpy calls here, not
        20,000."""
        cb, blobs = self.chunk_bytes, self.blobs
        nblobs = len(blobs)
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
        # data_files: the files the stored segments point to, renumbered densely.
        stored = table[:, 0] == STORED
        used = np.unique(table[stored, 1]).tolist()
        remap = np.zeros(len(self.files.keys), np.int64)
        remap[used] = np.arange(len(used))
        table[stored, 1] = remap[table[stored, 1]]
        # Per blob, its Merkle root and the hashes of its stored chunks.
        roots = [EMPTY_ROOT] * nblobs
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
            BlobEntry(blob.nbytes, root, table[lo:hi], hashes, cb)
            for blob, root, lo, hi, hashes in zip(
                blobs, roots, edges, edges[1:], kept, strict=False
            )
        ]
        return Segments(entries, [self.files.keys[i] for i in used])
