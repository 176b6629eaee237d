"""A thread below the program's (_run/capture/priority.py): the nice value it gives itself, never
raised, at most 19, left alone where threads have none or the system refuses."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from cryosnap._run.capture import priority as _priority
from cryosnap._run.capture.priority import BACKGROUND_NICE, lower_priority, thread_nice

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")


def _program_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


def on_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a fresh thread (the test's own thread keeps its priority)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@linux
def test_a_background_thread_runs_below_the_program() -> None:
    before = thread_nice()
    got = on_thread(lambda: (lower_priority(), thread_nice()))
    want = min(19, _program_nice() + BACKGROUND_NICE)
    assert got == (want, want)
    assert thread_nice() == before  # the caller's thread is untouched


@linux
def test_the_nice_value_is_at_most_19() -> None:
    assert on_thread(lambda: lower_priority(40)) == 19


@linux
def test_a_thread_already_lower_is_never_raised() -> None:
    def run() -> tuple[int | None, int | None]:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return lower_priority(1), thread_nice()

    assert on_thread(run) == (19, 19)


@linux
def test_a_refused_setpriority_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: Any) -> None:
        raise PermissionError("not here")

    monkeypatch.setattr(_priority.os, "setpriority", refuse)

    def run() -> tuple[int | None, int | None, int | None]:
        before = thread_nice()
        return before, lower_priority(), thread_nice()

    before, got, after = on_thread(run)
    assert got is None and after == before


def test_where_threads_have_no_nice_value_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(_priority, "_PER_THREAD", False)
    monkeypatch.setattr(_priority.os, "setpriority", lambda *a: calls.append(a), raising=False)
    assert on_thread(lower_priority) is None
    assert on_thread(thread_nice) is None
    assert calls == []
