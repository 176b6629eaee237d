"""Change detection on the device: which chunks of a version's tensors differ from the previous
version, found where the tensors live, so that only changed chunks are copied to the host.

Such a version is only correct on exactly the base it was compared with (``DiffPlan.base``).
Runs on the capture threads (the caller's, for eager capture), on the capture's CUDA stream.
docs/design/capture.md has the why.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cryosnap._run.capture.fingerprint import Fingerprinter, supported
from cryosnap._run.results import PendingSave
from cryosnap._state import FlatState

__all__ = ["DeviceDiff", "DiffPlan"]

# Blobs below this size are copied whole: a fingerprint costs a few kernel launches, and a
# state of 20,000 small tensors must not pay 20,000 of them for a few megabytes.
MIN_BYTES = 4 << 20


@dataclass(slots=True)
class DiffPlan:
    """What one capture does: the step its unchanged runs refer to (None: none), whether the
    version must be written full, and per blob index which chunks changed."""

    base: int | None = None
    full: bool = False
    changed: dict[int, np.ndarray[Any, np.dtype[np.bool_]]] = field(default_factory=dict)
    prints: dict[tuple[str | int, ...], tuple[int, Any]] = field(default_factory=dict)
    ready: Any = None  # CUDA event: the prints are computed (when computed beside the copies)


class DeviceDiff:
    """The fingerprints of the last captured version and whose turn it is to capture."""

    def __init__(
        self, chunk_bytes: int, *, full_every: int, cpu: bool, min_bytes: int = MIN_BYTES
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.full_every = full_every
        self.cpu = cpu
        self.min_bytes = min_bytes
        self.fingerprinter = Fingerprinter(chunk_bytes)
        self._prints: dict[tuple[str | int, ...], tuple[int, Any]] = {}
        self._ref: tuple[int, PendingSave] | None = None  # the version the prints are of
        self._depth = 0  # that version's chain depth
        self._cond = threading.Condition()
        self._issued = 0
        self._turn = 0
        self._stream: Any = None  # where a full version's fingerprints overlap its copies

    @staticmethod
    def usable(chunk_bytes: int) -> bool:
        return supported(chunk_bytes)

    def eligible(self, blob_source: Any, nbytes: int) -> bool:
        if nbytes < self.min_bytes or isinstance(blob_source, (bytes, np.ndarray)):
            return False
        return bool(blob_source.is_cuda or self.cpu)

    # -- turns ---------------------------------------------------------------------------------

    def ticket(self) -> int:
        """Called on the caller's thread by each save(), in order."""
        with self._cond:
            self._issued += 1
            return self._issued - 1

    def _wait_turn(self, ticket: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == ticket)

    def _next_turn(self) -> None:
        with self._cond:
            self._turn += 1
            self._cond.notify_all()

    def finish(self, ticket: int) -> None:
        """The capture holding ``ticket`` ended (however): the next one may go. Called once
        per ticket; waits for its turn if the capture never took it."""
        self._wait_turn(ticket)
        self._next_turn()

    def skip(self, ticket: int) -> None:
        """A save that does not capture (written from live memory): the next one starts over."""
        self._wait_turn(ticket)
        self._prints, self._ref = {}, None
        self._next_turn()

    # -- one capture ---------------------------------------------------------------------------

    def plan(self, ticket: int, flat: FlatState, *, overlap: bool = False) -> DiffPlan:
        """Fingerprint ``flat``'s eligible blobs and compare them with the previous version's
        (waits for this capture's turn; :meth:`finish` must follow, whatever happens).

        ``overlap``: a full version's fingerprints (needed by the next version only) are
        computed on a CUDA stream of their own while the copies run; the capture waits for
        ``DiffPlan.ready`` before it returns.
        """
        self._wait_turn(ticket)
        ref = self._ref
        if ref is not None and ref[1].failed():
            ref = None  # the version compared with failed: start over
        diff = ref is not None and self._depth < self.full_every
        plan = DiffPlan(base=ref[0] if diff and ref is not None else None, full=not diff)
        eligible = [(i, b) for i, b in enumerate(flat.blobs) if self.eligible(b.source, b.nbytes)]
        if not diff and overlap and eligible and all(b.source.is_cuda for _, b in eligible):
            torch = sys.modules["torch"]
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for _i, blob in eligible:
                    plan.prints[blob.key] = (blob.nbytes, self.fingerprinter.chunks(blob.source))
                plan.ready = torch.cuda.Event()
                plan.ready.record()
            return plan
        masks: list[tuple[int, Any]] = []
        for i, blob in eligible:
            fp = self.fingerprinter.chunks(blob.source)
            plan.prints[blob.key] = (blob.nbytes, fp)
            old = self._prints.get(blob.key) if diff else None
            if old is not None and old[0] == blob.nbytes and old[1].device == fp.device:
                masks.append((i, (fp != old[1]).any(1)))
        if masks:
            torch = sys.modules["torch"]
            # One transfer (and one wait) per device for every blob's mask.
            by_device: dict[str, list[tuple[int, Any]]] = {}
            for i, m in masks:
                by_device.setdefault(str(m.device), []).append((i, m))
            for group in by_device.values():
                host = torch.cat([m for _, m in group]).cpu().numpy()
                at = 0
                for i, m in group:
                    plan.changed[i] = host[at : at + len(m)]
                    at += len(m)
        return plan

    def adopt(self, step: int, plan: DiffPlan, pending: PendingSave) -> None:
        """The capture of ``step`` succeeded (during its turn): its fingerprints are the next
        version's reference."""
        self._prints = plan.prints
        self._ref = (step, pending)
        self._depth = 1 if plan.full else self._depth + 1
