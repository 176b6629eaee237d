"""A small Accelerate training for test_accelerate.py: one process, or each rank of a
``torchrun`` job on CPU (gloo), saving with ``cryosnap.integrations.accelerate.Checkpoints``.

The user code is what the README shows: ``Checkpoints(accelerator, run)`` after
``accelerator.prepare``, ``step = ckpts.restore() or 0`` before the loop, ``ckpts.save(step)``
after the optimizer step. The model has a frozen input layer (a second save does not write it
again), BatchNorm (buffers that differ per rank) and dropout (each rank's generators); the
data are shuffled, and an epoch (44 samples in batches of 4) does not divide evenly over 2
ranks (Accelerate pads the last batch). ``record`` (every loss, to a file that survives
SIGKILL) and ``--kill-at`` (rank 0 kills itself after that step) are the test's instruments.
``--fsdp``: the model is sharded by Accelerate's FSDP2 path (``prepare`` calls
``fully_shard``), which Accelerate takes on a CPU job only through
:func:`cryosnap.testing.cpu_fsdp2_accelerator`; with ``--device`` on the job's accelerators,
where Accelerate picks FSDP itself (tests/gpu/test_accelerate_fsdp_gpu.py).

    torchrun --nproc-per-node 2 accelerate_job.py train OUT RUN --steps 20 --every 4 --kill-at 14
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed

from cryosnap.errors import WorldSizeError
from cryosnap.integrations.accelerate import Checkpoints
from cryosnap.testing import cpu_fsdp2_accelerator

SAMPLES, BATCH, FEATURES, HIDDEN = 44, 4, 1024, 256
CHUNK = 64 << 10  # the run's chunk_bytes


class Net(torch.nn.Module):
    """A frozen 1024 x 256 input layer (1 MiB), BatchNorm, a trained head with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(FEATURES, HIDDEN)
        self.embed.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(HIDDEN)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(HIDDEN, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.embed(x)))
        return out


class Seen:
    """A registered object (``register_for_checkpointing``): samples this rank trained on."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples = int(state["samples"])


def prepared(
    total_limit: int | None = None, fsdp: bool = False, device: bool = False
) -> tuple[Accelerator, Any, Any, Any, Any, Seen]:
    """A fresh process's worth: seeded, a new model, optimizer, scheduler and loader; with
    ``fsdp`` the model sharded by Accelerate's FSDP2 ``prepare`` (on the CPU, or with
    ``device`` on the accelerators Accelerate finds)."""
    config = ProjectConfiguration(total_limit=total_limit)
    if fsdp and device:
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        accelerator = Accelerator(fsdp_plugin=plugin, project_config=config)
    elif fsdp:
        accelerator = cpu_fsdp2_accelerator(project_config=config)
    else:
        accelerator = Accelerator(cpu=True, project_config=config)
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, 1, generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    model = Net()
    opt = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    seen = Seen()
    accelerator.register_for_checkpointing(seen)
    return accelerator, model, opt, loader, sched, seen


def local(t: Any) -> torch.Tensor:
    """A tensor's memory on this rank: an FSDP2 DTensor's local shard, else the tensor."""
    found: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return found


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(local(t).detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def addresses(model: torch.nn.Module) -> dict[str, int]:
    """Where each parameter's memory (an FSDP2 rank's: its local shard's) lies."""
    return {name: local(p).data_ptr() for name, p in model.named_parameters()}


def train(
    run: Path,
    out: Path,
    steps: int,
    every: int,
    kill_at: int | None,
    fsdp: bool = False,
    device: bool = False,
) -> None:
    """Train ``steps`` optimizer steps (resuming from ``run`` if it holds a version), saving
    every ``every``; each rank appends ``step loss`` per step to ``out/losses-<rank>.txt``."""
    accelerator, model, opt, loader, sched, seen = prepared(fsdp=fsdp, device=device)
    rank = accelerator.process_index
    out.mkdir(parents=True, exist_ok=True)
    losses = (out / f"losses-{rank}.txt").open("a")
    with losses, Checkpoints(accelerator, run, chunk_bytes=CHUNK) as ckpts:
        before = addresses(model)
        step = ckpts.restore() or 0
        moved = sorted(name for name, at in addresses(model).items() if before[name] != at)
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
    result = {"digest": digest(accelerator.unwrap_model(model)), "seen": seen.samples}
    result["moved"] = moved  # parameters whose memory the restore replaced (none: in place)
    (out / f"final-{rank}.json").write_text(json.dumps(result))


