"""``cryosnap log PATH [--leaf LEAF] [--json] [--plot FILE.png]``: per version its marks, a
leaf's statistics and changed fraction; ``cryosnap ls`` shows the marks; usage errors are one
line, exit 2."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from tests.unit.cli.test_cli import assert_one_error_line, cli


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    w = np.linspace(-1, 1, 4096, dtype=np.float32)
    with cryosnap.Checkpointer(path, chunk_bytes=4096) as ckpt:
        ckpt.save(1, {"w": w, "b": np.zeros(3)}).result()
        w = w.copy()
        w[:10] = 5.0  # one chunk of four
        ckpt.save(2, {"w": w, "b": np.zeros(3)}).result()
        ckpt.mark(2, "eval_ok")
        w = w.copy()
        w[-1] = np.nan
        ckpt.save(3, {"w": w, "b": np.zeros(3)}).result()
    return path


def test_log_json_per_version_with_a_leaf(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    code, out, err = cli(capsys, "log", run, "--leaf", "w", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["leaf"] == "w" and [v["step"] for v in doc["versions"]] == [1, 2, 3]
    assert [v["marks"] for v in doc["versions"]] == [[], ["eval_ok"], ["unhealthy"]]
    assert [v["changed_fraction"] for v in doc["versions"]] == [1.0, 0.25, 0.25]
    stats = [v["stats"] for v in doc["versions"]]
    assert stats[0]["nan"] == 0 and stats[0]["min"] == -1.0 and stats[1]["max"] == 5.0
    assert stats[2]["nan"] == 1
    want = cryosnap.Run(run).stats(2)["w"]
    assert stats[1]["norm"] == pytest.approx(want.norm)


def test_log_table_and_ls_show_marks(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    code, out, err = cli(capsys, "log", run)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert "marks" in lines[0] and "eval_ok" in lines[2] and "unhealthy" in lines[3]
    code, out, err = cli(capsys, "log", run, "--leaf", "w")
    assert code == 0 and "25.0%" in out and "norm" in out.splitlines()[0]
    code, out, err = cli(capsys, "ls", run, "--json")
    assert [v["marks"] for v in json.loads(out)["versions"]] == [[], ["eval_ok"], ["unhealthy"]]
    code, out, err = cli(capsys, "ls", run)
    assert code == 0 and "eval_ok" in out and "unhealthy" in out


def test_log_plot(capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "w.png"
    code, _out, err = cli(capsys, "log", run, "--leaf", "w", "--plot", out_png)
    assert (code, err) == (0, "")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_usage_errors(
    capsys: pytest.CaptureFixture[str],
    run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, _out, err = cli(capsys, "log", run, "--plot", tmp_path / "x.png")
    assert code == 2
    assert_one_error_line(err, "--plot draws one leaf")
    code, _out, err = cli(capsys, "log", run, "--leaf", "nope")
    assert code == 2
    assert_one_error_line(err, "--leaf nope", "holds that leaf")
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code, _out, err = cli(capsys, "log", run, "--leaf", "w", "--plot", tmp_path / "x.png")
    assert code == 2
    assert_one_error_line(err, "--plot needs matplotlib")
    assert not (tmp_path / "x.png").exists()
