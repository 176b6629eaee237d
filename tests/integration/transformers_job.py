"""A small Hugging Face ``Trainer`` training for test_transformers.py and
test_transformers_ddp.py: a tiny GPT-2 (built from a config, nothing downloaded) on CPU, run in
the test process, as a child process that a signal stops in the middle of an epoch, or under
``torchrun`` on 2 gloo ranks (DDP; the data grows with the world, so an epoch is 4 optimizer
steps at any size).

The user code is what docs/INTEGRATIONS.md shows: ``callbacks=[CryosnapCallback(...)]`` and
``trainer.train(resume_from_checkpoint=...)``. ``Record`` (every logged loss, to a file that
survives SIGKILL), ``Stop`` (the signal, sent when a chosen optimizer step starts), ``Pause``
(every rank stops there and waits to be killed) and the weights' digests written at the end
are the test's instruments.

    python transformers_job.py RUN OUT --kill-at 7 --signal KILL
    torchrun --nproc-per-node 2 transformers_job.py RUN OUT [--pause-at 8] [--chunk-bytes 4096]
    torchrun --nproc-per-node 2 transformers_job.py RUN OUT --resume-in-process 6 [--fsdp]

``--fsdp``: ``fsdp=True``, ``fsdp_config={"version": 2}``; the Trainer's Accelerator
made FSDP2 (:func:`cryosnap.testing.as_cpu_fsdp2`: on a CPU job Accelerate, and so the
Trainer, would train with DDP), after which the Trainer's own FSDP2 path shards the model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
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
from cryosnap.testing import as_cpu_fsdp2

SAMPLES, BATCH, TOTAL, EVERY = 16, 4, 12, 3  # 4 steps per epoch; saves at 3, 6, 9, 12


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, samples: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (samples, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    """Appends ``step loss`` per logged loss to a file, flushed at once (global rank 0 only:
    under DDP every rank logs the same mean loss)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        logs = kw.get("logs") or {}
        if "loss" in logs and state.is_world_process_zero:
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


class Draw(TrainerCallback):
    """Under DDP: draws ``rank + 1`` numbers from torch's generator as each step starts, so
    every rank's generators (and dropout masks) are its own, as a resume must give them back
    (the Trainer seeds every rank alike)."""

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        torch.rand(args.process_index + 1)


class Pause(TrainerCallback):
    """When optimizer step ``step`` starts, every rank writes ``OUT/paused-<rank>`` and waits:
    the test kills the job there (SIGKILL to every process), mid-training."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step + 1 == self.step:
            (self.out / f"paused-{args.process_index}").write_text("")
            time.sleep(600)


class StopAt(TrainerCallback):
    """Stops training after ``step`` optimizer steps (the callback saves that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


def digests(model: torch.nn.Module | None) -> dict[str, str]:
    """A sha256 of each tensor of the model's state dict (under FSDP2 this rank's shards):
    equal iff bit for bit equal."""
    assert model is not None
    return {
        k: hashlib.sha256(_local(v).detach().contiguous().numpy().tobytes()).hexdigest()
        for k, v in model.state_dict().items()
    }


def _local(t: Any) -> torch.Tensor:
    found: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return found


class FSDP2Trainer(Trainer):
    """The Trainer, its Accelerator made FSDP2 as it would be on accelerators."""

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.utils import FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        plugin = FullyShardedDataParallelPlugin(**(self.args.fsdp_plugin_args or {}))
        as_cpu_fsdp2(self.accelerator, plugin)
        self.is_fsdp_enabled = True  # what the Trainer reads off the accelerator's state


def trainer(
    run: Path, out: Path, *callbacks: TrainerCallback, fsdp: bool = False, **options: Any
) -> Trainer:
    """A fresh process's worth: seeded, a new model and Trainer, the callback given to it;
    with ``fsdp`` the Trainer's FSDP2."""
    set_seed(0)
    sharding: dict[str, Any] = {"fsdp": True, "fsdp_config": {"version": 2}} if fsdp else {}
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
        **sharding,
    )
    return (FSDP2Trainer if fsdp else Trainer)(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(SAMPLES * args.world_size),
        callbacks=[
            CryosnapCallback(run, save_steps=EVERY, **options),
            *([Draw()] if args.world_size > 1 else []),
            *callbacks,
        ],
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
    parser.add_argument("--kill-at", type=int, help="send --signal when this step starts")
    parser.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    parser.add_argument("--pause-at", type=int, help="wait to be killed when this step starts")
    parser.add_argument("--resume-in-process", type=int, metavar="STEP", help="see below")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args(argv)
    options = {"chunk_bytes": args.chunk_bytes}
    if args.resume_in_process is not None:
        resume_in_process(args.run, args.out, args.resume_in_process, args.fsdp, **options)
        return
    callbacks: list[TrainerCallback] = [Record(args.out / "losses.txt")]
    if args.kill_at is not None:
        callbacks.append(Stop(args.kill_at, getattr(signal, f"SIG{args.signal}")))
    if args.pause_at is not None:
        callbacks.append(Pause(args.pause_at, args.out))
    job = trainer(args.run, args.out, *callbacks, fsdp=args.fsdp, **options)
    job.train(resume_from_checkpoint=True)  # a job script that may be requeued
    if args.kill_at is not None:
        sys.exit(3)  # not reached: the signal ends the process
    report(args.out, job, final=digests(job.model))
    if torch.distributed.is_initialized():  # its gloo threads joined, not torn down at exit
        torch.distributed.destroy_process_group()


def resume_in_process(run: Path, out: Path, cut: int, fsdp: bool, **options: Any) -> None:
    """In one process per rank: an uninterrupted training (``OUT/reference``), one into
    ``run`` stopped after step ``cut``, and a new Trainer resumed from ``run`` to the end."""
    record = Record(out / "reference.txt")
    reference = trainer(out / "reference", out, record, fsdp=fsdp, **options)
    reference.train()
    trainer(run, out, Record(out / "losses.txt"), StopAt(cut), fsdp=fsdp, **options).train()
    resumed = trainer(run, out, Record(out / "resumed.txt"), fsdp=fsdp, **options)
    resumed.train(resume_from_checkpoint=True)
    report(out, resumed, reference=digests(reference.model), final=digests(resumed.model))


def report(out: Path, job: Trainer, **weights: dict[str, str]) -> None:
    """``OUT/rank-<rank>.json``: the final step and the weights' digests (the launcher reads
    it, as tests/integration/ranks.py does)."""
    path = out / f"rank-{job.args.process_index}.json"
    path.write_text(json.dumps({"step": job.state.global_step, **weights}))


if __name__ == "__main__":
    main(sys.argv[1:])
