"""Compaction of one incremental part: small live remnants of older data files are copied
forward into the part's own data file (as log-structured stores clean segments), so that the
part does not pin a whole file for a few of its bytes once retention drops that file's version.
Pure planning over the part's segments (:func:`expand`, :func:`plan`, :func:`rewrite`) and the
one read of the remnants (:func:`read_moves`). Runs on the writer thread, in ``PartWriter.finish``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap._format.chunks import HASH_BYTES, hash_each_released
from cryosnap._format.manifest import INHERITED, STORED, BlobEntry
from cryosnap.engine._resolved import ResolvedPart
from cryosnap.engine.write._differ import Segments, align_pad
from cryosnap.errors import CheckpointError
from cryosnap.storage import Store

__all__ = [
    "LIVE_FRACTION",
    "ChunkRefs",
    "CompactPlan",
    "Placed",
    "expand",
    "plan",
    "read_moves",
    "rewrite",
]

log = logging.getLogger("cryosnap")

# A data file of an earlier version that this part reads for fewer than LIVE_FRACTION of its
# bytes is evacuated: those bytes are copied into this part's file. Copying L live bytes
# releases the file's other S - L bytes as soon as retention drops the versions that still
# read it, so at most one byte is written for every seven that are freed; and a dense
# training state (everything changes but a few small leaves) never keeps more than its K
# newest files (docs/design/write-path.md, "Compaction").
LIVE_FRACTION = 1 / 8

_I64 = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(frozen=True, slots=True, eq=False)
class ChunkRefs:
    """Every chunk of a part, blob after blob: the row of the part's segment table that
    covers it, where it lies (``key`` indexes ``keys``) and its size and hash."""

    keys: list[str]
    rows: _I64  # global row (the blobs' tables end to end) of each chunk
    blob: _I64
    key: _I64
    offset: _I64
    nbytes: _I64
    hashes: np.ndarray[Any, np.dtype[np.uint8]]  # (chunks, 16)
    row_bounds: _I64  # first row of each blob, and the end
    row_starts: _I64  # first chunk of each row, and the end

    def files(self) -> set[str]:
        """The data files the part reads: exactly those its chunks lie in."""
        return {self.keys[i] for i in np.unique(self.key).tolist()}


@dataclass(frozen=True, slots=True)
class CompactPlan:
    """The files evacuated, and the chunks moved out of them (``chunks``: indices into
    :class:`ChunkRefs`); ``distinct``: each distinct content once, in file order (sequential
    reads), and ``which``: per moved chunk its index in ``distinct``."""

    evacuated: frozenset[str]
    live_bytes: dict[str, int]
    chunks: _I64
    distinct: _I64
    which: _I64

    def placed(self, refs: ChunkRefs, offset: int) -> Placed:
        """The distinct chunks appended end to end from ``offset`` (aligned as the differ
        aligns new blobs): per distinct chunk its zero pad, per moved chunk its new offset."""
        pads: list[int] = []
        at = offset
        place = np.zeros(len(self.distinct), np.int64)
        for u, nb in enumerate(refs.nbytes[self.distinct].tolist()):
            pad = align_pad(at, nb)
            pads.append(pad)
            place[u] = at + pad
            at += pad + nb
        return Placed(pads, place[self.which], offset, at)


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a :class:`CompactPlan`'s chunks go: ``pads`` before each distinct chunk,
    ``new_offset`` of each moved chunk, the bytes ``start`` to ``end`` of the file."""

    pads: list[int]
    new_offset: _I64
    start: int
    end: int


