"""The manifest: one rank's part of one version (docs/FORMAT.md, "Manifest"), its format
versions, the base it builds on and its JSON text, validated on load (a malformed or unsafe
document raises :class:`~cryosnap.errors.CheckpointFormatError` naming the key).

Pure: (de)serialization and validation only, no I/O. Its blob entries are blobs.py's, the
skeleton's text skeleton_text.py's (a writer passes its cache to :meth:`Manifest.encode`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from cryosnap._format.blobs import BlobEntry, BlobTables, parse_blobs
from cryosnap._format.chunks import HASH_NAME, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from cryosnap._format.codec import CODEC_NAME
from cryosnap._format.document import (
    data_file,
    fail,
    int_field,
    names_ancestor,
    parse_json,
    unix_field,
    version_file,
)
from cryosnap._format.limits import MAX_RANK, MAX_STEP
from cryosnap._format.skeleton import check_depth, decode_key, encode_key
from cryosnap._format.skeleton_text import SkeletonTextCache
from cryosnap._format.stats import LeafStats, decode_stats, encode_stats

__all__ = [
    "CODEC_FORMAT_VERSION",
    "COLUMNS_FORMAT_VERSION",
    "FILES_FORMAT_VERSION",
    "FORK_FORMAT_VERSION",
    "FORMAT_VERSION",
    "NUMPY_PACKED_FORMAT_VERSION",
    "PACKED_FORMAT_VERSION",
    "STATS_FORMAT_VERSION",
    "BaseRef",
    "Manifest",
    "Replicated",
    "with_codec",
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
# A rank's manifest holding per-leaf statistics (the "stats" field, docs/FORMAT.md) says
# this, whatever else it holds, so that a cryosnap from before statistics refuses it by its
# version. A manifest without the field (Checkpointer(stats=False)) keeps the version it had.
STATS_FORMAT_VERSION = 6
# A rank's manifest naming a data file of an ancestor run ("ancestors/<i>/data/...": a fork,
# docs/FORMAT.md "Forks") says this, whatever else it holds, so that a cryosnap from before
# forks refuses it by its version.
FORK_FORMAT_VERSION = 7
# A rank's manifest naming data files stored with the persistent level's codec (the "codec"
# and "coded" fields, docs/FORMAT.md "Coded data files") says this, whatever else it holds, so
# that a cryosnap from before codecs refuses it by its version instead of reading compressed
# frames as chunks. A manifest naming no coded file keeps the version it had.
CODEC_FORMAT_VERSION = 8
# The manifest versions this cryosnap reads: every one up to the newest (each may hold what
# the ones before it may).
_MANIFEST_VERSIONS = tuple(range(FORMAT_VERSION, CODEC_FORMAT_VERSION + 1))
# Top-level keys a manifest may name as replicated (a state has a handful).
_MAX_REPLICATED_KEYS = 1 << 20

# Which top-level keys of a part were saved as replicated: a tuple of keys, True (the whole
# state), or None (none).
Replicated = tuple[str | int, ...] | Literal[True] | None


@dataclass(frozen=True, slots=True)
class BaseRef:
    """The version an incremental manifest builds on: its step and manifest hash."""

    step: int
    key: str
    xxh3: str


_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


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
    # Per floating-point leaf path, its statistics (None: none recorded, a manifest older than
    # STATS_FORMAT_VERSION or saved with stats=False). Written only when set.
    stats: dict[str, LeafStats] | None = None
    # The data files (of data_files) stored with the codec CODEC_NAME: read through
    # storage/_codec.py's DecodedStore. Written only when set (then format_version 8).
    coded: frozenset[str] = frozenset()
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

    def encode(self, texts: SkeletonTextCache | None = None) -> tuple[Manifest, bytes]:
        """The manifest with the ``format_version`` it is written with, and its text;
        ``texts``: the writer's cache of the last skeleton's text (None: nothing kept)."""
        # The skeleton's text first: whether it holds columns decides the version.
        tree, cols = (SkeletonTextCache() if texts is None else texts).text(self.skeleton)
        manifest = self
        if cols and self.format_version < COLUMNS_FORMAT_VERSION:
            manifest = dataclasses.replace(self, format_version=COLUMNS_FORMAT_VERSION)
        if self.stats is not None and manifest.format_version < STATS_FORMAT_VERSION:
            manifest = dataclasses.replace(manifest, format_version=STATS_FORMAT_VERSION)
        if manifest.format_version < FORK_FORMAT_VERSION and names_ancestor(self.data_files):
            manifest = dataclasses.replace(manifest, format_version=FORK_FORMAT_VERSION)
        if self.coded and manifest.format_version < CODEC_FORMAT_VERSION:
            manifest = dataclasses.replace(manifest, format_version=CODEC_FORMAT_VERSION)
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
        # The document's keys in this order: head, "blobs", "hashes", "tree", "replicated", "stats"
        # (the text of one json.dumps); the tree's text is kept by the writer's cache for the
        # next manifest of a skeleton sharing its nodes.
        dumps = _dumps
        hashes_text = dumps(base64.b64encode(b"".join(hashes)).decode())
        replicated = ""
        if self.replicated is not None:
            keys = True if self.replicated is True else [encode_key(k) for k in self.replicated]
            replicated = f',"replicated":{dumps(keys)}'
        stats = "" if self.stats is None else f',"stats":{dumps(encode_stats(self.stats))}'
        coded = ""
        if self.coded:
            files = [i for i, f in enumerate(self.data_files) if f in self.coded]
            coded = f',"codec":{dumps(CODEC_NAME)},"coded":{dumps(files)}'
        text = (
            f'{dumps(head)[:-1]},"blobs":[{",".join(blobs)}],"hashes":{hashes_text},'
            f'"tree":{tree}{replicated}{stats}{coded}}}'
        )
        return text.encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        doc = parse_json(data, where, _MANIFEST_VERSIONS)
        if doc.get("kind") != "cryosnap.manifest":
            raise fail(where, "not a cryosnap manifest")
        if doc.get("hash") != HASH_NAME:
            raise fail(where, f"unknown hash algorithm {doc.get('hash')!r}")
        chunk_bytes = int_field(doc, "chunk_bytes", where, lo=MIN_CHUNK_BYTES, hi=MAX_CHUNK_BYTES)
        files = doc.get("data_files")
        if not isinstance(files, list):
            raise fail(where, "field 'data_files' must be a list")
        data_files = tuple(data_file(f, where) for f in files)
        if doc["format_version"] < FORK_FORMAT_VERSION and names_ancestor(data_files):
            raise fail(where, f"an ancestor's data file in a manifest of {doc['format_version']=}")
        raw_base = doc.get("base")
        base = None
        if raw_base is not None:
            if not isinstance(raw_base, dict) or not isinstance(raw_base.get("xxh3_128"), str):
                raise fail(where, f"malformed base reference {raw_base!r:.120}")
            base = BaseRef(
                int_field(raw_base, "step", where, hi=MAX_STEP),
                version_file(raw_base.get("key"), where),
                raw_base["xxh3_128"],
            )
        raw_blobs = doc.get("blobs")
        if not isinstance(raw_blobs, list):
            raise fail(where, "field 'blobs' must be a list")
        try:
            table = base64.b64decode(doc.get("hashes", ""), validate=True)
        except (TypeError, ValueError) as exc:
            raise fail(where, "field 'hashes' is not base64") from exc
        blobs, tables = parse_blobs(
            raw_blobs, len(data_files), chunk_bytes, base is not None, table, where
        )
        created = unix_field(doc, "created_unix", where)
        if not isinstance(doc.get("tree"), dict):
            raise fail(where, "field 'tree' must be an object")
        # The skeleton is walked recursively on restore; the rest of the document is checked
        # field by field above. Its columns are parsed (checked) here, once.
        check_depth(doc["tree"], where)
        return cls(
            step=int_field(doc, "step", where, hi=MAX_STEP),
            rank=int_field(doc, "rank", where, hi=MAX_RANK),
            chunk_bytes=chunk_bytes,
            data_files=data_files,
            blobs=blobs,
            skeleton=doc["tree"],
            leaves=int_field(doc, "leaves", where),
            logical_bytes=int_field(doc, "logical_bytes", where),
            created_unix=created,
            base=base,
            replicated=_replicated(doc.get("replicated"), where),
            format_version=doc["format_version"],
            stats=_stats(doc, where),
            coded=_coded(doc, data_files, where),
            _tables=tables,
        )


def _stats(doc: dict[str, Any], where: str) -> dict[str, LeafStats] | None:
    if "stats" not in doc:
        return None
    if doc["format_version"] < STATS_FORMAT_VERSION:
        raise fail(where, f"field 'stats' in a manifest of format_version {doc['format_version']}")
    return decode_stats(doc["stats"], where)


def _coded(doc: dict[str, Any], files: tuple[str, ...], where: str) -> frozenset[str]:
    if "coded" not in doc and "codec" not in doc:
        return frozenset()
    if doc["format_version"] < CODEC_FORMAT_VERSION:
        raise fail(where, f"field 'coded' in a manifest of format_version {doc['format_version']}")
    if doc.get("codec") != CODEC_NAME:
        raise fail(
            where,
            f"data files stored with codec {doc.get('codec')!r:.40}, which this cryosnap does "
            f"not know (it reads {CODEC_NAME!r}); upgrade cryosnap to read it",
        )
    raw = doc.get("coded")
    if not isinstance(raw, list) or len(set(map(repr, raw))) != len(raw):
        raise fail(where, f"malformed field 'coded' {raw!r:.120}")
    if not all(type(i) is int and 0 <= i < len(files) for i in raw):
        raise fail(where, f"malformed field 'coded' {raw!r:.120}")
    return frozenset(files[i] for i in raw)


def with_codec(data: bytes, coded: frozenset[str], base_xxh3: str | None, where: str) -> bytes:
    """The text of manifest ``data`` as the persistent level stores it: naming the files of
    ``coded`` it lists as coded (format_version 8 when it names one) and its base's manifest
    by ``base_xxh3`` (that level's copy, which may differ from the faster level's). The same
    bytes for the same arguments, so a flush that runs again keeps what it wrote."""
    doc = json.loads(data)
    if not isinstance(doc, dict) or not isinstance(doc.get("data_files"), list):
        raise fail(where, "not a manifest")
    files = [i for i, f in enumerate(doc["data_files"]) if f in coded]
    if files:
        doc["format_version"] = CODEC_FORMAT_VERSION
        doc["codec"] = CODEC_NAME
        doc["coded"] = files
    if base_xxh3 is not None and isinstance(doc.get("base"), dict):
        doc["base"]["xxh3_128"] = base_xxh3
    return _dumps(doc).encode()


def _replicated(raw: Any, where: str) -> Replicated:
    if raw is None or raw is True:
        return raw
    if not isinstance(raw, list) or len(raw) > _MAX_REPLICATED_KEYS:
        raise fail(where, f"malformed field 'replicated' {raw!r:.120}")
    return tuple(decode_key(k, f"{where}: field 'replicated'") for k in raw)
