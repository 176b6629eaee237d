"""The claims of a version's chain checked against reality before anything is allocated or
read (:func:`check_chain_claims`: claimed bytes, inherited runs, stored runs against the real
sizes of their files) and after resolution (:func:`check_used_files`: files only an older
manifest names). Hostile or truncated runs are refused here, naming the leaf.

Caller's thread; a size per data file, no reads of data. docs/design/read-path.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection

import numpy as np

from cryosnap._format.blobs import STORED
from cryosnap._format.manifest import Manifest
from cryosnap._format.skeleton import blob_paths
from cryosnap.engine._resolved import ResolvedPart, _check_claimed_bytes, chain_coded
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
)
from cryosnap.storage import Store, decoded

__all__ = ["check_chain_claims", "check_used_files", "leaf_path"]


def check_chain_claims(
    store: Store, chain: list[tuple[Manifest, str, str]], listed: Collection[str]
) -> set[str]:
    """Check every claim of ``chain`` (newest first) against reality before anything is
    allocated or read: each manifest's claimed bytes against memory, each inherited run
    against the chunks its base has, each stored run against the real size of its data file.

    Sizes are taken once per file, for the files of the version's own manifest and of
    ``listed`` (the commit record's: all the version may read); an older manifest's other
    files may be retired (their chunks superseded) and are checked after resolution if used. A
    file that is missing is left to the read, which names the leaf. Returns the files whose
    sizes were checked."""
    store = decoded(store, chain_coded(chain))
    sizes: dict[str, int] = {}
    wanted = set(chain[0][0].data_files) | set(listed)
    for f in {f for m, _k, _h in chain for f in m.data_files if f in wanted}:
        try:
            sizes[f] = store.size(f)
        except CheckpointNotFoundError:
            continue
    for i, (m, key, _h) in enumerate(chain):
        where = f"{store.url}: {key}"
        _check_claimed_bytes(m, where)
        if not m.blobs:
            continue
        table = m.tables().table
        kind, a, b, c = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
        inherited = kind != STORED
        if inherited.any():
            base = chain[i + 1][0]  # a manifest with inherited runs has a base (parsed so)
            have = (
                -(-base.tables().nbytes // base.chunk_bytes)
                if base.blobs
                else np.zeros(1, np.int64)
            )
            blob, first, count = a[inherited], b[inherited], c[inherited]
            if (blob >= len(base.blobs)).any() or (
                first + count > have[np.minimum(blob, len(have) - 1)]
            ).any():
                raise CheckpointFormatError(
                    f"{where}: inherits chunks its base (step {base.step}) does not have",
                    step=chain[0][0].step,
                    path=store.url,
                )
        file_size = np.array([sizes.get(f, -1) for f in m.data_files] or [-1], np.int64)
        size = np.where(inherited, -1, file_size[np.where(inherited, 0, a)])
        # Offsets and sizes are below 2**47 (manifest.MAX_FILE_BYTES): the sum cannot wrap.
        past = (size >= 0) & (b + c > size)
        if past.any():
            j = int(np.argmax(past))
            f, lo, hi = m.data_files[int(a[j])], int(b[j]), int(b[j] + c[j])
            blob = int(np.searchsorted(np.cumsum(m.tables().rows), j, side="right"))
            raise IntegrityError(
                f"step {chain[0][0].step}, tier {store.url}: data file {f} is truncated "
                f"({int(size[j])} bytes; {key} needs bytes {lo}-{hi}); "
                f"leaf {leaf_path(m, blob)} cannot be read",
                step=chain[0][0].step,
                path=store.url,
            )
    return set(sizes)


def leaf_path(manifest: Manifest, blob: int) -> str:
    """The leaf path of ``blob`` for a message (its number if the skeleton does not say)."""
    try:
        return blob_paths(manifest.skeleton, len(manifest.blobs))[blob] or f"blob {blob}"
    except CheckpointError:
        return f"blob {blob}"


def check_used_files(store: Store, part: ResolvedPart, checked: set[str]) -> None:
    """The chunks the resolved version reads from files :func:`check_chain_claims` did not
    size (files an older manifest names that the commit record does not list) lie inside
    them too, so no read goes past a file's end or reaches the OS with an absurd offset."""
    unchecked = [i for i, f in enumerate(part.files) if f not in checked]
    if not unchecked or not part.blobs:
        return
    store = decoded(store, part.coded)
    size = np.full(len(part.files), -1, np.int64)
    for i in unchecked:
        with contextlib.suppress(CheckpointNotFoundError):  # missing: the read names it
            size[i] = store.size(part.files[i])
    cb = part.manifest.chunk_bytes
    chunks = part.chunks()  # every chunk of every blob at once
    have = size[chunks.files]
    ends = chunks.offsets + cb
    last = chunks.starts[1:] - 1  # each blob's last chunk (of a blob that has one)
    short = (chunks.nbytes % cb != 0) & (last >= chunks.starts[:-1])
    ends[last[short]] -= cb - chunks.nbytes[short] % cb  # the short last chunks
    past = (have >= 0) & (ends > have)
    if past.any():
        c = int(np.argmax(past))
        b = part.blobs[int(np.searchsorted(chunks.starts, c, side="right")) - 1]
        f = part.files[int(chunks.files[c])]
        raise IntegrityError(
            f"step {part.step}, tier {store.url}: data file {f} is truncated; "
            f"leaf {b.path} cannot be read",
            step=part.step,
            path=store.url,
        )
