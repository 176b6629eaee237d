"""The scheduling priority of cryosnap's background threads (Linux: a nice value per thread).

A checkpoint's background work (the lazy capture's copies, hashing and diffing on the writer
thread, the appenders' writes and fsyncs, the hand-off's flushes) competes with the program for
the cores. The program's threads come first: each background thread lowers its own priority
when it starts, to :data:`BACKGROUND_NICE` above the process's nice value (at most 19), so the
scheduler runs it on the cycles the program leaves and preempts it when a program thread wakes.
It is never raised: a thread of a process already started with a higher nice value keeps it.
Where threads have no nice value of their own (not Linux), nothing changes.

Runs on the thread it lowers; no storage, no collectives.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["BACKGROUND_NICE", "lower_priority", "thread_nice"]

# How far below the program's threads cryosnap's background threads run (in nice steps: at 10
# the scheduler gives a thread about a tenth of the share of one at 0 when both want a core).
BACKGROUND_NICE = 10
_MAX_NICE = 19

_PER_THREAD = sys.platform.startswith("linux")


def thread_nice(native_id: int | None = None) -> int | None:
    """The nice value of thread ``native_id`` (default: this thread); None where threads have
    none of their own."""
    if not _PER_THREAD:
        return None
    tid = threading.get_native_id() if native_id is None else native_id
    return os.getpriority(os.PRIO_PROCESS, tid)


def lower_priority(nice: int | None = None) -> int | None:
    """Lower the calling thread's priority to ``nice`` (default :data:`BACKGROUND_NICE`) above
    the process's, at most 19, never raised; returns the thread's nice value now (None: not
    supported here, or refused by the system, as in a sandbox without ``setpriority``: nothing
    changed)."""
    if not _PER_THREAD:
        return None
    nice = BACKGROUND_NICE if nice is None else nice
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        # The main thread's id is the process's: the program's own priority.
        target = max(current, min(_MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice))
        if target != current:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None
