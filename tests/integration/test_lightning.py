"""Lightning integration: a tiny model trained on CPU through the real ``lightning.pytorch``.

A run saved with the callback (or through the CheckpointIO plugin) and resumed in a fresh
Trainer continues from the saved step with the saved weights and ends bit for bit where an
uninterrupted run ends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import cryosnap
from cryosnap.integrations.lightning import (
    CryosnapCallback,
    CryosnapCheckpointIO,
    load_checkpoint,
    to_plain,
)

pytestmark = [
    # On machines with more than 2 cores Lightning advises DataLoader workers for speed.
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    # Lightning 2.6 calls torch.utils._pytree.LeafSpec(), which torch 2.13 deprecates.
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
]

BATCHES_PER_EPOCH = 4


class Tiny(LightningModule):
    def __init__(self, lr: float = 0.1, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES_PER_EPOCH * 4, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=False)


class Probe(Callback):
    """Records the step and weights at which training (re)starts."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        self.start_weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step = trainer.global_step
        self.start_weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


def _trainer(tmp_path: Path, max_steps: int, callbacks: list[Any], **kwargs: Any) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        deterministic=True,
        **kwargs,
    )


def _fit(
    tmp_path: Path, max_steps: int, *callbacks: Any, ckpt_path: str | None = None, **kwargs: Any
) -> tuple[Tiny, Probe]:
    seed_everything(0, verbose=False)
    model, probe = Tiny(), Probe()
    trainer = _trainer(tmp_path, max_steps, [*callbacks, probe], **kwargs)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model, probe


def _steps(run: Path) -> list[int]:
    with cryosnap.Checkpointer(run) as ckpt:
        return ckpt.steps()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_callback_saves_and_resumes_exactly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    total = 3 * BATCHES_PER_EPOCH
    cut = 2 * BATCHES_PER_EPOCH  # an epoch boundary: the plain DataLoader resumes exactly there

    reference, _ = _fit(tmp_path / "ref", total, enable_checkpointing=False)

    first, _ = _fit(
        tmp_path / "a",
        cut,
        CryosnapCallback(run, every_n_steps=BATCHES_PER_EPOCH),
        enable_checkpointing=False,
    )
    assert _steps(run) == [BATCHES_PER_EPOCH, cut]
    saved = cryosnap.load(run)
    assert saved["global_step"] == cut
    assert saved["hyper_parameters"] == {"lr": 0.1, "width": 8}
    _assert_same(saved["state_dict"], first.state_dict())

    callback = CryosnapCallback(run, every_n_steps=BATCHES_PER_EPOCH)
    resumed, probe = _fit(tmp_path / "b", total, callback, enable_checkpointing=False)
    assert callback.restored_step == cut
    assert probe.start_step == cut
    _assert_same(probe.start_weights, saved["state_dict"])
    assert _steps(run) == [4, 8, 12]
    _assert_same(resumed.state_dict(), reference.state_dict())


# Resuming into the directory of the interrupted run: Lightning warns that it is not empty.
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* is not empty:UserWarning")
def test_checkpoint_io_writes_model_checkpoints_and_resumes(tmp_path: Path) -> None:
    total = 3 * BATCHES_PER_EPOCH
    cut = 2 * BATCHES_PER_EPOCH
    reference, _ = _fit(tmp_path / "ref", total, enable_checkpointing=False)

    ckpt_dir = tmp_path / "ckpts"

    def checkpointing() -> ModelCheckpoint:
        # save_top_k=1 without a monitor keeps the newest: the older path is removed.
        return ModelCheckpoint(ckpt_dir, every_n_train_steps=BATCHES_PER_EPOCH, save_last=True)

    first, _ = _fit(
        tmp_path / "a", cut, checkpointing(), plugins=[CryosnapCheckpointIO(async_save=True)]
    )
    names = sorted(os.listdir(ckpt_dir))
    assert names == ["epoch=1-step=8.ckpt", "last.ckpt"]
    for name in names:  # each path is a cryosnap run holding one version
        assert _steps(ckpt_dir / name) == [cut]
        saved = load_checkpoint(ckpt_dir / name)
        assert saved["global_step"] == cut
        _assert_same(saved["state_dict"], first.state_dict())
        assert len(saved["optimizer_states"]) == 1
        assert saved["lr_schedulers"][0]["last_epoch"] == cut

    resumed, probe = _fit(
        tmp_path / "b",
        total,
        checkpointing(),
        plugins=[CryosnapCheckpointIO(async_save=False)],
        ckpt_path=str(ckpt_dir / "last.ckpt"),
    )
    assert probe.start_step == cut
    _assert_same(probe.start_weights, first.state_dict())
    _assert_same(resumed.state_dict(), reference.state_dict())
    # last.ckpt moved on to the final step; the superseded version was retired.
    assert _steps(ckpt_dir / "last.ckpt") == [total]
    assert sorted(os.listdir(ckpt_dir)) == [f"epoch=2-step={total}.ckpt", "last.ckpt"]


def test_checkpoint_io_rewrites_a_path_at_the_same_step(tmp_path: Path) -> None:
    io = CryosnapCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"global_step": 3, "w": torch.zeros(2)}, path)
    io.save_checkpoint({"global_step": 3, "w": torch.ones(2)}, path)
    io.teardown()
    assert torch.equal(io.load_checkpoint(path)["w"], torch.ones(2))
    assert _steps(path) == [3]
    io.remove_checkpoint(path)
    assert not path.exists()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 1}, path, storage_options={"a": 1})


def test_to_plain_maps_lightning_objects_and_refuses_the_rest(tmp_path: Path) -> None:
    from enum import Enum

    from lightning.fabric.utilities.data import AttributeDict

    class Color(Enum):
        RED = 1

    hparams = AttributeDict(lr=0.1, out=tmp_path, dtype=torch.float32, device=torch.device("cpu"))
    plain = to_plain({"hyper_parameters": hparams, "t": (1, [2.0])})
    assert type(plain["hyper_parameters"]) is dict
    assert plain == {
        "hyper_parameters": {
            "lr": 0.1,
            "out": str(tmp_path),
            "dtype": "torch.float32",
            "device": "cpu",
        },
        "t": (1, [2.0]),
    }
    with pytest.raises(TypeError, match="/hyper_parameters/color"):
        to_plain({"hyper_parameters": {"color": Color.RED}})
    assert to_plain({"c": Color.RED}, allow_pickle=True) == {"c": Color.RED}
