"""A manifest's blob entries: each blob's segments as rows of a table (stored chunks in a data
file, or chunks inherited from the base version), their JSON form (plain rows, or packed when
there are many) and their parsing, every row checked before it sizes or indexes anything.

Pure: (de)serialization and validation only, no I/O. Runs on whichever thread calls it.
"""

from __future__ import annotations

import base64
import itertools
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap._format.chunks import HASH_BYTES, chunk_count
from cryosnap._format.document import fail, show
from cryosnap._format.limits import MAX_BLOB_BYTES, MAX_BLOB_CHUNKS, MAX_FILE_BYTES
from cryosnap.errors import CheckpointFormatError

__all__ = [
    "INHERITED",
    "PACK_ROWS",
    "STORED",
    "BlobEntry",
    "BlobTables",
    "Inherited",
    "Segment",
    "Stored",
    "parse_blobs",
]

# A blob's segment table of more rows than this is written packed (zlib-compressed
# little-endian int64 rows, base64): JSON rows cost far more to parse than to read.
PACK_ROWS = 64


@dataclass(frozen=True, slots=True)
class Stored:
    """Consecutive chunks of a blob stored back to back at ``offset`` of data file ``file``.

    ``hashes`` holds their 16-byte digests. The file is an index into the manifest's
    ``data_files``, which may name files of earlier versions (de-duplicated content).
    """

    file: int
    offset: int
    nbytes: int
    hashes: bytes


@dataclass(frozen=True, slots=True)
class Inherited:
    """``count`` chunks, from chunk ``first`` on, identical to the same chunks of blob ``blob``
    of the base version: same place, same hashes. One entry per unchanged run, so an incremental
    version's metadata grows with the changed regions, not with the state."""

    blob: int
    first: int
    count: int


Segment = Stored | Inherited


STORED, INHERITED = 0, 1


