"""Capture: leaves -> staging buffers, the only part of a save the program waits for.

Blob bytes go into pooled slabs (:class:`StagingPool`, bounded by ``staging_bytes``), handed to
the writer as :class:`Batch` items; unchanged and foreign chunks are not copied.
Where it runs: ``capture_to_slabs`` on the caller's thread (eager) or the capture thread (lazy);
slabs are released by the writer thread. Torch copies release the GIL.
docs/design/capture.md has the why.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from cryosnap import _native
from cryosnap._format.chunks import chunk_count, hash_chunks_released, value_runs
from cryosnap._run.capture.through import WriteThrough
from cryosnap._run.results import CaptureTracker
from cryosnap._state import Blob, FlatState
from cryosnap.engine.items import Batch, Hashed, Item, Piece, Unchanged
from cryosnap.storage._direct import BLOCK_BYTES, DIRECT_MIN_BYTES

__all__ = ["StagingPool", "capture_to_slabs", "direct_batches"]

# Pieces of this many bytes or more are copied one call each; smaller ones are gathered into one
# torch.cat per slab, so 20,000 small tensors do not cost 20,000 Python-level copies.
_SMALL_PIECE_BYTES = 1 << 20


class _Slab:
    """``nbytes`` of host memory starting on a page (BLOCK_BYTES): a piece placed at a page
    offset of it goes to a direct-I/O data file from where it lies (storage/_direct.py)."""

    __slots__ = ("array", "nbytes", "tensor")

    def __init__(self, nbytes: int, pin: bool) -> None:
        torch = sys.modules.get("torch")
        self.nbytes = nbytes
        self.tensor: Any = None
        extra = BLOCK_BYTES
        if torch is not None:
            whole = torch.empty(nbytes + extra, dtype=torch.uint8, pin_memory=pin)
            skip = -whole.data_ptr() % BLOCK_BYTES
            self.tensor = whole[skip : skip + nbytes]
            self.array: np.ndarray[Any, np.dtype[np.uint8]] = self.tensor.numpy()
        else:
            whole_array = np.empty(nbytes + extra, dtype=np.uint8)
            skip = -whole_array.ctypes.data % BLOCK_BYTES
            self.array = whole_array[skip : skip + nbytes]


class StagingPool:
    """Host slabs reused across versions, at most ``budget_bytes`` of them (None: unbounded)."""

    def __init__(self, *, slab_bytes: int, budget_bytes: int | None, pin: bool = False) -> None:
        self.slab_bytes = slab_bytes
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._free: list[_Slab] = []
        self._allocated = 0
        self._cond = threading.Condition()
        self._closed = False

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def room_bytes(self) -> int:
        """The bytes a capture can take without allocating: the idle slabs' (a slab the
        writer holds comes back only once its bytes are written)."""
        with self._cond:
            return sum(s.nbytes for s in self._free)

    def acquire(
        self,
        abort: Callable[[], BaseException | None] = lambda: None,
        before_wait: Callable[[], None] = lambda: None,
    ) -> _Slab:
        """A free slab; blocks while the budget is spent until the writer returns one.
        ``before_wait`` runs (outside the pool's lock) before the first wait."""
        waited = False
        while True:
            with self._cond:
                if self._free:
                    return self._free.pop()
                if self.budget_bytes is None or self._allocated + self.slab_bytes <= max(
                    self.budget_bytes, self.slab_bytes
                ):
                    self._allocated += self.slab_bytes
                    break
                error = abort()
                if error is not None:
                    raise error
                if waited:
                    self._cond.wait(0.1)
                    continue
            waited = True
            before_wait()
        return _Slab(self.slab_bytes, self.pin)

    def release(self, slab: _Slab) -> None:
        with self._cond:
            self._free.append(slab)
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop the idle slabs (memory goes back to the allocator)."""
        with self._cond:
            self._allocated -= sum(s.nbytes for s in self._free)
            self._free.clear()


def _pieces(end: int, start: int, space: int, chunk_bytes: int) -> int:
    """How many bytes from ``start`` (up to ``end``) fit in ``space``, ending on a chunk
    boundary."""
    left = end - start
    if left <= space:
        return left
    return space // chunk_bytes * chunk_bytes


def _copy(dst: _Slab, at: int, blob: Blob, start: int, n: int) -> None:
    src = blob.source
    if isinstance(src, bytes):
        dst.array[at : at + n] = np.frombuffer(src, dtype=np.uint8, count=n, offset=start)
    elif isinstance(src, np.ndarray):
        dst.array[at : at + n] = src[start : start + n]
    else:
        dst.tensor[at : at + n].copy_(src[start : start + n], non_blocking=src.is_cuda)


def capture_to_slabs(
    flat: FlatState,
    pool: StagingPool,
    *,
    chunk_bytes: int,
    emit: Callable[[Batch], None],
    tracker: CaptureTracker,
    abort: Callable[[], BaseException | None] = lambda: None,
    hold: bool = False,
    changed: dict[int, np.ndarray[Any, np.dtype[np.bool_]]] | None = None,
    foreign: dict[int, np.ndarray[Any, np.dtype[np.bool_]]] | None = None,
    events: bool = False,
    through: WriteThrough | None = None,
) -> int:
    """Copy every blob into slabs, emitting each sealed slab as a Batch, in blob order; the
    bytes copied.

    ``changed`` (blob index -> per chunk, whether it changed) limits the copy of those blobs to
    their changed chunks; the others become :class:`Unchanged` runs. ``foreign`` (blob index ->
    per chunk, whether another rank writes it) makes those chunks of a host blob
    :class:`Hashed` runs: hashed in place, not copied. With ``events`` (lazy
    capture) a CUDA event is recorded after each CUDA blob's copies are queued, so that an
    optimizer step waits on the device for them, not on the host for its whole slab.

    With ``hold`` the batches are emitted only once everything is copied, or when the staging
    budget runs out: the writer's hashing and I/O then do not compete with the copy for cores
    and memory bandwidth (the copy is what the program waits for).

    ``through`` (an eager capture onto a direct-I/O level: _run/capture/through.py) hands blobs
    from the back to the writer, which writes them from the live memory: they are skipped
    here, and the capture returns once they are written.

    Small pieces of host tensors are one memmove each; larger ones torch ``copy_``.
    """
    filler = _SlabFiller(pool, chunk_bytes, emit, tracker, abort, hold)
    try:
        _fill(flat, filler, chunk_bytes, tracker, changed, foreign, events, through)
    finally:
        if through is not None:
            through.finish()  # the writer no longer reads the program's memory
    filler.flush_held()
    return filler.copied


def _fill(
    flat: FlatState,
    filler: _SlabFiller,
    chunk_bytes: int,
    tracker: CaptureTracker,
    changed: dict[int, np.ndarray[Any, np.dtype[np.bool_]]] | None,
    foreign: dict[int, np.ndarray[Any, np.dtype[np.bool_]]] | None,
    events: bool,
    through: WriteThrough | None,
) -> None:
    """The copies of :func:`capture_to_slabs`, every slab sealed (held or emitted)."""
    for index, blob in enumerate(flat.blobs):
        if blob.nbytes == 0:
            tracker.mark(index)
            continue
        if through is not None and not through.enter(index):
            continue  # handed to the writer: written from where it lies, marked once written
        cuda = not isinstance(blob.source, (bytes, np.ndarray)) and blob.source.is_cuda
        filler.gpu = filler.gpu or cuda
        mask = changed.get(index) if changed else None
        others = foreign.get(index) if foreign and not cuda else None
        if blob.private and mask is None and others is None:
            # Copied already (a pack of small tensors): written from where it lies.
            filler.pieces.append(Piece(index, 0, blob.host_view()))
            filler.marks.append(index)
            filler.copied += blob.nbytes
            continue
        for lo, hi, kind in _runs(blob.nbytes, mask, chunk_bytes, others):
            if kind == _UNCHANGED:
                first = lo // chunk_bytes
                filler.pieces.append(Unchanged(index, first, -(-(hi - lo) // chunk_bytes), hi - lo))
            elif kind == _HASH:
                view = blob.host_view()[lo:hi]
                digests = hash_chunks_released(view, chunk_bytes)
                filler.pieces.append(Hashed(index, lo, hi - lo, digests))
            else:
                filler.copy(index, blob, lo, hi)
        if cuda and events:
            filler.flush_small()
            event = sys.modules["torch"].cuda.Event()
            event.record()
            tracker.issued(index, event)
        filler.marks.append(index)
    filler.seal()


class _SlabFiller:
    """The state of one :func:`capture_to_slabs`: the slab being filled, its pieces, the small
    host pieces copied together, the blobs to mark captured once their slab is sealed."""

    def __init__(
        self,
        pool: StagingPool,
        chunk_bytes: int,
        emit: Callable[[Batch], None],
        tracker: CaptureTracker,
        abort: Callable[[], BaseException | None],
        hold: bool,
    ) -> None:
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self.sink = emit
        self.held: list[Batch] = []
        self.emit = self.held.append if hold else emit
        self.tracker = tracker
        self.abort = abort
        self.slab: _Slab | None = None
        self.whole = memoryview(b"")  # the current slab's bytes
        self.fill = 0
        self.pieces: list[Item] = []
        self.copied = 0
        self.small: list[tuple[int, Blob, int, int]] = []  # (slab offset, blob, start, n)
        self.marks: list[int] = []
        self.gpu = False

    def flush_held(self) -> None:
        # The budget is spent (or the capture is over): the writer must get the held slabs
        # to give them back.
        while self.held:
            self.sink(self.held.pop(0))

    def copy(self, index: int, blob: Blob, lo: int, hi: int) -> None:
        """Copy bytes ``lo:hi`` of ``blob`` into slabs, piece by piece."""
        start = lo
        while start < hi:
            if self.slab is None:
                self.slab = self.pool.acquire(self.abort, self.flush_held)
                self.whole = self.slab.array.data  # sliced per piece (cheaper than the array)
            slab = self.slab
            if hi - start >= DIRECT_MIN_BYTES:
                # A large piece starts on a page of the slab: a direct write takes it from here.
                self.fill = min(-(-self.fill // BLOCK_BYTES) * BLOCK_BYTES, slab.nbytes)
            n = _pieces(hi, start, slab.nbytes - self.fill, self.chunk_bytes)
            if n == 0:
                self.seal()
                continue
            if n < _SMALL_PIECE_BYTES:
                self.small.append((self.fill, blob, start, n))
            else:
                self.flush_small()
                _copy(slab, self.fill, blob, start, n)
            self.pieces.append(Piece(index, start, self.whole[self.fill : self.fill + n]))
            self.fill += n
            start += n
            self.copied += n

    def flush_small(self) -> None:
        slab = self.slab
        if not self.small or slab is None:
            return
        # Small pieces of host tensors: one memmove each, by address. torch's copy_ and cat
        # run on its intra-op (OpenMP) threads; with the writer busy on another core those
        # wait for each other, and a state of thousands of small tensors stalled for seconds.
        base = slab.array.ctypes.data
        rest = []
        memmove = _native.memmove_fn()
        for s in self.small:
            src = s[1].source
            if type(src) is bytes or isinstance(src, np.ndarray) or not src.is_cpu:
                rest.append(s)
            else:
                memmove(base + s[0], src.data_ptr() + s[2], s[3])
        small = rest
        # Small pieces are back to back in the slab: one torch.cat copies all torch ones.
        torch_small = [s for s in small if not isinstance(s[1].source, (bytes, np.ndarray))]
        if len(torch_small) > 1 and slab.tensor is not None:
            torch = sys.modules["torch"]
            lo = torch_small[0][0]
            hi = torch_small[-1][0] + torch_small[-1][3]
            if hi - lo == sum(s[3] for s in torch_small) and not any(
                s[1].source.is_cuda for s in torch_small
            ):
                torch.cat(
                    [s[1].source[s[2] : s[2] + s[3]] for s in torch_small],
                    out=slab.tensor[lo:hi],
                )
                small = [s for s in small if isinstance(s[1].source, (bytes, np.ndarray))]
        for at, blob, start, n in small:
            _copy(slab, at, blob, start, n)
        self.small = []

    def seal(self) -> None:
        if self.slab is None and not self.pieces:
            return
        self.flush_small()
        if self.gpu:
            # Device-to-host copies were queued non-blocking on the current stream.
            sys.modules["torch"].cuda.current_stream().synchronize()
        for b in self.marks:
            self.tracker.mark(b)
        done, self.pieces, self.marks = self.pieces, [], []
        s, pool = self.slab, self.pool
        self.slab, self.fill = None, 0
        self.emit(Batch(done, (lambda: pool.release(s)) if s is not None else (lambda: None)))


_UNCHANGED, _COPY, _HASH = 0, 1, 2


def _runs(
    nbytes: int,
    mask: np.ndarray[Any, np.dtype[np.bool_]] | None,
    chunk_bytes: int,
    foreign: np.ndarray[Any, np.dtype[np.bool_]] | None = None,
) -> list[tuple[int, int, int]]:
    """Byte ranges ``(lo, hi, kind)`` of a blob: runs of unchanged chunks, chunks to copy, and
    changed chunks another rank writes (to hash in place)."""
    if (mask is None or mask.all()) and (foreign is None or not foreign.any()):
        return [(0, nbytes, _COPY)]
    n = chunk_count(nbytes, chunk_bytes)
    kinds = np.full(n, _COPY, np.int8)
    if foreign is not None:
        kinds[foreign[:n]] = _HASH
    if mask is not None:
        kinds[~mask[:n]] = _UNCHANGED
    return [
        (a * chunk_bytes, min(b * chunk_bytes, nbytes), int(kinds[a])) for a, b in value_runs(kinds)
    ]


def direct_batches(
    flat: FlatState,
    *,
    batch_bytes: int,
    chunk_bytes: int = 0,
    foreign: dict[int, np.ndarray[Any, np.dtype[np.bool_]]] | None = None,
    hashes: Sequence[np.ndarray[Any, np.dtype[np.uint8]]] = (),
) -> Iterator[Batch]:
    """Batches that view the live blob memory: zero copy, for callers that block until durable.

    ``foreign`` (as for :func:`capture_to_slabs`) with ``hashes`` (per blob, its known
    ``(chunks, 16)`` chunk hashes) makes those chunks :class:`Hashed` runs carrying the known
    hashes (a hand-off that did not read them: _writer.Rewriter)."""
    pieces: list[Item] = []
    size = 0
    for index, blob in enumerate(flat.blobs):
        nbytes = blob.nbytes
        if nbytes == 0:
            continue
        view = blob.host_view()
        others = foreign.get(index) if foreign else None
        if others is None:  # the whole blob, one piece (most leaves)
            pieces.append(Piece(index, 0, view))
            size += nbytes
            if size >= batch_bytes:
                yield Batch(pieces)
                pieces, size = [], 0
            continue
        for lo, hi, kind in _runs(nbytes, None, chunk_bytes or nbytes, others):
            if kind == _HASH:
                known = hashes[index][lo // chunk_bytes : -(-hi // chunk_bytes)]
                pieces.append(Hashed(index, lo, hi - lo, known.tobytes()))
                continue
            pieces.append(Piece(index, lo, view[lo:hi]))
            size += hi - lo
            if size >= batch_bytes:
                yield Batch(pieces)
                pieces, size = [], 0
    if pieces:
        yield Batch(pieces)
