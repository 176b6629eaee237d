"""transformers integration: a tiny GPT-2 (built from a config, nothing downloaded) trained on
CPU with the real ``Trainer``.

A run saved by the callback and killed (SIGKILL) or preempted (SIGTERM) in the middle of an epoch,
in a child process running the user's script (transformers_job.py), resumes through each
documented path (``trainer.train(resume_from_checkpoint=True | <run> | <run>@<step>)``,
``resume()``) and ends bit for bit where an uninterrupted run ends: final weights and every
logged loss, dropout and shuffled data included. A second training into a used run is refused.
"""

from __future__ import annotations

import json
import signal
import subprocess
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
from tests import forkserver

from . import transformers_job

JOB = Path(transformers_job.__file__)

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
    with pytest.raises(TypeError, match="one of save_steps= and policy="):
        CryosnapCallback(tmp_path / "run")


# -- exact resume through the documented paths (transformers_job.py is the user's script) -----


def _job(run: Path, out: Path, kill_at: int, sig: str) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    return forkserver.run(
        [str(JOB), str(run), str(out), "--kill-at", str(kill_at), "--signal", sig], timeout=300
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[Any]]:
    """The uninterrupted run: final weights and every logged loss."""
    out = tmp_path_factory.mktemp("reference")
    trainer = transformers_job.trainer(out / "run", out, transformers_job.Record(out / "l.txt"))
    trainer.train()
    losses = transformers_job.losses(out / "l.txt")
    assert [s for s, _ in losses] == list(range(1, transformers_job.TOTAL + 1))
    return trainer.model.state_dict(), losses


def _resume_through(
    run: Path, out: Path, reference: tuple[dict[str, Any], list[Any]], target: Any
) -> None:
    """Resume with ``trainer.train(resume_from_checkpoint=target)``; check it is exact."""
    weights, losses = reference
    killed = transformers_job.losses(out / "losses.txt")
    assert killed == losses[: len(killed)]
    resumed_from = max(_steps(run))
    probe = _Probe()
    record = transformers_job.Record(out / "resumed.txt")
    trainer = transformers_job.trainer(run, out, record, probe)
    trainer.train(resume_from_checkpoint=target)
    assert probe.start_step == resumed_from
    assert transformers_job.losses(out / "resumed.txt") == losses[resumed_from:]
    _assert_same(trainer.model.state_dict(), weights)
    assert _steps(run)[-1] == transformers_job.TOTAL


def _steps(run: Path) -> list[int]:
    with cryosnap.Checkpointer(run) as ckpt:
        return ckpt.steps()


def test_sigkill_mid_epoch_then_resume_from_the_run_is_exact(
    tmp_path: Path, reference: tuple[dict[str, Any], list[Any]]
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    done = _job(run, out, kill_at=8, sig="KILL")  # step 8 of 12: mid-epoch, saves at 3, 6
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert max(_steps(run)) in (3, 6)  # step 6 is durable unless the kill came first
    _resume_through(run, out, reference, str(run))


def test_sigterm_saves_the_step_and_run_at_step_resumes_exactly(
    tmp_path: Path, reference: tuple[dict[str, Any], list[Any]]
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    done = _job(run, out, kill_at=5, sig="TERM")
    # The process ended by SIGTERM's own default action, after cryosnap saved step 5.
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
    assert "step 5 of" in done.stderr and "is durable; passing SIGTERM on" in done.stderr
    assert _steps(run) == [3, 5]
    _resume_through(run, out, reference, f"{run}@5")


def test_resume_true_continues_and_a_new_training_is_refused(
    tmp_path: Path, reference: tuple[dict[str, Any], list[Any]]
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    first = transformers_job.trainer(run, out, _StopAt(7))
    first.train(resume_from_checkpoint=True)  # nothing to resume yet: from the start
    assert _steps(run) == [3, 6, 7]
    with pytest.raises(cryosnap.CheckpointExistsError, match=r"already holds steps 3, 6, 7"):
        transformers_job.trainer(run, out).train()
    with pytest.raises(cryosnap.CheckpointExistsError, match=r"newer steps 6, 7"):
        transformers_job.trainer(run, out).train(resume_from_checkpoint=f"{run}@3")
    assert _steps(run) == [3, 6, 7]
    # An older version into a new path: that run continues from it.
    probe = _Probe()
    transformers_job.trainer(tmp_path / "other", out, probe).train(
        resume_from_checkpoint=f"{run}@3"
    )
    assert probe.start_step == 3 and _steps(tmp_path / "other") == [6, 9, 12]
    _resume_through(run, out, reference, True)


def test_adaptive_policy_and_an_hf_checkpoint_directory_pass_through(tmp_path: Path) -> None:
    from cryosnap.policy import EveryNSteps

    run = tmp_path / "run"
    trainer = _trainer(tmp_path / "a", CryosnapCallback(run, policy=EveryNSteps(5, offset=1)))
    trainer.train()
    assert _steps(run) == [1, 6, 11, TOTAL]
    # A path that holds no cryosnap run is the Trainer's business (its own error here).
    with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
        _trainer(tmp_path / "b", CryosnapCallback(tmp_path / "r2", save_steps=5)).train(
            resume_from_checkpoint=str(tmp_path)
        )
