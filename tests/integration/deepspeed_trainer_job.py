"""A Hugging Face ``Trainer`` with a DeepSpeed config (ZeRO 2, ``DS_ACCELERATOR=cpu``, gloo)
whose own checkpoints go through cryosnap's DeepSpeed engine, for test_deepspeed_routes.py;
each rank of a ``torchrun`` job.

The user code is what docs/INTEGRATIONS.md shows: ``cryosnap.integrations.deepspeed.register()``
before the Trainer builds its engine, a ``"cryosnap"`` section in the DeepSpeed config, the
Trainer's own ``save_strategy="steps"`` and ``trainer.train(resume_from_checkpoint=True)``. The
model and data are transformers_job.py's (a tiny GPT-2 from a config, dropout, every rank's
generators its own); ``Record`` and ``Pause`` are its instruments.

    torchrun --nproc-per-node 2 deepspeed_trainer_job.py RUN OUTPUT_DIR OUT [--pause-at 8]

RUN is the cryosnap run, OUTPUT_DIR the Trainer's (its checkpoint-N folders: a job started
again with the same one resumes), OUT where the losses and the report go.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from accelerate import PartialState
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from cryosnap.integrations import deepspeed as cs_ds
from tests.integration.transformers_job import (
    BATCH,
    EVERY,
    SAMPLES,
    TOTAL,
    Draw,
    Pause,
    Record,
    Tokens,
    digests,
    report,
)


def ds_config(run: Path, chunk_bytes: int) -> dict[str, Any]:
    """ZeRO 2 with DeepSpeed's Adam (torch's implementation: no CPU op to build); the Trainer
    fills in the "auto" values and builds the LR scheduler."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        cs_ds.CONFIG_KEY: {"path": str(run), "chunk_bytes": chunk_bytes},
    }


def gloo_state() -> None:
    """On CPU only: Accelerate's state for DeepSpeed over gloo, set up before the Trainer's
    arguments (which pass no backend with a DeepSpeed config; Accelerate would then find
    none and count each rank as a job of its own). On GPUs the Trainer does this itself."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def trainer(run: Path, output_dir: Path, *callbacks: TrainerCallback, chunk_bytes: int) -> Trainer:
    gloo_state()
    set_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.1
    )
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=BATCH,
        max_steps=TOTAL,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=EVERY,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        deepspeed=ds_config(run, chunk_bytes),
        accelerator_config={"use_configured_state": True},  # gloo_state()'s
    )
    return Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(SAMPLES * args.world_size),
        callbacks=[Draw(), *callbacks],
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--pause-at", type=int, help="wait to be killed when this step starts")
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cs_ds.register()  # before the Trainer builds its DeepSpeed engine
    callbacks: list[TrainerCallback] = [Record(args.out / "losses.txt")]
    if args.pause_at is not None:
        callbacks.append(Pause(args.pause_at, args.out))
    job = trainer(args.run, args.output_dir, *callbacks, chunk_bytes=args.chunk_bytes)
    resume = any(args.output_dir.glob("checkpoint-*"))
    job.train(resume_from_checkpoint=True if resume else None)
    report(args.out, job, final=digests(job.model))
    job.model_wrapped.destroy()  # the last version committed and durable


if __name__ == "__main__":
    main(sys.argv[1:])
