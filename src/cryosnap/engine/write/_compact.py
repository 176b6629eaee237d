"""Compaction of one incremental part: small live remnants of older data files are copied
forward into the part's own data file (as log-structured stores clean segments), so that the
part does not pin a whole file for a few of its bytes once retention drops that file's version.
Pure planning over the part's segments (:func:`expand`, :func:`plan`, :func:`rewrite`) and the
one read of the remnants (:func:`read_moves`). Runs on the writer thread, in ``PartWriter.finish``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap._format.blobs import STORED
from cryosnap._format.chunks import HASH_BYTES, hash_each_released
from cryosnap.engine._resolved import ResolvedPart
from cryosnap.engine.write._differ import Segments, align_pad
from cryosnap.errors import CheckpointError
from cryosnap.storage import Store

__all__ = [
    "LIVE_FRACTION",
    "ChunkRefs",
    "CompactPlan",
    "Move",
    "Placed",
    "by_blob",
    "expand",
    "files_after",
    "plan",
    "read_moves",
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
    its references, as it would without compaction). Chunks back to back in an old file are
    read in one call, into one buffer for them all."""
    chunks = moves.distinct
    sizes = refs.nbytes[chunks]
    pads = np.array(placed.pads, np.int64)
    ends = np.cumsum(pads + sizes)
    starts = ends - sizes  # of each chunk in the buffer
    buf = memoryview(bytearray(int(ends[-1]) if len(ends) else 0))
    views = [buf[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    keys, offsets = refs.key[chunks], refs.offset[chunks]
    # A new read where the file changes or the next chunk does not follow in it.
    cut = np.ones(len(chunks), bool)
    cut[1:] = (keys[1:] != keys[:-1]) | (offsets[1:] != offsets[:-1] + sizes[:-1])
    bounds = [*np.flatnonzero(cut).tolist(), len(chunks)]
    by_file: dict[int, list[tuple[int, list[memoryview]]]] = {}
    for a, b in itertools.pairwise(bounds):
        by_file.setdefault(int(keys[a]), []).append((int(offsets[a]), views[a:b]))
    try:
        for k, ranges in by_file.items():
            store.read_ranges(refs.keys[k], ranges)
    except CheckpointError as exc:
        log.warning("compaction skipped: reading a remnant failed: %s", exc)
        return None
    got = np.frombuffer(b"".join(hash_each_released(views)), np.uint8).reshape(-1, HASH_BYTES)
    if not np.array_equal(got, refs.hashes[chunks]):
        log.warning("compaction skipped: a remnant in %s does not match its hash", store.url)
        return None
    return [buf]


Move = tuple[int, int, int, bytes]  # (chunk of the blob, new offset, bytes, hash)


def by_blob(refs: ChunkRefs, moves: CompactPlan, placed: Placed) -> dict[int, list[Move]]:
    """Per blob, its moved chunks: which chunk of the blob, where it goes, its size, hash."""
    first = refs.row_starts[refs.row_bounds[:-1]]  # each blob's first chunk
    chunks = moves.chunks
    blobs = refs.blob[chunks]
    raw = refs.hashes[chunks].tobytes()
    out: dict[int, list[Move]] = {}
    for i, (blob, k, at, nb) in enumerate(
        zip(
            blobs.tolist(),
            (chunks - first[blobs]).tolist(),
            placed.new_offset.tolist(),
            refs.nbytes[chunks].tolist(),
            strict=True,
        )
    ):
        out.setdefault(blob, []).append((k, at, nb, raw[i * HASH_BYTES : (i + 1) * HASH_BYTES]))
    return out


def files_after(refs: ChunkRefs, moves: CompactPlan, own_key: str) -> set[str]:
    """The data files the part reads once ``moves`` went into ``own_key``."""
    stay = np.ones(len(refs.key), bool)
    stay[moves.chunks] = False
    return {refs.keys[i] for i in np.unique(refs.key[stay]).tolist()} | {own_key}
