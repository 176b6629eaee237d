"""The write and read pipelines of one version on one tier.

Write (:class:`PartWriter` then ``commit_version``): hash the chunks of each captured batch and
append its bytes to one packed data file per rank and version (``writev``: many buffers, few
syscalls), fsync it, write the rank's manifest, and finally the commit record. Until the commit
record exists the version is invisible; a crash at any point leaves only unreferenced files that
retention removes.

Read (``read_part``): read the commit record and the rank's manifest (both checked against their
hashes), allocate every leaf empty, read each data file in large contiguous runs straight into
the leaves (``preadv``), verify every chunk's hash, then build the tree. ``into=`` is checked
before any byte is read and filled only after every chunk verified.

Writes run on the Checkpointer's background thread, reads on the caller's; no collectives here.
"""

from __future__ import annotations

import logging
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from .capture import Piece
from .chunks import HASH_BYTES, hash_chunks, merkle_root
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
)
from .manifest import (
    BlobEntry,
    CommitRecord,
    Extent,
    Manifest,
    ManifestRef,
    commit_key,
    data_key,
    manifest_key,
    now_unix,
    step_of_commit_key,
)
from .storage import Store
from .storage.base import BlobWriter, TruncatedError
from .tree import FlatState, Restorer, apply_into, check_into

__all__ = [
    "PartResult",
    "PartWriter",
    "commit_version",
    "list_steps",
    "read_commit",
    "read_manifest",
    "read_part",
    "verify_part",
]

log = logging.getLogger("cryosnap")

# Bytes handed to one writev/preadv call: large enough for sequential bandwidth.
IO_BATCH_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PartResult:
    """What one rank wrote for a version."""

    ref: ManifestRef
    data_files: tuple[str, ...]
    logical_bytes: int
    written_bytes: int
    chunks: int
    new_chunks: int
    leaves: int
    root: bytes


class PartWriter:
    """Streams one rank's part of a version into one packed data file, then its manifest.

    ``add`` hashes each piece's chunks and appends its bytes to the data file; pieces of a blob
    arrive in order and start on chunk boundaries. ``finish`` fsyncs the data file and writes the
    manifest (durable, not yet committed). Runs on the background writer thread.
    """

    def __init__(
        self, store: Store, step: int, flat: FlatState, *, chunk_bytes: int, rank: int = 0
    ) -> None:
        if store.exists(commit_key(step)):
            raise CheckpointExistsError(f"step {step} already exists in {store.url}")
        self.store = store
        self.step = step
        self.rank = rank
        self.flat = flat
        self.chunk_bytes = chunk_bytes
        self.key = data_key(step, rank, secrets.token_hex(4))
        self._writer: BlobWriter | None = None
        self._offset = 0
        self._hashes = [bytearray() for _ in flat.blobs]
        self._extents: list[list[Extent]] = [[] for _ in flat.blobs]

    @property
    def written_bytes(self) -> int:
        return self._offset

    def add(self, pieces: Sequence[Piece]) -> None:
        if not pieces:
            return
        for p in pieces:
            self._hashes[p.blob] += hash_chunks(p.view, self.chunk_bytes)
            ext = self._extents[p.blob]
            n = p.view.nbytes
            if ext and ext[-1].offset + ext[-1].nbytes == self._offset:
                ext[-1] = Extent(0, ext[-1].offset, ext[-1].nbytes + n)
            else:
                ext.append(Extent(0, self._offset, n))
            self._offset += n
        if self._writer is None:
            self._writer = self.store.open_writer(self.key)
        self._writer.write([p.view for p in pieces])

    def finish(self) -> PartResult:
        if self._writer is not None:
            self._writer.commit()
        blobs = []
        nchunks = 0
        for blob, hashes, extents in zip(self.flat.blobs, self._hashes, self._extents, strict=True):
            h = bytes(hashes)
            if sum(e.nbytes for e in extents) != blob.nbytes:
                raise CheckpointError(
                    f"step {self.step}: leaf {blob.path} was captured incompletely "
                    f"({sum(e.nbytes for e in extents)} of {blob.nbytes} bytes)"
                )
            nchunks += len(h) // HASH_BYTES
            blobs.append(BlobEntry(blob.nbytes, merkle_root(h), h, tuple(extents)))
        files = (self.key,) if self._writer is not None else ()
        manifest = Manifest(
            step=self.step,
            rank=self.rank,
            chunk_bytes=self.chunk_bytes,
            data_files=files,
            blobs=tuple(blobs),
            skeleton=self.flat.skeleton,
            leaves=self.flat.leaves,
            logical_bytes=self.flat.logical_bytes,
            created_unix=now_unix(),
        )
        body = manifest.to_json()
        mkey = manifest_key(self.step, self.rank)
        self.store.write(mkey, body)
        return PartResult(
            ref=ManifestRef(self.rank, mkey, xxhash.xxh3_128_hexdigest(body), len(body)),
            data_files=files,
            logical_bytes=self.flat.logical_bytes,
            written_bytes=self._offset,
            chunks=nchunks,
            new_chunks=nchunks,
            leaves=self.flat.leaves,
            root=merkle_root([b.root for b in blobs]),
        )

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def commit_version(
    store: Store, step: int, parts: Sequence[PartResult], *, chunk_bytes: int
) -> CommitRecord:
    """Write the commit record that makes ``step`` visible; every part must be durable."""
    parts = sorted(parts, key=lambda p: p.ref.rank)
    record = CommitRecord(
        step=step,
        world_size=len(parts),
        manifests=tuple(p.ref for p in parts),
        data_files=tuple(sorted({f for p in parts for f in p.data_files})),
        logical_bytes=sum(p.logical_bytes for p in parts),
        written_bytes=sum(p.written_bytes for p in parts),
        leaves=sum(p.leaves for p in parts),
        chunk_bytes=chunk_bytes,
        root=merkle_root([p.root for p in parts]).hex(),
        created_unix=now_unix(),
    )
    store.write(commit_key(step), record.to_json())
    log.debug("committed step %d in %s", step, store.url)
    return record


