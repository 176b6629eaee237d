"""A small Hugging Face ``Trainer`` training for test_transformers.py: a tiny GPT-2 (built from a
config, nothing downloaded) on CPU, run in the test process or as a child process that a signal
stops in the middle of an epoch.

The user code is what docs/INTEGRATIONS.md shows: ``callbacks=[CryosnapCallback(...)]`` and
``trainer.train(resume_from_checkpoint=...)``. ``Record`` (every logged loss, to a file that
survives SIGKILL) and ``Stop`` (the signal, sent when a chosen optimizer step starts) are the
test's instruments.

    python transformers_job.py RUN OUT --kill-at 7 --signal KILL
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

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

from cryosnap.integrations.transformers import CryosnapCallback

SAMPLES, BATCH, TOTAL, EVERY = 16, 4, 12, 3  # 4 steps per epoch; saves at 3, 6, 9, 12


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (SAMPLES, 8), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    """Appends ``step loss`` per logged loss to a file, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        logs = kw.get("logs") or {}
        if "loss" in logs:
            with self.path.open("a") as f:
                f.write(f"{state.global_step} {float(logs['loss'])!r}\n")


class Stop(TrainerCallback):
    """Sends ``signum`` to this process when optimizer step ``step`` starts."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def trainer(run: Path, out: Path, *callbacks: TrainerCallback, **options: Any) -> Trainer:
    """A fresh process's worth: seeded, a new model and Trainer, the callback given to it."""
    set_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.1
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
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(),
        callbacks=[CryosnapCallback(run, save_steps=EVERY, **options), *callbacks],
    )


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
    args = parser.parse_args(argv)
    signum = getattr(signal, f"SIG{args.signal}")
    job = trainer(args.run, args.out, Record(args.out / "losses.txt"), Stop(args.kill_at, signum))
    job.train(resume_from_checkpoint=True)  # a job script that may be requeued
    sys.exit(3)  # not reached: the signal ends the process


if __name__ == "__main__":
    main(sys.argv[1:])