def expand(segments: Segments, base: ResolvedPart | None, chunk_bytes: int) -> ChunkRefs:
    """Per chunk of ``segments`` (a part's diff against ``base``) where it lies: stored rows in
    the part's data files, inherited rows where the base resolves them."""
    cb = chunk_bytes
    entries = segments.entries
    nrows = np.array([len(e.table) for e in entries], np.int64)
    row_bounds = np.zeros(len(entries) + 1, np.int64)
    np.cumsum(nrows, out=row_bounds[1:])
    table = (
        np.concatenate([e.table for e in entries]).reshape(-1, 4)
        if entries
        else np.empty((0, 4), np.int64)
    )
    kind, a, b, c = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    stored = kind == STORED
    counts = np.where(stored, -(-c // cb), c)
    n = int(counts.sum())
    rows = np.repeat(np.arange(len(table), dtype=np.int64), counts)
    within = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    keys = [*segments.data_files, *(base.files if base is not None else ())]
    key = np.zeros(n, np.int64)
    offset = np.zeros(n, np.int64)
    nbytes = np.zeros(n, np.int64)
    hashes = np.zeros((n, HASH_BYTES), np.uint8)
    s = stored[rows]
    key[s] = a[rows[s]]
    offset[s] = b[rows[s]] + within[s] * cb
    nbytes[s] = np.minimum(cb, c[rows[s]] - within[s] * cb)
    hashes[s] = np.frombuffer(b"".join(e.hashes for e in entries), np.uint8).reshape(-1, HASH_BYTES)
    i = ~s
    if i.any():
        assert base is not None, "inherited chunks without a base"
        chunks = base.chunks()
        first = b[rows[i]] + within[i]
        at = chunks.starts[a[rows[i]]] + first
        key[i] = chunks.files[at].astype(np.int64) + len(segments.data_files)
        offset[i] = chunks.offsets[at]
        nbytes[i] = np.minimum(cb, chunks.nbytes[a[rows[i]]] - first * cb)
        hashes[i] = chunks.hashes[at]
    # One index per distinct key (a base file may also be one of the part's own).
    canon = {k: j for j, k in enumerate(dict.fromkeys(keys))}
    remap = np.array([canon[k] for k in keys] or [0], np.int64)
    blob = np.repeat(np.repeat(np.arange(len(entries), dtype=np.int64), nrows), counts)
    row_starts = np.zeros(len(table) + 1, np.int64)
    np.cumsum(counts, out=row_starts[1:])
    return ChunkRefs(
        list(canon), rows, blob, remap[key], offset, nbytes, hashes, row_bounds, row_starts
    )


def plan(
    refs: ChunkRefs,
    *,
    own: Collection[str],
    fixed_blobs: Collection[int],
    size_of: Callable[[str], int],
) -> CompactPlan | None:
    """Which files to evacuate (read for under :data:`LIVE_FRACTION` of their bytes, written
    by an earlier version, holding no chunk of ``fixed_blobs``: replicated blobs, whose
    locations the other ranks share), and the chunks to move. None: nothing to move."""
    if not len(refs.key):
        return None
    keys = refs.keys
    theirs = np.array([k not in own for k in keys], bool)[refs.key]
    if fixed_blobs:
        fixed = np.isin(refs.key, refs.key[np.isin(refs.blob, list(fixed_blobs))])
        theirs &= ~fixed
    if not theirs.any():
        return None
    # Live bytes per file: each distinct (file, offset) once (a chunk may be read twice).
    pairs = np.unique(
        np.stack([refs.key[theirs], refs.offset[theirs]], 1), axis=0, return_index=True
    )
    sizes = refs.nbytes[theirs][pairs[1]]
    live = np.bincount(pairs[0][:, 0], weights=sizes, minlength=len(keys)).astype(np.int64)
    live_bytes = {keys[k]: int(live[k]) for k in np.unique(pairs[0][:, 0]).tolist()}
    evacuated = {k for k, nb in live_bytes.items() if nb < LIVE_FRACTION * _size(size_of, k)}
    if not evacuated:
        return None
    ids = np.array([keys.index(k) for k in sorted(evacuated)], np.int64)
    moved = np.flatnonzero(theirs & np.isin(refs.key, ids))
    raw = refs.hashes[moved].view(f"V{HASH_BYTES}").reshape(-1)
    _, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
    order = np.lexsort((refs.offset[moved[first]], refs.key[moved[first]]))
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return CompactPlan(
        frozenset(evacuated),
        {k: live_bytes[k] for k in evacuated},
        moved,
        moved[first[order]],
        rank[inverse.reshape(-1)],
    )


def _size(size_of: Callable[[str], int], key: str) -> int:
    try:
        return size_of(key)
    except CheckpointError:
        return 0  # cannot tell: never evacuated


def read_moves(
    store: Store, refs: ChunkRefs, moves: CompactPlan, placed: Placed
) -> list[memoryview] | None:
    """The bytes to append for ``moves`` placed so (zero pads included), every chunk checked
    against its hash; None when one cannot be read or does not match (the part then keeps
    its references, as it would without compaction)."""
    out: list[memoryview] = []
    by_file: dict[int, list[tuple[int, list[memoryview]]]] = {}
    views: list[memoryview] = []
    for chunk, pad in zip(moves.distinct.tolist(), placed.pads, strict=True):
        if pad:
            out.append(memoryview(bytes(pad)))
        buf = memoryview(bytearray(int(refs.nbytes[chunk])))
        out.append(buf)
        views.append(buf)
        by_file.setdefault(int(refs.key[chunk]), []).append((int(refs.offset[chunk]), [buf]))
    try:
        for k, ranges in by_file.items():
            store.read_ranges(refs.keys[k], ranges)
    except CheckpointError as exc:
        log.warning("compaction skipped: reading a remnant failed: %s", exc)
        return None
    got = hash_each_released(views)
    want = [refs.hashes[chunk].tobytes() for chunk in moves.distinct.tolist()]
    if got != want:
        log.warning("compaction skipped: a remnant in %s does not match its hash", store.url)
        return None
    return out


def rewrite(
    segments: Segments,
    refs: ChunkRefs,
    moves: CompactPlan,
    placed: Placed,
    own_key: str,
    chunk_bytes: int,
) -> Segments:
    """``segments`` with the moved chunks stored in ``own_key`` at their new offsets, and
    the data files renumbered densely over those still read."""
    files = list(segments.data_files)
    if own_key not in files:
        files.append(own_key)
    own = files.index(own_key)
    moved_at = dict(zip(moves.chunks.tolist(), placed.new_offset.tolist(), strict=True))
    blobs = np.unique(refs.blob[moves.chunks]).tolist()
    entries = list(segments.entries)
    starts = refs.row_starts.tolist()
    for i in blobs:
        lo = int(refs.row_bounds[i])
        entries[i] = _rewrite_blob(entries[i], starts, lo, moved_at, refs, own, chunk_bytes)
    return _renumber(entries, files)


def _rewrite_blob(
    entry: BlobEntry,
    starts: list[int],
    lo: int,
    moved_at: dict[int, int],
    refs: ChunkRefs,
    own: int,
    cb: int,
) -> BlobEntry:
    """One blob's table again, chunk by chunk where a chunk moved, row by row elsewhere (its
    rows start at row ``lo`` of ``starts``, the first chunk of each row)."""
    rows: list[list[int]] = []
    hashes: list[bytes] = []
    stored_seen = 0  # stored chunks of this entry so far (its hashes, in order)
    for r, row in enumerate(entry.table.tolist()):
        in_row = range(starts[lo + r], starts[lo + r + 1])
        kind = row[0]
        if not any(c in moved_at for c in in_row):
            if kind == STORED:
                nchunks = len(in_row)
                hashes.append(
                    entry.hashes[stored_seen * HASH_BYTES : (stored_seen + nchunks) * HASH_BYTES]
                )
                stored_seen += nchunks
            _append(rows, row, cb)
            continue
        for k, c in enumerate(in_row):
            digest = refs.hashes[c].tobytes()
            if c in moved_at:
                _append(rows, [STORED, own, moved_at[c], int(refs.nbytes[c])], cb)
                hashes.append(digest)
            elif kind == STORED:
                _append(rows, [STORED, row[1], int(refs.offset[c]), int(refs.nbytes[c])], cb)
                hashes.append(digest)
            else:
                _append(rows, [INHERITED, row[1], row[2] + k, 1], cb)
        if kind == STORED:
            stored_seen += len(in_row)
    table = np.array(rows, np.int64).reshape(-1, 4)
    return BlobEntry(entry.nbytes, entry.root, table, b"".join(hashes), entry.chunk_bytes)


def _append(rows: list[list[int]], row: list[int], cb: int) -> None:
    """Append ``row``, merged into the last one where they continue each other."""
    last = rows[-1] if rows else None
    if (
        last is not None
        and last[0] == row[0]
        and last[1] == row[1]
        and last[2] + last[3] == row[2]
        and (row[0] == INHERITED or last[3] % cb == 0)
    ):
        last[3] += row[3]
        return
    rows.append(list(row))


def _renumber(entries: Sequence[BlobEntry], files: list[str]) -> Segments:
    """The stored rows' files renumbered densely, in the order of ``files``."""
    used: set[int] = set()
    for e in entries:
        t = e.table
        used.update(np.unique(t[t[:, 0] == STORED, 1]).tolist())
    keep = sorted(used)
    remap = np.zeros(len(files), np.int64)
    remap[keep] = np.arange(len(keep))
    out = []
    for e in entries:
        t = e.table.copy()
        s = t[:, 0] == STORED
        t[s, 1] = remap[t[s, 1]]
        out.append(BlobEntry(e.nbytes, e.root, t, e.hashes, e.chunk_bytes))
    return Segments(out, [files[i] for i in keep])
