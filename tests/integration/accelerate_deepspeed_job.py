"""A small Accelerate training with a DeepSpeed plugin (ZeRO 2, ``DS_ACCELERATOR=cpu``, gloo)
saving with ``cryosnap.integrations.accelerate.Checkpoints``, for test_deepspeed_routes.py;
each rank of a ``torchrun`` job.

The user code is accelerate_job.py's loop (``Checkpoints`` after ``accelerator.prepare``,
``step = ckpts.restore() or 0``, ``ckpts.save(step)``) with ``Accelerator(deepspeed_plugin=
...)``. The model has dropout (each rank's generators) and no BatchNorm (DeepSpeed saves the
module's buffers as the same on every rank); the data are shuffled; a torch LR scheduler that
DeepSpeed does not know is saved by Checkpoints beside the engine's files. ``--kill-at``:
rank 0 kills itself (SIGKILL) after that step.

    torchrun --nproc-per-node 2 accelerate_deepspeed_job.py OUT RUN --steps 14 --every 4
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed

from cryosnap.integrations.accelerate import Checkpoints
from tests.integration.accelerate_job import BATCH, CHUNK, SAMPLES, Seen, digest

FEATURES, HIDDEN = 64, 128


def prepared() -> tuple[Accelerator, Any, Any, Any, Any, Seen]:
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
        # On CPU: else Accelerate finds no backend and counts each rank as a job of its own.
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, 1, generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(HIDDEN, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    seen = Seen()
    accelerator.register_for_checkpointing(seen)
    return accelerator, model, opt, loader, sched, seen


def train(run: Path, out: Path, steps: int, every: int, kill_at: int | None) -> None:
    """accelerate_job.train's loop: each rank appends ``step loss`` per step to
    ``out/losses-<rank>.txt``, and writes ``out/final-<rank>.txt`` at the end."""
    accelerator, model, opt, loader, sched, seen = prepared()
    rank = accelerator.process_index
    assert accelerator.num_processes == int(os.environ["WORLD_SIZE"])
    out.mkdir(parents=True, exist_ok=True)
    losses = (out / f"losses-{rank}.txt").open("a")
    with losses, Checkpoints(accelerator, run, chunk_bytes=CHUNK) as ckpts:
        step = ckpts.restore() or 0
        losses.write(f"resumed {step}\n")
        while step < steps:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                seen.samples += len(x)
                losses.write(f"{step} {float(loss.item()).hex()}\n")
                losses.flush()
                if step % every == 0:
                    ckpts.save(step)
                if step == kill_at and rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == steps:
                    break
    final = f"{digest(accelerator.unwrap_model(model))} {seen.samples} {sched.get_last_lr()}"
    (out / f"final-{rank}.txt").write_text(final)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("run", type=Path)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args(argv)
    train(args.run, args.out, args.steps, args.every, args.kill_at)


if __name__ == "__main__":
    main(sys.argv[1:])
