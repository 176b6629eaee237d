"""A small DDP training on gloo for test_ddp_resume.py: every rank runs this script.

    python ddp_job.py train OUT RUN TOTAL [--kill-at N] [--prepare]

The user's code: a DDP model with dropout, AdamW and a scheduler, a ResumableLoader, one
Checkpointer per rank saving every 2 steps (model, optimizer, scheduler and loader replicated,
each rank's RNG states its own), resuming from the newest version when the run holds one;
``--prepare`` calls ``cryosnap.integrations.torch.prepare_ddp_resume`` after a restore.
``--kill-at N``: after N steps every rank waits until its saves are durable and SIGKILLs
itself.
Each rank that finishes writes ``OUT/rank-R.json``: its losses and the final weights' bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import cryosnap
from cryosnap.integrations.torch import (
    ResumableLoader,
    ResumableSampler,
    RNGState,
    prepare_ddp_resume,
)

EVERY = 2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256),
        torch.nn.Dropout(0.2),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 32, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def train(out: Path, run: Path, total: int, kill_at: int | None, prepare: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # each rank's own dropout masks
    # A small first bucket and cap: several buckets, whose order the first backward rebuilds.
    ddp = DistributedDataParallel(model(), bucket_cap_mb=0.1)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    data = dataset()
    loader = ResumableLoader(data, batch_size=8, sampler=ResumableSampler(data, seed=0))
    state = {"model": ddp.module, "optim": opt, "sched": sched, "loader": loader}
    state["rng"] = RNGState()
    losses: list[float] = []
    with cryosnap.Checkpointer(run) as ckpt:
        step = 0
        if ckpt.latest_step() is not None:
            ckpt.restore(into=state)
            step = ckpt.restored_step or 0
            if prepare:
                prepare_ddp_resume(ddp, torch.zeros(8, 32))
        while step < total:
            for x, y in loader:
                if step == kill_at:
                    ckpt.wait()  # the previous saves are durable
                    os.kill(os.getpid(), signal.SIGKILL)
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                losses.append(loss.item())
                if step % EVERY == 0:
                    ckpt.save(step, state, replicated=["model", "optim", "sched", "loader"])
                if step == total:
                    break
    weights = b"".join(p.detach().numpy().tobytes() for p in ddp.module.parameters())
    report = {"losses": losses, "weights": hashlib.sha256(weights).hexdigest()}
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train"])
    parser.add_argument("out", type=Path)
    parser.add_argument("run", type=Path)
    parser.add_argument("total", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--prepare", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train(args.out, args.run, args.total, args.kill_at, args.prepare)


if __name__ == "__main__":
    main(sys.argv[1:])
