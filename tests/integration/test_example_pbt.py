"""examples/population_based_training.py as a user runs it: members fork from the best one,
and the runs hold less than full copies would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import cryosnap

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "population_based_training.py"


def test_population_based_training_shares_what_it_forks(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dir", str(tmp_path / "pbt"), "--rounds", "3"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"hold ([0-9.]+) MiB on disk; full copies .* ([0-9.]+) MiB", proc.stdout)
    assert m is not None, proc.stdout
    assert float(m.group(2)) > 2 * float(m.group(1))
    runs = [p for p in (tmp_path / "pbt").iterdir() if p.is_dir()]
    forks = [p for p in runs if (p / "FORK.json").exists()]
    assert len(forks) == 6  # 2 of 4 members fork in each of 3 rounds
    for path in runs:
        run = cryosnap.Run(path)
        assert run.verify().ok, path
