"""``cryosnap export PATH OUT --step B --since A``: a delta from the command line, its JSON
output, and its usage errors (exit 2, one line, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import cryosnap
from tests.unit.cli.test_cli import assert_one_error_line, cli


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    emb = torch.arange(256.0).reshape(16, 16)
    cryosnap.save(path, {"emb": emb, "bias": np.zeros(4), "it": 1, "old": 0.5}, step=1)
    emb = emb.clone()
    emb[2] = -1.0
    cryosnap.save(path, {"emb": emb, "bias": np.zeros(4), "it": 2}, step=2)
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_export_since_writes_a_delta_apply_delta_takes(
    capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path, suffix: str
) -> None:
    out = tmp_path / f"delta{suffix}"
    code, stdout, err = cli(capsys, "export", run, out, "--step", "2", "--since", "1")
    assert (code, err) == (0, "")
    assert stdout.startswith(f"exported the changes of step 2 since step 1 of {run} to {out}")
    assert "2 leaves added or changed, 1 removed" in stdout
    state = cryosnap.apply_delta(cryosnap.load(run, step=1), out)
    assert sorted(state) == ["bias", "emb", "it"] and state["it"] == 2
    assert torch.equal(state["emb"], cryosnap.load(run, step=2)["emb"])


def test_export_since_json(capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path) -> None:
    out = tmp_path / "delta.safetensors"
    code, stdout, _ = cli(capsys, "export", run, out, "--since", "1", "--json")
    assert code == 0
    doc = json.loads(stdout)
    assert (doc["step"], doc["since"], doc["removed"], doc["leaves"]) == (2, 1, ["old"], 2)
    assert doc["bytes"] == out.stat().st_size


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--since", "1", "{out}.pt"], "--since writes .safetensors or .npz"),
        (["--since", "9", "{out}.npz"], "step 9"),
        (["--since", "1", "--step", "7", "{out}.npz"], "step 7"),
    ],
)
def test_export_since_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path, args: list[str], fragment: str
) -> None:
    argv = [a.format(out=tmp_path / "delta") for a in args]
    code, stdout, err = cli(capsys, "export", run, *argv)
    assert (code, stdout) == (2, "")
    assert_one_error_line(err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