# ---------------------------------------------------------------------------------------------
# read


def list_steps(store: Store) -> list[int]:
    """Steps with a commit record on ``store``, ascending."""
    steps = (step_of_commit_key(k) for k in store.list("versions"))
    return sorted(s for s in steps if s is not None)


def read_commit(store: Store, step: int) -> CommitRecord:
    key = commit_key(step)
    try:
        data = store.read(key)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"step {step} not found in {store.url}") from None
    return CommitRecord.from_json(data, f"{store.url}: {key}")


def read_manifest(store: Store, record: CommitRecord, rank: int) -> Manifest:
    refs = [m for m in record.manifests if m.rank == rank]
    if not refs:
        raise CheckpointNotFoundError(
            f"step {record.step} in {store.url} has no rank {rank} (world size {record.world_size})"
        )
    ref = refs[0]
    data = store.read(ref.key)
    if len(data) != ref.nbytes or xxhash.xxh3_128_hexdigest(data) != ref.xxh3:
        raise IntegrityError(
            f"step {record.step}, tier {store.url}: manifest {ref.key} does not match the hash "
            "in its commit record"
        )
    manifest = Manifest.from_json(data, f"{store.url}: {ref.key}")
    if manifest.step != record.step or manifest.rank != rank:
        raise CheckpointFormatError(
            f"{store.url}: {ref.key} describes step {manifest.step} rank {manifest.rank}"
        )
    return manifest


