"""Train, kill, resume: a complete training script that a kill at any moment does not set back
by more than a few steps, and whose resumed run ends bit for bit where an uninterrupted one
does (weights, optimizer, data order, dropout).

    python examples/train.py --checkpoints runs/example     # Ctrl-C or kill -9 it, then
    python examples/train.py --checkpoints runs/example     # run it again: it resumes
    torchrun --nproc-per-node 2 examples/train.py --checkpoints runs/example-ddp

It prints ``saved step N`` after each save and, at the end, ``final <digest>`` of the weights:
the digest of a run killed and resumed any number of times is the uninterrupted run's.
tests/integration/test_example_train.py runs it so, killed with SIGKILL and SIGTERM.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import cryosnap
from cryosnap.integrations.torch import ResumableLoader, ResumableSampler, RNGState
from cryosnap.policy import EveryNSteps


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default="runs/example", help="the run's directory (or URL)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    p.add_argument("--every", type=int, default=20, help="save every N steps")
    return p.parse_args()


def data() -> TensorDataset:
    """A small regression task, the same on every run and every rank."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2048, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(2048, 1, generator=g)
    return TensorDataset(x, y)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    args = parse()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:  # torchrun set the rendezvous; cryosnap picks the process group up
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = data()
    # The sampler takes its rank and world size from torch.distributed (each rank its share
    # of every epoch, in an order fixed by the seed); the loader counts the batches handed
    # out, so a resumed run sees exactly the rest of the epoch.
    loader = ResumableLoader(dataset, batch_size=32, sampler=ResumableSampler(dataset, seed=0))
    torch.manual_seed(100 + rank)  # each rank's own dropout masks, restored by RNGState
    state = {"model": model, "optim": opt, "loader": loader, "rng": RNGState(), "step": 0}
    # keep=3: the newest three versions (keep=None would keep every one). SIGTERM (a
    # scheduler's notice) only sets ckpt.preempted: the loop checks it, saves and leaves.
    with cryosnap.Checkpointer(
        args.checkpoints, keep=3, policy=EveryNSteps(args.every), handle_signals=(signal.SIGTERM,)
    ) as ckpt:
        if ckpt.latest_step() is not None:
            ckpt.restore(into=state)  # every rank its own RNG and data position
            print(f"resumed at step {state['step']}", flush=True)
        while state["step"] < args.steps and not ckpt.preempted:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                state["step"] += 1
                # Yes every `every` steps, and on every rank once any rank got SIGTERM.
                if ckpt.should_save(state["step"]):
                    ckpt.save(state["step"], state, replicated=["model", "optim"], lazy=True)
                    print(f"saved step {state['step']}", flush=True)
                if ckpt.preempted or state["step"] >= args.steps:
                    break
    # Leaving `with` waited until the last save was durable.
    if ckpt.preempted:
        print(f"preempted at step {state['step']}: run me again to go on", flush=True)
    else:
        print(f"final {digest(model)} loss {loss.item():.6f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
