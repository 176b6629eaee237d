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

__all__ = ["Location", "Owners", "ShareMap", "assign_shares", "owner_runs"]

Owners = np.ndarray[Any, np.dtype[np.int32]]
_Ints = np.ndarray[Any, np.dtype[np.int64]]

# A run of chunks back to back in one file: (blob, first chunk, chunks, data file, offset).
Location = tuple[int, int, int, str, int]


def assign_shares(sizes: Sequence[int], world_size: int, chunk_bytes: int) -> list[Owners]:
    """For each blob of ``sizes`` bytes (in order), the rank that writes each of its chunks.
    The blobs are laid end to end and cut into ``world_size`` ranges of equal bytes; a chunk
    belongs to the range its first byte falls in."""
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
