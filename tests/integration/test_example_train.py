"""examples/train.py as the README tells a user to run it: once through; killed with SIGKILL
after a save and run again; stopped by SIGTERM (it saves and leaves) and run again. Every
resumed run ends with the uninterrupted run's weights, bit for bit (its ``final`` digest);
under torchrun (2 gloo ranks) too."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"


def _readme_lines() -> list[list[str]]:
    """The lines of README.md that run the example, as a user types them."""
    lines = []
    for text in (ROOT / "README.md").read_text().splitlines():
        if not text.startswith(("python examples/", "torchrun ")):
            continue
        words = shlex.split(text, comments=True)
        if "examples/train.py" in words:
            lines.append(words)
    return lines


def test_the_readme_runs_this_example_as_the_test_does() -> None:
    """What README.md tells a user to run is what these tests run: the same script and
    options (one process, and torchrun at 2 ranks)."""
    lines = _readme_lines()
    assert [w[:2] for w in lines if w[0] == "python"] == [["python", "examples/train.py"]] * 2
    [torchrun] = [w for w in lines if w[0] == "torchrun"]
    assert torchrun[:4] == ["torchrun", "--nproc-per-node", "2", "examples/train.py"]
    for words in lines:
        assert words[words.index("examples/train.py") + 1] == "--checkpoints"


STEPS = "400"  # long enough that the signal lands mid-run, however late it is read
TIMEOUT = 240


def _command(run: Path, ranks: int) -> list[str]:
    args = [str(EXAMPLE), "--checkpoints", str(run), "--steps", STEPS, "--every", "10"]
    if ranks == 1:
        return [sys.executable, *args]
    from tests.integration.test_dist_torch import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *args,
    ]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }


def _run(run: Path, ranks: int) -> str:
    proc = subprocess.run(
        _command(run, ranks), capture_output=True, text=True, timeout=TIMEOUT, env=_env()
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _final(out: str) -> str:
    found = re.findall(r"^final (\w+)", out, re.M)
    assert found, out
    return found[-1]


def _signal_tree(pid: int, signum: int) -> None:
    """``signum`` to ``pid`` and every process below it (torchrun's ranks start sessions of
    their own: a SIGKILL of the job is one of each of them, as a node's loss is)."""
    import psutil

    procs = [psutil.Process(pid)]
    with contextlib.suppress(psutil.NoSuchProcess):
        procs += procs[0].children(recursive=True)
    for p in reversed(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signum)


def _interrupt(run: Path, ranks: int, signum: int, after: str) -> str:
    """Start the example, send ``signum`` once it printed ``after``; what it printed."""
    proc = subprocess.Popen(
        _command(run, ranks),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,  # the signal goes to torchrun's ranks too
    )
    seen = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(after):
                _signal_tree(proc.pid, signum)
                break
        rest = proc.communicate(timeout=TIMEOUT)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return "".join(seen) + (rest or "")


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.deep)])
def test_killed_and_resumed_ends_bit_for_bit(tmp_path: Path, ranks: int) -> None:
    want = _final(_run(tmp_path / "straight", ranks))
    run = tmp_path / "killed"
    out = _interrupt(run, ranks, signal.SIGKILL, "saved step 30")
    assert "final" not in out
    again = _run(run, ranks)
    assert re.search(r"^resumed at step [1-5]?[0-9]0$", again, re.M), again
    assert _final(again) == want


def test_sigterm_saves_and_leaves_then_resumes(tmp_path: Path) -> None:
    want = _final(_run(tmp_path / "straight", 1))
    run = tmp_path / "preempted"
    out = _interrupt(run, 1, signal.SIGTERM, "saved step 20")
    stopped = re.search(r"^preempted at step (\d+)", out, re.M)
    assert stopped, out
    again = _run(run, 1)
    assert f"resumed at step {stopped.group(1)}" in again
    assert _final(again) == want
