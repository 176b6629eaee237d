"""Pause Python's cyclic garbage collector around allocation-heavy phases.

Flattening a state of 20,000 tensors or building its manifest allocates hundreds of thousands
of small objects; each allocation burst can trigger full collections that walk every live
object, which costs more than the work itself. Nothing built in these phases forms cycles, so
collection is paused while any thread is inside one and resumed (if it was on) when the last
one leaves. Used on the caller's thread (flatten) and the writer thread (manifests).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
