"""A torchtitan training on N gloo ranks with cryosnap's checkpoint manager, as torchtitan's
``Trainer.train`` drives it (its loop without the CUDA parts): test_torchtitan.py launches it.

``torchtitan_job.py train OUT RUN MODE STEPS INTERVAL KILL_AT CHUNK`` trains a small model,
FSDP2 on a CPU mesh (``MODE`` ``fsdp``: parameters sharded over the ranks; ``ddp``: a (N, 1)
``dp_replicate x fsdp`` mesh, parameters replicated, as torchtitan applies DDP), with
torchtitan's ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer``,
``ParallelAwareDataloader`` and a ``train_state``; the manager is built from its ``Config``
and loads before the loop; at step ``KILL_AT`` (-1: none) each rank SIGKILLs itself. Each rank
writes ``rank-N.json``: digests of the final state, what each save wrote, the restored step.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

TIMEOUT = 120.0
VOCAB, DIM, HIDDEN = 512, 64, 64  # the frozen embedding: VOCAB * DIM floats (128 KiB)


def _model(seed: int, hidden: int = HIDDEN) -> Any:
    import torch

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(VOCAB, DIM)
            self.tok.weight.requires_grad_(False)  # frozen: the same in every version
            self.layers = torch.nn.ModuleList(
                [torch.nn.Linear(DIM, hidden), torch.nn.Linear(hidden, DIM)]
            )
            self.out = torch.nn.Linear(DIM, 8)

        def forward(self, tokens: Any) -> Any:
            x = self.tok(tokens).mean(dim=1)
            x = torch.relu(self.layers[0](x))
            return self.out(self.layers[1](x))

    torch.manual_seed(seed)
    return Small()


def tokens(rank: int) -> Any:
    """An endless, stateful dataset: sample i of rank r is drawn from a generator seeded (r, i)."""
    from torch.utils.data import IterableDataset

    class Tokens(_Tokens, IterableDataset[tuple[Any, Any]]):
        pass

    return Tokens(rank)


class _Tokens:
    def __init__(self, rank: int) -> None:
        self.rank, self.i = rank, 0

    def __iter__(self) -> Any:
        import torch

        while True:
            g = torch.Generator().manual_seed(self.rank * 100_003 + self.i)
            self.i += 1
            yield torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, 8, (), generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class TrainState:
    """The trainer's own state (torchtitan's ``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def parts(mode: str, hidden: int = HIDDEN) -> tuple[Any, Any, Any, Any]:
    """Model, optimizers, schedulers and dataloader, built as torchtitan builds them
    (``MODE`` ``single``: one process, no process group, no FSDP)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    model = _model(0, hidden)
    world, rank = (1, 0) if mode == "single" else (dist.get_world_size(), dist.get_rank())
    if mode != "single":
        if mode == "fsdp":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        else:  # torchtitan's DDP: FSDP2 over dp_replicate x fsdp with an fsdp degree of 1
            shape = (world, 1)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "fsdp"))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-2, foreach=False).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=100
    )
    loader = ParallelAwareDataloader(tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=4)
    return model, optimizers, schedulers, loader


def manager(run: str, optimizers_etc: tuple[Any, ...], train_state: Any, **fields: Any) -> Any:
    from cryosnap.integrations.torchtitan import CryosnapCheckpointManager

    model, optimizers, schedulers, loader = optimizers_etc
    config = CryosnapCheckpointManager.Config(enable=True, folder=run, **fields)
    return config.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
    )


def cli_config() -> Any:
    """A config function for torchtitan's ``--module/--config`` (ConfigManager): a stand-in for
    ``Trainer.Config`` (whose module imports tensorboard, not installed here) with its
    ``dump_folder``, ``hf_assets_path`` and ``checkpoint`` fields, the checkpoint cryosnap's."""
    from dataclasses import field, make_dataclass

    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager

    from cryosnap.integrations.torchtitan import CryosnapCheckpointManager

    fields = [  # the types themselves, not strings: tyro reads them
        ("dump_folder", str, field(default="./outputs")),
        ("hf_assets_path", str, field(default=".")),  # ConfigManager checks that it exists
        (
            "checkpoint",
            BaseCheckpointManager.Config,
            field(default_factory=CheckpointManager.Config),
        ),
    ]
    trainer_like = make_dataclass("TrainerLike", fields, kw_only=True, slots=True)
    return trainer_like(checkpoint=CryosnapCheckpointManager.Config(enable=True, interval=5))