def bytes_per_rank(run: Path, out: Path) -> None:
    """Two saves a step apart, then two more with total_limit=2; each rank writes what each
    save cost it to ``out/rank-<rank>.json``."""
    accelerator, model, opt, loader, sched, _seen = prepared(total_limit=2)
    rank = accelerator.process_index
    out.mkdir(parents=True, exist_ok=True)
    with Checkpoints(accelerator, run, chunk_bytes=CHUNK) as ckpts:
        infos = _four_saves(accelerator, model, opt, sched, iter(loader), ckpts)
        steps = ckpts.checkpointer.steps()
    (out / f"rank-{rank}.json").write_text(json.dumps({"infos": infos, "steps": steps}))


def _one_step(accelerator: Accelerator, model: Any, opt: Any, sched: Any, batches: Any) -> None:
    x, y = next(batches)
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    sched.step()
    opt.zero_grad()


def _four_saves(
    accelerator: Accelerator, model: Any, opt: Any, sched: Any, batches: Any, ckpts: Checkpoints
) -> list[dict[str, int]]:
    infos = []
    for step in range(1, 5):
        _one_step(accelerator, model, opt, sched, batches)
        info = ckpts.save(step).result()
        infos.append({"step": step, "written": info.written_bytes})
    return infos


def fsdp_shards(run: Path, out: Path, other: Path) -> None:
    """Under FSDP2: the four saves of :func:`bytes_per_rank`, the bytes of this rank's shards
    and of the whole model and optimizer, one more training step and a restore (in place,
    bit-exact), then a restore of ``other`` (a run a world of one saved)."""
    accelerator, model, opt, loader, sched, _seen = prepared(total_limit=2, fsdp=True)
    rank = accelerator.process_index
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, Any] = {}
    with Checkpoints(accelerator, run, chunk_bytes=CHUNK) as ckpts:
        batches = iter(loader)
        got["infos"] = _four_saves(accelerator, model, opt, sched, batches, ckpts)
        got["steps"] = ckpts.checkpointer.steps()
        saved = local_digests(model, opt)
        _one_step(accelerator, model, opt, sched, batches)
        got["changed"] = local_digests(model, opt) != saved
        before = addresses(model)
        got["restored_step"] = ckpts.restore()
        got["bit_exact"] = local_digests(model, opt) == saved
        got["moved"] = sorted(n for n, at in addresses(model).items() if before[n] != at)
    got.update(shard_bytes(model, opt.optimizer))
    got["frozen_shard"] = sum(
        local(p).nbytes for n, p in model.named_parameters() if n.startswith("embed.")
    )
    with Checkpoints(accelerator, other, chunk_bytes=CHUNK) as ckpts:
        try:
            ckpts.restore()
            got["world_size_error"] = ""
        except WorldSizeError as exc:
            got["world_size_error"] = str(exc)
    (out / f"rank-{rank}.json").write_text(json.dumps(got))


def local_digests(model: torch.nn.Module, opt: Any) -> dict[str, str]:
    """sha256 of each parameter's and optimizer state tensor's local shard on this rank."""
    tensors = {f"model/{n}": p for n, p in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        tensors.update({f"optim/{i}/{k}": v for k, v in state.items()})
    found = {}
    for name, t in tensors.items():
        raw = local(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        found[name] = hashlib.sha256(raw).hexdigest()[:16]
    return found


def shard_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """``shard``: bytes of the DTensors of the model and optimizer this rank holds (their
    local shards); ``full``: of the whole DTensors, every rank's shards together."""
    tensors = [*model.parameters()]
    tensors += [v for state in opt.state.values() for v in state.values() if hasattr(v, "to_local")]
    return {
        "shard": sum(local(t).nbytes for t in tensors),
        "full": sum(t.numel() * t.element_size() for t in tensors),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "bytes", "fsdp"])
    parser.add_argument("out", type=Path)  # first: tests/integration/ranks.py's order
    parser.add_argument("run", type=Path)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--device", action="store_true", help="with --fsdp: on accelerators")
    parser.add_argument("--other", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.scenario == "bytes":
        bytes_per_rank(args.run, args.out)
    elif args.scenario == "fsdp":
        fsdp_shards(args.run, args.out, args.other)
    else:
        train(args.run, args.out, args.steps, args.every, args.kill_at, args.fsdp, args.device)


if __name__ == "__main__":
    main(sys.argv[1:])
