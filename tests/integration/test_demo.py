"""The main job end to end: trained, SIGKILLed, resumed, bit-exact (a shortened run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_kills_resumes_and_matches(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cryosnap.demo",
            "--dir",
            str(tmp_path / "demo"),
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
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exited with -9 (killed by SIGKILL)" in proc.stdout
    assert "bit for bit: YES" in proc.stdout
    assert "incremental" in proc.stdout
