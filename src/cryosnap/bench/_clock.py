"""The plumbing of one run: the progress count (:class:`Clock`) and the Ctrl-C a peer may wrap
in an exception of its own (:class:`CtrlC`). Runs on the caller's (main) thread.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from cryosnap.bench._config import BenchStep, ProgressFn


class CtrlC:
    """Remembers a Ctrl-C, so that a peer that wraps the ``KeyboardInterrupt`` in an exception of
    its own (DCP does: its ``CheckpointException`` carries it) still stops the run, instead of
    being recorded as that peer's failure while the benchmark goes on."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handler(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def failure(self, exc: Exception) -> str:
        """The one-line reason a peer failed; raises ``KeyboardInterrupt`` after a Ctrl-C."""
        if self.seen:
            raise KeyboardInterrupt from exc
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class Clock:
    """Counts finished measurements for the progress display."""

    def __init__(self, total: int, progress: ProgressFn | None) -> None:
        self.total = total
        self.done = 0
        self._progress = progress
        self._t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def tick(self, what: str) -> None:
        self.done += 1
        if self._progress is not None:
            self._progress(BenchStep(self.done, self.total, what, self.elapsed))
