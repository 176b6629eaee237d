from __future__ import annotations

import io

import pytest

from cryosnap.progress import Progress, human_bytes


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Tty()
    monkeypatch.setattr("sys.stderr", err)
    p = Progress("cryosnap: saving step 3", 2048, after_seconds=0.0)
    p.update(1024)
    p.close()
    out = err.getvalue()
    assert "\rcryosnap: saving step 3: 1.0 KiB / 2.0 KiB (50%)" in out
    assert out.endswith("\n")


def test_progress_is_silent_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    p = Progress("x", 10, after_seconds=0.0)
    p.update(10)
    p.close()
    assert err.getvalue() == ""


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 30) == "3.0 GiB"
    assert human_bytes(5 << 50) == "5.0 PiB"
