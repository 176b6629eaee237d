"""transformers integration: a tiny GPT-2 (built from a config, nothing downloaded) trained on
CPU with the real ``Trainer``.

A run saved by the callback and resumed with ``resume()`` in a fresh Trainer continues from the
saved step with the saved weights and ends bit for bit where an uninterrupted run ends, even
when it stopped in the middle of an epoch of shuffled data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    set_seed,
)

import cryosnap
from cryosnap.integrations.transformers import CryosnapCallback, resume

SAMPLES, BATCH, TOTAL, CUT = 16, 4, 12, 6  # 4 steps per epoch: the cut falls mid-epoch


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (SAMPLES, 8), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _StopAt(TrainerCallback):
    """Stops training after ``step`` optimizer steps: a preemption, as far as the run knows."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


class _Probe(TrainerCallback):
    """Records the step and weights with which training (re)starts."""

    start_step: int | None = None
    start_weights: dict[str, torch.Tensor] = {}  # noqa: RUF012

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.start_step = state.global_step
        self.start_weights = {k: v.clone() for k, v in kw["model"].state_dict().items()}


def _trainer(out: Path, *callbacks: TrainerCallback) -> Trainer:
    set_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        max_steps=TOTAL,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=_Tokens(),
        callbacks=list(callbacks),
    )


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_callback_saves_and_resume_continues_exactly(tmp_path: Path) -> None:
    run = tmp_path / "run"

    reference = _trainer(tmp_path / "ref")
    reference.train()
    assert reference.state.global_step == TOTAL

    first = _trainer(tmp_path / "a", CryosnapCallback(run, save_steps=3), _StopAt(CUT))
    first.train()
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.steps() == [3, CUT]
    saved = cryosnap.load(run)
    assert json.loads(saved["trainer_state"])["global_step"] == CUT
    assert saved["lr_scheduler"]["last_epoch"] == CUT
    _assert_same(saved["model"], first.model.state_dict())
    assert set(saved["rng"]) >= {"python", "numpy", "torch"}  # RNGState().state_dict()

    probe = _Probe()
    second = _trainer(tmp_path / "b", CryosnapCallback(run, save_steps=3), probe)
    output = resume(second)
    assert probe.start_step == CUT
    _assert_same(probe.start_weights, saved["model"])
    assert output.global_step == second.state.global_step == TOTAL
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.steps() == [3, 6, 9, 12]
    _assert_same(second.model.state_dict(), reference.model.state_dict())


def test_resume_without_versions_trains_from_the_start(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "a", CryosnapCallback(tmp_path / "run", save_steps=5))
    assert resume(trainer).global_step == TOTAL
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.steps() == [5, 10, TOTAL]
    with pytest.raises(TypeError, match="path= or a CryosnapCallback"):
        resume(_trainer(tmp_path / "b"))
    with pytest.raises(ValueError, match="save_steps=0"):
        CryosnapCallback(tmp_path / "run", save_steps=0)
