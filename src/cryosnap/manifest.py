"""The on-disk schema: keys of a run, per-rank manifests and commit records (format 1).

Everything here is JSON, readable without pickle and validated on load: a malformed or unsafe
document raises :class:`~cryosnap.errors.CheckpointFormatError` naming the key, never a
``KeyError`` from deep inside. docs/FORMAT.md is the prose version of this module.

Layout of one tier (a run directory or URL prefix)::

    data/<step:012d>-r<rank:05d>-<token>.dat   packed chunks, written once, never modified
    versions/<step:012d>/rank-<rank:05d>.json  manifest of one rank's part of the version
    versions/<step:012d>/COMMIT.json           commit record: the version exists iff this does

A manifest lists its rank's blobs. Each blob is cut into chunks of ``chunk_bytes``; its entry
holds the Merkle root and *segments* covering its chunks in order: ``Stored`` runs (chunks back
to back in a data file, with their hashes; the file may belong to an earlier version when the
content was seen before) and, in an incremental manifest, ``Inherited`` runs (chunks unchanged
since the *base* version, whose manifest this one names with its hash). Resolving a version
walks its chain of bases back to a full version; ``full_every`` bounds the chain. The commit
record lists every data file and every manifest step the version needs after resolution, which
is what reference-counted retention counts.

Pure: (de)serialization and validation only; no I/O.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .chunks import HASH_BYTES, HASH_NAME, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, chunk_count
from .errors import CheckpointFormatError
from .storage.base import validate_key

__all__ = [
    "FORMAT_VERSION",
    "MAX_STEP",
    "BaseRef",
    "BlobEntry",
    "CommitRecord",
    "Inherited",
    "Manifest",
    "ManifestRef",
    "INHERITED",
    "STORED",
    "Segment",
    "Stored",
    "commit_key",
    "data_key",
    "manifest_key",
    "step_of_commit_key",
    "version_prefix",
]

FORMAT_VERSION = 1
# A blob's segment table of more rows than this is written packed (zlib-compressed
# little-endian int64 rows, base64): JSON rows cost far more to parse than to read.
PACK_ROWS = 64
MAX_STEP = 10**12 - 1


def version_prefix(step: int) -> str:
    return f"versions/{step:012d}"


def commit_key(step: int) -> str:
    return f"{version_prefix(step)}/COMMIT.json"


def manifest_key(step: int, rank: int) -> str:
    return f"{version_prefix(step)}/rank-{rank:05d}.json"


def data_key(step: int, rank: int, token: str) -> str:
    return f"data/{step:012d}-r{rank:05d}-{token}.dat"


def step_of_commit_key(key: str) -> int | None:
    """The step of ``versions/<step>/COMMIT.json``, or None for any other key."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "versions" and parts[2] == "COMMIT.json":
        s = parts[1]
        if len(s) == 12 and s.isdigit():
            return int(s)
    return None


def _checksum(doc: dict[str, Any]) -> str:
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_hexdigest(body)


def _fail(where: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where}: {what}")


def _int(doc: dict[str, Any], name: str, where: str, *, lo: int = 0, hi: int | None = None) -> int:
    v = doc.get(name)
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        raise _fail(where, f"field {name!r} must be an int >= {lo}, got {v!r:.60}")
    return v


def _data_file(key: Any, where: str) -> str:
    if not isinstance(key, str) or not key.startswith("data/"):
        raise _fail(where, f"data file {key!r:.80} is not under data/")
    try:
        return validate_key(key)
    except ValueError as exc:
        raise _fail(where, f"unsafe data file name {key!r:.80}") from exc