def _read_blobs(
    store: Store, manifest: Manifest, views: Sequence[memoryview], paths: Sequence[str]
) -> None:
    """Fill ``views`` from the data files in large runs, then verify every chunk."""
    # (file, offset, blob, start-in-blob, nbytes), grouped per file in file order, so adjacent
    # extents become one preadv of many buffers.
    pieces: dict[int, list[tuple[int, int, int, int]]] = {}
    for i, entry in enumerate(manifest.blobs):
        start = 0
        for e in entry.extents:
            pieces.setdefault(e.file, []).append((e.offset, i, start, e.nbytes))
            start += e.nbytes
    for f, plist in pieces.items():
        key = manifest.data_files[f]
        plist.sort()
        # Merge pieces that follow each other in the file into runs of at most a few batches.
        runs: list[tuple[int, list[memoryview], int]] = []  # (offset, buffers, first blob)
        end = -1
        size = 0
        for offset, blob, start, nbytes in plist:
            view = views[blob][start : start + nbytes]
            if runs and offset == end and size < 4 * IO_BATCH_BYTES:
                runs[-1][1].append(view)
                size += nbytes
            else:
                runs.append((offset, [view], blob))
                size = nbytes
            end = offset + nbytes
        for offset, bufs, first_blob in runs:
            try:
                store.read_into(key, offset, bufs)
            except (TruncatedError, CheckpointNotFoundError) as exc:
                what = "truncated" if isinstance(exc, TruncatedError) else "missing"
                raise IntegrityError(
                    f"step {manifest.step}, tier {store.url}: data file {key} is {what}; "
                    f"leaf {paths[first_blob]} cannot be read"
                ) from exc
    for i, entry in enumerate(manifest.blobs):
        _verify_blob(store, manifest, i, entry, views[i], paths[i])


def _verify_blob(
    store: Store, manifest: Manifest, i: int, entry: BlobEntry, view: memoryview, path: str
) -> None:
    hashes = hash_chunks(view, manifest.chunk_bytes)
    if hashes == entry.hashes and merkle_root(hashes) == entry.root:
        return
    for c in range(0, len(hashes), HASH_BYTES):
        if hashes[c : c + HASH_BYTES] != entry.hashes[c : c + HASH_BYTES]:
            chunk = c // HASH_BYTES
            lo = chunk * manifest.chunk_bytes
            hi = min(lo + manifest.chunk_bytes, entry.nbytes)
            raise IntegrityError(
                f"step {manifest.step}, tier {store.url}: leaf {path}: chunk {chunk} "
                f"(bytes {lo}-{hi}) does not match its hash"
            )
    raise IntegrityError(
        f"step {manifest.step}, tier {store.url}: leaf {path}: Merkle root does not match"
    )


def read_part(
    store: Store,
    step: int,
    *,
    rank: int = 0,
    into: Any = None,
    allow_pickle: bool = False,
) -> Any:
    """Read, verify and assemble one rank's state of ``step`` (optionally into ``into``)."""
    record = read_commit(store, step)
    manifest = read_manifest(store, record, rank)
    if into is not None:
        check_into(manifest.skeleton, into)
    restorer = Restorer(
        manifest.skeleton, [b.nbytes for b in manifest.blobs], allow_pickle=allow_pickle
    )
    views = restorer.allocate()
    _read_blobs(store, manifest, views, restorer.blob_paths)
    tree = restorer.build()
    if into is None:
        return tree
    try:
        return apply_into(manifest.skeleton, tree, into)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"step {step}: filling into= failed: {exc}") from exc


def verify_part(store: Store, step: int, *, rank: int = 0) -> Manifest:
    """Read and verify every chunk of one rank's part; raise on the first damage found."""
    record = read_commit(store, step)
    manifest = read_manifest(store, record, rank)
    restorer = Restorer(manifest.skeleton, [b.nbytes for b in manifest.blobs], allow_pickle=True)
    views = restorer.allocate()
    _read_blobs(store, manifest, views, restorer.blob_paths)
    return manifest


def newest_restorable(store: Store, attempt: Any, steps: Sequence[int]) -> Any:
    """Run ``attempt(step)`` from the newest step down; warn and fall back past damage."""
    if not steps:
        raise CheckpointNotFoundError(f"no committed version in {store.url}")
    errors: list[str] = []
    for step in reversed(steps):
        try:
            return attempt(step)
        except (IntegrityError, CheckpointFormatError) as exc:
            errors.append(str(exc))
            warnings.warn(
                f"cryosnap: skipping damaged step {step} in {store.url}: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
    raise IntegrityError(f"every version in {store.url} is damaged; newest error: {errors[0]}")
