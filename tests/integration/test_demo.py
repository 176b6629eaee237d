"""The main job end to end: trained, SIGKILLed, resumed, bit-exact (a shortened run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from cryosnap import demo

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.slow
def test_demo_kills_resumes_and_matches(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cryosnap.demo",
            "--dir",
            str(work),
            "--steps",
            "30",
            "--every",
            "5",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "exited with -9 (killed by SIGKILL)" in out
    assert "incremental" in out
    assert "resumed from step" in out
    assert "(scratch wiped): step 30 restored in" in out
    assert "equal to the final state: YES" in out
    assert "bit for bit: YES" in out
    # Both tiers were used: the persistent tier holds the newest versions, scratch was rebuilt.
    assert (work / "persistent").is_dir() and (work / "scratch").is_dir()
    if HAVE_MATPLOTLIB:
        assert f"plot: {work / 'summary.png'}" in out
        assert (work / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "plot skipped: matplotlib is not installed" in out


# Save events as the demo's children log them (the fields plot() reads).
SAVES = [
    {"step": 5, "incremental": False, "stall_seconds": 0.004, "written_bytes": 50 << 20},
    {"step": 10, "incremental": True, "stall_seconds": 0.001, "written_bytes": 8 << 20},
]
SAVES = [{**e, "logical_bytes": 140 << 20} for e in SAVES]


def test_plot_is_skipped_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    why = demo.plot(tmp_path / "summary.png", SAVES, 0.1, kill_at=7, every=5)
    assert why is not None and "matplotlib is not installed" in why
    assert not (tmp_path / "summary.png").exists()


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib (the demo extra) not installed")
def test_plot_writes_png(tmp_path: Path) -> None:
    assert demo.plot(tmp_path / "summary.png", SAVES, 0.1, kill_at=7, every=5) is None
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_too_few_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--steps", "10", "--every", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps >= 2 * every + 2" in err


def test_cli_demo_command_runs_demo_main(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("typer")
    from cryosnap import cli

    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 0

    monkeypatch.setattr(demo, "main", fake_main)
    assert cli.main(["demo", "--dir", "d", "--steps", "40", "--every", "4", "--seed", "1"]) == 0
    assert seen == [["--dir", "d", "--steps", "40", "--every", "4", "--seed", "1"]]
