"""What a save reports: :class:`SaveInfo`, :class:`Status`, and :class:`PendingSave`, the state
machine of one version from ``save()`` to durable on every level, with its
:class:`CaptureTracker` (which blobs are captured yet).

The caller's thread reads a PendingSave; the capture thread, the writer thread and the
flushers advance it. docs/design/run.md has the states and how a failure is delivered.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cryosnap.engine import VersionSpace
from cryosnap.errors import CheckpointTimeoutError

__all__ = ["CaptureTracker", "PendingSave", "SaveInfo", "Status"]


class CaptureTracker:
    """Which blobs of a version are captured; lets hooks wait for the ones they need."""

    def __init__(self, nblobs: int) -> None:
        self._done = bytearray(nblobs)
        # CUDA events recorded after a blob's device-to-host copies were issued: a waiter
        # orders its own stream after them instead of blocking until they complete.
        self._events: dict[int, Any] = {}
        self._all = threading.Event()
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        if nblobs == 0:
            self._all.set()

    def mark(self, blob: int) -> None:
        with self._cond:
            self._done[blob] = 1
            self._cond.notify_all()

    def issued(self, blob: int, event: Any) -> None:
        """The copies of ``blob`` are queued on a CUDA stream; ``event`` completes after them."""
        with self._cond:
            self._events[blob] = event
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.error = error
            self._all.set()
            self._cond.notify_all()

    def captured(self) -> bool:
        return self._all.is_set()

    def wait_all(self, timeout: float | None = None) -> bool:
        return self._all.wait(timeout)

    def wait_blobs(self, blobs: list[int]) -> None:
        """Return once ``blobs`` may be mutated: copied, or (CUDA) their copies queued, with the
        caller's current stream made to wait for them on the device."""
        with self._cond:
            while not self._all.is_set() and not all(
                self._done[b] or b in self._events for b in blobs
            ):
                self._cond.wait()
            pending = [self._events[b] for b in blobs if not self._done[b] and b in self._events]
        if pending:
            stream = sys.modules["torch"].cuda.current_stream()
            for event in pending:
                stream.wait_event(event)


@dataclass(frozen=True, slots=True)
class SaveInfo:
    """What one version cost this process (this rank).

    ``written_bytes`` counts the data this rank wrote to its first tier; ``stall_seconds`` is how
    long the program was blocked by the save: the whole ``save`` call from entry to return
    (flattening and packing, waiting for a free in-flight slot, the copy itself when eager,
    the start of the capture thread when lazy), plus, in lazy mode, every wait of an optimizer
    step pre-hook for the leaves it mutates and of ``wait_captured`` before the version was
    durable; ``seconds`` runs from the ``save`` call until the version was
    durable; ``tiers`` names the tiers (storage levels) the version reached, fastest first;
    ``captured_bytes`` counts the bytes copied out of the program's memory (from a GPU: over
    PCIe; on a direct-I/O level, blobs written from where they lie count too), below
    ``logical_bytes`` when change detection on the device skipped unchanged chunks or other
    ranks write part of the replicated state (their chunks are hashed, not copied).
    """

    step: int
    logical_bytes: int
    written_bytes: int
    chunks: int
    new_chunks: int
    stall_seconds: float
    seconds: float
    incremental: bool
    tiers: tuple[str, ...]
    captured_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Status:
    """Where a run's versions are (``Checkpointer.status()``).

    ``steps`` lists the complete versions per tier (``"scratch"``, ``"persistent"``);
    ``not_persistent`` the versions committed on a faster tier and not yet on the last one,
    oldest first; ``flush_error`` the last failure of a flush in progress while it is retried.
    ``space`` says per tier what each version keeps alive (``engine.VersionSpace``: bytes of
    the data files it wrote, of earlier versions' files it reads, and of those whose version
    is gone, which it pins).
    """

    steps: dict[str, tuple[int, ...]]
    not_persistent: tuple[int, ...]
    flush_error: BaseException | None
    space: dict[str, tuple[VersionSpace, ...]] = field(default_factory=dict)


