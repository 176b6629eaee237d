"""``cryosnap fork`` as a user types it, and the lineage ``ls`` and ``log`` print."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from tests.unit.cli.test_cli import cli


def _run(path: Path, steps: int) -> None:
    with cryosnap.Checkpointer(path, chunk_bytes=64 << 10) as ckpt:
        for s in range(1, steps + 1):
            ckpt.save(s, {"w": np.full(100_000, float(s)), "step": s}).result()


def test_fork_then_ls_and_log_show_the_lineage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anc, fork = tmp_path / "anc", tmp_path / "fork"
    _run(anc, 3)
    code, out, err = cli(capsys, "fork", anc, fork, "--step", "2")
    assert code == 0, err
    assert "forked step 2" in out and "sharing its data files" in out
    assert cryosnap.load(fork)["step"] == 2
    code, out, _ = cli(capsys, "ls", fork)
    assert code == 0 and f"forked from {os.path.realpath(anc)} at step 2" in out
    code, out, _ = cli(capsys, "log", anc)
    assert code == 0 and f"fork: {os.path.realpath(fork)} from step 2" in out
    code, out, _ = cli(capsys, "log", anc, "--json")
    doc = json.loads(out)
    assert doc["forks"] == [
        {"path": os.path.realpath(fork), "from": os.path.realpath(anc), "step": 2}
    ]
    assert doc["forked_from"] is None
    code, out, _ = cli(capsys, "ls", fork, "--json")
    assert json.loads(out)["forked_from"] == {"path": os.path.realpath(anc), "step": 2}


def test_fork_defaults_to_the_newest_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anc = tmp_path / "anc"
    _run(anc, 3)
    code, out, err = cli(capsys, "fork", anc, tmp_path / "f", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["step"], doc["shared"], doc["data_bytes_written"]) == (3, True, 0)


@pytest.mark.parametrize("case", ["not_empty", "no_step", "empty_dest"])
def test_a_bad_fork_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    anc, dest = tmp_path / "anc", tmp_path / "dest"
    _run(anc, 2)
    dest.mkdir()
    (dest / "x").write_text("mine")
    args = {
        "not_empty": ["fork", anc, dest],
        "no_step": ["fork", anc, tmp_path / "new", "--step", "7"],
        "empty_dest": ["fork", anc, ""],
    }[case]
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert {"not_empty": "not empty", "no_step": "step 7", "empty_dest": "DEST"}[case] in err
    assert (dest / "x").read_text() == "mine" and not (tmp_path / "new").exists()
