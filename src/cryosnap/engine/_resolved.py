"""Resolve: follow a manifest's chain of bases back to a full version and produce per chunk its
data file, offset and hash (numpy arrays; no data is read). Owns :class:`ResolvedPart`.

Runs on the caller's thread for reads and on the Checkpointer's background thread when a
written version becomes the next one's base; no collectives here.
docs/design/engine.md has the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cryosnap._format.blobs import STORED
from cryosnap._format.chunks import HASH_BYTES
from cryosnap._format.commit import CommitRecord
from cryosnap._format.manifest import BaseRef, Manifest
from cryosnap._format.skeleton import blob_paths
from cryosnap._located import located
from cryosnap.engine._records import _load_manifest, read_commit, read_manifest
from cryosnap.errors import CheckpointFormatError
from cryosnap.storage import Store

__all__ = [
    "MAX_CHAIN",
    "chain_coded",
    "chain_keys",
    "PartChunks",
    "ResolvedBlob",
    "ResolvedPart",
    "chain_manifests",
    "memory_limit_bytes",
    "resolve",
    "resolve_version",
]

# A chain longer than this is refused as malformed (full_every keeps real chains far shorter).
MAX_CHAIN = 4096

_Loc = tuple[str, int]  # (data file key, byte offset) of one stored chunk


_Files = np.ndarray[Any, np.dtype[np.int32]]
_Offsets = np.ndarray[Any, np.dtype[np.int64]]
_Hashes = np.ndarray[Any, np.dtype[np.uint8]]


class ResolvedBlob:
    """Where each chunk of one blob lies and what it hashes to: per chunk ``files`` (an index
    into ResolvedPart.files), ``offsets`` (byte offset in that file) and ``hashes`` (chunks,
    16).

    A blob of a resolved part takes its three arrays from the part's arrays of every chunk
    (``source``, chunks ``lo`` to ``hi``) when first asked: a restore reads the part's
    arrays, and slicing them for 20,000 small blobs up front cost more than resolving them.
    """

    __slots__ = ("_files", "_hashes", "_hi", "_lo", "_offsets", "_source", "nbytes", "path")

    def __init__(
        self,
        path: str,
        nbytes: int,
        files: _Files | None,
        offsets: _Offsets | None,
        hashes: _Hashes | None,
        source: tuple[_Files, _Offsets, _Hashes] | None = None,
        lo: int = 0,
        hi: int = 0,
    ) -> None:
        self.path = path
        self.nbytes = nbytes
        self._files = files
        self._offsets = offsets
        self._hashes = hashes
        self._source = source
        self._lo = lo
        self._hi = hi

    def _slice(self, i: int) -> Any:
        assert self._source is not None, "a ResolvedBlob made without its arrays"
        return self._source[i][self._lo : self._hi]

    @property
    def files(self) -> _Files:
        f = self._files
        if f is None:
            f = self._files = self._slice(0)
        return f

    @files.setter
    def files(self, value: _Files) -> None:
        self._files = value

    @property
    def offsets(self) -> _Offsets:
        o = self._offsets
        if o is None:
            o = self._offsets = self._slice(1)
        return o

    @offsets.setter
    def offsets(self, value: _Offsets) -> None:
        self._offsets = value

    @property
    def hashes(self) -> _Hashes:
        h = self._hashes
        if h is None:
            h = self._hashes = self._slice(2)
        return h

    @hashes.setter
    def hashes(self, value: _Hashes) -> None:
        self._hashes = value

    def __repr__(self) -> str:
        return (
            f"ResolvedBlob(path={self.path!r}, nbytes={self.nbytes!r}, files={self.files!r}, "
            f"offsets={self.offsets!r}, hashes={self.hashes!r})"
        )


@dataclass(frozen=True, slots=True, eq=False)
class PartChunks:
    """Every chunk of a part's blobs at once, blob after blob: ``starts`` (the first chunk of
    each blob, and the end) and per chunk its file, offset and hash, as in
    :class:`ResolvedBlob`. ``blobs`` is the list they describe."""

    blobs: list[ResolvedBlob]
    nbytes: np.ndarray[Any, np.dtype[np.int64]]  # of each blob
    starts: np.ndarray[Any, np.dtype[np.int64]]
    files: np.ndarray[Any, np.dtype[np.int32]]
    offsets: np.ndarray[Any, np.dtype[np.int64]]
    hashes: np.ndarray[Any, np.dtype[np.uint8]]  # (chunks, 16)

    @classmethod
    def of(cls, blobs: list[ResolvedBlob]) -> PartChunks:
        nbytes = np.fromiter((b.nbytes for b in blobs), np.int64, len(blobs))
        counts = np.fromiter((len(b.files) for b in blobs), np.int64, len(blobs))
        starts = np.zeros(len(blobs) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        if not blobs:
            return cls(
                blobs,
                nbytes,
                starts,
                np.empty(0, np.int32),
                np.empty(0, np.int64),
                np.empty((0, HASH_BYTES), np.uint8),
            )
        return cls(
            blobs,
            nbytes,
            starts,
            np.concatenate([b.files for b in blobs]),
            np.concatenate([b.offsets for b in blobs]),
            np.concatenate([b.hashes for b in blobs]).reshape(-1, HASH_BYTES),
        )


@dataclass(slots=True)
class ResolvedPart:
    """One rank's part of a version with its chain of bases applied."""

    manifest: Manifest
    key: str
    xxh3: str
    files: list[str]
    blobs: list[ResolvedBlob]
    chain: tuple[int, ...]  # steps whose manifests resolution needed, oldest first
    chain_keys: tuple[str, ...] = ()  # the keys of those manifests (this rank's), in order
    # The data files stored with the level's codec (any manifest of the chain says so):
    # readers go through storage's ``decoded(store, coded)``.
    coded: frozenset[str] = frozenset()
    _by_path: dict[str, int] = field(default_factory=dict)
    # Every chunk at once, as resolution built them (None, or stale after a replace(blobs=):
    # :meth:`chunks` builds them again).
    _chunks: PartChunks | None = field(default=None, compare=False, repr=False)

    def chunks(self) -> PartChunks:
        """Every chunk of the blobs at once: what a reader plans with, without a pass over
        the blobs."""
        c = self._chunks
        if c is None or c.blobs is not self.blobs:
            c = self._chunks = PartChunks.of(self.blobs)
        return c

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def depth(self) -> int:
        return len(self.chain)

    def blob_index(self, path: str) -> int | None:
        if not self._by_path:
            self._by_path = {b.path: i for i, b in enumerate(self.blobs)}
        return self._by_path.get(path)

    def used_files(self) -> list[str]:
        used: set[int] = set()
        for b in self.blobs:
            used.update(np.unique(b.files).tolist())
        return sorted(self.files[i] for i in used)

    def locations(self) -> dict[bytes, _Loc]:
        """Content index of this version: chunk hash -> where it is stored."""
        index: dict[bytes, _Loc] = {}
        for b in self.blobs:
            raw = b.hashes.tobytes()
            for i in range(len(b.offsets)):
                index.setdefault(
                    raw[i * HASH_BYTES : (i + 1) * HASH_BYTES],
                    (self.files[int(b.files[i])], int(b.offsets[i])),
                )
        return index


