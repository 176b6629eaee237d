"""``cryosnap plan``: the rendering, --json against cryosnap.plan.plan(), --plot, usage errors.

In process, through ``cryosnap.cli.main(argv)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cryosnap.cli import main
from cryosnap.plan import (
    CostPrediction,
    FailureClass,
    JobShape,
    LevelCost,
    Machine,
    Simulation,
    Weibull,
    plan,
    predict,
)

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
        (["--cost", "a=1"], "give at least one --mtbf"),
        (["--mtbf", "x=1h:a"], "give at least one --cost"),
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


# ---------------------------------------------------------------------------------------------
# the job's shape: the predicted save, and the plan it feeds

SHAPE = [
    "--ranks", "64", "--ranks-per-node", "8", "--state-bytes", "1GiB",
    "--replicated-bytes", "4GiB", "--memcpy-bandwidth", "20GB/s", "--hash-bandwidth", "10GB/s",
    "--local-bandwidth", "4GB/s", "--pfs-bandwidth", "1TB/s", "--node-bandwidth", "25GB/s",
    "--latency", "50us",
]  # fmt: skip
FAILURES = ["--mtbf", "crash=2h:scratch", "--mtbf", "outage=2d:persistent"]


def shape_prediction() -> CostPrediction:
    machine = Machine(20e9, 10e9, 4e9, 1e12, 25e9, 50e-6)
    return predict(JobShape(64, 8, 1 << 30, replicated_bytes=4 << 30), machine)


def test_plan_with_the_shape_prints_the_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, *SHAPE)
    assert code == 0, err
    assert err == ""
    p = shape_prediction()
    lines = out.splitlines()
    assert lines[0] == (
        "64 ranks on 8 nodes (8 per node); per rank 1.0 GiB of its own and 4.0 GiB replicated"
    )
    assert lines[1] == f"stall: {p.stall_seconds * 1e3:.3g} ms (copies 5.0 GiB per rank)"
    assert lines[2].split()[:3] == ["level", "durable", "after"]
    assert lines[3].split()[0] == "scratch" and lines[4].split()[0] == "persistent"
    assert "expected waste" not in out  # no --mtbf: no plan


def test_plan_with_the_shape_and_failures_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, *SHAPE, *FAILURES, "--json")
    assert code == 0, err
    doc = json.loads(out)
    p = shape_prediction()
    assert doc["prediction"] == p.to_dict()
    costs = p.level_costs()
    expected = plan(
        costs,
        [FailureClass("crash", 7200, "scratch"), FailureClass("outage", 2 * 86400, "persistent")],
    )
    assert [lv["save_seconds"] for lv in doc["plan"]["levels"]] == [c.save_seconds for c in costs]
    assert doc["plan"]["expected_waste"] == expected.expected_waste
    assert [lv["every"] for lv in doc["plan"]["levels"]] == [lv.every for lv in expected.levels]
    # the same save straight to the shared level, which then survives every failure
    machine = Machine(20e9, 10e9, 4e9, 1e12, 25e9, 50e-6)
    direct = predict(JobShape(64, 8, 1 << 30, replicated_bytes=4 << 30), machine, scratch=False)
    alone = plan(
        direct.level_costs(),
        [
            FailureClass("crash", 7200, "persistent"),
            FailureClass("outage", 2 * 86400, "persistent"),
        ],
    )
    assert doc["without_scratch"]["prediction"] == direct.to_dict()
    assert doc["without_scratch"]["plan"]["expected_waste"] == alone.expected_waste


def test_plan_with_the_shape_renders_the_plan_and_takes_restart_overrides(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = cli(capsys, *SHAPE, *FAILURES, "--restart", "persistent=10m", "--json")
    assert code == 0
    assert json.loads(out)["plan"]["levels"][1]["restart_seconds"] == 600.0
    code, out, _ = cli(capsys, *SHAPE, *FAILURES)
    assert code == 0
    assert "expected waste:" in out and "persistent alone at Young/Daly" in out
    assert "without scratch (--no-scratch): stall" in out
    # scratch takes 10.7 s (8 ranks share 4 GB/s), the shared level 0.4 s: it is better alone
    assert out.splitlines()[-1] == "recommended: without scratch (the lower expected waste)"
    # a fast scratch and a slow shared level: the two levels are better
    fast = ["--local-bandwidth", "400GB/s", "--pfs-bandwidth", "20GB/s"]
    code, out, _ = cli(capsys, *SHAPE, *FAILURES, *fast)
    assert out.splitlines()[-1] == "recommended: the levels above"


def test_plan_without_scratch_predicts_one_level(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, *SHAPE[:-4], "--no-scratch", "--json")
    assert code == 0
    assert "no --latency" in err  # the note, on stderr
    levels = json.loads(out)["prediction"]["levels"]
    assert [lv["name"] for lv in levels] == ["persistent"]


def test_plan_partner_adds_the_parity(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, *SHAPE, "--partner", "xor", "--json")
    assert code == 0
    scratch = json.loads(out)["prediction"]["levels"][0]
    assert scratch["written_bytes_per_rank"] == pytest.approx((5 << 30) * (1 + 1 / 7))
    assert "xor network" in scratch["terms"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*SHAPE, "--cost", "a=1"], "either --cost"),
        (["--local-bandwidth", "2GB/s", "--cost", "a=1", "--mtbf", "x=1h:a"], "job's shape"),
        (["--ranks", "8"], "needs --ranks-per-node, --state-bytes, --memcpy-bandwidth"),
        ([*SHAPE[:8], "--hash-bandwidth", "1GB/s", "--pfs-bandwidth", "1GB/s"], "--memcpy"),
        ([*SHAPE, "--ranks-per-node", "128"], "--ranks-per-node 128 is more than --ranks 64"),
        ([*SHAPE, "--state-bytes", "lots"], "--state-bytes: 'lots' is not a size"),
        ([*SHAPE, "--pfs-bandwidth", "1TB"], "--pfs-bandwidth: '1TB' is not a positive rate"),
        ([*SHAPE, "--latency", "soon"], "--latency: 'soon' is not a duration"),
        ([*SHAPE, "--partner", "raid"], "--partner must be copy, xor or rs:K+M"),
        ([*SHAPE, "--partner", "rs:1+1"], "K >= 2"),
        ([*SHAPE, "--no-scratch", "--partner", "copy"], "without scratch"),
        ([*SHAPE, "--plot", "w.png"], "--plot needs --mtbf"),
        ([*SHAPE, "--restart", "scratch=1"], "--restart and --weibull need --mtbf"),
        ([*SHAPE, *FAILURES, "--restart", "disk=1"], "--restart: unknown level 'disk'"),
    ],
)
def test_plan_shape_usage_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = cli(capsys, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("cryosnap: error: ")
    assert message in err


def test_plan_measure_fills_the_rates_not_given(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    shape = ["--ranks", "4", "--ranks-per-node", "2", "--state-bytes", "64MiB"]
    code, out, err = cli(
        capsys, *shape, "--pfs-bandwidth", "1TB/s", "--measure", str(tmp_path), "--json"
    )
    assert code == 0, err
    measured = next(line for line in err.splitlines() if "measured at" in line)
    for option in ("--memcpy-bandwidth", "--hash-bandwidth", "--local-bandwidth"):
        assert option in measured
    assert "--pfs-bandwidth" not in measured  # given: kept
    doc = json.loads(out)
    assert [lv["name"] for lv in doc["prediction"]["levels"]] == ["scratch", "persistent"]
    assert list(tmp_path.iterdir()) == []  # the probe's files are gone


def test_plan_measure_of_a_folder_that_is_not_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    shape = ["--ranks", "4", "--ranks-per-node", "2", "--state-bytes", "64MiB"]
    code, _, err = cli(capsys, *shape, "--measure", str(tmp_path / "missing"))
    assert code != 0
    assert err.strip().count("\n") == 0 and "not a folder" in err
