"""A Lightning training under ``CryosnapDDPStrategy`` for test_lightning_strategy.py: each rank
runs this script (launched with torchrun's environment by tests/integration/ranks.py).

The user code is ``Trainer(strategy=CryosnapDDPStrategy(run, every_n_steps=3), devices=2)`` and
a ``ModelCheckpoint`` (the best by the synced loss every 4 steps, and ``last``); the model has a
frozen 1 MiB input layer (a later save does not write it again), BatchNorm (each rank's own
buffers), dropout with each rank's own generators and an LR scheduler.

    python lightning_strategy_job.py train OUT RUN [--kill-at K]  # K: each rank SIGKILLs itself
    python lightning_strategy_job.py fsdp-train OUT RUN [--kill-at K]  # the same under FSDP
    python lightning_strategy_job.py slice OUT DIR                 # three fits in one job
    python lightning_strategy_job.py fsdp-slice OUT DIR            # the same under FSDP

``train`` fits to ``TOTAL`` steps (resuming from RUN when it holds versions); ``slice`` fits an
uninterrupted reference into DIR/ref, a training stopped at ``STOP`` into DIR/run (its last
save at step 6) and its resume with ``ckpt_path="last"``, in one job. Each rank appends
``step loss`` per optimizer step to ``OUT/losses-<rank>-<fit>.txt`` and saves its final
weights to ``OUT/weights-<rank>-<fit>.pt``. The Trainer takes as many devices as the job has
processes (``WORLD_SIZE``). test_lightning_strategy.py runs ``fit`` in-process with one device
too.
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
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from cryosnap.integrations.lightning import CryosnapDDPStrategy, CryosnapFSDPStrategy

# 32 samples over 2 ranks, batches of 4: 4 steps per epoch. The strategy saves at 3, 6, 9
# (mid-epoch) and 10 (the end), the ModelCheckpoint at 4 and 8.
SAMPLES, BATCH, TOTAL, EVERY, STOP, BEST_EVERY = 32, 4, 10, 3, 7, 4
CHUNK = 4096  # the smallest chunk: the bounds of the test are tight
FEATURES = 1024


class Net(LightningModule):
    """A frozen 1024 x 256 input layer (1 MiB), BatchNorm, a trained head with dropout."""

    def __init__(self, lr: float = 0.02, hidden: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.embed = torch.nn.Linear(FEATURES, 256)
        self.embed.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(256)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(256, hidden),
            torch.nn.Dropout(0.3),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.norm(self.embed(x))), y)
        # Synced: every rank's ModelCheckpoint ranks the saves alike.
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Plain(Net):
    """For FSDP (FSDP1 cannot flatten frozen and trained parameters together): all trained,
    no BatchNorm."""

    def __init__(self, lr: float = 0.02, hidden: int = 64) -> None:
        super().__init__(lr, hidden)
        self.embed.requires_grad_(True)
        self.norm = torch.nn.Identity()  # type: ignore[assignment]


def dataset(samples: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=g)
    return TensorDataset(x, x[:, :8].sum(1, keepdim=True))


def loader() -> DataLoader[Any]:
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True)


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
    """Each rank its own dropout masks (Lightning's DDP seeds every rank alike)."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.manual_seed(1000 + trainer.global_rank)


class Shards(Callback):
    """Saves this rank's flat parameter shards when training ends (FSDP)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        model = trainer.strategy.model
        assert model is not None
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, self.path)


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


def files(run: Path) -> Path:
    """The folder of the ModelCheckpoint of the Trainer that saves into ``run``."""
    return run.parent / f"{run.name}-files"


def trainer(
    run: Path,
    out: Path,
    *callbacks: Callback,
    devices: int | None = None,
    save_on_train_end: bool = True,
    fsdp: bool = False,
    **options: Any,
) -> Trainer:
    """The user's Trainer: the strategy, a ModelCheckpoint into ``files(run)``."""
    strategy: CryosnapDDPStrategy | CryosnapFSDPStrategy
    if fsdp:
        strategy = CryosnapFSDPStrategy(
            run,
            every_n_steps=EVERY,
            chunk_bytes=CHUNK,
            save_on_train_end=save_on_train_end,
            fsdp_options={"process_group_backend": "gloo"},
        )
    else:
        strategy = CryosnapDDPStrategy(
            run,
            every_n_steps=EVERY,
            chunk_bytes=CHUNK,
            save_on_train_end=save_on_train_end,
            ddp_options={"process_group_backend": "gloo"},
        )
    best = ModelCheckpoint(
        dirpath=files(run), monitor="loss", every_n_train_steps=BEST_EVERY, save_last=True
    )
    return Trainer(
        max_steps=TOTAL,
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "2")) if devices is None else devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[best, RankSeed(), *callbacks],
        **options,
    )


def fit(
    run: Path,
    out: Path,
    name: str,
    *callbacks: Callback,
    ckpt_path: str | None = None,
    fsdp: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """One fit into ``run`` (resumed when it holds versions); what it started from. Under
    FSDP the weights saved are this rank's flat parameter shards."""
    seed_everything(0, verbose=False)
    rank = int(os.environ.get("RANK", "0"))
    losses = Losses(out / f"losses-{rank}-{name}.txt")
    weights = out / f"weights-{rank}-{name}.pt"
    shards = [Shards(weights)] if fsdp else []
    t = trainer(run, out, losses, *shards, *callbacks, fsdp=fsdp, **options)
    model = Plain() if fsdp else Net()
    t.fit(model, loader(), ckpt_path=ckpt_path)
    if not fsdp:
        torch.save(model.state_dict(), weights)
    best = t.checkpoint_callback
    assert isinstance(best, ModelCheckpoint)
    return {
        "start": losses.start_step,
        "best_k": sorted(best.best_k_models),
        "last": best.last_model_path,
    }


def main(scenario: str, out: Path, target: Path, *args: str) -> None:
    warnings.simplefilter("ignore")  # Lightning's advice on workers and resumable loaders
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, Any] = {}
    if scenario in ("train", "fsdp-train"):
        kill = [Halt(int(args[1]), kill=True)] if args[:1] == ("--kill-at",) else []
        got["train"] = fit(target, out, "train", *kill, fsdp=scenario == "fsdp-train")
    else:
        assert scenario in ("slice", "fsdp-slice")
        fsdp = scenario == "fsdp-slice"
        got["ref"] = fit(target / "ref", out, "ref", fsdp=fsdp)
        # Stopped without a save at the end: the resume is from the last save mid-epoch (6),
        # as after a kill; "last" is the run's newest version.
        stop = Halt(STOP, kill=False)
        got["stopped"] = fit(
            target / "run", out, "stopped", stop, save_on_train_end=False, fsdp=fsdp
        )
        got["resumed"] = fit(target / "run", out, "resumed", ckpt_path="last", fsdp=fsdp)
    (out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:])
