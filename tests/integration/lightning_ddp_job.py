"""A Lightning training under multi-process DDP for test_lightning_ddp.py: each rank runs
this script (launched with torchrun's environment by tests/integration/ranks.py).

The user code is what docs/INTEGRATIONS.md shows: ``Trainer(strategy="ddp", devices=2)``, a
``CryosnapCallback``, a plain ``DataLoader(shuffle=True)`` (Lightning injects a
``DistributedSampler``), dropout and an LR scheduler (lightning_job.Tiny).

    python lightning_ddp_job.py train OUT RUN [--kill-at K]   # K: each rank SIGKILLs itself
    python lightning_ddp_job.py slice OUT DIR                  # three fits in one job

``train`` fits to ``TOTAL`` steps (resuming from RUN when it holds versions); ``slice`` fits
an uninterrupted reference into DIR/ref, a training stopped at ``STOP`` into DIR/run (saved
last at step 6) and its resume into DIR/run, in one job. Each rank appends ``step loss`` per
optimizer step to ``OUT/losses-<rank>-<fit>.txt`` and saves its final weights to
``OUT/weights-<rank>-<fit>.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader

from cryosnap.integrations.lightning import CryosnapCallback
from tests.integration import lightning_job

# 32 samples over 2 ranks, batches of 4: 4 steps per epoch. Saves at 3, 6, 9 (mid-epoch).
SAMPLES, BATCH, TOTAL, EVERY, STOP = 32, 4, 10, 3, 7


class Losses(Callback):
    """Appends ``step loss`` per optimizer step to a file, flushed at once (survives SIGKILL)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start_step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        with self.path.open("a") as f:
            f.write(f"{trainer.global_step} {float(outputs['loss'])!r}\n")


class RankSeed(Callback):
    """Each rank its own dropout masks: Lightning's DDP seeds every rank alike (``reset_seed``),
    so without this a rank resumed with another rank's generators would go unnoticed."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.manual_seed(1000 + trainer.global_rank)


class Halt(Callback):
    """At the start of optimizer step ``step``: SIGKILL this rank (``kill``), or stop fit."""

    def __init__(self, step: int, *, kill: bool) -> None:
        self.step, self.kill = step, kill

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step + 1 == self.step and self.kill:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.global_step >= self.step and not self.kill:
            trainer.should_stop = True


def fit(
    run: Path, out: Path, name: str, *callbacks: Callback, save_on_train_end: bool = True
) -> int | None:
    """One fit into ``run`` (resumed when it holds versions); returns the step it started at."""
    seed_everything(0, verbose=False)
    rank = int(os.environ["RANK"])
    losses = Losses(out / f"losses-{rank}-{name}.txt")
    trainer = Trainer(
        max_steps=TOTAL,
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[
            CryosnapCallback(run, every_n_steps=EVERY, save_on_train_end=save_on_train_end),
            RankSeed(),
            losses,
            *callbacks,
        ],
    )
    model = lightning_job.Tiny()
    data = DataLoader(lightning_job.dataset(SAMPLES), batch_size=BATCH, shuffle=True)
    trainer.fit(model, data)
    torch.save(model.state_dict(), out / f"weights-{rank}-{name}.pt")
    return losses.start_step


def main(scenario: str, out: Path, target: Path, *args: str) -> None:
    warnings.simplefilter("ignore")  # Lightning's advice on workers and resumable loaders
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, Any] = {}
    if scenario == "train":
        kill = [Halt(int(args[1]), kill=True)] if args[:1] == ("--kill-at",) else []
        got["start"] = fit(target, out, "train", *kill)
    else:
        assert scenario == "slice"
        got["ref"] = fit(target / "ref", out, "ref")
        # Stopped without a save at the end: the resume is from the last save mid-epoch (6),
        # as after a kill.
        stop = Halt(STOP, kill=False)
        got["stopped"] = fit(target / "run", out, "stopped", stop, save_on_train_end=False)
        got["resumed"] = fit(target / "run", out, "resumed")
    (out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:])
