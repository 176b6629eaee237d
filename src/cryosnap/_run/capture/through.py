"""Write-through capture: while an eager capture copies the state into slabs from the front,
the writer takes whole blobs from the back straight from the program's memory (a direct-I/O
level writes them from where they lie), so their bytes are never copied; the capture skips
them and returns once every blob it handed over is written (the caller may then change it).

Runs on the caller's thread (``enter``, ``finish``), the writer thread (``begin``) and the
appender's I/O thread (each blob's release, which hands over the next). No storage here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cryosnap._state import FlatState
from cryosnap.engine.items import Batch, Piece

__all__ = ["THROUGH_MIN_BYTES", "Chooser", "Rates", "WriteThrough", "candidates"]

# Blobs smaller than this are copied: a batch of its own costs more than their copy.
THROUGH_MIN_BYTES = 1 << 20
# At most this many blobs handed over and not yet written: one written while the next hashes.
_AHEAD = 2


class Rates:
    """The capture's copy and the writer's write throughput over past versions (bytes per
    second, a moving average), which decide how much a version hands over: a handed-over
    blob must be written before the capture would have reached it, else the caller waits."""

    __slots__ = ("copy_bps", "write_bps")

    def __init__(self, copy_bps: float = 0.0, write_bps: float = 0.0) -> None:
        self.copy_bps = copy_bps
        self.write_bps = write_bps

    @property
    def ratio(self) -> float:
        """How many times faster the capture copies than the writer writes (4 until both are
        measured: a first version hands over little)."""
        if self.copy_bps <= 0 or self.write_bps <= 0:
            return 4.0
        return max(self.copy_bps / self.write_bps, 0.25)

    def observe(self, attr: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        old = getattr(self, attr)
        rate = nbytes / seconds
        setattr(self, attr, rate if old <= 0 else 0.5 * old + 0.5 * rate)


class Chooser:
    """Whether an eager capture hands blobs over, by what each way cost: the stall per byte of
    the versions captured with and without it (moving averages), the way that stalled less
    taken, the other retried every :attr:`RETRY` versions (the machine's load moves which one
    wins: on a quiet 2-core machine the copy and the writer's direct writes share the cores
    and the memory bandwidth and the hand-over made the stall longer; beside other work, where
    the copy is slow, it made it shorter). Either way is tried before either is chosen."""

    RETRY = 8

    __slots__ = ("_count", "_per_byte")

    def __init__(self) -> None:
        self._per_byte = {True: 0.0, False: 0.0}  # seconds of stall per byte; 0: not measured
        self._count = 0

    def use(self) -> bool:
        """Whether the next eager capture hands blobs over."""
        self._count += 1
        on, off = self._per_byte[True], self._per_byte[False]
        if on <= 0 or off <= 0:
            return on <= 0  # the way not measured yet (the hand-over first)
        best = on <= off
        return best != (self._count % self.RETRY == 0)

    def observe(self, through: bool, nbytes: int, seconds: float) -> None:
        """A capture ``through`` (handed blobs over or not) stalled ``seconds`` for ``nbytes``."""
        if nbytes <= 0 or seconds <= 0:
            return
        old, rate = self._per_byte[through], seconds / nbytes
        self._per_byte[through] = rate if old <= 0 else 0.5 * old + 0.5 * rate


def candidates(
    flat: FlatState, *, skip: Sequence[int] = (), min_bytes: int = THROUGH_MIN_BYTES
) -> list[int]:
    """The blobs (ascending) a capture may hand over: host memory (a numpy array or a CPU
    tensor) of the program's own (not a pack cryosnap copied), at least ``min_bytes``,
    not in ``skip`` (replicated blobs, chunks compared on the device)."""
    out = []
    skipped = set(skip)
    for i, blob in enumerate(flat.blobs):
        src = blob.source
        if blob.private or blob.nbytes < min_bytes or i in skipped:
            continue
        if isinstance(src, np.ndarray) or (not isinstance(src, bytes) and bool(src.is_cpu)):
            out.append(i)
    return out


class WriteThrough:
    """The hand-over between one eager capture and the writer of its version.

    ``candidates`` (ascending blob indices) are handed over from the last one down, each as a
    :class:`Batch` of one :class:`Piece` viewing the live memory, put with ``emit`` (the
    version's batch queue), at most two at a time; the next goes when one is written (its
    release), if the capture is still far enough from it (:class:`Rates`). The capture calls
    :meth:`enter` before copying each blob (False: handed over, skip it) and :meth:`finish`
    once done, which waits until every handed-over blob is written. ``mark`` is called with
    each handed-over blob once written (the capture tracker's)."""

    def __init__(
        self,
        flat: FlatState,
        candidates: Sequence[int],
        *,
        emit: Callable[[Any], None],
        abort: Callable[[], BaseException | None],
        rates: Rates,
        mark: Callable[[int], None] = lambda _blob: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._flat = flat
        self._left = list(candidates)  # not handed over yet; the last one goes next
        self._emit = emit
        self._abort = abort
        self._rates = rates
        self._mark = mark
        self._clock = clock
        sizes = np.fromiter((b.nbytes for b in flat.blobs), np.int64, len(flat.blobs))
        self._before = np.concatenate([[0], np.cumsum(sizes)]).tolist()  # bytes before blob i
        self._cond = threading.Condition()
        self._cursor = -1  # the blob the capture copies (or last copied)
        self._handed: set[int] = set()
        self._out = 0  # blobs handed over, not yet written
        self._out_bytes = 0
        self._stopped = False
        self._began = 0.0
        self.handed_bytes = 0  # bytes written from where they lie (never copied)
        self.written_seconds = 0.0  # from begin to the last handed-over blob written
        self.waited_seconds = 0.0  # the capture's wait in finish (no copy: not its rate)

    # -- the writer's side ---------------------------------------------------------------------

    def begin(self) -> None:
        """The writer starts this version (its thread): hand over the first blobs."""
        with self._cond:
            self._began = self._clock()
        for _ in range(_AHEAD):
            if not self._hand_one():
                return

    def _hand_one(self) -> bool:
        with self._cond:
            if self._stopped or self._out >= _AHEAD or not self._left:
                return False
            if self._abort() is not None:
                return False
            blob = self._left[-1]
            nbytes = self._flat.blobs[blob].nbytes
            # Bytes the capture copies before it would reach ``blob``, against the bytes the
            # writer must write first: hand over only what is written before it gets there.
            ahead = self._before[blob] - self._before[self._cursor + 1]
            if blob <= self._cursor or ahead < (self._out_bytes + nbytes) * self._rates.ratio:
                return False
            self._left.pop()
            self._handed.add(blob)
            self._out += 1
            self._out_bytes += nbytes
            self.handed_bytes += nbytes
        view = self._flat.blobs[blob].host_view()
        self._emit(Batch([Piece(blob, 0, view)], lambda: self._written(blob, nbytes)))
        return True

    def _written(self, blob: int, nbytes: int) -> None:
        """A handed-over blob is written (or dropped, on a failure): the I/O thread's."""
        self._mark(blob)
        with self._cond:
            self._out -= 1
            self._out_bytes -= nbytes
            self.written_seconds = self._clock() - self._began
            self._cond.notify_all()
        self._hand_one()

    # -- the capture's side --------------------------------------------------------------------

    def enter(self, blob: int) -> bool:
        """The capture is about to copy ``blob``: False when it was handed over (skip it)."""
        with self._cond:
            if blob in self._handed:
                return False
            self._cursor = blob
            return True

    def finish(self) -> None:
        """No more hand-overs; returns once every handed-over blob is written."""
        t0 = self._clock()
        with self._cond:
            self._stopped = True
            self._cond.wait_for(lambda: self._out == 0)
        self.waited_seconds = self._clock() - t0
