"""The share map of a part's replicated blobs: which rank writes which of their chunks
(:func:`assign_shares`, the same split on every rank from the blob sizes alone), where this
rank's share lies, and the other ranks' shares placed as stored segments once they said.
Pure, no I/O; runs on the writer thread (the ranks' exchange itself is _replicated.py's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cryosnap._format.blobs import INHERITED, STORED
from cryosnap._format.chunks import HASH_BYTES, chunk_count, value_runs
from cryosnap._state import Blob
from cryosnap.engine.items import Hashed
from cryosnap.engine.write._differ import EXTERNAL, Differ, FileTable
from cryosnap.errors import CheckpointError

__all__ = [
    "STRIPES_PER_RANK",
    "Location",
    "Owners",
    "ShareMap",
    "assign_shares",
    "owner_runs",
    "stripe_bytes",
    "stripes_per_rank",
]

Owners = np.ndarray[Any, np.dtype[np.int32]]
_Ints = np.ndarray[Any, np.dtype[np.int64]]

# A run of chunks back to back in one file: (blob, first chunk, chunks, data file, offset).
Location = tuple[int, int, int, str, int]


# At most this many stripes per rank per save: each rank's share is that many runs (and one
# more per blob a stripe straddles), which is what the ranks exchange and every manifest records
# for each other rank. docs/design/write-path.md has the why.
STRIPES_PER_RANK = 8


def stripes_per_rank(total_bytes: int, world_size: int, chunk_bytes: int) -> int:
    """How many stripes each rank gets of ``total_bytes`` of replicated blobs: as many as
    :data:`STRIPES_PER_RANK` allows while a stripe stays at least that many chunks long (so a
    rank's share, its first rounds cut by position, cannot outgrow its 1/N before the last)."""
    per_rank_chunks = total_bytes // (max(world_size, 1) * chunk_bytes)
    k = 1
    while k < STRIPES_PER_RANK and (k + 1) * (k + 1) <= per_rank_chunks:
        k += 1
    return k


def stripe_bytes(total_bytes: int, world_size: int, chunk_bytes: int) -> int:
    """The length of one stripe of the first rounds: a whole number of chunks, at least one
    (the last round's stripes take what is left, about as long: :func:`assign_shares`)."""
    k = stripes_per_rank(total_bytes, world_size, chunk_bytes)
    return chunk_bytes * max(1, total_bytes // (world_size * k * chunk_bytes))


def assign_shares(sizes: Sequence[int], world_size: int, chunk_bytes: int) -> list[Owners]:
    """For each blob of ``sizes`` bytes (in order), the rank that writes each of its chunks.

    The blobs are laid end to end and cut at chunk boundaries into ``world_size * k`` stripes
    (``k``: :func:`stripes_per_rank`), stripe ``j`` to rank ``j % world_size``: a contiguous
    change longer than ``world_size`` stripes is spread over every rank. The first ``k - 1``
    rounds are stripes of :func:`stripe_bytes` each; the last round cuts what is left so that
    every rank's bytes in all come within one chunk of ``1/world_size`` of the total."""
    total = sum(sizes)
    starts = _chunk_starts(sizes, chunk_bytes)
    if world_size <= 1 or total == 0:
        return [np.zeros(len(s), np.int32) for s in starts]
    # Where a stripe may end: every chunk's first byte, and the end.
    bounds = np.concatenate([*starts, np.array([total], np.int64)])
    cuts = _stripe_ends(bounds, total, world_size, chunk_bytes)
    return [(np.searchsorted(cuts, s, side="right") % world_size).astype(np.int32) for s in starts]


def _chunk_starts(sizes: Sequence[int], chunk_bytes: int) -> list[_Ints]:
    """Per blob, the first byte of each of its chunks in the blobs laid end to end."""
    out: list[_Ints] = []
    at = 0
    for nbytes in sizes:
        out.append(at + np.arange(chunk_count(nbytes, chunk_bytes), dtype=np.int64) * chunk_bytes)
        at += nbytes
    return out


def _stripe_ends(bounds: _Ints, total: int, world_size: int, chunk_bytes: int) -> _Ints:
    """The end of every stripe but the last (non-decreasing; equal ends: an empty stripe).

    Rounds ``0 .. k-2`` end at the first boundary at or after each multiple of the stripe
    length: inside one blob a stripe is then exactly that many chunks. They leave each rank
    off its ``(k-1)/k`` of the total by less than ``k - 1`` chunks, which the stripe length (at
    least ``k`` chunks) keeps smaller than a stripe. The last round aims each rank's total at
    exactly ``total / world_size`` and ends at the boundary nearest to that: boundaries are at
    most a chunk apart, so each rank ends within half a chunk of its aim on either side, and
    its total within one chunk of its 1/N."""
    n = world_size
    k = stripes_per_rank(total, n, chunk_bytes)
    stripe = stripe_bytes(total, n, chunk_bytes)
    marks = stripe * np.arange(1, n * (k - 1) + 1, dtype=np.int64)
    first = bounds[np.minimum(np.searchsorted(bounds, marks, side="left"), len(bounds) - 1)]
    lengths = np.diff(np.concatenate([np.zeros(1, np.int64), first]))
    owned = lengths.reshape(k - 1, n).sum(axis=0) if k > 1 else np.zeros(n, np.int64)
    at = int(first[-1]) if k > 1 else 0
    # The last round's aims, times n (integers): at + sum over ranks <= r of (total/n - owned).
    aims = n * at + total * np.arange(1, n, dtype=np.int64) - n * np.cumsum(owned)[:-1]
    last = _nearest(bounds * n, aims) if n > 1 else np.zeros(0, np.int64)
    return np.concatenate([first, bounds[last]])


def _nearest(points: _Ints, aims: _Ints) -> _Ints:
    """For each aim, the index of the nearest of the sorted ``points`` (ties: the lower)."""
    hi = np.minimum(np.searchsorted(points, aims, side="left"), len(points) - 1)
    lo = np.maximum(hi - 1, 0)
    return np.where(aims - points[lo] <= points[hi] - aims, lo, hi)


def owner_runs(owners: Owners, first: int, count: int) -> list[tuple[int, int, int]]:
    """Chunks ``first .. first+count-1`` as runs ``(first, count, owner)`` of one owner each
    (stripes: a rank's chunks recur along a blob, so runs are found, never assumed)."""
    if count == 0:
        return []
    part = owners[first : first + count]
    return [(first + a, b - a, int(part[a])) for a, b in value_runs(part)]


class ShareMap:
    """The replicated blobs of one part (``shares``: blob index -> the rank that writes each
    of its chunks) over the part's :class:`Differ` and :class:`FileTable`: chunks of another
    rank's share are diffed but left ``EXTERNAL`` until :meth:`place_external`."""

    def __init__(
        self,
        shares: dict[int, Owners],
        *,
        rank: int,
        step: int,
        blobs: Sequence[Blob],
        differ: Differ,
        files: FileTable,
    ) -> None:
        self.shares = shares
        self.rank = rank
        self.step = step
        self.blobs = blobs
        self.differ = differ
        self.files = files
        self.pending: set[int] = set()  # blobs with runs another rank writes, not yet placed
        self._base_files: _Ints | None = None

    def __bool__(self) -> bool:
        return bool(self.shares)

    def owners(self, blob: int) -> Owners | None:
        return self.shares.get(blob)

    def foreign(self, blob: int, first: int, digests: bytes, rank: int) -> None:
        """Chunks ``first ..`` of ``blob``, of ``rank``'s share: diffed, never written."""
        if self.differ.external(blob, first, digests, rank):
            self.pending.add(blob)

    def hashed(self, h: Hashed) -> None:
        """Chunks the capture hashed in place because other ranks write them."""
        cb = self.differ.chunk_bytes
        owners = self.shares.get(h.blob)
        first = h.offset // cb
        count = len(h.digests) // HASH_BYTES
        runs = [] if owners is None else owner_runs(owners, first, count)
        if h.offset % cb or not runs or any(rank == self.rank for _a, _n, rank in runs):
            raise CheckpointError(
                f"step {self.step}: leaf {self.blobs[h.blob].path}: chunks {first}.."
                f"{first + count - 1} were hashed as another rank's share, but rank "
                f"{self.rank} writes some of them (the capture and the writer disagree on the "
                "split of the replicated state)"
            )
        for a, n, rank in runs:
            lo = (a - first) * HASH_BYTES
            self.foreign(h.blob, a, h.digests[lo : lo + n * HASH_BYTES], rank)

    def check_placed(self) -> None:
        if self.pending:
            path = self.blobs[min(self.pending)].path
            raise CheckpointError(
                f"step {self.step}: leaf {path}: the chunks other ranks write were never placed"
            )

    def owned_locations(self) -> list[Location]:
        """Where this rank's share of the replicated blobs lies, every piece added: runs of
        chunks back to back in one file (new, referenced or inherited: every chunk of the
        share)."""
        cb = self.differ.chunk_bytes
        out: list[Location] = []
        for i, owners in self.shares.items():
            idx = np.flatnonzero(owners == self.rank)
            if not len(idx):
                continue
            files, offsets = self._chunk_locations(i)
            f, o = files[idx], offsets[idx]
            cut = (np.diff(idx) != 1) | (np.diff(f) != 0) | (np.diff(o) != cb)
            starts = [0, *(np.flatnonzero(cut) + 1).tolist()]
            for s, e in zip(starts, [*starts[1:], len(idx)], strict=True):
                out.append((i, int(idx[s]), e - s, self.files.keys[int(f[s])], int(o[s])))
        return out

    def _chunk_locations(self, i: int) -> tuple[_Ints, _Ints]:
        """Per chunk of blob ``i``: its file (index into the file table; -1: another rank's)
        and offset."""
        cb = self.differ.chunk_bytes
        base = self.differ.base
        n = chunk_count(self.blobs[i].nbytes, cb)
        files = np.full(n, -1, np.int64)
        offsets = np.zeros(n, np.int64)
        pos = 0
        for seg in self.differ.builder(i).segments:
            if seg[0] == STORED:
                k = chunk_count(seg[3], cb)
                files[pos : pos + k] = seg[1]
                offsets[pos : pos + k] = seg[2] + np.arange(k, dtype=np.int64) * cb
            elif seg[0] == INHERITED:
                assert base is not None
                k = seg[3]
                src = base.blobs[seg[1]]
                files[pos : pos + k] = self._base_file_map()[src.files[seg[2] : seg[2] + k]]
                offsets[pos : pos + k] = src.offsets[seg[2] : seg[2] + k]
            else:
                k = seg[3]
            pos += k
        return files, offsets

    def _base_file_map(self) -> _Ints:
        """The base's file indices as indices into the file table (unused ones never reach
        the manifest: it lists only the files its stored segments use)."""
        if self._base_files is None:
            base = self.differ.base
            assert base is not None
            self._base_files = np.array([self.files.index(f) for f in base.files], np.int64)
        return self._base_files

    def place_external(self, runs: Sequence[Location]) -> None:
        """The other ranks' shares (their :meth:`owned_locations`) become stored segments of
        this part, with the hashes this rank computed itself (every chunk is still verified
        on read)."""
        by_blob: dict[int, list[Location]] = {}
        for run in runs:
            by_blob.setdefault(run[0], []).append(run)
        for i in sorted(self.pending):
            files, offsets = self._reported(i, by_blob.get(i, ()))
            builder = self.differ.builder(i)
            hashes = b"".join(builder.hashes)
            segments: list[list[Any]] = []
            for seg in builder.segments:
                if seg[0] != EXTERNAL:
                    segments.append(seg)
                    continue
                segments += self._stored(i, seg, files, offsets, hashes)
            builder.segments = segments
        self.pending.clear()

    def _reported(self, i: int, runs: Sequence[Location]) -> tuple[_Ints, _Ints]:
        """Per chunk of blob ``i``, the file and offset the other ranks' ``runs`` name."""
        cb = self.differ.chunk_bytes
        blob = self.blobs[i]
        n = chunk_count(blob.nbytes, cb)
        files = np.full(n, -1, np.int64)
        offsets = np.zeros(n, np.int64)
        for _i, first, count, key, offset in runs:
            if first < 0 or count <= 0 or first + count > n or offset < 0:
                raise CheckpointError(
                    f"step {self.step}: leaf {blob.path}: another rank reported chunks "
                    f"{first}..{first + count - 1} of a blob of {n} chunks"
                )
            files[first : first + count] = self.files.index(key)
            offsets[first : first + count] = offset + np.arange(count, dtype=np.int64) * cb
        return files, offsets

    def _stored(
        self, i: int, seg: list[Any], files: _Ints, offsets: _Ints, hashes: bytes
    ) -> list[list[Any]]:
        """The external segment ``seg`` of blob ``i`` as stored segments where it lies."""
        cb = self.differ.chunk_bytes
        blob = self.blobs[i]
        _kind, rank, first, count = seg
        f, o = files[first : first + count], offsets[first : first + count]
        if (f < 0).any():
            raise CheckpointError(
                f"step {self.step}: leaf {blob.path}: rank {rank} did not say where "
                f"chunks {first}..{first + count - 1} of its share lie"
            )
        cut = (np.diff(f) != 0) | (np.diff(o) != cb)
        starts = [0, *(np.flatnonzero(cut) + 1).tolist()]
        out: list[list[Any]] = []
        for s, e in zip(starts, [*starts[1:], count], strict=True):
            c0, k = first + s, e - s
            nbytes = min(k * cb, blob.nbytes - c0 * cb)
            chunk_hashes = hashes[c0 * HASH_BYTES : (c0 + k) * HASH_BYTES]
            out.append([STORED, int(f[s]), int(o[s]), nbytes, [chunk_hashes]])
        return out