def digests(model: Any, optimizers: Any, schedulers: Any, state: Any) -> dict[str, str]:
    import torch

    out: dict[str, str] = {}
    trees = {
        "model": model.state_dict(),
        "optimizer": optimizers.state_dict(),
        "lr_scheduler": schedulers.state_dict(),
        "train_state": state.state_dict(),
    }
    for name, tree in trees.items():
        for k, v in tree.items():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                out[f"{name}/{k}"] = hashlib.sha256(raw).hexdigest()[:16]
            else:
                out[f"{name}/{k}"] = repr(v)
    return out


def loop(
    built: tuple[Any, ...], state: Any, ckpt: Any, steps: int, kill_at: int = -1
) -> list[tuple[int, Any]]:
    """torchtitan's ``Trainer.train`` loop (without its CUDA parts) up to ``steps``: the
    ``(step, pending save)`` of each save."""
    import torch

    model, optimizers, schedulers, loader = built
    batches = iter(loader)
    pending = []
    while state.step < steps:
        state.step += 1
        tokens, labels = next(batches)
        loss = torch.nn.functional.cross_entropy(model(tokens), labels)
        loss.backward()  # type: ignore[no-untyped-call]
        state.ntokens_seen += tokens.numel()
        ckpt.maybe_wait_for_staging()  # the trainer's capture barrier
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        if ckpt.save(state.step, last_step=state.step == steps):
            pending.append((state.step, ckpt.save_future))
        if state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return pending


def train(
    out: Path, run: str, mode: str, steps: int, interval: int, kill_at: int, chunk: int
) -> dict[str, Any]:
    import torch.distributed as dist

    built = parts(mode)
    state = TrainState()
    ckpt = manager(
        run,
        built,
        state,
        interval=interval,
        chunk_bytes=chunk,
        keep_latest_k=0,
        last_save_model_only=False,
    )
    got: dict[str, Any] = {"saves": {}}
    ckpt.load(step=-1)
    got["resumed_at"] = state.step
    pending = loop(built, state, ckpt, steps, kill_at)
    ckpt.close()
    for step, p in pending:
        info = p.result()
        got["saves"][str(step)] = {"written": info.written_bytes, "logical": info.logical_bytes}
    model = built[0]
    got["final"] = digests(built[0], built[1], built[2], state)
    got["steps"] = ckpt_steps(run)
    got["local_param_bytes"] = {
        k: (v.to_local() if hasattr(v, "to_local") else v).nbytes
        for k, v in model.state_dict().items()
    }
    dist.barrier()
    return got


def mismatch(run: str, mode: str) -> dict[str, Any]:
    """Load the run (saved under another mode: another mesh) into ``mode``'s parts: the error,
    and whether the parts were left as they were."""
    import cryosnap

    built = parts(mode)
    state = TrainState()
    ckpt = manager(run, built, state, interval=2)
    before = digests(built[0], built[1], built[2], state)
    got: dict[str, Any] = {"error": "", "type": ""}
    try:
        ckpt.load()
    except cryosnap.CheckpointError as exc:
        got = {"error": str(exc), "type": type(exc).__name__}
    got["unchanged"] = digests(built[0], built[1], built[2], state) == before
    ckpt.close()
    return got


def ckpt_steps(run: str) -> list[int]:
    import cryosnap

    steps: list[int] = cryosnap.Run(run).steps()
    return steps


def main(scenario: str, out: Path, *args: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    if scenario == "train":
        run, mode, steps, interval, kill_at, chunk = args
        got = train(out, run, mode, int(steps), int(interval), int(kill_at), int(chunk))
    elif scenario == "mismatch":
        got = mismatch(*args)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
