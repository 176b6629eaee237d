"""Lightning under multi-process DDP: 2 gloo processes with torchrun's environment, a real
``Trainer(strategy="ddp")`` (lightning_ddp_job.py, the user's script), a plain
``DataLoader(shuffle=True)`` (Lightning injects a DistributedSampler), dropout with each
rank's own generators, an LR scheduler. Every rank saves its own part of each version (rank 0
the checkpoint, each rank its generators and data position); a resumed job ends with weights
``torch.equal`` to the uninterrupted job's on every rank, and the same losses.

The unmarked slice runs the three fits (reference, stopped, resumed) in one job; the deep test
SIGKILLs the whole job mid-epoch and resumes it in a new one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch

import cryosnap
from tests.integration import lightning_ddp_job, lightning_job, ranks

JOB = Path(lightning_ddp_job.__file__)
WORLD = 2

pytestmark = [
    # As in test_lightning.py: Lightning's advice on workers, and its LeafSpec under torch 2.13.
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
    # Lightning warns on resume that a plain DataLoader is not resumable: cryosnap resumes it.
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before"),
]


def _losses(out: Path, rank: int, fit: str) -> list[tuple[int, float]]:
    path = out / f"losses-{rank}-{fit}.txt"
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(step), float(loss)) for step, loss in rows]


def _assert_same_weights(a: Path, b: Path) -> None:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), f"{k}: {a.name} vs {b.name}"


def test_a_ddp_training_stopped_mid_epoch_resumes_bit_exact_on_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    got = ranks.launch(JOB, "slice", WORLD, out, str(tmp_path / "runs"), elastic=True)
    for rank in range(WORLD):
        assert got[rank] == {"ref": 0, "stopped": 0, "resumed": 6}, rank  # resumed mid-epoch
        ref = _losses(out, rank, "ref")
        assert _losses(out, rank, "stopped") == ref[: lightning_ddp_job.STOP]
        assert _losses(out, rank, "resumed") == ref[6:]
        _assert_same_weights(out / f"weights-{rank}-ref.pt", out / f"weights-{rank}-resumed.pt")
    # Each rank's generators are its own: the ranks' losses differ, step for step.
    assert _losses(out, 0, "ref") != _losses(out, 1, "ref")
    # One process cannot resume what two saved exactly: refused with exact=True, else warned.
    run = tmp_path / "runs" / "run"
    with pytest.raises(cryosnap.InexactResumeError, match=r"saved by 2 process\(es\)"):
        lightning_job.fit(run, tmp_path, kind="plain", exact=True)
    with pytest.warns(lightning_job.InexactResumeWarning, match="rank 0's random number"):
        lightning_job.fit(run, tmp_path, kind="plain")


@pytest.mark.deep
def test_a_ddp_job_sigkilled_mid_epoch_resumes_bit_exact(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ranks.launch(JOB, "train", WORLD, ref, str(tmp_path / "ref-run"), elastic=True)
    killed = frozenset(range(WORLD))  # the whole job: each rank SIGKILLs itself at step 8
    ranks.launch(
        JOB,
        "train",
        WORLD,
        tmp_path / "killed",
        str(run),
        "--kill-at",
        "8",
        elastic=True,
        killed=killed,
    )
    resumed = ranks.launch(JOB, "train", WORLD, tmp_path / "resumed", str(run), elastic=True)
    for rank in range(WORLD):
        start = resumed[rank]["start"]
        assert start in (3, 6), start  # 6 is durable unless the kill came first
        expected = _losses(ref, rank, "train")
        assert _losses(tmp_path / "killed", rank, "train") == expected[:7]
        assert _losses(tmp_path / "resumed", rank, "train") == expected[start:]
        _assert_same_weights(
            ref / f"weights-{rank}-train.pt", tmp_path / "resumed" / f"weights-{rank}-train.pt"
        )
