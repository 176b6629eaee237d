"""A small Lightning training for test_lightning.py: run in the test process, or as a child
process that a signal stops in the middle of an epoch.

The user code is what docs/INTEGRATIONS.md shows: a ``CryosnapCallback`` and a resumable train
dataloader. ``Record`` (the losses, to a file that survives SIGKILL) and ``Stop`` (the signal,
sent at the start of a chosen optimizer step) are the test's instruments.

    python lightning_job.py RUN OUT --kill-at 9 --signal KILL [--loader plain]

``--loader`` picks the train dataloader: ``resumable`` (a ResumableLoader), or what users
have: ``plain`` (``DataLoader(shuffle=True)``), ``workers`` (the same with 2 worker processes
and ``drop_last``), ``distributed`` (a ``DistributedSampler``, as Lightning injects under DDP).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cryosnap.integrations.lightning import CryosnapCallback, InexactResumeWarning
from cryosnap.integrations.torch import ResumableLoader, ResumableSampler

SAMPLES, BATCH, TOTAL, EVERY = 24, 4, 14, 4  # 6 steps per epoch; saves at 4, 8, 12


class Tiny(LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


LOADERS = ("resumable", "plain", "workers", "distributed")


def dataset(samples: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def loader(kind: str = "resumable") -> Any:
    """The train dataloader ``kind`` names; each has 6 batches per epoch."""
    if kind == "resumable":
        data = dataset()
        return ResumableLoader(data, batch_size=BATCH, sampler=ResumableSampler(data, seed=0))
    if kind == "plain":
        return DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    if kind == "workers":  # 26 samples: drop_last drops a short seventh batch
        data = dataset(SAMPLES + 2)
        return DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=2, drop_last=True)
    assert kind == "distributed"
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=3)
    return DataLoader(data, batch_size=BATCH, sampler=sampler)


class Record(Callback):
    """Appends ``step loss`` per optimizer step to a file, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        with self.path.open("a") as f:
            f.write(f"{trainer.global_step} {float(outputs['loss'])!r}\n")


class Stop(Callback):
    """Sends ``signum`` to this process when optimizer step ``step`` starts."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def fit(
    run: Path,
    out: Path,
    *callbacks: Callback,
    ckpt_path: str | None = None,
    resume: bool = True,
    data: Any = None,
    kind: str = "resumable",
    exact: bool = False,
    module: type[Tiny] = Tiny,
) -> Tiny:
    """One ``fit`` (a fresh process's worth: seeded, a new model and Trainer)."""
    seed_everything(0, verbose=False)
    model = module()
    trainer = Trainer(
        max_steps=TOTAL,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[
            CryosnapCallback(run, every_n_steps=EVERY, resume=resume, exact=exact),
            *callbacks,
        ],
    )
    trainer.fit(model, loader(kind) if data is None else data, ckpt_path=ckpt_path)
    return model


__all__ = ["InexactResumeWarning", "Record", "Stop", "Tiny", "fit", "loader", "losses"]


def losses(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(step), float(loss)) for step, loss in rows]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int, required=True)
    parser.add_argument("--signal", choices=["KILL", "TERM"], required=True)
    parser.add_argument("--loader", choices=LOADERS, default="resumable")
    args = parser.parse_args(argv)
    signum = getattr(signal, f"SIG{args.signal}")
    record, stop = Record(args.out / "losses.txt"), Stop(args.kill_at, signum)
    fit(args.run, args.out, record, stop, kind=args.loader)
    # A preempted fit returns (Lightning ended it on the passed-on SIGTERM): say how far it got.
    sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1:])
