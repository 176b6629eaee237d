"""A one-line progress display for long saves and restores, on a terminal only.

Silent when stderr is not a terminal (CI, logs, pipes) and for operations shorter than
``after_seconds``; events go to the ``cryosnap`` logger instead. Thread-safe: the writer thread
updates it while the program runs.
"""

from __future__ import annotations

import sys
import threading
import time

from cryosnap._units import human_bytes

__all__ = ["Progress", "human_bytes"]


class Progress:
    """``label: 312.0 MiB / 1.0 GiB (31%) 410.2 MiB/s`` redrawn in place on stderr."""

    def __init__(self, label: str, total_bytes: int, *, after_seconds: float = 1.0) -> None:
        self.label = label
        self.total = total_bytes
        self.done = 0
        self.after = after_seconds
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._shown = False
        self._lock = threading.Lock()
        self._enabled = sys.stderr.isatty()

    def update(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if not self._enabled:
                return
            now = time.perf_counter()
            if now - self._t0 < self.after or now - self._last < 0.2:
                return
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self._t0, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        line = (
            f"\r{self.label}: {human_bytes(self.done)} / {human_bytes(self.total)} "
            f"({pct:.0f}%) {human_bytes(rate)}/s"
        )
        sys.stderr.write(line)
        sys.stderr.flush()
        self._shown = True

    def close(self) -> None:
        with self._lock:
            if self._shown:
                self._draw(time.perf_counter())
                sys.stderr.write("\n")
                sys.stderr.flush()
                self._shown = False
