"""The on-disk schema: keys of a run, per-rank manifests and commit records (format 1).

Everything here is JSON, validated on load: a malformed or unsafe document raises
:class:`~cryosnap.errors.CheckpointFormatError` naming the key. docs/FORMAT.md is the prose
version of this module; docs/design/format.md has the layout of a tier in brief.
Pure: (de)serialization and validation only; no I/O.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import re
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import xxhash

from cryosnap._format import columns
from cryosnap._format.chunks import (
    HASH_BYTES,
    HASH_NAME,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    chunk_count,
)
from cryosnap._format.keys import (
    Lineage,
    commit_key,
    data_key,
    manifest_key,
    max_generation,
    parse_commit_key,
    parse_manifest_key,
    step_of_commit_key,
    validate_key,
    version_prefix,
    visible_versions,
)
from cryosnap._format.limits import (
    MAX_BLOB_BYTES,
    MAX_BLOB_CHUNKS,
    MAX_COUNT,
    MAX_FILE_BYTES,
    MAX_JSON_DEPTH,
    MAX_RANK,
    MAX_STEP,
    MAX_UNIX,
)
from cryosnap._format.skeleton import check_depth, decode_key, encode_key
from cryosnap.errors import CheckpointFormatError

__all__ = [
    "COLUMNS_FORMAT_VERSION",
    "FILES_FORMAT_VERSION",
    "FORMAT_VERSION",
    "NUMPY_PACKED_FORMAT_VERSION",
    "PACKED_FORMAT_VERSION",
    "MAX_STEP",
    "BaseRef",
    "BlobEntry",
    "CommitRecord",
    "Inherited",
    "Manifest",
    "ManifestRef",
    "PartSummary",
    "RUN_ID_PATTERN",
    "Replicated",
    "INHERITED",
    "Lineage",
    "STORED",
    "Segment",
    "Stored",
    "commit_key",
    "data_key",
    "forget_tree_text",
    "manifest_key",
    "max_generation",
    "parse_manifest_key",
    "parse_commit_key",
    "step_of_commit_key",
    "version_prefix",
    "visible_versions",
]

FORMAT_VERSION = 1
# A rank's manifest holding packed tensors (skeleton nodes with "at", docs/FORMAT.md "Packs")
# says this instead, so that a cryosnap from before packs refuses it by its version ("upgrade
# cryosnap") instead of taking it for damage. Everything else stays FORMAT_VERSION.
PACKED_FORMAT_VERSION = 2
# A rank's manifest holding cryosnap.File leaves (skeleton nodes "file", packed tensors or not)
# says this, for the same reason: a cryosnap from before files refuses it by its version.
FILES_FORMAT_VERSION = 3
# A rank's manifest whose skeleton holds a dict node in columns (a state dict's tensors as one
# list per field, docs/FORMAT.md) says this, packed tensors and files or not, so that a
# cryosnap from before columns refuses it by its version. A skeleton without one keeps the
# version it had (1, 2 or 3), readable by every cryosnap that read it before.
COLUMNS_FORMAT_VERSION = 4
# A rank's manifest whose skeleton holds packed numpy arrays ("numpy" nodes with "at") says
# this, whatever else it holds (packs, files, columns), so that a cryosnap from before numpy
# packs refuses it by its version instead of taking the array's pack for damage.
NUMPY_PACKED_FORMAT_VERSION = 5
# The manifest versions this cryosnap reads: every one up to the newest (each may hold what
# the ones before it may).
_MANIFEST_VERSIONS = tuple(range(FORMAT_VERSION, NUMPY_PACKED_FORMAT_VERSION + 1))
# A blob's segment table of more rows than this is written packed (zlib-compressed
# little-endian int64 rows, base64): JSON rows cost far more to parse than to read.
PACK_ROWS = 64
# A run id (which training wrote a version): letters, digits and ._:- only, 1 to 128 of them,
# so it is safe in a log line, a file name or a shell command.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Top-level keys a manifest may name as replicated (a state has a handful).
_MAX_REPLICATED_KEYS = 1 << 20

# Which top-level keys of a part were saved as replicated: a tuple of keys, True (the whole
# state), or None (none).
Replicated = tuple[str | int, ...] | Literal[True] | None


def _checksum(doc: dict[str, Any]) -> str:
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_hexdigest(body)


def _fail(where: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where}: {what}")


def _int(doc: dict[str, Any], name: str, where: str, *, lo: int = 0, hi: int = MAX_COUNT) -> int:
    v = doc.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(where, f"field {name!r} must be an int in [{lo}, {hi}], got {_show(v)}")
    return v


def _show(v: Any) -> str:
    """A value for a message: short, and never str() of an int of thousands of digits (which
    Python refuses)."""
    if type(v) is int and v.bit_length() > 64:
        return f"an int of {v.bit_length()} bits"
    return f"{v!r:.60}"


def _unix(doc: dict[str, Any], name: str, where: str) -> float:
    v = doc.get(name)
    if not isinstance(v, (int, float)) or type(v) is bool or not 0 <= v <= MAX_UNIX:
        # NaN fails the comparison; 1e400 is inf; a huge int would overflow float().
        raise _fail(where, f"field {name!r} must be a time in [0, {MAX_UNIX:.0f}], got {_show(v)}")
    return float(v)


def _check_depth(doc: Any, where: str) -> None:
    """Refuse a document nested deeper than MAX_JSON_DEPTH (iterative: no recursion here)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _fail(where, f"nested deeper than {MAX_JSON_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _data_file(key: Any, where: str) -> str:
    if not isinstance(key, str) or not key.startswith("data/"):
        raise _fail(where, f"data file {key!r:.80} is not under data/")
    try:
        return validate_key(key)
    except ValueError as exc:
        raise _fail(where, f"unsafe data file name {key!r:.80}") from exc


def _parse_json(
    data: bytes, where: str, versions: tuple[int, ...] = (FORMAT_VERSION,)
) -> dict[str, Any]:
    try:
        # NaN, Infinity and 1e400 (inf) parse; every number is range-checked where it is used.
        doc = json.loads(data)
    except RecursionError as exc:
        raise _fail(where, "not valid JSON (nested too deeply)") from exc
    except ValueError as exc:  # also UnicodeDecodeError, and ints of over 4,300 digits
        raise _fail(where, f"not valid JSON ({exc!s:.200})") from exc
    if not isinstance(doc, dict):
        raise _fail(where, "not a JSON object")
    fv = doc.get("format_version")
    if type(fv) is not int or fv not in versions:
        reads = " and ".join(map(str, versions))
        raise _fail(
            where,
            f"format_version {fv!r} is not supported by this cryosnap (reads {reads}); "
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


_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# The text of every container node of the last skeleton encoded, by id: (node, its text, the
# ids of its container children kept). A Checkpointer saves the same skeleton version after
# version, or a copy where an inline leaf changed (a step counter, a learning rate) that shares
# every other node (_state/reuse.py; a skeleton is never modified once made): only the
# containers on the changed path are encoded again. The whole text of a state of 20,000
# leaves took 45-85 ms of the writer's thread per version here.
# The last field says whether the node's text holds columns (docs/FORMAT.md, "State dicts in
# columns"): the manifest's format_version then says so.
_tree_nodes: dict[int, tuple[Any, str, tuple[int, ...], bool]] = {}
_tree_lock = threading.Lock()
# Stands for a container's children while its other fields are encoded: a string no skeleton
# holds (NUL characters), checked to occur once.
_CHILDREN = "\x00cryosnap children\x00"
_CHILDREN_TEXT = _dumps(_CHILDREN)


def forget_tree_text() -> None:
    """Let go of the texts kept of the last skeleton (a writer that stops: its skeleton need
    not outlive it)."""
    global _tree_nodes
    with _tree_lock:
        _tree_nodes = {}


def _tree_text(skeleton: Any) -> tuple[str, bool]:
    """``skeleton`` as JSON text, and whether it holds columns: the text of ``_dumps`` of the
    skeleton with every dict node of tensor leaves that :func:`columns.encode` takes in
    columns, with the texts of the nodes it shares with the last skeleton encoded taken as
    they were."""
    global _tree_nodes
    with _tree_lock:
        kept: dict[int, tuple[Any, str, tuple[int, ...], bool]] = {}
        text, cols = _node_text(skeleton, _tree_nodes, kept)
        _tree_nodes = kept
    return text, cols


def _is_container(node: Any) -> bool:
    return type(node) is dict and type(node.get("v")) in (list, dict)


def _node_text(
    node: Any,
    last: dict[int, tuple[Any, str, tuple[int, ...], bool]],
    kept: dict[int, tuple[Any, str, tuple[int, ...], bool]],
) -> tuple[str, bool]:
    hit = last.get(id(node))
    if hit is not None and hit[0] is node:
        stack = [id(node)]  # kept with the texts of its containers, for the next skeleton
        while stack:
            entry = last[stack.pop()]
            kept[id(entry[0])] = entry
            stack.extend(entry[2])
        return hit[1], hit[3]
    if not _is_container(node):
        # A leaf, or a dict node read in columns (a manifest written again).
        return _dumps(node), type(node) is dict and "cols" in node
    children = node["v"]
    if type(children) is dict:  # a stateful object's state
        inner, cols = _node_text(children, last, kept)
    elif not any(_is_container(c) for c in children):
        # Leaves only (a state dict): one call, in columns where they are all tensors.
        table = columns.encode(children) if node.get("t") in ("dict", "odict") else None
        if table is None:
            text = _dumps(node)
        else:
            text = _dumps({**{k: v for k, v in node.items() if k != "v"}, "cols": table})
        kept[id(node)] = (node, text, (), table is not None)
        return text, table is not None
    else:
        texts = [
            _node_text(c, last, kept) if _is_container(c) else (_dumps(c), False) for c in children
        ]
        inner = f"[{','.join(t for t, _c in texts)}]"
        cols = any(c for _t, c in texts)
    shell = _dumps({k: _CHILDREN if k == "v" else v for k, v in node.items()})
    if shell.count(_CHILDREN_TEXT) == 1:
        text = shell.replace(_CHILDREN_TEXT, inner)
    else:
        text, cols = _dumps(node), False  # in no columns: as it is
    below = (children,) if type(children) is dict else children
    kept[id(node)] = (node, text, tuple(id(c) for c in below if id(c) in kept), cols)
    return text, cols


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
    # The top-level keys saved as replicated (identical on every rank; True: the whole state),
    # or None. Written only when set: older manifests stay valid, format_version stays 1.
    replicated: Replicated = None
    # NUMPY_PACKED_FORMAT_VERSION when the skeleton holds packed numpy arrays, FILES_ with
    # files, PACKED_ with packed tensors, FORMAT_VERSION otherwise (COLUMNS_ is chosen by
    # encode() where the skeleton's text holds columns and nothing asks for more).
    format_version: int = FORMAT_VERSION
    # What from_json already has of every blob at once (:class:`BlobTables`), so readers need
    # not gather it blob by blob again; None: :meth:`tables` builds it.
    _tables: BlobTables | None = field(default=None, compare=False, repr=False)

    def tables(self) -> BlobTables:
        """Every blob's segment table, size and stored hashes at once."""
        t = self._tables
        if t is None or t.blobs is not self.blobs:
            t = BlobTables.of(self.blobs)
            object.__setattr__(self, "_tables", t)
        return t

    def to_json(self) -> bytes:
        """The manifest as written (its ``format_version`` :data:`COLUMNS_FORMAT_VERSION`
        where the skeleton's text holds columns: :meth:`encode` says so)."""
        return self.encode()[1]

    def encode(self) -> tuple[Manifest, bytes]:
        """The manifest with the ``format_version`` it is written with, and its text."""
        # The skeleton's text first: whether it holds columns decides the version.
        tree, cols = _tree_text(self.skeleton)
        manifest = self
        if cols and self.format_version < COLUMNS_FORMAT_VERSION:
            manifest = dataclasses.replace(self, format_version=COLUMNS_FORMAT_VERSION)
        return manifest, manifest._text(tree)

    def _text(self, tree: str) -> bytes:
        # The blobs as JSON text, each the text json.dumps gives its BlobEntry.to_json: a
        # blob of one segment row of plain ints (nearly every leaf of a state of many small
        # tensors) formatted directly, without a list per blob for the encoder to walk.
        hashes: list[bytes] = []
        blobs: list[str] = []
        one = '[%d,"%s",[[%d,%d,%d,%d]]]'
        for b in self.blobs:
            nbytes, table = b.nbytes, b.table
            if len(table) == 1 and type(nbytes) is int:
                row = table.tolist()[0]
                if type(row) is list and len(row) == 4 and type(row[0]) is int:
                    hashes.append(b.hashes)
                    blobs.append(one % (nbytes, b.root.hex(), *row))
                    continue
            entry = b.to_json(hashes)
            blobs.append(json.dumps(entry, separators=(",", ":"), allow_nan=False))
        head = {
            "format_version": self.format_version,
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
        }
        # The document's keys in this order: head, "blobs", "hashes", "tree", "replicated"
        # (the text of one json.dumps); the tree's text is the last one's where the skeleton
        # is the same object.
        dumps = _dumps
        hashes_text = dumps(base64.b64encode(b"".join(hashes)).decode())
        replicated = ""
        if self.replicated is not None:
            keys = True if self.replicated is True else [encode_key(k) for k in self.replicated]
            replicated = f',"replicated":{dumps(keys)}'
        text = (
            f'{dumps(head)[:-1]},"blobs":[{",".join(blobs)}],"hashes":{hashes_text},'
            f'"tree":{tree}{replicated}}}'
        )
        return text.encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        doc = _parse_json(data, where, _MANIFEST_VERSIONS)
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
        blobs, tables = _parse_blobs(
            raw_blobs, len(data_files), chunk_bytes, base is not None, table, where
        )
        created = _unix(doc, "created_unix", where)
        if not isinstance(doc.get("tree"), dict):
            raise _fail(where, "field 'tree' must be an object")
        # The skeleton is walked recursively on restore; the rest of the document is checked
        # field by field above. Its columns are parsed (checked) here, once.
        check_depth(doc["tree"], where)
        return cls(
            step=_int(doc, "step", where, hi=MAX_STEP),
            rank=_int(doc, "rank", where, hi=MAX_RANK),
            chunk_bytes=chunk_bytes,
            data_files=data_files,
            blobs=blobs,
            skeleton=doc["tree"],
            leaves=_int(doc, "leaves", where),
            logical_bytes=_int(doc, "logical_bytes", where),
            created_unix=created,
            base=base,
            replicated=_replicated(doc.get("replicated"), where),
            format_version=doc["format_version"],
            _tables=tables,
        )


def _replicated(raw: Any, where: str) -> Replicated:
    if raw is None or raw is True:
        return raw
    if not isinstance(raw, list) or len(raw) > _MAX_REPLICATED_KEYS:
        raise _fail(where, f"malformed field 'replicated' {raw!r:.120}")
    return tuple(decode_key(k, f"{where}: field 'replicated'") for k in raw)


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


def _parse_blobs(
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
        raise _fail(where, "hash table does not match the stored segments")
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
        raise _fail(here, f"malformed blob entry {raw!r:.120}")
    nbytes, root_hex, raw_segments = raw
    if type(nbytes) is not int or not 0 <= nbytes <= MAX_BLOB_BYTES:
        raise _fail(here, f"blob size must be an int in [0, {MAX_BLOB_BYTES}], got {_show(nbytes)}")
    nchunks = chunk_count(nbytes, chunk_bytes)
    if nchunks > MAX_BLOB_CHUNKS:
        raise _fail(here, f"blob of {nbytes} bytes has more than {MAX_BLOB_CHUNKS} chunks")
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
            raise _fail(here, f"{len(raw_segments)} segments, more than the blob can have")
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
        raise _fail(here, "unknown segment kind")
    # Bounded fields keep every sum and product below in int64 (see the limits above).
    if stored.any() and (
        (a[stored] < 0).any()
        or (a[stored] >= nfiles).any()
        or (b[stored] < 0).any()
        or (b[stored] > MAX_FILE_BYTES).any()
        or (c[stored] <= 0).any()
        or (c[stored] > nbytes).any()
    ):
        raise _fail(here, "invalid stored segment (file, offset or size out of range)")
    if inherited.any() and (
        not has_base
        or (a[inherited] < 0).any()
        or (a[inherited] > MAX_BLOB_CHUNKS).any()
        or (b[inherited] < 0).any()
        or (b[inherited] > MAX_BLOB_CHUNKS).any()
        or (c[inherited] <= 0).any()
        or (c[inherited] > nchunks).any()
    ):
        raise _fail(here, "invalid inherited segment (blob, first chunk or count out of range)")
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
        raise _fail(here, "the hash table is too short")
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
            raise _fail(here, "invalid stored segment (file, offset or size out of range)")
        count = -(-c // chunk_bytes)
    elif kind == INHERITED:
        if not (has_base and 0 <= a <= MAX_BLOB_CHUNKS and 0 <= b <= MAX_BLOB_CHUNKS):
            raise _fail(here, "invalid inherited segment (blob, first chunk or count out of range)")
        if not 0 < c <= nchunks:
            raise _fail(here, "invalid inherited segment (blob, first chunk or count out of range)")
        count = c
    else:
        raise _fail(here, "unknown segment kind")
    if count != nchunks:
        raise _fail(here, f"segments cover {count} chunks, the blob has {nchunks}")
    if kind == STORED and c != nbytes:
        raise _fail(here, "the last stored segment does not end at the blob's end")
    return count if kind == STORED else 0


def _unpack_rows(doc: dict[str, Any], max_rows: int, where: str) -> np.ndarray[Any, Any]:
    """A packed segment table: ``{"rows": n, "zlib_i64": base64(zlib(int64 LE rows of 4))}``.

    ``n`` is checked against ``max_rows`` before anything is inflated, and inflation stops at
    the size ``n`` rows take: a zlib bomb costs no more memory than an honest table."""
    rows, packed = doc.get("rows"), doc.get("zlib_i64")
    if type(rows) is not int or rows < 0 or not isinstance(packed, str) or len(doc) != 2:
        raise _fail(where, f"malformed packed segment table {doc!r:.120}")
    if rows > max_rows:
        raise _fail(
            where, f"packed table claims {_show(rows)} segments, the blob can have {max_rows}"
        )
    want = rows * 4 * 8
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(base64.b64decode(packed, validate=True), want + 1)
    except (zlib.error, ValueError) as exc:  # binascii.Error is a ValueError
        raise _fail(where, "packed segment table is not base64 zlib data") from exc
    if len(raw) != want or not inflate.eof:
        raise _fail(where, f"packed segment table does not inflate to its {rows} rows")
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
class PartSummary:
    """What the commit record needs of one rank's part, and nothing more: small and
    JSON-serialisable, so the parts written by every participant can be gathered and committed
    by one (rank 0 of a distributed run)."""

    ref: ManifestRef
    data_files: tuple[str, ...]  # every data file the part reads (its own and inherited)
    logical_bytes: int
    written_bytes: int
    leaves: int
    root: str  # hex Merkle root of the part
    incremental: bool
    chain: tuple[int, ...]  # steps whose manifests the part resolves through
    # The keys of those manifests (gathered only, never in a record: a commit record in doubt
    # reserves exactly them from retention).
    chain_keys: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.ref.rank,
            "key": self.ref.key,
            "xxh3_128": self.ref.xxh3,
            "bytes": self.ref.nbytes,
            "data_files": list(self.data_files),
            "logical_bytes": self.logical_bytes,
            "written_bytes": self.written_bytes,
            "leaves": self.leaves,
            "root": self.root,
            "incremental": self.incremental,
            "chain": list(self.chain),
            "chain_keys": list(self.chain_keys),
        }

    @classmethod
    def from_json(cls, doc: Any, where: str) -> PartSummary:
        if not isinstance(doc, dict) or not isinstance(doc.get("xxh3_128"), str):
            raise _fail(where, f"malformed part summary {doc!r:.120}")
        files = doc.get("data_files")
        if not isinstance(files, list) or not isinstance(doc.get("root"), str):
            raise _fail(where, "part summary: 'data_files' must be a list, 'root' a string")
        return cls(
            ref=ManifestRef(
                _int(doc, "rank", where, hi=MAX_RANK),
                _version_file(doc.get("key"), where),
                doc["xxh3_128"],
                _int(doc, "bytes", where),
            ),
            data_files=tuple(_data_file(f, where) for f in files),
            logical_bytes=_int(doc, "logical_bytes", where),
            written_bytes=_int(doc, "written_bytes", where),
            leaves=_int(doc, "leaves", where),
            root=doc["root"],
            incremental=doc.get("incremental") is True,
            chain=tuple(_steps(doc.get("chain", []), where)),
            chain_keys=tuple(
                _version_file(k, where) for k in _list(doc.get("chain_keys", []), where)
            ),
        )


def _list(raw: Any, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise _fail(where, f"malformed list {raw!r:.120}")
    return raw


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
    run_id: str | None = None  # the training that wrote the version (Checkpointer(run_id=))
    lineage: Lineage | None = None  # a version saved after a rewind (None: generation 0)

    @property
    def key(self) -> str:
        """Where this record lies on a tier."""
        return commit_key(self.step, self.lineage)

    @classmethod
    def of_parts(
        cls,
        step: int,
        parts: Sequence[PartSummary],
        *,
        chunk_bytes: int,
        root: str,
        metrics: dict[str, float] | None = None,
        run_id: str | None = None,
        lineage: Lineage | None = None,
    ) -> CommitRecord:
        """The record of ``step`` made of every rank's part (``root``: the Merkle root over
        the parts' roots, in rank order)."""
        parts = sorted(parts, key=lambda p: p.ref.rank)
        return cls(
            step=step,
            world_size=len(parts),
            manifests=tuple(p.ref for p in parts),
            data_files=tuple(sorted({f for p in parts for f in p.data_files})),
            logical_bytes=sum(p.logical_bytes for p in parts),
            written_bytes=sum(p.written_bytes for p in parts),
            leaves=sum(p.leaves for p in parts),
            chunk_bytes=chunk_bytes,
            root=root,
            created_unix=now_unix(),
            incremental=any(p.incremental for p in parts),
            chain=tuple(sorted({s for p in parts for s in p.chain})),
            metrics=metrics or None,
            run_id=run_id,
            lineage=lineage,
        )

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
        if self.run_id is not None:  # written only when set: older readers never see it
            doc["run_id"] = self.run_id
        if self.lineage is not None:  # the same: only versions saved after a rewind
            doc["lineage"] = {
                "generation": self.lineage.generation,
                "fork": self.lineage.fork,
            }
        doc["checksum"] = _checksum(doc)
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitRecord:
        doc = _parse_json(data, where)
        if doc.get("kind") != "cryosnap.commit":
            raise _fail(where, "not a cryosnap commit record")
        # A commit record is small and flat: its whole document is checked, so the checksum's
        # own serialization cannot recurse out of the stack.
        _check_depth(doc, where)
        checksum = doc.pop("checksum", None)
        if checksum != _checksum(doc):
            raise _fail(where, "checksum mismatch: the commit record is damaged")
        world_size = _int(doc, "world_size", where, lo=1, hi=MAX_RANK)
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
                    _int(m, "rank", where, hi=MAX_RANK),
                    str(key),
                    m["xxh3_128"],
                    _int(m, "bytes", where),
                )
            )
        if sorted(r.rank for r in refs) != list(range(world_size)):
            raise _fail(where, "field 'manifests' must name each rank 0..world_size-1 once")
        files = doc.get("data_files")
        if not isinstance(files, list):
            raise _fail(where, "field 'data_files' must be a list")
        created = _unix(doc, "created_unix", where)
        if not isinstance(doc.get("root"), str):
            raise _fail(where, "field 'root' must be a string")
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
            created_unix=created,
            incremental=bool(doc.get("incremental", False)),
            chain=tuple(_steps(doc.get("chain", []), where)),
            metrics=_metrics(doc.get("metrics"), where),
            run_id=_run_id(doc.get("run_id"), where),
            lineage=_lineage(doc.get("lineage"), where),
        )


def _metrics(raw: Any, where: str) -> dict[str, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and type(v) in (int, float) and abs(v) <= MAX_COUNT
        for k, v in raw.items()
    ):
        raise _fail(where, f"malformed metrics {raw!r:.120}")
    return {k: float(v) for k, v in raw.items()}


def _run_id(raw: Any, where: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not RUN_ID_PATTERN.fullmatch(raw):
        raise _fail(where, f"malformed run_id {raw!r:.120}")
    return raw


def _lineage(raw: Any, where: str) -> Lineage | None:
    if raw is None:
        return None
    ok = isinstance(raw, dict) and set(raw) == {"generation", "fork"}
    gen, fork = (raw.get("generation"), raw.get("fork")) if ok else (None, None)
    if not (type(gen) is int and 1 <= gen < 10**9 and type(fork) is int and 0 <= fork <= MAX_STEP):
        raise _fail(where, f"malformed lineage {raw!r:.120}")
    return Lineage(gen, fork)


def _steps(raw: Any, where: str) -> list[int]:
    if not isinstance(raw, list) or not all(type(s) is int and 0 <= s <= MAX_STEP for s in raw):
        raise _fail(where, f"malformed chain {raw!r:.120}")
    return list(raw)


def now_unix() -> float:
    return time.time()
