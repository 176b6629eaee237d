"""Preemption signals: one module-level handler per signal, shared by every Checkpointer that
asked for it (two runs in one process, or one closed while another is open); the program's own
handler is put back when the last one closes.

Handlers run on the main thread (Python delivers signals there); they only set a flag.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Protocol

__all__ = ["Preemptible", "parse_signals", "subscribe", "unsubscribe"]

log = logging.getLogger("cryosnap")


class Preemptible(Protocol):
    def _on_signal(self, signum: int, frame: Any) -> None: ...


def parse_signals(handle_signals: object) -> list[int]:
    if handle_signals is None:
        return []
    if not isinstance(handle_signals, (list, tuple, set, frozenset)):
        raise TypeError(
            f"handle_signals must be a sequence of signal numbers, got {handle_signals!r}"
        )
    valid = set(signal.valid_signals())
    out = []
    for sig in handle_signals:
        if isinstance(sig, bool) or not isinstance(sig, int) or sig not in valid:
            raise ValueError(f"handle_signals: {sig!r} is not a signal (e.g. signal.SIGTERM)")
        if sig in (signal.SIGKILL, getattr(signal, "SIGSTOP", -1)):
            raise ValueError(f"handle_signals: {signal.Signals(sig).name} cannot be handled")
        out.append(int(sig))
    return out


_signal_lock = threading.Lock()
_signal_users: dict[int, list[Preemptible]] = {}
_signal_original: dict[int, Any] = {}


def _dispatch_signal(signum: int, frame: Any) -> None:
    for ckpt in list(_signal_users.get(signum, ())):
        ckpt._on_signal(signum, frame)


def subscribe(signum: int, ckpt: Preemptible) -> None:
    with _signal_lock:
        users = _signal_users.get(signum)
        ours = signum in _signal_original and signal.getsignal(signum) is _dispatch_signal
        if not users and not ours:
            try:
                previous = signal.signal(signum, _dispatch_signal)
            except ValueError as exc:  # not the main thread
                raise ValueError(f"handle_signals: {exc}") from exc
            _signal_original[signum] = signal.SIG_DFL if previous is None else previous
        users = _signal_users.setdefault(signum, [])
        users.append(ckpt)


def unsubscribe(signum: int, ckpt: Preemptible) -> None:
    with _signal_lock:
        users = _signal_users.get(signum, [])
        if ckpt in users:
            users.remove(ckpt)
        if users or signum not in _signal_original:
            return
        if signal.getsignal(signum) is not _dispatch_signal:
            _signal_original.pop(signum)  # the program replaced it since: leave theirs
            return
        try:
            signal.signal(signum, _signal_original[signum])
        except ValueError:  # not the main thread: ours stays installed, handling nobody
            log.warning("closed off the main thread: %s keeps cryosnap's handler", signum)
            return
        _signal_original.pop(signum)
