"""The main job end to end: trained, SIGKILLed, resumed, bit-exact (a shortened run)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cryosnap import demo

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


# make test: 17 steps, killed at step 11 (seed 19): versions 5 and 10 before the kill, 15 and
# 17 after it; make test-deep also 30 steps (seed 3: a kill at step 13, six versions).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("steps", "seed"),
    [
        pytest.param(17, 19, id="17-steps"),
        pytest.param(30, 3, id="30-steps", marks=pytest.mark.deep),
    ],
)
def test_demo_kills_resumes_and_matches(tmp_path: Path, steps: int, seed: int) -> None:
    work = tmp_path / "demo"
    args = ["--dir", str(work), "--steps", str(steps), "--every", "5", "--seed", str(seed)]
    proc = subprocess.run(
        [sys.executable, "-m", "cryosnap.demo", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "exited with -9 (killed by SIGKILL)" in out
    assert "incremental" in out
    assert "resumed from step" in out
    assert f"(scratch wiped): step {steps} restored in" in out
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


def _demo_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cryosnap.demo", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)


def test_demo_refuses_a_directory_it_did_not_create(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "persistent").mkdir()  # a name the demo uses, but not the demo's
    (tmp_path / "persistent" / "data.bin").write_bytes(b"x")
    proc = _demo_cli("--dir", ".", "--steps", "30", "--every", "5", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert "is not empty and is not a demo directory" in proc.stderr
    assert str(tmp_path) in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "persistent"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "persistent" / "data.bin").read_bytes() == b"x"


def test_demo_refuses_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("mine")
    assert demo.main(["--dir", str(tmp_path / "f"), "--steps", "30", "--every", "5"]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert (tmp_path / "f").read_text() == "mine"


def test_prepare_takes_a_new_or_empty_directory_and_marks_it(tmp_path: Path) -> None:
    assert demo.prepare(tmp_path / "new" / "run") is None
    assert (tmp_path / "new" / "run" / demo.MARKER).is_file()
    (tmp_path / "empty").mkdir()
    assert demo.prepare(tmp_path / "empty") is None
    assert [p.name for p in (tmp_path / "empty").iterdir()] == [demo.MARKER]


def test_prepare_replaces_an_earlier_demo_run_and_nothing_else(tmp_path: Path) -> None:
    assert demo.prepare(tmp_path) is None
    for name in ("scratch", "persistent"):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "x").write_bytes(b"old")
    (tmp_path / "events.jsonl").write_text("{}\n")
    (tmp_path / "summary.png").symlink_to(tmp_path / "events.jsonl")
    (tmp_path / "notes.txt").write_text("added by the user since")
    assert demo.prepare(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [demo.MARKER, "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "added by the user since"


@pytest.mark.slow
@pytest.mark.deep
def test_demo_rerun_reuses_its_own_directory(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    # Seed 19 kills at step 11: the save of step 10 returned only once step 5 was durable
    # (max_inflight=1), so the killed run always leaves a version to resume from.
    args = ("--dir", str(work), "--steps", "17", "--every", "5", "--seed", "19")
    first = _demo_cli(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    (work / "notes.txt").write_text("mine")
    # The rerun goes through the CLI with --json: progress on stderr, one JSON object on stdout.
    cmd = [sys.executable, "-m", "cryosnap", "demo", *args, "--json"]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "SIGKILLed at step 11" in second.stderr and "bit for bit: YES" in second.stderr
    summary = json.loads(second.stdout)
    assert summary["killed_at"] == 11 and summary["exit_code"] == 0
    assert summary["equal_to_uninterrupted"] and summary["persistent_alone_restores"]
    steps = [e["step"] for e in summary["saves"]]
    assert steps[0] == 5 and steps[-1] == summary["steps"] == 17 and steps == sorted(steps)
    # The second run started from nothing: one restore (after its own kill), not two.
    events = (work / "events.jsonl").read_text().splitlines()
    assert sum('"event": "restore"' in line for line in events) == 1
    assert (work / "notes.txt").read_text() == "mine"
