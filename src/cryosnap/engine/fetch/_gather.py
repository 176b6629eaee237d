"""Windowed gathers of a scattered blob's chunks (the end of an incremental chain over sparse
updates): windows of a file read in a few calls, the chunks copied out with one vectorized
index each, then verified all at once. Runs on the read pool's threads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from cryosnap._format.chunks import HASH_BYTES, hash_bytes, hash_chunks_released
from cryosnap.engine._resolved import ResolvedPart
from cryosnap.engine.fetch._plan import _GATHER_WINDOW_BYTES, Gather, gather_windows, window_batches
from cryosnap.engine.fetch._verify import _INLINE_HASH_BYTES, Outcome
from cryosnap.errors import CheckpointNotFoundError, IntegrityError
from cryosnap.storage import Store
from cryosnap.storage.base import TruncatedError

__all__ = ["Gatherer", "unreadable"]


def unreadable(part: ResolvedPart, url: str, key: str, exc: Exception, leaf: str) -> IntegrityError:
    """The error for data file ``key`` missing or truncated (``exc``), naming ``leaf``."""
    what = "truncated" if isinstance(exc, TruncatedError) else "missing"
    error = IntegrityError(
        f"step {part.step}, tier {url}: data file {key} is {what}; leaf {leaf} cannot be read"
    )
    error.__cause__ = exc
    return error


class Gatherer:
    """Reads and verifies the gathers of one part into the leaves (``views``), or into the
    private buffers of ``staged`` blobs (into='s own, copied into place by the second pass);
    a window spans no gap wider than ``gap_bytes`` (the read's :class:`ReadLimits`)."""

    def __init__(
        self,
        store: Store,
        part: ResolvedPart,
        views: Sequence[memoryview],
        staged: Mapping[int, np.ndarray[Any, Any]],
        outcome: Outcome,
        on_bytes: Callable[[int], None],
        *,
        gap_bytes: int,
    ) -> None:
        self.store, self.part, self.views, self.staged = store, part, views, staged
        self.outcome, self.on_bytes = outcome, on_bytes
        self.gap_bytes = gap_bytes
        self.cb = part.manifest.chunk_bytes

    def run(self, number: int, task: Gather) -> None:
        try:
            self._read(task)
        except BaseException as exc:
            self.outcome.fail(number, exc)
            return
        i, idx = task.blob, task.chunks
        dest = self.staged.get(i)
        view = dest.data if dest is not None else self.views[i]
        cb = self.cb
        hash_one = hash_bytes if cb <= _INLINE_HASH_BYTES else self._hash_chunk
        chunks = idx.tolist()
        got = [hash_one(view[c * cb : (c + 1) * cb]) for c in chunks]
        # Compared all at once; chunk by chunk only when something differs.
        part_chunks = self.part.chunks()
        want = part_chunks.hashes[int(part_chunks.starts[i]) + idx].tobytes()
        if b"".join(got) == want:
            return
        for k, c in enumerate(chunks):
            if got[k] != want[k * HASH_BYTES : (k + 1) * HASH_BYTES]:
                self.outcome.mismatch(i, c)

    def _hash_chunk(self, chunk: memoryview) -> bytes:
        return hash_chunks_released(chunk, self.cb)

    def _read(self, task: Gather) -> None:
        i, f, idx = task.blob, task.file, task.chunks
        cb = self.cb
        b, key = self.part.blobs[i], self.part.files[f]
        offs = b.offsets[idx]
        order = np.argsort(offs, kind="stable")
        idx, offs = idx[order], offs[order]
        whole = b.nbytes // cb
        staged = self.staged.get(i)
        flat = staged if staged is not None else np.frombuffer(self.views[i], np.uint8)
        dest = flat[: whole * cb].reshape(whole, cb)
        per_copy = max(_GATHER_WINDOW_BYTES // cb, 1)
        buffer = np.empty(0, np.uint8)  # reused: fresh pages for every batch cost faults
        for batch, size in window_batches(gather_windows(offs, cb, self.gap_bytes)):
            if len(buffer) < size:
                buffer = np.empty(size, np.uint8)
            slices, at = [], 0
            for _a, _b, lo, hi in batch:
                slices.append(buffer[at : at + hi - lo])
                at += hi - lo
            try:
                self.store.read_ranges(
                    key, [(win[2], [sl.data]) for win, sl in zip(batch, slices, strict=True)]
                )
            except (TruncatedError, CheckpointNotFoundError) as exc:
                raise unreadable(self.part, self.store.url, key, exc, b.path) from exc
            for (a, z, lo, _hi), window in zip(batch, slices, strict=True):
                # Every byte offset of the window as the start of a chunk-long row (a view, no
                # copy): the chunks are a fancy index away.
                rows = np.lib.stride_tricks.as_strided(
                    window, shape=(len(window) - cb + 1, cb), strides=(1, 1), writeable=False
                )
                # The fancy index copies through a temporary: a window's bytes bound its
                # reads, not its chunks (de-duplicated chunks share one place), so the copy
                # goes in slices of at most a window's worth.
                for s in range(a, z, per_copy):
                    e = min(s + per_copy, z)
                    dest[idx[s:e]] = rows[offs[s:e] - lo]
                self.on_bytes((z - a) * cb)
