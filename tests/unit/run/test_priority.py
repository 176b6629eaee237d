"""A lazy capture's thread runs below the program's (_run/capture/priority.py); the writer thread
and the appenders' I/O threads, which an eager save and the next save wait for, keep the program's
priority, and an eager capture runs on the caller's thread and leaves its priority alone."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap._format.keys import commit_key
from cryosnap._run.capture.capturer import CAPTURE_NICE, Capturer
from cryosnap._run.capture.priority import thread_nice
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread nice values: Linux"
)


def _below(nice: int) -> int:
    return min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)


class Seen:
    """Which thread made each storage call of interest, and at which nice value."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[str, int | None]] = {}
        self.lock = threading.Lock()

    def fault(self, op: str, key: str) -> None:
        with self.lock:
            self.calls.setdefault(f"{op} {key.split('/')[0]}", (_name(), thread_nice()))


def _name() -> str:
    return threading.current_thread().name


def _observe_captures(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """Each capture's thread name and nice value, as it starts."""
    captures: list[tuple[str, int | None]] = []
    capture = Capturer._capture

    def observed(self: Capturer, job: Any, hooks: list[Any], **kwargs: Any) -> None:
        captures.append((_name(), thread_nice()))
        capture(self, job, hooks, **kwargs)

    monkeypatch.setattr(Capturer, "_capture", observed)
    return captures


def test_a_lazy_capture_runs_below_the_program_and_the_writer_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = Seen()
    captures = _observe_captures(monkeypatch)
    caller = thread_nice()
    store = FaultyStore(LocalStore(tmp_path / "run"), fault=seen.fault)
    with cryosnap.Checkpointer(store) as ckpt:
        ckpt.save(1, {"w": np.arange(1 << 16, dtype=np.float32)}, lazy=True).result()
    assert captures == [("cryosnap-capture-1", _below(CAPTURE_NICE))]
    assert seen.calls["writer.write data"] == ("cryosnap-io", caller)
    assert seen.calls[f"write {commit_key(1).split('/')[0]}"] == ("cryosnap-writer", caller)
    assert thread_nice() == caller


def test_an_eager_capture_keeps_the_callers_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    captures = _observe_captures(monkeypatch)
    caller = thread_nice()
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"w": np.ones(1000)}).result()
    assert captures == [(_name(), caller)]
    assert thread_nice() == caller
