"""Exact DDP resume: a torchrun-style gloo job SIGKILLed mid-training and restarted ends bit
for bit where the uninterrupted job ends, with ``prepare_ddp_resume`` after the restore.

Three ranks: with two, gloo's sum of a gradient over the ranks is one addition whatever the
buckets (a + b == b + a), so a resume is exact without help. With three, the first backward
of a fresh process (DDP's single initial bucket) sums in another order than the rebuilt
buckets of the uninterrupted job, and the final weights differ in the last bits unless the
buckets are rebuilt first (measured: another weights digest without the helper).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from . import ddp_job
from .test_dist_torch import launch

JOB = Path(ddp_job.__file__)
WORLD, TOTAL, KILL_AT = 3, 6, 3  # saves at 2 and 4: the kill comes after step 2 is durable


@pytest.mark.deep
def test_a_killed_ddp_job_resumes_bit_exact_with_prepare_ddp_resume(tmp_path: Path) -> None:
    reference = launch(
        "train", WORLD, tmp_path / "ref", str(tmp_path / "ref-run"), str(TOTAL), script=JOB
    )
    run = str(tmp_path / "run")
    launch(
        "train",
        WORLD,
        tmp_path / "killed",
        run,
        str(TOTAL),
        "--kill-at",
        str(KILL_AT),
        script=JOB,
        killed=frozenset(range(WORLD)),
    )
    resumed = launch("train", WORLD, tmp_path / "resumed", run, str(TOTAL), "--prepare", script=JOB)
    for rank in range(WORLD):
        assert resumed[rank]["losses"] == reference[rank]["losses"][KILL_AT - 1 :], rank
        assert resumed[rank]["weights"] == reference[rank]["weights"], rank
