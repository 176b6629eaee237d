"""Exact DDP resume by default: a gloo job restarted from its checkpoint, whose script never
calls ``prepare_ddp_resume``, ends bit for bit where the uninterrupted job ends, because the
restore armed the model (cryosnap._run.ddp) and the first training forward rebuilt DDP's
buckets before the step. Three ranks, as in test_ddp_resume.py (with two, a resume is exact
without help); the restarts are in-process (ddp_auto_job.py says why that is a new process's
DDP), one launch for every variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from . import ddp_auto_job
from .test_dist_torch import launch

JOB = Path(ddp_auto_job.__file__)
WORLD = 3
RESUMED = ddp_auto_job.STOP - 1  # the restart resumes from step 2: its losses from step 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ddp-auto")
    return launch("check", WORLD, tmp / "out", str(tmp / "work"), script=JOB)


@pytest.mark.parametrize("variant", ["plain", "held", "late"])
def test_an_unchanged_ddp_script_resumes_bit_exact(
    ranks: list[dict[str, Any]], variant: str
) -> None:
    # "held": the state holds the DDP model itself (its keys "module.*"), not its module;
    # "late": the DDP is built after the restore. Both train as "plain" does.
    for rank, report in enumerate(ranks):
        ref, resumed = report["plain-reference"], report[variant]
        assert resumed["losses"] == ref["losses"][RESUMED:], rank
        assert resumed["weights"] == ref["weights"], rank
        assert resumed["hooks"] == 0, rank  # the hook went once it had run
        assert resumed["warned"] == [], rank


def test_gradients_accumulated_under_no_sync_survive_the_warm_up(
    ranks: list[dict[str, Any]],
) -> None:
    # The hook waits for the forward that reduces, and puts the accumulated gradients back
    # by value: DDP writes the reduced ones into the same tensors.
    for rank, report in enumerate(ranks):
        ref, resumed = report["accumulate-reference"], report["accumulate"]
        assert resumed["losses"] == ref["losses"][RESUMED:], rank
        assert resumed["weights"] == ref["weights"], rank


def test_without_the_hook_the_resumed_job_ends_elsewhere(ranks: list[dict[str, Any]]) -> None:
    # What the tests above would catch: the same restart with the hook removed.
    for rank, report in enumerate(ranks):
        assert report["unarmed"]["weights"] != report["plain-reference"]["weights"], rank


def test_a_static_graph_resume_is_named_inexact_on_rank_0(ranks: list[dict[str, Any]]) -> None:
    # static_graph=True: not bit for bit by either warm-up (measured): a warning, not a fix.
    warned = [report["static"]["warned"] for report in ranks]
    assert [len(w) for w in warned] == [1] + [0] * (WORLD - 1)
    assert "static_graph=True" in warned[0][0]
    assert all(report["static"]["hooks"] == 0 for report in ranks)
