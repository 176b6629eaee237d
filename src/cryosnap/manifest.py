"""The on-disk schema: keys of a run, per-rank manifests and commit records (format 1).

Everything here is JSON, readable without pickle and validated on load: a malformed or unsafe
document raises :class:`~cryosnap.errors.CheckpointFormatError` naming the key, never a
``KeyError`` from deep inside. docs/FORMAT.md is the prose version of this module.

Layout of one tier (a run directory or URL prefix)::

    data/<step:012d>-r<rank:05d>-<token>.dat   packed chunks, written once, never modified
    versions/<step:012d>/rank-<rank:05d>.json  manifest of one rank's part of the version
    versions/<step:012d>/COMMIT.json           commit record: the version exists iff this does

A manifest lists its rank's blobs. Each blob is cut into chunks of ``chunk_bytes``; its entry
holds the chunk hashes, the Merkle root and *extents*: runs of consecutive chunks stored
contiguously at an offset of a data file. Extents may point into data files written by earlier
versions (incremental versions) and ``data_files`` lists every file a manifest references, which
is what reference-counted retention counts.

Pure: (de)serialization and validation only; no I/O.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from typing import Any

import xxhash

from .chunks import HASH_BYTES, HASH_NAME, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, chunk_count
from .errors import CheckpointFormatError
from .storage.base import validate_key

__all__ = [
    "FORMAT_VERSION",
    "MAX_STEP",
    "BlobEntry",
    "CommitRecord",
    "Extent",
    "Manifest",
    "ManifestRef",
    "commit_key",
    "data_key",
    "manifest_key",
    "step_of_commit_key",
    "version_prefix",
]

FORMAT_VERSION = 1
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
class Extent:
    """``nbytes`` consecutive bytes of a blob, stored at ``offset`` of data file ``file``."""

    file: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class BlobEntry:
    """One stored buffer: its size, chunk hashes, Merkle root and where its chunks lie."""

    nbytes: int
    root: bytes
    hashes: bytes
    extents: tuple[Extent, ...]

    def to_json(self) -> list[Any]:
        return [
            self.nbytes,
            self.root.hex(),
            base64.b64encode(self.hashes).decode(),
            [[e.file, e.offset, e.nbytes] for e in self.extents],
        ]


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

    def to_json(self) -> bytes:
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
            "data_files": list(self.data_files),
            "blobs": [b.to_json() for b in self.blobs],
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
        raw_blobs = doc.get("blobs")
        if not isinstance(raw_blobs, list):
            raise _fail(where, "field 'blobs' must be a list")
        blobs = tuple(
            _parse_blob(b, i, len(data_files), chunk_bytes, where) for i, b in enumerate(raw_blobs)
        )
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
        )


def _parse_blob(raw: Any, index: int, nfiles: int, chunk_bytes: int, where: str) -> BlobEntry:
    here = f"{where}, blob {index}"
    try:
        nbytes, root_hex, hashes_b64, raw_extents = raw
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError("size")
        root = bytes.fromhex(root_hex)
        hashes = base64.b64decode(hashes_b64, validate=True)
        extents = tuple(Extent(int(f), int(o), int(n)) for f, o, n in raw_extents)
    except (TypeError, ValueError) as exc:
        raise _fail(here, f"malformed blob entry {raw!r:.120}") from exc
    if len(root) != HASH_BYTES or len(hashes) != chunk_count(nbytes, chunk_bytes) * HASH_BYTES:
        raise _fail(here, "hash list does not match the blob's size")
    covered = 0
    for e in extents:
        # Extents start on chunk boundaries so each chunk is verified from one contiguous read.
        if not 0 <= e.file < nfiles or e.offset < 0 or e.nbytes <= 0 or covered % chunk_bytes:
            raise _fail(here, f"invalid extent {e}")
        covered += e.nbytes
    if covered != nbytes:
        raise _fail(here, f"extents cover {covered} bytes, the blob has {nbytes}")
    return BlobEntry(nbytes, root, hashes, extents)


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
        }
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
            if not isinstance(m, dict):
                raise _fail(where, "malformed manifest reference")
            key = m.get("key")
            try:
                validate_key(key)  # type: ignore[arg-type]
            except ValueError as exc:
                raise _fail(where, f"unsafe manifest key {key!r:.80}") from exc
            if not str(key).startswith("versions/") or not isinstance(m.get("xxh3_128"), str):
                raise _fail(where, f"malformed manifest reference {m!r:.120}")
            refs.append(
                ManifestRef(
                    _int(m, "rank", where), str(key), m["xxh3_128"], _int(m, "bytes", where)
                )
            )
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
        )


def now_unix() -> float:
    return time.time()