@dataclass(frozen=True, slots=True, eq=False)
class BlobEntry:
    """One stored buffer: its size, Merkle root and its chunks as segments, in order.

    ``table`` holds one row per segment, ``[0, file, offset, nbytes]`` (stored) or
    ``[1, blob, first, count]`` (inherited), as an int64 array: a manifest of an incremental
    version over a fragmented state has tens of thousands of them. ``hashes`` holds the hashes
    of the stored segments' chunks, in order.
    """

    nbytes: int
    root: bytes
    table: np.ndarray[Any, np.dtype[np.int64]]
    hashes: bytes
    chunk_bytes: int

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlobEntry):
            return NotImplemented
        return (
            (self.nbytes, self.root, self.hashes, self.chunk_bytes)
            == (other.nbytes, other.root, other.hashes, other.chunk_bytes)
            and self.table.shape == other.table.shape
            and bool((self.table == other.table).all())
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments as objects (for inspection; the engine works on ``table``)."""
        out: list[Segment] = []
        at = 0
        for kind, a, b, c in self.table.tolist():
            if kind == STORED:
                k = chunk_count(c, self.chunk_bytes) * HASH_BYTES
                out.append(Stored(a, b, c, self.hashes[at : at + k]))
                at += k
            else:
                out.append(Inherited(a, b, c))
        return tuple(out)

    def to_json(self, hashes: list[bytes]) -> list[Any]:
        """The JSON form; the stored segments' hashes are appended to ``hashes`` in order (the
        manifest keeps them all in one table instead of one string per segment)."""
        hashes.append(self.hashes)
        if len(self.table) <= PACK_ROWS:
            return [self.nbytes, self.root.hex(), self.table.tolist()]
        raw = np.ascontiguousarray(self.table, dtype="<i8").tobytes()
        packed = base64.b64encode(zlib.compress(raw, 1)).decode()
        return [self.nbytes, self.root.hex(), {"rows": len(self.table), "zlib_i64": packed}]


@dataclass(frozen=True, slots=True, eq=False)
class BlobTables:
    """Every blob of a manifest at once: ``table``, the segment tables back to back (one row
    per segment, as in :class:`BlobEntry`); ``rows``, the rows of each blob; ``nbytes``, each
    blob's size; ``hashes``, every stored chunk's hash in blob order (the manifest's hash
    table). ``blobs`` is the tuple they describe."""

    blobs: tuple[BlobEntry, ...]
    table: np.ndarray[Any, np.dtype[np.int64]]
    rows: np.ndarray[Any, np.dtype[np.int64]]
    nbytes: np.ndarray[Any, np.dtype[np.int64]]
    hashes: bytes

    @classmethod
    def of(cls, blobs: tuple[BlobEntry, ...]) -> BlobTables:
        n = len(blobs)
        table = np.concatenate([e.table for e in blobs]) if n else np.empty((0, 4), np.int64)
        return cls(
            blobs,
            table.astype(np.int64, copy=False).reshape(-1, 4),
            np.fromiter((len(e.table) for e in blobs), np.int64, n),
            np.fromiter((e.nbytes for e in blobs), np.int64, n),
            b"".join(e.hashes for e in blobs),
        )


def parse_blobs(
    raw: list[Any],
    nfiles: int,
    chunk_bytes: int,
    has_base: bool,
    table: bytes,
    where: str,
) -> tuple[tuple[BlobEntry, ...], BlobTables | None]:
    """The blob entries of a manifest, every check of :func:`_parse_blob` made. Blobs of one
    segment (nearly every leaf of a state of many small tensors) are checked all at once
    (:func:`_parse_simple_blobs`); when anything there is off, every blob goes through
    :func:`_parse_blob` in order, which names the first bad one as it always did."""
    fast = _parse_simple_blobs(raw, nfiles, chunk_bytes, has_base, table, where)
    if fast is not None:
        return fast
    cursor = [0]
    blobs = tuple(
        _parse_blob(b, i, nfiles, chunk_bytes, has_base, table, cursor, where)
        for i, b in enumerate(raw)
    )
    if cursor[0] != len(table):
        raise fail(where, "hash table does not match the stored segments")
    return blobs, None


def _simple_head(
    raw: list[Any], chunk_bytes: int
) -> (
    tuple[tuple[Any, ...], tuple[Any, ...], np.ndarray[Any, Any], np.ndarray[Any, Any], bytes]
    | None
):
    """The sizes, segments, sizes and chunk counts as arrays, and the roots' bytes of blob
    entries that are plainly what the writer writes; None for anything else."""
    n = len(raw)
    if not n or set(map(type, raw)) != {list} or set(map(len, raw)) != {3}:
        return None
    sizes, roots, segs = zip(*raw, strict=True)
    if (
        set(map(type, sizes)) != {int}
        or set(map(type, roots)) != {str}
        or set(map(len, roots)) != {32}
    ):
        return None
    try:
        nbytes = np.array(sizes, np.int64)
        # 32 hex digits each, so no whitespace anywhere iff the total is 16 bytes each.
        root_bytes = bytes.fromhex("".join(roots))
    except (ValueError, OverflowError):
        return None
    if len(root_bytes) != n * HASH_BYTES or (nbytes < 0).any() or (nbytes > MAX_BLOB_BYTES).any():
        return None
    nchunks = -(-nbytes // chunk_bytes)
    if (nchunks > MAX_BLOB_CHUNKS).any():
        return None
    return sizes, segs, nbytes, nchunks, root_bytes


def _simple_rows_ok(
    rows: np.ndarray[Any, Any],
    size: np.ndarray[Any, Any],
    count: np.ndarray[Any, Any],
    nfiles: int,
    has_base: bool,
) -> bool:
    """The checks of :func:`_one_row`, for every one-row blob at once: a stored segment is the
    whole blob, an inherited one all its chunks (so count == nchunks in both)."""
    kind, a, b, c = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    stored = kind == STORED
    good_stored = (a >= 0) & (a < nfiles) & (b >= 0) & (b <= MAX_FILE_BYTES) & (c > 0) & (c == size)
    good_inherited = (
        (kind == INHERITED)
        & has_base
        & (a >= 0)
        & (a <= MAX_BLOB_CHUNKS)
        & (b >= 0)
        & (b <= MAX_BLOB_CHUNKS)
        & (c > 0)
        & (c == count)
    )
    return bool(np.where(stored, good_stored, good_inherited).all())


def _parse_simple_blobs(
    raw: list[Any],
    nfiles: int,
    chunk_bytes: int,
    has_base: bool,
    table: bytes,
    where: str,
) -> tuple[tuple[BlobEntry, ...], BlobTables] | None:
    """The blob entries of ``raw`` with the blobs of exactly one segment row checked
    vectorized (the others one by one through :func:`_parse_blob`, in order); None when any
    check fails or any field is not plainly what the writer writes (an int, a 32-digit hex
    root, a list), so that the blob-by-blob path decides and names the blob."""
    n = len(raw)
    head = _simple_head(raw, chunk_bytes)
    if head is None:
        return None
    sizes, segs, nbytes, nchunks, root_bytes = head
    # One row: a list of one item (the item is checked below); anything else goes blob by
    # blob (packed tables, empty blobs, malformed entries).
    simple = np.fromiter((type(s) is list and len(s) == 1 for s in segs), bool, n)
    one = [s[0] for s, y in zip(segs, simple.tolist(), strict=True) if y]
    if one and (set(map(type, one)) != {list} or set(map(len, one)) != {4}):
        return None
    flat = list(itertools.chain.from_iterable(one))
    if flat and set(map(type, flat)) != {int}:
        return None
    try:
        rows = np.array(flat, np.int64).reshape(-1, 4)
    except (ValueError, OverflowError):
        return None
    count = nchunks[simple]
    stored = rows[:, 0] == STORED
    if not _simple_rows_ok(rows, nbytes[simple], count, nfiles, has_base):
        return None
    # Hash table bytes each blob takes; the other blobs' are known once parsed, in order.
    took = np.zeros(n, np.int64)
    took[simple] = np.where(stored, count, 0) * HASH_BYTES
    other = np.flatnonzero(~simple).tolist()
    entries: dict[int, BlobEntry] = {}
    if other:
        before = np.cumsum(took) - took  # bytes the simple blobs before each one take
        extra = 0  # bytes the other blobs parsed so far took
        try:
            for i in other:
                cursor = [int(before[i]) + extra]
                at = cursor[0]
                entries[i] = _parse_blob(
                    raw[i], i, nfiles, chunk_bytes, has_base, table, cursor, where
                )
                took[i] = cursor[0] - at
                extra += cursor[0] - at
        except CheckpointFormatError:
            return None
    ends = np.cumsum(took)
    if n and int(ends[-1]) != len(table):
        return None  # short or long: the blob-by-blob path says where
    starts = (ends - took).tolist()
    ends_l = ends.tolist()
    tables = list(rows.reshape(-1, 1, 4))
    roots_l = [root_bytes[i : i + HASH_BYTES] for i in range(0, n * HASH_BYTES, HASH_BYTES)]
    if not entries:
        blobs = tuple(
            BlobEntry(s, r, t, table[lo:hi], chunk_bytes)
            for s, r, t, lo, hi in zip(sizes, roots_l, tables, starts, ends_l, strict=True)
        )
    else:
        it = iter(tables)
        blobs = tuple(
            entries[i]
            if i in entries
            else BlobEntry(
                sizes[i], roots_l[i], next(it), table[starts[i] : ends_l[i]], chunk_bytes
            )
            for i in range(n)
        )
    if entries:
        return blobs, BlobTables.of(blobs)
    return blobs, BlobTables(blobs, rows, np.ones(n, np.int64), nbytes, table)


def _parse_blob(
    raw: Any,
    index: int,
    nfiles: int,
    chunk_bytes: int,
    has_base: bool,
    table: bytes,
    cursor: list[int],
    where: str,
) -> BlobEntry:
    here = f"{where}, blob {index}"
    if not isinstance(raw, list) or len(raw) != 3:
        raise fail(here, f"malformed blob entry {raw!r:.120}")
    nbytes, root_hex, raw_segments = raw
    if type(nbytes) is not int or not 0 <= nbytes <= MAX_BLOB_BYTES:
        raise fail(here, f"blob size must be an int in [0, {MAX_BLOB_BYTES}], got {show(nbytes)}")
    nchunks = chunk_count(nbytes, chunk_bytes)
    if nchunks > MAX_BLOB_CHUNKS:
        raise fail(here, f"blob of {nbytes} bytes has more than {MAX_BLOB_CHUNKS} chunks")
    # Each segment covers a chunk or more, and each stored one brings a chunk hash or more in
    # the hash table; in what the writer makes, two inherited segments are never adjacent. So
    # a blob has at most this many segments: the bound on what a packed table may inflate to.
    hashes_left = (len(table) - cursor[0]) // HASH_BYTES
    max_rows = min(nchunks, 2 * hashes_left + 1 if has_base else hashes_left)
    try:
        if isinstance(raw_segments, dict):
            raw_segments = _unpack_rows(raw_segments, max_rows, here)
        if not isinstance(raw_segments, (list, np.ndarray)):
            raise ValueError("segments")
        if len(raw_segments) > max_rows:
            raise fail(here, f"{len(raw_segments)} segments, more than the blob can have")
        root = bytes.fromhex(root_hex)
        # numpy infers the type: all-int rows give an integer array; a float or a string
        # anywhere gives another kind, refused below (checked at C speed, not per field).
        # Rows of 4 fields flattened first: a 1-D list converts about twice as fast.
        # A row that is not a list fails here (len) or below (flattened, it is not 1-D ints).
        if isinstance(raw_segments, np.ndarray):
            rows_ok, flat = True, raw_segments.reshape(-1) if len(raw_segments) else None
        else:
            rows_ok = not raw_segments or set(map(len, raw_segments)) == {4}
            flat = (
                np.array(list(itertools.chain.from_iterable(raw_segments)))
                if raw_segments and rows_ok
                else None
            )
    except (TypeError, ValueError, OverflowError) as exc:
        raise fail(here, f"malformed blob entry {raw!r:.120}") from exc
    if not rows_ok:
        raise fail(here, "segment fields must be rows of 4 ints")
    if len(root) != HASH_BYTES:
        raise fail(here, "malformed Merkle root")
    if flat is None:
        if nbytes:
            raise fail(here, f"no segments for a blob of {nbytes} bytes")
        return BlobEntry(nbytes, root, np.empty((0, 4), np.int64), b"", chunk_bytes)
    if flat.dtype.kind not in "iu" or flat.ndim != 1:
        raise fail(here, "segment fields must be rows of 4 ints")
    if len(flat) == 4:
        # One segment (most small leaves): the same checks in plain Python, ~10x cheaper than
        # a dozen numpy reductions over one row.
        counted = _one_row(flat.tolist(), nfiles, nbytes, nchunks, chunk_bytes, has_base, here)
        t = flat.astype(np.int64, copy=False).reshape(1, 4)
        return _take_hashes(nbytes, root, t, counted, table, cursor, chunk_bytes, here)
    t = flat.astype(np.int64, copy=False).reshape(-1, 4)
    counted = _check_rows(t, nfiles, nbytes, nchunks, chunk_bytes, has_base, here)
    return _take_hashes(nbytes, root, t, counted, table, cursor, chunk_bytes, here)


def _check_rows(
    t: np.ndarray[Any, Any],
    nfiles: int,
    nbytes: int,
    nchunks: int,
    chunk_bytes: int,
    has_base: bool,
    here: str,
) -> int:
    """Validate a blob's segment rows (several); the chunks its stored segments hold."""
    kind, a, b, c = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    stored = kind == STORED
    inherited = kind == INHERITED
    if not (stored | inherited).all():
        raise fail(here, "unknown segment kind")
    # Bounded fields keep every sum and product below in int64 (_format/limits.py).
    if stored.any() and (
        (a[stored] < 0).any()
        or (a[stored] >= nfiles).any()
        or (b[stored] < 0).any()
        or (b[stored] > MAX_FILE_BYTES).any()
        or (c[stored] <= 0).any()
        or (c[stored] > nbytes).any()
    ):
        raise fail(here, "invalid stored segment (file, offset or size out of range)")
    if inherited.any() and (
        not has_base
        or (a[inherited] < 0).any()
        or (a[inherited] > MAX_BLOB_CHUNKS).any()
        or (b[inherited] < 0).any()
        or (b[inherited] > MAX_BLOB_CHUNKS).any()
        or (c[inherited] <= 0).any()
        or (c[inherited] > nchunks).any()
    ):
        raise fail(here, "invalid inherited segment (blob, first chunk or count out of range)")
    # Chunks per segment; a stored run that is not the blob's last segment is whole chunks,
    # and the last one ends exactly at the blob's end.
    counts = np.where(stored, -(-c // chunk_bytes), c)
    if stored[:-1].any() and (c[:-1][stored[:-1]] % chunk_bytes).any():
        raise fail(here, "a stored segment does not end on a chunk boundary")
    total = int(counts.sum())
    if total != chunk_count(nbytes, chunk_bytes):
        raise fail(
            here, f"segments cover {total} chunks, the blob has {chunk_count(nbytes, chunk_bytes)}"
        )
    if stored[-1] and (total - int(counts[-1])) * chunk_bytes + int(c[-1]) != nbytes:
        raise fail(here, "the last stored segment does not end at the blob's end")
    return int(counts[stored].sum())


def _take_hashes(
    nbytes: int,
    root: bytes,
    t: np.ndarray[Any, Any],
    stored_chunks: int,
    table: bytes,
    cursor: list[int],
    chunk_bytes: int,
    here: str,
) -> BlobEntry:
    k = stored_chunks * HASH_BYTES
    hashes = table[cursor[0] : cursor[0] + k]
    if len(hashes) != k:
        raise fail(here, "the hash table is too short")
    cursor[0] += k
    return BlobEntry(nbytes, root, t, hashes, chunk_bytes)


def _one_row(
    row: list[int],
    nfiles: int,
    nbytes: int,
    nchunks: int,
    chunk_bytes: int,
    has_base: bool,
    here: str,
) -> int:
    """The checks of :func:`_parse_blob` for a table of one segment; returns the stored
    chunks it brings (0 for an inherited one)."""
    kind, a, b, c = row
    if kind == STORED:
        if not (0 <= a < nfiles and 0 <= b <= MAX_FILE_BYTES and 0 < c <= nbytes):
            raise fail(here, "invalid stored segment (file, offset or size out of range)")
        count = -(-c // chunk_bytes)
    elif kind == INHERITED:
        if not (has_base and 0 <= a <= MAX_BLOB_CHUNKS and 0 <= b <= MAX_BLOB_CHUNKS):
            raise fail(here, "invalid inherited segment (blob, first chunk or count out of range)")
        if not 0 < c <= nchunks:
            raise fail(here, "invalid inherited segment (blob, first chunk or count out of range)")
        count = c
    else:
        raise fail(here, "unknown segment kind")
    if count != nchunks:
        raise fail(here, f"segments cover {count} chunks, the blob has {nchunks}")
    if kind == STORED and c != nbytes:
        raise fail(here, "the last stored segment does not end at the blob's end")
    return count if kind == STORED else 0


def _unpack_rows(doc: dict[str, Any], max_rows: int, where: str) -> np.ndarray[Any, Any]:
    """A packed segment table: ``{"rows": n, "zlib_i64": base64(zlib(int64 LE rows of 4))}``.

    ``n`` is checked against ``max_rows`` before anything is inflated, and inflation stops at
    the size ``n`` rows take: a zlib bomb costs no more memory than an honest table."""
    rows, packed = doc.get("rows"), doc.get("zlib_i64")
    if type(rows) is not int or rows < 0 or not isinstance(packed, str) or len(doc) != 2:
        raise fail(where, f"malformed packed segment table {doc!r:.120}")
    if rows > max_rows:
        raise fail(
            where, f"packed table claims {show(rows)} segments, the blob can have {max_rows}"
        )
    want = rows * 4 * 8
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(base64.b64decode(packed, validate=True), want + 1)
    except (zlib.error, ValueError) as exc:  # binascii.Error is a ValueError
        raise fail(where, "packed segment table is not base64 zlib data") from exc
    if len(raw) != want or not inflate.eof:
        raise fail(where, f"packed segment table does not inflate to its {rows} rows")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64).reshape(rows, 4)