def _parse_json(data: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(where, f"not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise _fail(where, "not a JSON object")
    fv = doc.get("format_version")
    if fv != FORMAT_VERSION:
        raise _fail(
            where,
            f"format_version {fv!r} is not supported by this cryosnap (reads {FORMAT_VERSION}); "
            "upgrade cryosnap to read it",
        )
    return doc


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


@dataclass(frozen=True, slots=True)
class BaseRef:
    """The version an incremental manifest builds on: its step and manifest hash."""

    step: int
    key: str
    xxh3: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """One rank's part of one version."""

    step: int
    rank: int
    chunk_bytes: int
    data_files: tuple[str, ...]
    blobs: tuple[BlobEntry, ...]
    skeleton: Any
    leaves: int
    logical_bytes: int
    created_unix: float
    base: BaseRef | None = None

    def to_json(self) -> bytes:
        hashes: list[bytes] = []
        blobs = [b.to_json(hashes) for b in self.blobs]
        doc = {
            "format_version": FORMAT_VERSION,
            "kind": "cryosnap.manifest",
            "step": self.step,
            "rank": self.rank,
            "hash": HASH_NAME,
            "chunk_bytes": self.chunk_bytes,
            "created_unix": self.created_unix,
            "leaves": self.leaves,
            "logical_bytes": self.logical_bytes,
            "base": None
            if self.base is None
            else {"step": self.base.step, "key": self.base.key, "xxh3_128": self.base.xxh3},
            "data_files": list(self.data_files),
            "blobs": blobs,
            "hashes": base64.b64encode(b"".join(hashes)).decode(),
            "tree": self.skeleton,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        doc = _parse_json(data, where)
        if doc.get("kind") != "cryosnap.manifest":
            raise _fail(where, "not a cryosnap manifest")
        if doc.get("hash") != HASH_NAME:
            raise _fail(where, f"unknown hash algorithm {doc.get('hash')!r}")
        chunk_bytes = _int(doc, "chunk_bytes", where, lo=MIN_CHUNK_BYTES, hi=MAX_CHUNK_BYTES)
        files = doc.get("data_files")
        if not isinstance(files, list):
            raise _fail(where, "field 'data_files' must be a list")
        data_files = tuple(_data_file(f, where) for f in files)
        raw_base = doc.get("base")
        base = None
        if raw_base is not None:
            if not isinstance(raw_base, dict) or not isinstance(raw_base.get("xxh3_128"), str):
                raise _fail(where, f"malformed base reference {raw_base!r:.120}")
            base = BaseRef(
                _int(raw_base, "step", where, hi=MAX_STEP),
                _version_file(raw_base.get("key"), where),
                raw_base["xxh3_128"],
            )
        raw_blobs = doc.get("blobs")
        if not isinstance(raw_blobs, list):
            raise _fail(where, "field 'blobs' must be a list")
        try:
            table = base64.b64decode(doc.get("hashes", ""), validate=True)
        except (TypeError, ValueError) as exc:
            raise _fail(where, "field 'hashes' is not base64") from exc
        cursor = [0]
        blobs = tuple(
            _parse_blob(b, i, len(data_files), chunk_bytes, base is not None, table, cursor, where)
            for i, b in enumerate(raw_blobs)
        )
        if cursor[0] != len(table):
            raise _fail(where, "hash table does not match the stored segments")
        created = doc.get("created_unix")
        if not isinstance(created, (int, float)):
            raise _fail(where, "field 'created_unix' must be a number")
        if not isinstance(doc.get("tree"), dict):
            raise _fail(where, "field 'tree' must be an object")
        return cls(
            step=_int(doc, "step", where, hi=MAX_STEP),
            rank=_int(doc, "rank", where),
            chunk_bytes=chunk_bytes,
            data_files=data_files,
            blobs=blobs,
            skeleton=doc["tree"],
            leaves=_int(doc, "leaves", where),
            logical_bytes=_int(doc, "logical_bytes", where),
            created_unix=float(created),
            base=base,
        )


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
    try:
        nbytes, root_hex, raw_segments = raw
        if isinstance(raw_segments, dict):
            raw_segments = _unpack_rows(raw_segments)
        if (
            type(nbytes) is not int
            or nbytes < 0
            or not isinstance(raw_segments, (list, np.ndarray))
        ):
            raise ValueError("size")
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
    except (TypeError, ValueError) as exc:
        raise _fail(here, f"malformed blob entry {raw!r:.120}") from exc
    if not rows_ok:
        raise _fail(here, "segment fields must be rows of 4 ints")
    if len(root) != HASH_BYTES:
        raise _fail(here, "malformed Merkle root")
    if flat is None:
        if nbytes:
            raise _fail(here, f"no segments for a blob of {nbytes} bytes")
        return BlobEntry(nbytes, root, np.empty((0, 4), np.int64), b"", chunk_bytes)
    if flat.dtype.kind not in "iu" or flat.ndim != 1:
        raise _fail(here, "segment fields must be rows of 4 ints")
    t = flat.astype(np.int64, copy=False).reshape(-1, 4)
    kind, a, b, c = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    stored = kind == STORED
    inherited = kind == INHERITED
    if not (stored | inherited).all():
        raise _fail(here, "unknown segment kind")
    if stored.any() and (
        (a[stored] < 0).any()
        or (a[stored] >= nfiles).any()
        or (b[stored] < 0).any()
        or (c[stored] <= 0).any()
    ):
        raise _fail(here, "invalid stored segment")
    if inherited.any() and (
        not has_base
        or (a[inherited] < 0).any()
        or (b[inherited] < 0).any()
        or (c[inherited] <= 0).any()
    ):
        raise _fail(here, "invalid inherited segment")
    # Chunks per segment; a stored run that is not the blob's last segment is whole chunks,
    # and the last one ends exactly at the blob's end.
    counts = np.where(stored, -(-c // chunk_bytes), c)
    if stored[:-1].any() and (c[:-1][stored[:-1]] % chunk_bytes).any():
        raise _fail(here, "a stored segment does not end on a chunk boundary")
    total = int(counts.sum())
    if total != chunk_count(nbytes, chunk_bytes):
        raise _fail(
            here, f"segments cover {total} chunks, the blob has {chunk_count(nbytes, chunk_bytes)}"
        )
    if stored[-1] and (total - int(counts[-1])) * chunk_bytes + int(c[-1]) != nbytes:
        raise _fail(here, "the last stored segment does not end at the blob's end")
    k = int(counts[stored].sum()) * HASH_BYTES
    hashes = table[cursor[0] : cursor[0] + k]
    if len(hashes) != k:
        raise _fail(here, "the hash table is too short")
    cursor[0] += k
    return BlobEntry(nbytes, root, t, hashes, chunk_bytes)


def _unpack_rows(doc: dict[str, Any]) -> np.ndarray[Any, Any]:
    """A packed segment table: ``{"rows": n, "zlib_i64": base64(zlib(int64 LE rows of 4))}``."""
    rows, packed = doc.get("rows"), doc.get("zlib_i64")
    if type(rows) is not int or rows < 0 or not isinstance(packed, str) or len(doc) != 2:
        raise ValueError("packed table")
    want = rows * 4 * 8
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(base64.b64decode(packed, validate=True), want + 1)
    except (zlib.error, ValueError) as exc:  # binascii.Error is a ValueError
        raise ValueError("packed table") from exc
    if len(raw) != want or not inflate.eof:
        raise ValueError("packed table size")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64).reshape(rows, 4)


def _version_file(key: Any, where: str) -> str:
    try:
        validate_key(key)
    except ValueError as exc:
        raise _fail(where, f"unsafe key {key!r:.80}") from exc
    if not str(key).startswith("versions/"):
        raise _fail(where, f"key {key!r:.80} is not under versions/")
    return str(key)


@dataclass(frozen=True, slots=True)
class ManifestRef:
    """Where a rank's manifest is and what it hashes to."""

    rank: int
    key: str
    xxh3: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """The record whose presence makes a version exist.

    Written last, atomically, once every manifest and data file it names is durable on the tier.
    It names every data file the version references, so retention can count references without
    opening the manifests.
    """

    step: int
    world_size: int
    manifests: tuple[ManifestRef, ...]
    data_files: tuple[str, ...]
    logical_bytes: int
    written_bytes: int
    leaves: int
    chunk_bytes: int
    root: str
    created_unix: float
    incremental: bool = False
    chain: tuple[int, ...] = ()
    metrics: dict[str, float] | None = None

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "kind": "cryosnap.commit",
            "step": self.step,
            "world_size": self.world_size,
            "manifests": [
                {"rank": m.rank, "key": m.key, "xxh3_128": m.xxh3, "bytes": m.nbytes}
                for m in self.manifests
            ],
            "data_files": list(self.data_files),
            "logical_bytes": self.logical_bytes,
            "written_bytes": self.written_bytes,
            "leaves": self.leaves,
            "chunk_bytes": self.chunk_bytes,
            "root": self.root,
            "created_unix": self.created_unix,
            "incremental": self.incremental,
            "chain": list(self.chain),
        }
        if self.metrics:
            doc["metrics"] = dict(self.metrics)
        doc["checksum"] = _checksum(doc)
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitRecord:
        doc = _parse_json(data, where)
        if doc.get("kind") != "cryosnap.commit":
            raise _fail(where, "not a cryosnap commit record")
        checksum = doc.pop("checksum", None)
        if checksum != _checksum(doc):
            raise _fail(where, "checksum mismatch: the commit record is damaged")
        world_size = _int(doc, "world_size", where, lo=1)
        raw = doc.get("manifests")
        if not isinstance(raw, list) or len(raw) != world_size:
            raise _fail(where, "field 'manifests' must list one manifest per rank")
        refs = []
        for m in raw:
            if not isinstance(m, dict) or not isinstance(m.get("xxh3_128"), str):
                raise _fail(where, f"malformed manifest reference {m!r:.120}")
            key = _version_file(m.get("key"), where)
            refs.append(
                ManifestRef(
                    _int(m, "rank", where), str(key), m["xxh3_128"], _int(m, "bytes", where)
                )
            )
        if sorted(r.rank for r in refs) != list(range(world_size)):
            raise _fail(where, "field 'manifests' must name each rank 0..world_size-1 once")
        files = doc.get("data_files")
        if not isinstance(files, list):
            raise _fail(where, "field 'data_files' must be a list")
        created = doc.get("created_unix")
        if not isinstance(created, (int, float)) or not isinstance(doc.get("root"), str):
            raise _fail(where, "malformed 'created_unix' or 'root'")
        return cls(
            step=_int(doc, "step", where, hi=MAX_STEP),
            world_size=world_size,
            manifests=tuple(sorted(refs, key=lambda r: r.rank)),
            data_files=tuple(_data_file(f, where) for f in files),
            logical_bytes=_int(doc, "logical_bytes", where),
            written_bytes=_int(doc, "written_bytes", where),
            leaves=_int(doc, "leaves", where),
            chunk_bytes=_int(doc, "chunk_bytes", where, lo=MIN_CHUNK_BYTES, hi=MAX_CHUNK_BYTES),
            root=doc["root"],
            created_unix=float(created),
            incremental=bool(doc.get("incremental", False)),
            chain=tuple(_steps(doc.get("chain", []), where)),
            metrics=_metrics(doc.get("metrics"), where),
        )


def _metrics(raw: Any, where: str) -> dict[str, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and type(v) in (int, float) for k, v in raw.items()
    ):
        raise _fail(where, f"malformed metrics {raw!r:.120}")
    return {k: float(v) for k, v in raw.items()}


def _steps(raw: Any, where: str) -> list[int]:
    if not isinstance(raw, list) or not all(type(s) is int and 0 <= s <= MAX_STEP for s in raw):
        raise _fail(where, f"malformed chain {raw!r:.120}")
    return list(raw)


def now_unix() -> float:
    return time.time()