class PendingSave:
    """A version being saved: captured first, then durable on each tier in turn."""

    def __init__(
        self,
        step: int,
        tracker: CaptureTracker,
        t0: float,
        levels: tuple[str, ...],
        all_levels: tuple[str, ...] = (),
    ) -> None:
        self.step = step
        self._tracker = tracker
        self._t0 = t0
        self._all_levels = all_levels or levels
        self._levels = levels
        self._reached = {name: threading.Event() for name in levels}
        self._infos: dict[str, SaveInfo] = {}
        self._reached_at: dict[str, float] = {}  # perf_counter() when each level was reached
        self._done = threading.Event()
        self._info: SaveInfo | None = None
        self._error: BaseException | None = None
        self._delivered = False
        self._stall = 0.0

    def __repr__(self) -> str:
        state = "done" if self.done() else "captured" if self.captured() else "capturing"
        return f"<PendingSave step={self.step} {state}>"

    # -- the caller's side ---------------------------------------------------------------------

    def captured(self) -> bool:
        """Whether every byte of the state has been copied out (it may now change)."""
        return self._tracker.captured()

    def wait_captured(self, timeout: float | None = None) -> None:
        """Block until the state is captured; mutate non-optimizer leaves only after this."""
        t0 = time.perf_counter()
        if not self._tracker.wait_all(timeout):
            raise CheckpointTimeoutError(f"step {self.step} not captured after {timeout} s")
        self._stall += time.perf_counter() - t0
        if self._tracker.error is not None:
            self._delivered = True
            raise self._tracker.error

    def done(self) -> bool:
        """Whether the version is durable on every tier or has failed."""
        return self._done.is_set()

    def failed(self) -> bool:
        """Whether the version has failed (it is done and will never be durable)."""
        return self._done.is_set() and self._error is not None

    def result(self, timeout: float | None = None, *, tier: str | None = None) -> SaveInfo:
        """The :class:`SaveInfo` once durable on every tier; re-raises the failure of this
        version. ``tier="scratch"`` returns as soon as it is durable on that tier."""
        if tier is not None and tier in self._all_levels and tier not in self._levels:
            raise ValueError(
                f"tier={tier!r}: step {self.step} does not go to that tier (its save policy "
                f"sends it to {', '.join(self._levels)})"
            )
        if tier is not None and tier not in self._levels:
            allowed = ", ".join(repr(n) for n in (None, *self._levels))
            raise ValueError(f"tier={tier!r} is invalid: allowed are {allowed}")
        if tier is not None and tier != self._levels[-1]:
            if not self._reached[tier].wait(timeout):
                raise CheckpointTimeoutError(f"step {self.step} not on {tier} after {timeout} s")
            info = self._infos.get(tier)
            if info is not None:
                return info
        if not self._done.wait(timeout):
            raise CheckpointTimeoutError(f"step {self.step} not durable after {timeout} s")
        if self._error is not None:
            self._delivered = True
            raise self._error
        assert self._info is not None
        return self._info

    # -- the background's side -----------------------------------------------------------------

    @property
    def stall_seconds(self) -> float:
        """Time the program waited in optimizer hooks and ``wait_captured`` (lazy capture)."""
        return self._stall

    def add_stall(self, seconds: float) -> None:
        self._stall += seconds

    @property
    def levels(self) -> tuple[str, ...]:
        """The tiers this version goes to, fastest first (the last one makes it done)."""
        return self._levels

    def seconds_to(self, level: str) -> float:
        """Seconds from the level below (from ``save()`` for the first) to ``level``."""
        i = self._levels.index(level)
        since = self._t0 if i == 0 else self._reached_at.get(self._levels[i - 1], self._t0)
        return self._reached_at.get(level, time.perf_counter()) - since

    @property
    def started(self) -> float:
        """``time.perf_counter()`` at the ``save`` call."""
        return self._t0

    def abort_requested(self) -> BaseException | None:
        """The failure that stops a capture still in progress (polled by the capture)."""
        return self._error

    def reached(self, level: str, info: SaveInfo | None) -> None:
        """Durable on ``level``; on the last level the version is done. ``info`` is None for a
        version this session did not save (a flush resumed after a crash)."""
        if info is not None:
            self._infos[level] = info
        self._reached_at[level] = time.perf_counter()
        self._reached[level].set()
        if level == self._levels[-1]:
            self._info = info
            self._release()

    def request_abort(self, error: BaseException) -> None:
        """Stop a capture still in progress (it polls :meth:`abort_requested`); the version is
        failed by :meth:`fail` once the writer let go of it."""
        self._error = error

    def fail(self, error: BaseException, *, delivered: bool = False) -> None:
        """The version failed; ``delivered`` when the caller already received ``error``."""
        self._error = error
        self._delivered = self._delivered or delivered
        self._release()

    def mark_delivered(self) -> None:
        self._delivered = True

    def undelivered_error(self) -> BaseException | None:
        """The failure nobody received yet, once."""
        if self._done.is_set() and self._error is not None and not self._delivered:
            self._delivered = True
            return self._error
        return None

    def failed_undelivered(self) -> bool:
        return self._error is not None and not self._delivered

    def _release(self) -> None:
        for event in self._reached.values():
            event.set()
        self._done.set()
