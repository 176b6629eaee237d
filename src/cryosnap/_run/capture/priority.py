"""The scheduling priority of a lazy capture's thread (Linux: a nice value per thread).

A lazy capture copies the state into staging while the program runs its next forward and
backward passes, on the same cores. Its thread lowers its own priority when it starts, to
:data:`BACKGROUND_NICE` above the process's nice value (at most 19), so the scheduler gives
the program's threads the cores first and runs the copy on the cycles they leave; an optimizer
step that waits for the copy leaves the cores to it. It is never raised: a process started
with a higher nice value keeps it. Where threads have no nice value of their own (not Linux),
or the system refuses (a sandbox without ``setpriority``), nothing changes.

The writer thread and the appenders' I/O threads keep the program's priority: an eager save
waits for the blobs the writer writes from the program's memory (through.py) and the next
save for the previous version's commit (``max_inflight``), and the storage calls' worker
threads, which inherit the nice value of the thread that starts them, are shared with the
caller's own calls. docs/PERFORMANCE.md ("Training at every step") has the measurements.

Runs on the thread it lowers; no storage, no collectives.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["BACKGROUND_NICE", "lower_priority", "thread_nice"]

# How far below the program's threads a lowered thread runs (in nice steps: at 10 the
# scheduler gives it about a tenth of the share of a thread at 0 when both want a core).
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
