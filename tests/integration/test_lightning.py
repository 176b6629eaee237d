"""Lightning integration: a tiny model trained on CPU through the real ``lightning.pytorch``.

A run saved with the callback and killed (SIGKILL) or preempted (SIGTERM) in the middle of an
epoch, in a child process running the user's script (lightning_job.py), resumes through each
documented path (the same script again; ``fit(ckpt_path=<run>[@step])``) and ends bit for bit
where an uninterrupted run ends: final weights and every logged loss, dropout and a shuffled
resumable dataloader included. A second training into a used run is refused. Checkpoints
written through the CheckpointIO plugin resume the same way.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, TensorDataset

import cryosnap
from cryosnap.integrations.lightning import (
    CryosnapCallback,
    CryosnapCheckpointIO,
    load_checkpoint,
    load_from_checkpoint,
    to_plain,
)

from . import lightning_job

JOB = Path(lightning_job.__file__)

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
        self.trainer: Trainer

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.trainer = trainer
        self.start_step = trainer.global_step
        self.start_weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


class Stop(Callback):
    """Ends fit after ``step`` optimizer steps (no signal: a process that simply stops)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


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


# -- exact resume through the documented paths (lightning_job.py is the user's script) --------


def _job(
    run: Path, out: Path, kill_at: int, sig: str, kind: str = "resumable"
) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    args = [str(run), str(out), "--kill-at", str(kill_at), "--signal", sig, "--loader", kind]
    # Exec'd, not forked (tests/forkserver.py). Its DataLoader workers outlive a SIGKILLed
    # job by up to 5 s; they no longer hold its run locked (cryosnap._run.lock closes a fork's
    # copy), but a forked job was not yet tried beside the whole suite.
    return subprocess.run(
        [sys.executable, str(JOB), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[Any]]:
    """The uninterrupted run: final weights and every logged loss."""
    out = tmp_path_factory.mktemp("reference")
    model = lightning_job.fit(out / "run", out, lightning_job.Record(out / "losses.txt"))
    losses = lightning_job.losses(out / "losses.txt")
    assert [s for s, _ in losses] == list(range(1, lightning_job.TOTAL + 1))
    return model.state_dict(), losses


def _resumed(
    run: Path, out: Path, reference: tuple[dict[str, Any], list[Any]], **fit: Any
) -> CryosnapCallback:
    weights, losses = reference
    killed = lightning_job.losses(out / "losses.txt")
    assert killed == losses[: len(killed)]
    resumed_from = max(_steps(run))
    record = out / "resumed.txt"
    probe = Probe()
    model = lightning_job.fit(run, out, lightning_job.Record(record), probe, **fit)
    assert probe.start_step == resumed_from
    assert lightning_job.losses(record) == losses[resumed_from:]
    _assert_same(model.state_dict(), weights)
    callback = next(c for c in probe.trainer.callbacks if isinstance(c, CryosnapCallback))
    return callback


def test_sigkill_mid_epoch_then_rerun_the_script_resumes_exactly(
    tmp_path: Path, reference: tuple[dict[str, Any], list[Any]]
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    done = _job(run, out, kill_at=10, sig="KILL")  # step 10 of 14: mid-epoch, saves at 4, 8
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert max(_steps(run)) in (4, 8)  # step 8 is durable unless the kill came first
    callback = _resumed(run, out, reference)  # the same script again: resume=True
    assert callback.restored_step in (4, 8)
    assert _steps(run)[-1] == lightning_job.TOTAL


def test_sigterm_saves_the_step_and_fit_ckpt_path_resumes_exactly(
    tmp_path: Path, reference: tuple[dict[str, Any], list[Any]]
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    done = _job(run, out, kill_at=9, sig="TERM")
    # Lightning's own SIGTERM handling ended fit, after cryosnap saved step 9.
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 9 of" in done.stderr and "is durable; passing SIGTERM on" in done.stderr
    assert _steps(run) == [4, 8, 9]
    _resumed(run, out, reference, ckpt_path=str(run), resume=False)


def test_fit_ckpt_path_picks_a_step_and_a_new_training_is_refused(
    tmp_path: Path, reference: tuple[dict[str, Any], list[Any]]
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    lightning_job.fit(run, out, Probe())
    assert _steps(run) == [4, 8, 12, 14]
    with pytest.raises(cryosnap.CheckpointExistsError, match=r"already holds steps 4, 8, 12, 14"):
        lightning_job.fit(run, out, resume=False)
    # An older step: its saves would collide with the newer versions.
    with pytest.raises(cryosnap.CheckpointExistsError, match=r"newer steps 12, 14"):
        lightning_job.fit(run, out, ckpt_path=f"{run}@8", resume=False)
    assert _steps(run) == [4, 8, 12, 14]
    # An older version into a new path: that run continues from it, exactly.
    probe = Probe()
    model = lightning_job.fit(tmp_path / "other", out, probe, ckpt_path=f"{run}@8")
    assert probe.start_step == 8
    assert _steps(tmp_path / "other") == [12, 14]
    _assert_same(model.state_dict(), reference[0])


# Lightning warns on resume that a plain DataLoader is not resumable: cryosnap resumed it.
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
@pytest.mark.parametrize(
    "kind", ["plain", pytest.param("workers", marks=pytest.mark.deep), "distributed"]
)
def test_the_loader_users_have_resumes_exactly_after_sigkill_mid_epoch(
    tmp_path: Path, kind: str
) -> None:
    """DataLoader(shuffle=True) (with workers and drop_last; a DistributedSampler), dropout
    and a scheduler: killed mid-epoch, resumed by running the script again, bit for bit."""
    ref = tmp_path / "ref"
    ref.mkdir()
    weights = lightning_job.fit(
        ref / "run", ref, lightning_job.Record(ref / "losses.txt"), kind=kind
    ).state_dict()
    losses = lightning_job.losses(ref / "losses.txt")
    run, out = tmp_path / "run", tmp_path / "out"
    done = _job(run, out, kill_at=11, sig="KILL", kind=kind)  # epoch 2, saves at 4 and 8
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert "InexactResumeWarning" not in done.stderr
    resumed_from = max(_steps(run))
    assert resumed_from in (4, 8)  # 8 is mid-epoch 2 (steps 7..12), 4 mid-epoch 1
    assert lightning_job.losses(out / "losses.txt") == losses[:10]
    probe = Probe()
    record = out / "resumed.txt"
    model = lightning_job.fit(run, out, lightning_job.Record(record), probe, kind=kind)
    assert probe.start_step == resumed_from
    assert lightning_job.losses(record) == losses[resumed_from:]
    _assert_same(model.state_dict(), weights)


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
@pytest.mark.parametrize("kind", ["plain", "resumable"])
def test_a_resume_at_the_end_of_an_epoch_is_exact(tmp_path: Path, kind: str) -> None:
    """The next epoch's iterators start from the restored generators, as uninterrupted."""
    weights = lightning_job.fit(tmp_path / "ref", tmp_path, kind=kind).state_dict()
    lightning_job.fit(tmp_path / "run", tmp_path, Stop(12), kind=kind)  # epoch 2's last step
    assert _steps(tmp_path / "run") == [4, 8, 12]
    probe = Probe()
    model = lightning_job.fit(tmp_path / "run", tmp_path, probe, kind=kind)
    assert probe.start_step == 12
    _assert_same(model.state_dict(), weights)


class _Stream(torch.utils.data.IterableDataset[Any]):
    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        for _ in range(8):
            x = torch.randn(4, 8, generator=g)
            yield x, x.sum(1, keepdim=True)


def test_a_loader_that_cannot_resume_exactly_warns_once_and_exact_refuses_it(
    tmp_path: Path,
) -> None:
    stream = DataLoader(_Stream(), batch_size=None)
    with pytest.raises(
        cryosnap.InexactResumeError, match=r"\(DataLoader\) cannot resume mid-epoch"
    ):
        lightning_job.fit(tmp_path / "strict", tmp_path, data=stream, exact=True)
    assert not (tmp_path / "strict").exists()
    with pytest.warns(lightning_job.InexactResumeWarning) as warned:
        lightning_job.fit(tmp_path / "run", tmp_path, data=stream)
    ours = [w for w in warned if w.category is lightning_job.InexactResumeWarning]
    assert len(ours) == 1, [str(w.message) for w in warned]
    assert "_Stream, is an IterableDataset" in str(ours[0].message)
    assert _steps(tmp_path / "run") == [4, 8, 12, 14]
    # A plain map-style DataLoader is exact: exact=True takes it.
    lightning_job.fit(tmp_path / "plain", tmp_path, kind="plain", exact=True)
    assert _steps(tmp_path / "plain") == [4, 8, 12, 14]


class _Pair(lightning_job.Tiny):
    """Trains on the batches of two loaders at once (a CombinedLoader's dict of batches)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        losses = [lightning_job.Tiny.training_step(self, b, batch_idx) for b in batch.values()]
        return torch.stack(losses).sum()


def _pair(mode: str) -> CombinedLoader:
    six = DataLoader(lightning_job.dataset(24), batch_size=4, shuffle=True)  # 6 batches
    three = DataLoader(lightning_job.dataset(12), batch_size=4, shuffle=True)  # 3 batches
    return CombinedLoader({"six": six, "three": three}, mode=mode)


def test_loaders_of_different_lengths_warn_once_and_exact_refuses_them(tmp_path: Path) -> None:
    fit = functools.partial(lightning_job.fit, module=_Pair)
    with pytest.raises(cryosnap.InexactResumeError, match=r"train dataloader 1 \(3 batches\)"):
        fit(tmp_path / "strict", tmp_path, data=_pair("max_size_cycle"), exact=True)
    assert not (tmp_path / "strict").exists()  # refused at start, before any save
    with pytest.warns(lightning_job.InexactResumeWarning) as warned:
        fit(tmp_path / "run", tmp_path, data=_pair("max_size_cycle"))
    ours = [str(w.message) for w in warned if w.category is lightning_job.InexactResumeWarning]
    assert len(ours) == 1, ours
    assert "is shorter than the longest (6 batches)" in ours[0] and "mode='min_size'" in ours[0]


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
def test_loaders_of_different_lengths_in_min_size_mode_resume_exactly(tmp_path: Path) -> None:
    """min_size: every loader starts each epoch together and the shortest ends it."""
    fit = functools.partial(lightning_job.fit, module=_Pair, exact=True)
    weights = fit(tmp_path / "ref", tmp_path, data=_pair("min_size")).state_dict()
    fit(tmp_path / "run", tmp_path, Stop(8), data=_pair("min_size"))  # 3 a epoch: mid-epoch
    probe = Probe()
    model = fit(tmp_path / "run", tmp_path, probe, data=_pair("min_size"))
    assert probe.start_step == 8
    _assert_same(model.state_dict(), weights)


def test_load_from_checkpoint_of_a_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model = lightning_job.fit(run, tmp_path)
    loaded = load_from_checkpoint(lightning_job.Tiny, run)
    assert isinstance(loaded, lightning_job.Tiny) and loaded.hparams.lr == 0.05
    _assert_same(loaded.state_dict(), model.state_dict())
    older = load_from_checkpoint(lightning_job.Tiny, f"{run}@8", lr=0.5)
    assert older.hparams.lr == 0.5
    _assert_same(older.state_dict(), load_checkpoint(run, step=8)["state_dict"])


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
