"""``cryosnap plan``: the rendering, --json against cryosnap.plan.plan(), --plot, usage errors.

In process, through ``cryosnap.cli.main(argv)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cryosnap.cli import main
from cryosnap.plan import FailureClass, LevelCost, Simulation, Weibull, plan

TWO_LEVELS = [
    "--cost", "scratch=2", "--cost", "persistent=1m",
    "--restart", "scratch=5", "--restart", "persistent=120",
    "--mtbf", "crash=6h:scratch", "--mtbf", "outage=7d:persistent",
]  # fmt: skip


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_each_level_and_the_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, *TWO_LEVELS)
    assert code == 0, err
    assert err == ""
    expected = plan(
        [LevelCost("scratch", 2, 5), LevelCost("persistent", 60, 120)],
        [FailureClass("crash", 6 * 3600, "scratch"), FailureClass("outage", 7 * 86400, 1)],
    )
    lines = out.splitlines()
    assert lines[0].split() == ["level", "takes", "interval", "save", "restart"]
    assert lines[1].split()[:3] == ["scratch", "every", "version"]
    every = expected.levels[1].every
    assert f"every {every}th scratch version" in lines[2]
    assert f"expected waste: {expected.expected_waste:.2%} (analytic; first-order model)" in out
    assert f"every version to every level: {expected.every_version_waste:.2%}" in out
    assert f"persistent alone at Young/Daly's interval: {expected.young_daly_waste:.2%}" in out


def test_plan_json_is_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, *TWO_LEVELS, "--json")
    assert code == 0
    doc = json.loads(out)
    expected = plan(
        [LevelCost("scratch", 2, 5), LevelCost("persistent", 60, 120)],
        [FailureClass("crash", 6 * 3600, "scratch"), FailureClass("outage", 7 * 86400, 1)],
    ).to_dict()
    for entry in doc["levels"]:
        entry.pop("save_seconds"), entry.pop("restart_seconds")
    doc.pop("plot")
    assert doc == expected


def test_plan_with_weibull_searches_with_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, *TWO_LEVELS, "--weibull", "crash=0.7", "--seed", "3", "--json")
    assert code == 0
    doc = json.loads(out)
    expected = plan(
        [LevelCost("scratch", 2, 5), LevelCost("persistent", 60, 120)],
        [
            FailureClass("crash", 6 * 3600, "scratch", Weibull(0.7)),
            FailureClass("outage", 7 * 86400, "persistent"),
        ],
        simulation=Simulation(seed=3),
    )
    assert doc["method"] == "search" and doc["waste_model"] == "simulated"
    assert doc["expected_waste"] == expected.expected_waste
    assert [lv["every"] for lv in doc["levels"]] == [lv.every for lv in expected.levels]
    assert 0 < doc["simulated"] < doc["grid_size"]
    assert doc["expected_waste"] <= doc["every_version"]["waste"]


def test_plan_restart_defaults_to_the_save_cost(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "--cost", "disk=30", "--mtbf", "any=1d:disk", "--json")
    assert code == 0
    assert err.strip() == (
        "cryosnap: note: no --restart for disk: using the save cost as the restart cost"
    )
    assert json.loads(out)["levels"][0]["restart_seconds"] == 30.0


def test_plan_plot_writes_an_image(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "waste.png"
    code, out, _ = cli(capsys, *TWO_LEVELS, "--plot", str(out_png), "--json")
    assert code == 0
    assert json.loads(out)["plot"] == str(out_png)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_plot_without_matplotlib_is_skipped_with_a_note(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backend_bases"):
        monkeypatch.setitem(sys.modules, name, None)  # what an absent package looks like
    out_png = tmp_path / "waste.png"
    code, out, err = cli(capsys, *TWO_LEVELS, "--plot", str(out_png))
    assert code == 0
    assert "expected waste" in out
    assert "--plot needs matplotlib" in err
    assert not out_png.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cost", "a=1"], "Missing option '--mtbf'"),
        (["--mtbf", "x=1h:a"], "Missing option '--cost'"),
        (["--cost", "a", "--mtbf", "x=1h:a"], "--cost expects LEVEL=SECONDS, got 'a'"),
        (["--cost", "a=-1", "--mtbf", "x=1h:a"], "--cost a: '-1' is not a positive number"),
        (["--cost", "a=1", "--cost", "a=2", "--mtbf", "x=1h:a"], "--cost a is given twice"),
        (["--cost", "a=1", "--mtbf", "x=1h:b"], "--mtbf x: unknown level 'b' (known: a)"),
        (["--cost", "a=1", "--mtbf", "x=1h"], "--mtbf expects CLASS=SECONDS:LEVEL"),
        (["--cost", "a=1", "--mtbf", "x=soon:a"], "--mtbf x: 'soon' is not a positive number"),
        (["--cost", "a=1", "--mtbf", "x=1h:a", "--restart", "b=1"], "--restart: unknown level"),
        (["--cost", "a=1", "--mtbf", "x=1h:a", "--weibull", "y=2"], "unknown failure class 'y'"),
        (["--cost", "a=1", "--mtbf", "x=1h:a", "--weibull", "x=0"], "shape must be a positive"),
        (["--cost", "a=1", "--mtbf", "x=1h:a", "--method", "best"], "--method must be auto"),
        (
            ["--cost", "a=1", "--mtbf", "x=1h:a", "--plot", "/no/such/dir/w.png"],
            "no such directory",
        ),
    ],
)
def test_plan_usage_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = cli(capsys, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("cryosnap: error: ")
    assert message in err


def test_plan_unknown_plot_format_is_refused_before_planning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    code, _, err = cli(
        capsys, "--cost", "a=1", "--mtbf", "x=1h:a", "--plot", str(tmp_path / "w.zz")
    )
    assert code == 2
    assert "unknown image format 'zz'" in err
    assert not (tmp_path / "w.zz").exists()


def test_plan_usage_error_with_json_is_also_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--cost", "a=1", "--mtbf", "x=1h:b", "--json")
    assert code == 2
    doc = json.loads(out)
    assert doc["exit_code"] == 2 and doc["type"] == "usage"
    assert "unknown level 'b'" in doc["error"]