class _Chain:
    """A version being resolved, in compact form: per chunk of the part (every blob back to
    back) an id into tables of every chunk stored along the chain (file, offset, hash).

    Applying a manifest costs a few vectorized passes over its chunks and segments, whatever
    the number of blobs; the per-blob arrays (three gathers) are built once, at the end, for
    the version asked for only, not for every version of the chain.
    """

    __slots__ = ("_fidx", "_hashes", "_offs", "file_index", "files", "ids", "starts", "step")

    def __init__(self) -> None:
        self.files: list[str] = []
        self.file_index: dict[str, int] = {}
        self._fidx: list[np.ndarray[Any, np.dtype[np.int32]]] = []
        self._offs: list[np.ndarray[Any, np.dtype[np.int64]]] = []
        self._hashes: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
        self.ids: np.ndarray[Any, np.dtype[np.int64]] | None = None  # None: nothing applied
        self.starts = np.zeros(1, np.int64)  # first chunk of each blob in ids, and the end
        self.step = -1

    @classmethod
    def of(cls, part: ResolvedPart) -> _Chain:
        """A resolved part as the starting point (the base of a version being written)."""
        chain = cls()
        chain.files = list(part.files)
        chain.file_index = {f: i for i, f in enumerate(chain.files)}
        chunks = part.chunks()
        chain.starts = chunks.starts
        if part.blobs:
            chain._fidx.append(chunks.files)
            chain._offs.append(chunks.offsets)
            chain._hashes.append(chunks.hashes)
        chain.ids = np.arange(int(chain.starts[-1]), dtype=np.int64)
        chain.step = part.step
        return chain

    @property
    def stored(self) -> int:
        return sum(len(h) for h in self._hashes)

    def apply(self, manifest: Manifest, where: str) -> None:
        """Resolve ``manifest`` on top of this (its base; nothing for a full version)."""
        if (manifest.base is None) != (self.ids is None):
            raise CheckpointFormatError(f"{where}: base of step {manifest.step} does not match")
        _check_claimed_bytes(manifest, where)
        cb = manifest.chunk_bytes
        local = np.array([self._file(f) for f in manifest.data_files] or [0], np.int32)
        tables = manifest.tables()
        nb = len(manifest.blobs)
        nchunks = -(-tables.nbytes // cb)
        starts = np.zeros(nb + 1, np.int64)
        np.cumsum(nchunks, out=starts[1:])
        n = int(starts[-1])
        rows = tables.rows
        table = tables.table
        kind, a, b, c = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
        stored = kind == STORED
        counts = np.where(stored, -(-c // cb), c)
        hashes = np.frombuffer(tables.hashes, np.uint8).reshape(-1, HASH_BYTES)
        if int(counts.sum()) != n or int(counts[stored].sum()) != len(hashes):
            raise CheckpointFormatError(f"{where}: segments do not cover the blobs' chunks")
        before = 0 if self.ids is None else len(self.ids)
        # Where each segment's first chunk is in [base ids..., this version's stored ids...].
        stored_counts = np.where(stored, counts, 0)
        seg_src = before + np.cumsum(stored_counts) - stored_counts
        inherited = ~stored
        if inherited.any():
            assert self.ids is not None
            blob, first = a[inherited], b[inherited]
            nbase = len(self.starts) - 1
            base_chunks = self.starts[1:] - self.starts[:-1]
            bad = blob >= nbase
            bad[~bad] = first[~bad] + c[inherited][~bad] > base_chunks[blob[~bad]]
            if bad.any():
                i = int(np.repeat(np.arange(nb), rows)[inherited][np.argmax(bad)])
                raise CheckpointFormatError(
                    f"{where}: blob {i} inherits chunks its base (step {self.step}) lacks"
                )
            seg_src[inherited] = self.starts[blob] + first
        seg_start = np.cumsum(counts) - counts
        within = np.arange(n, dtype=np.int64) - np.repeat(seg_start, counts)
        pos = np.repeat(seg_src, counts) + within
        new_ids = np.arange(self.stored, self.stored + len(hashes), dtype=np.int64)
        ext = new_ids if self.ids is None else np.concatenate([self.ids, new_ids])
        self.ids = ext[pos]
        self.starts = starts
        # The new stored chunks: file and offset of each.
        s_rows, s_counts = table[stored], counts[stored]
        s_within = np.arange(len(hashes), dtype=np.int64) - np.repeat(
            np.cumsum(s_counts) - s_counts, s_counts
        )
        self._fidx.append(np.repeat(local[s_rows[:, 1]], s_counts))
        self._offs.append(np.repeat(s_rows[:, 2], s_counts) + s_within * cb)
        self._hashes.append(hashes)
        self.step = manifest.step

    def _file(self, key: str) -> int:
        i = self.file_index.get(key)
        if i is None:
            i = self.file_index[key] = len(self.files)
            self.files.append(key)
        return i

    def part(
        self,
        manifest: Manifest,
        key: str,
        xxh3: str,
        chain: tuple[int, ...],
        paths: list[str] | None = None,
        keys: tuple[str, ...] = (),
    ) -> ResolvedPart:
        """The per-blob arrays of the version applied last (``paths``: each blob's leaf path,
        when the caller has them already)."""
        assert self.ids is not None
        ids = self.ids
        if len(self._hashes) == 1 and len(ids) == len(self._hashes[0]):
            fidx, offs, hashes = self._fidx[0], self._offs[0], self._hashes[0]
            if not (ids == np.arange(len(ids))).all():
                fidx, offs, hashes = fidx[ids], offs[ids], hashes[ids]
        else:
            fidx = np.concatenate(self._fidx)[ids]
            offs = np.concatenate(self._offs)[ids]
            # 16-byte rows as one opaque item each: one gather instead of a 2-D one.
            raw = np.concatenate(self._hashes).view(f"V{HASH_BYTES}").reshape(-1)
            hashes = raw[ids].view(np.uint8).reshape(-1, HASH_BYTES)
        if paths is None or len(paths) != len(manifest.blobs):
            paths = blob_paths(manifest.skeleton, len(manifest.blobs))
        s = self.starts.tolist()
        source = (fidx, offs, hashes)  # each blob's arrays are sliced when first asked
        blobs = [
            ResolvedBlob(path, e.nbytes, None, None, None, source, lo, hi)
            for path, e, lo, hi in zip(paths, manifest.blobs, s, s[1:], strict=False)
        ]
        part = ResolvedPart(manifest, key, xxh3, list(self.files), blobs, chain, keys or (key,))
        nbytes = manifest.tables().nbytes
        part._chunks = PartChunks(blobs, nbytes, self.starts, fidx, offs, hashes)
        return part


def _resolve_one(
    manifest: Manifest, key: str, xxh3: str, base: ResolvedPart | None, where: str
) -> ResolvedPart:
    if (manifest.base is None) != (base is None):
        raise CheckpointFormatError(f"{where}: base of step {manifest.step} does not match")
    chain = _Chain() if base is None else _Chain.of(base)
    chain.apply(manifest, where)
    steps = (*base.chain, manifest.step) if base is not None else (manifest.step,)
    keys = (*base.chain_keys, key) if base is not None else (key,)
    part = chain.part(manifest, key, xxh3, steps, keys=keys)
    part.coded = manifest.coded if base is None else manifest.coded | base.coded
    return part


def memory_limit_bytes() -> int:
    """The most one restore may allocate for its leaves: this machine's physical memory. A
    version that claims more cannot be restored here whatever its data files hold, and a
    manifest that claims it (a few bytes can) must not make the reader try."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):  # no sysconf: assume a large machine
        return 1 << 40


def _check_claimed_bytes(manifest: Manifest, where: str) -> None:
    # Python ints: a hostile manifest's sizes could wrap an int64 sum.
    claimed = sum(manifest.tables().nbytes.tolist())
    limit = memory_limit_bytes()
    if claimed > limit:
        raise CheckpointFormatError(
            f"{where}: step {manifest.step} claims {claimed} bytes of leaves, more than this "
            f"machine's memory ({limit} bytes)"
        )


def resolve(
    store: Store,
    manifest: Manifest,
    key: str,
    xxh3: str,
    *,
    chain: list[tuple[Manifest, str, str]] | None = None,
    paths: list[str] | None = None,
) -> ResolvedPart:
    """Apply ``manifest``'s chain of bases (``chain``, as :func:`chain_manifests` gives it, or
    read here); reads manifests only, verified hash by hash. ``paths``: the leaf path of each
    blob (``_format.skeleton.blob_paths``), when the caller has walked the skeleton already."""
    if chain is None:
        chain = chain_manifests(store, manifest, key, xxh3)
    # Compact resolution up the chain; the per-blob arrays only for the version asked for.
    state = _Chain()
    for m, _k, _h in reversed(chain):
        state.apply(m, f"{store.url}: {_k}")
    steps = tuple(m.step for m, _k, _h in reversed(chain))
    keys = tuple(k for _m, k, _h in reversed(chain))
    part = state.part(manifest, key, xxh3, steps, paths, keys=keys)
    part.coded = chain_coded(chain)
    return part


def chain_coded(chain: list[tuple[Manifest, str, str]]) -> frozenset[str]:
    """The data files a chain of manifests names as coded."""
    return frozenset().union(*(m.coded for m, _k, _h in chain))


def chain_manifests(
    store: Store, manifest: Manifest, key: str, xxh3: str
) -> list[tuple[Manifest, str, str]]:
    """``manifest`` and the manifests of its chain of bases, newest first, as (manifest, key,
    xxh3); each base is checked against the hash its successor recorded."""
    chain: list[tuple[Manifest, str, str]] = [(manifest, key, xxh3)]
    while chain[-1][0].base is not None:
        ref: BaseRef = chain[-1][0].base
        if len(chain) > MAX_CHAIN or ref.step == chain[-1][0].step:
            raise CheckpointFormatError(
                f"{store.url}: chain of step {manifest.step} is malformed at step {ref.step}"
            )
        base = _load_manifest(store, ref.key, ref.xxh3, None, manifest.step)
        if base.step != ref.step or base.rank != manifest.rank:
            raise CheckpointFormatError(f"{store.url}: {ref.key} is not step {ref.step}")
        if base.chunk_bytes != manifest.chunk_bytes:
            raise CheckpointFormatError(f"{store.url}: {ref.key} has another chunk size")
        chain.append((base, ref.key, ref.xxh3))
    return chain


def chain_keys(store: Store, record: CommitRecord) -> list[str]:
    """The keys of every manifest version ``record`` resolves through, every rank's part,
    oldest first; each manifest checked against the hash its referrer recorded. Whatever the
    manifests are named (a generation, a token): the chain is followed, not guessed."""
    out: dict[str, None] = {}
    for ref in record.manifests:
        manifest, _ = read_manifest(store, record, ref.rank)
        chain = chain_manifests(store, manifest, ref.key, ref.xxh3)
        out.update(dict.fromkeys(key for _m, key, _h in reversed(chain)))
    return list(out)


def resolve_version(store: Store, step: int, *, rank: int = 0) -> ResolvedPart:
    """Read the commit record of ``step`` and resolve one rank's part."""
    with located(step=step, path=store.url):
        record = read_commit(store, step)
        manifest, ref = read_manifest(store, record, rank)
        return resolve(store, manifest, ref.key, ref.xxh3)
