"""Copy one version onto another store as a full version of its own: only the chunks the
version reads, each once (a chunk that several ranks read is copied by the first and named by
the others), every chunk verified against its hash on the way. What ``Run.fork`` does where
the fork cannot name the source's files (another file system, an object store).

Runs on the calling thread; writes the data files, then the manifests, then the commit
record, as a save does, so a crash leaves no version (its files are leftovers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xxhash

from cryosnap._format.blobs import BlobEntry
from cryosnap._format.chunks import hash_each_released
from cryosnap._format.commit import CommitRecord, ManifestRef
from cryosnap._format.keys import data_key, manifest_key
from cryosnap.engine._records import _no_fence, read_commit, read_manifest
from cryosnap.engine._resolved import PartChunks, ResolvedPart, resolve
from cryosnap.engine.write._differ import align_pad
from cryosnap.errors import IntegrityError
from cryosnap.storage import BlobWriter, Store

__all__ = ["copy_version"]

_I64 = np.ndarray[Any, np.dtype[np.int64]]

# Chunks read per request while copying (bounded memory whatever the version's size).
_BATCH_BYTES = 64 << 20


@dataclass(slots=True)
class _Copied:
    """Where each copied chunk went: (source file, offset) -> (data file index, offset)."""

    keys: list[str] = field(default_factory=list)
    at: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    written: int = 0


def copy_version(
    source: Store,
    step: int,
    dest: Store,
    *,
    token: str,
    fence: Callable[[], None] = _no_fence,
) -> CommitRecord:
    """Write version ``step`` of ``source`` on ``dest`` (data files named with ``token``),
    full and self-contained; returns its commit record (written last)."""
    record = read_commit(source, step)
    copied = _Copied()
    texts: list[tuple[str, bytes]] = []
    refs: list[ManifestRef] = []
    for ref in record.manifests:
        manifest, _ = read_manifest(source, record, ref.rank)
        part = resolve(source, manifest, ref.key, ref.xxh3)
        key = data_key(step, ref.rank, token)
        writer = dest.open_writer(key)
        try:
            blobs = _copy_part(source, part, copied, len(copied.keys), writer, record.chunk_bytes)
            copied.keys.append(key)
            fence()
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        full = replace(
            manifest,
            data_files=tuple(copied.keys),
            blobs=tuple(blobs),
            base=None,
            created_unix=manifest.created_unix,
        )
        full, text = full.encode()
        mkey = manifest_key(step, ref.rank)
        texts.append((mkey, text))
        refs.append(ManifestRef(ref.rank, mkey, xxhash.xxh3_128_hexdigest(text), len(text)))
    fence()
    for mkey, text in texts:
        dest.write(mkey, text)
    out = replace(
        record,
        manifests=tuple(refs),
        data_files=tuple(copied.keys),
        written_bytes=copied.written,
        incremental=False,
        chain=(step,),
        lineage=None,
        run_id=None,
    )
    fence()
    dest.write(out.key, out.to_json())
    return out


def _copy_part(
    source: Store,
    part: ResolvedPart,
    copied: _Copied,
    own: int,
    writer: BlobWriter,
    chunk_bytes: int,
) -> list[BlobEntry]:
    """Copy the chunks of ``part`` not copied yet into ``writer`` (data file ``own``), and
    return its blobs as stored segments over the copies."""
    chunks = part.chunks()
    sizes = _chunk_sizes(chunks.nbytes, chunks.starts, chunk_bytes)
    where = np.zeros((len(sizes), 2), np.int64)  # per chunk: (file index, offset)
    pending: list[int] = []
    pending_bytes = 0
    first_of_blob = np.zeros(len(sizes), bool)
    first_of_blob[chunks.starts[:-1][chunks.starts[:-1] < len(sizes)]] = True
    for i in range(len(sizes)):
        name = (part.files[int(chunks.files[i])], int(chunks.offsets[i]))
        seen = copied.at.get(name)
        if seen is None:
            pad = align_pad(writer.tell() + pending_bytes, int(sizes[i])) if first_of_blob[i] else 0
            if pad:
                _flush(source, part, chunks, sizes, pending, writer, copied, own)
                pending_bytes = 0
                writer.write([bytes(pad)])
            copied.at[name] = seen = (own, writer.tell() + pending_bytes)
            pending.append(i)
            pending_bytes += int(sizes[i])
            if pending_bytes >= _BATCH_BYTES:
                _flush(source, part, chunks, sizes, pending, writer, copied, own)
                pending_bytes = 0
        where[i] = seen
    _flush(source, part, chunks, sizes, pending, writer, copied, own)
    return [
        _entry(part, b, where[chunks.starts[b] : chunks.starts[b + 1]], chunks, chunk_bytes)
        for b in range(len(chunks.blobs))
    ]


def _chunk_sizes(nbytes: _I64, starts: _I64, chunk_bytes: int) -> _I64:
    """The size of each chunk: ``chunk_bytes``, but the last of a blob."""
    counts = np.diff(starts)
    sizes = np.full(int(starts[-1]), chunk_bytes, np.int64)
    last = starts[1:][counts > 0] - 1
    sizes[last] = nbytes[counts > 0] - (counts[counts > 0] - 1) * chunk_bytes
    return sizes


def _flush(
    source: Store,
    part: ResolvedPart,
    chunks: PartChunks,
    sizes: _I64,
    pending: list[int],
    writer: BlobWriter,
    copied: _Copied,
    own: int,
) -> None:
    """Read the ``pending`` chunks (one request per source file), check each against its
    hash, append them to ``writer`` in order."""
    if not pending:
        return
    files, offsets, hashes = chunks.files, chunks.offsets, chunks.hashes
    bufs = {i: bytearray(int(sizes[i])) for i in pending}
    by_file: dict[int, list[int]] = {}
    for i in pending:
        by_file.setdefault(int(files[i]), []).append(i)
    for f, ids in by_file.items():
        ids.sort(key=lambda i: int(offsets[i]))
        ranges = [(int(offsets[i]), [memoryview(bufs[i])]) for i in ids]
        source.read_ranges(part.files[f], ranges)
    got = hash_each_released([memoryview(bufs[i]) for i in pending])
    for n, i in enumerate(pending):
        if got[n] != bytes(hashes[i]):
            raise IntegrityError(
                f"step {part.step}, {source.url}: a chunk of {part.files[int(files[i])]} at "
                f"offset {int(offsets[i])} does not match its hash",
                step=part.step,
                path=part.files[int(files[i])],
            )
    writer.write([bufs[i] for i in pending])
    copied.written += sum(len(bufs[i]) for i in pending)
    pending.clear()


def _entry(
    part: ResolvedPart, b: int, where: _I64, chunks: PartChunks, chunk_bytes: int
) -> BlobEntry:
    """Blob ``b`` as stored segments: one row per run of chunks lying back to back."""
    blob = chunks.blobs[b]
    lo = int(chunks.starts[b])
    hashes = chunks.hashes[lo : lo + len(where)].tobytes()
    rows: list[list[int]] = []
    left = int(blob.nbytes)
    for f, off in where.tolist():
        size = min(chunk_bytes, left)
        left -= size
        if rows and rows[-1][1] == f and rows[-1][2] + rows[-1][3] == off:
            rows[-1][3] += size
        else:
            rows.append([0, f, off, size])
    table = np.array(rows, np.int64).reshape(-1, 4)
    return BlobEntry(int(blob.nbytes), part.manifest.blobs[b].root, table, hashes, chunk_bytes)
