"""Coded data files through a store: :class:`CodedWriter` writes one (frames compressed as the
plain bytes arrive, then the index and trailer), :class:`DecodedStore` reads them back as the
plain bytes their manifests' segments name, and :func:`coded_size` tells the plain size.

The format is _format/codec.py's (docs/FORMAT.md, "Coded data files"). Runs on the calling
thread: the flusher's for writes, the read pool's for reads; a DecodedStore is shared by the
pool's threads (its index cache takes a lock).
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from cryosnap._format.codec import (
    FRAME_BYTES,
    TRAILER_BYTES,
    FrameEncoder,
    FrameIndex,
    decode_frame,
)
from cryosnap.errors import IntegrityError, TruncatedError
from cryosnap.storage._wrap import WrapperStore
from cryosnap.storage.base import BlobWriter, BytesLike, Store

__all__ = ["CodedWriter", "CodecStats", "DecodedStore", "coded_size", "decoded", "read_index"]


@dataclass(slots=True)
class CodecStats:
    """What one coded file cost: plain and stored bytes, seconds compressing and writing."""

    plain_bytes: int = 0
    stored_bytes: int = 0
    encode_seconds: float = 0.0
    write_seconds: float = 0.0


class CodedWriter:
    """A :class:`BlobWriter` that stores what it is given as a coded file through ``inner``.

    ``tell()`` counts plain bytes (the offsets segments name). Frames are compressed on the
    calling thread as soon as :data:`FRAME_BYTES` have arrived (whole frames of a large
    buffer straight from it, without a copy)."""

    def __init__(self, inner: BlobWriter) -> None:
        self.key = inner.key
        self._inner = inner
        self._encoder = FrameEncoder()
        self._pending = bytearray()
        self._rows: list[tuple[int, int, int, int]] = []
        self.stats = CodecStats()

    def write(self, buffers: Sequence[BytesLike]) -> None:
        for b in buffers:
            view = memoryview(b).cast("B")
            self.stats.plain_bytes += view.nbytes
            if self._pending:  # fill the frame begun by an earlier write first
                take = FRAME_BYTES - len(self._pending)
                self._pending += view[:take]
                view = view[take:]
                if len(self._pending) < FRAME_BYTES:
                    continue
                self._frame(memoryview(self._pending))
                self._pending = bytearray()
            while view.nbytes >= FRAME_BYTES:  # whole frames straight from the caller's buffer
                self._frame(view[:FRAME_BYTES])
                view = view[FRAME_BYTES:]
            self._pending += view

    def tell(self) -> int:
        return self.stats.plain_bytes

    def _frame(self, frame: memoryview) -> None:
        t0 = time.perf_counter()
        stored, elem, how = self._encoder.encode(frame)
        t1 = time.perf_counter()
        self._inner.write([stored])
        self.stats.encode_seconds += t1 - t0
        self.stats.write_seconds += time.perf_counter() - t1
        self.stats.stored_bytes += len(stored)
        self._rows.append((frame.nbytes, len(stored), elem, how))

    def commit(self) -> None:
        if self._pending:
            self._frame(memoryview(self._pending))
            self._pending = bytearray()
        tail = FrameIndex.tail(self._rows)
        t0 = time.perf_counter()
        self._inner.write([tail])
        self._inner.commit()
        self.stats.write_seconds += time.perf_counter() - t0
        self.stats.stored_bytes += len(tail)

    def abort(self) -> None:
        self._inner.abort()


def read_index(store: Store, key: str, size: int | None = None) -> FrameIndex:
    """The frame index of coded file ``key`` (two reads: the trailer, then the index)."""
    where = f"data file {key} on {store.url}"
    size = store.size(key) if size is None else size
    if size < TRAILER_BYTES:
        raise TruncatedError(f"{where}: {size} bytes, too short for a coded data file")
    trailer = bytearray(TRAILER_BYTES)
    store.read_into(key, size - TRAILER_BYTES, [memoryview(trailer)])
    _plain, frames = FrameIndex.trailer(bytes(trailer), size, where)
    table = bytearray(frames * 32)
    store.read_into(key, size - TRAILER_BYTES - len(table), [memoryview(table)])
    return FrameIndex.parse(bytes(table), bytes(trailer), size, where)


def coded_size(store: Store, key: str, plain_bytes: int) -> bool:
    """Whether ``key`` on ``store`` is a whole coded file of ``plain_bytes`` plain bytes (a
    flush interrupted after it, or an earlier flush of the chain, wrote it)."""
    try:
        return read_index(store, key).plain_size == plain_bytes
    except (IntegrityError, OSError):
        return False


class DecodedStore(WrapperStore):
    """``inner`` with the coded files ``coded`` read as their plain bytes (``size``, ``read``,
    ``read_into``, ``read_ranges``); every other key as it is. It maps nothing and reads
    nothing cold (no ``map_file``, no ``read_ranges_cold``): readers take the buffered route."""

    def __init__(self, inner: Store, coded: Collection[str]) -> None:
        super().__init__(inner)
        self.coded = frozenset(coded)
        self._indexes: dict[str, FrameIndex] = {}
        self._lock = threading.Lock()

    def _index(self, key: str) -> FrameIndex:
        with self._lock:
            index = self._indexes.get(key)
        if index is None:
            index = read_index(self.inner, key)
            with self._lock:
                self._indexes[key] = index
        return index

    def size(self, key: str) -> int:
        if key not in self.coded:
            return self.inner.size(key)
        return self._index(key).plain_size

    def read(self, key: str) -> bytes:
        if key not in self.coded:
            return self.inner.read(key)
        out = bytearray(self.size(key))
        self.read_into(key, 0, [memoryview(out)])
        return bytes(out)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.read_ranges(key, [(offset, buffers)])

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        if key not in self.coded:
            self.inner.read_ranges(key, ranges)
            return
        index = self._index(key)
        spans = [(o, o + sum(b.nbytes for b in bufs)) for o, bufs in ranges]
        if any(hi > index.plain_size for _lo, hi in spans):
            raise TruncatedError(
                f"data file {key} on {self.inner.url} holds {index.plain_size} bytes, "
                f"fewer than a read asks for"
            )
        wanted = sorted({f for lo, hi in spans for f in index.frames(lo, hi)})
        frames = self._inflate(key, index, wanted)
        for (lo, _hi), (_o, bufs) in zip(spans, ranges, strict=True):
            at = lo
            for buf in bufs:
                _copy_out(index, frames, at, buf)
                at += buf.nbytes

    def _inflate(self, key: str, index: FrameIndex, wanted: list[int]) -> dict[int, memoryview]:
        stored = {f: bytearray(int(index.stored_bytes[f])) for f in wanted}
        self.inner.read_ranges(
            key, [(int(index.stored_offsets[f]), [memoryview(stored[f])]) for f in wanted]
        )
        out: dict[int, memoryview] = {}
        for f in wanted:
            plain = memoryview(bytearray(int(index.plain_bytes[f])))
            try:
                decode_frame(
                    stored[f], plain.nbytes, int(index.elems[f]), int(index.hows[f]), plain
                )
            except ValueError as exc:
                raise IntegrityError(
                    f"data file {key} on {self.inner.url}: frame {f} is damaged ({exc})"
                ) from exc
            out[f] = plain
        return out

    def remove_incomplete(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.remove_incomplete(prefix)


def _copy_out(index: FrameIndex, frames: dict[int, memoryview], at: int, buf: memoryview) -> None:
    """Copy plain bytes ``at``... of the inflated ``frames`` into ``buf``."""
    done = 0
    flat = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    for f in index.frames(at, at + buf.nbytes):
        start = int(index.plain_offsets[f])
        lo = at + done - start
        n = min(int(index.plain_bytes[f]) - lo, buf.nbytes - done)
        flat[done : done + n] = frames[f][lo : lo + n]
        done += n


def decoded(store: Store, coded: Collection[str]) -> Store:
    """``store`` reading ``coded`` as plain bytes (itself where nothing is coded, or where it
    already does)."""
    if not coded:
        return store
    if isinstance(store, DecodedStore):
        if store.coded >= frozenset(coded):
            return store
        return DecodedStore(store.inner, store.coded | frozenset(coded))
    return DecodedStore(store, coded)
