"""Background threads below the program's (engine/write/_priority.py): the nice value a thread
gives itself, never raised, at most 19, left alone where threads have none or the system
refuses; the appender's I/O thread writes at it while the caller's thread keeps its own."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cryosnap.engine.write import _priority
from cryosnap.engine.write._appender import Appender
from cryosnap.engine.write._priority import BACKGROUND_NICE, lower_priority, thread_nice
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

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


@linux
def test_the_appenders_io_thread_writes_below_the_program(tmp_path: Path) -> None:
    seen: dict[str, int | None] = {}

    def record(op: str, _key: str) -> None:
        seen[op] = thread_nice()

    before = thread_nice()
    store = FaultyStore(LocalStore(tmp_path), fault=record)
    appender = Appender(store, "data/x")
    done = threading.Event()
    appender.append([memoryview(b"abc" * 1000)], done.set, 3000)
    appender.start_commit()
    appender.wait_commit()
    assert done.is_set()
    want = min(19, _program_nice() + BACKGROUND_NICE)
    assert seen == {"open_writer": want, "writer.write": want, "writer.commit": want}
    assert thread_nice() == before  # the caller's own priority is its own
