"""The job: one version on its way from ``save()`` through the capture to the writer, and the
items of its batch queue (:data:`QueueItem`: a captured :class:`~cryosnap.engine.items.Batch`, the
capture's error, or :data:`END`, always last).

A value the facade makes, the capture fills and the writer consumes; no I/O of its own.
Runs on the caller's thread (made), the capture threads (batches put) and the writer thread
(batches taken). docs/design/run.md has the states of a version.
"""

from __future__ import annotations

import enum
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeAlias

from cryosnap._format.keys import Lineage
from cryosnap._format.manifest import Replicated
from cryosnap._run.replicated import Plan
from cryosnap._run.results import PendingSave
from cryosnap._state import FlatState
from cryosnap.engine.items import Batch

__all__ = ["END", "End", "HandOver", "Job", "QueueItem"]


class End(enum.Enum):
    """The type of :data:`END`, the last item of every job's batch queue."""

    END = "end"


END: Final = End.END
# One item of a job's batch queue: a captured batch, the error that ended the capture, or END.
QueueItem: TypeAlias = Batch | BaseException | End


class HandOver(Protocol):
    """What an eager capture hands the writer besides batches: live blobs it writes from the
    program's memory (:class:`~cryosnap._run.capture.through.WriteThrough`), begun with the
    version."""

    def begin(self) -> None: ...


@dataclass(slots=True)
class Job:
    """One version on its way from the caller to the writer."""

    step: int
    flat: FlatState
    pending: PendingSave
    batches: queue.SimpleQueue[QueueItem]
    metrics: dict[str, float] | None = None
    stall_seconds: float = 0.0
    # The same start and stall on the policy's clock (``Checkpointer(clock=)``): the policy is
    # told time and durations by one clock, so a test's fake clock makes it deterministic.
    clock0: float = 0.0
    stall_clock: float = 0.0
    # Top-level keys identical on every rank (save(replicated=...), checked by the facade).
    replicated: Replicated = None
    # Who writes which chunks of the replicated blobs, and this rank's number among the
    # writers (set by the facade): the capture copies only this rank's share.
    plan: Plan | None = None
    rank: int = 0
    # Set by the capture before its first batch (change detection on the device): the step
    # the unchanged runs refer to, or a version that must be written full.
    diff_base: int | None = None
    full: bool = False
    captured_bytes: int = 0
    # Set by ``Checkpointer.save`` once it returns, with the stall above final: the writer
    # waits for it before it reports the stall (None: a job no caller waits on).
    returned: threading.Event | None = None

    def final_stall(self) -> tuple[float, float]:
        """The stall (perf_counter seconds, policy-clock seconds) of this version: the
        ``save`` call from entry to return, plus the waits in optimizer hooks and
        ``wait_captured`` so far; waits until ``save`` returned."""
        if self.returned is not None:
            self.returned.wait()
        extra = self.pending.stall_seconds
        return self.stall_seconds + extra, self.stall_clock + extra

    ticket: int = -1  # this capture's turn with the DeviceDiff
    ready: Any = None  # CUDA event on the caller's stream at save(): the capture waits for it
    # The lineage the version is committed in (None: generation 0); a version saved after a
    # rewind supersedes the abandoned ones with it (docs/FORMAT.md, "Superseding").
    lineage: Lineage | None = None
    # An eager capture onto a direct-I/O level hands blobs to the writer (_run/capture/through.py),
    # from when both the capture attached it and the writer started this version.
    through: HandOver | None = None
    began: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> None:
        """The writer starts this version (on its thread)."""
        with self._lock:
            self.began, through = True, self.through
        if through is not None:
            through.begin()

    def attach(self, through: HandOver) -> None:
        """The capture's hand-over (on its thread): begun now if the writer already started."""
        with self._lock:
            self.through, began = through, self.began
        if began:
            through.begin()

    def drain(self) -> None:
        """Give back every captured batch still queued (the version is abandoned)."""
        while True:
            item = self.batches.get()
            if item is END:
                return
            if isinstance(item, Batch):
                item.release()
