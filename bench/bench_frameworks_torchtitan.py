"""torchtitan's own checkpoint manager beside cryosnap's, on the same FSDP2 training (issue 51).

Two ranks (processes started by this script with torchrun's environment: gloo on 127.0.0.1,
``OMP_NUM_THREADS=1``) train an MLP of ``--layers`` square Linear layers of ``--width``
(default 6 x 2048: 25.2M parameters, 101 MB of fp32; AdamW: 201 MB more), FSDP2 on a CPU mesh
(``--mode fsdp``: sharded over the 2 ranks; ``--mode ddp``: torchtitan's DDP, FSDP2 over a
(2, 1) ``dp_replicate x fsdp`` mesh, every parameter on both ranks), with torchtitan's
``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer``. Each manager is built from its
``Config`` as torchtitan's ``Trainer`` builds it and driven as it drives it: ``save(step)``
after a training step, ``maybe_wait_for_staging()`` before the next ``optimizers.step()``.
After ``--warmup`` steps, ``--rounds`` rounds each run, in alternating order:

- **dcp-async**: torchtitan's ``CheckpointManager`` with ``async_mode="async"`` (its gloo
  process group, ``dcp.async_save``: a copy to CPU memory in the call, the write in a thread).
- **cryosnap**: ``CryosnapCheckpointManager`` (lazy: the copy overlaps the next step until its
  ``maybe_wait_for_staging``).

Stall: the ``save`` call plus what the next ``maybe_wait_for_staging`` waited. Durable: from
the ``save`` call until the version is on disk (DCP: its future done; cryosnap:
``SaveInfo.seconds``). Bytes: what each rank wrote (DCP: its ``.distcp`` files, rank 0 the
``.metadata`` too; cryosnap: ``SaveInfo.written_bytes``). Each round saves twice, a training
step apart: with ``--frozen F`` the first F of the layers are frozen, which cryosnap does not
write again. Restore: ``load(step)`` of the round's second save. Figures per save are the
slowest rank's, then the median over the rounds. Nothing is asserted.

The third manager of torchtitan 0.3.0, ``TorchCheckpointingManager``, is not measured: its
``save`` and ``load`` raise ``NotImplementedError`` (a stub in that release), and its module
does not import with the only ``torch_checkpointing`` on the package index (0.1.1 has no
``dtensor_resharder``).

Run: ``.venv/bin/python bench/bench_frameworks_torchtitan.py --rounds 2`` (``--width 512
--layers 2`` for a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve()
CHUNK_BYTES = 4 << 20
LAUNCH_TIMEOUT_S = 3600.0
PEERS = ("dcp-async", "cryosnap")


# -- the ranks' side -----------------------------------------------------------------------------


def _parts(args: argparse.Namespace) -> tuple[Any, ...]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    world = dist.get_world_size()
    if args.mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    else:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "fsdp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(args.width, args.width) for _ in range(args.layers))
    )
    for layer in list(model)[: int(args.frozen * args.layers)]:
        layer.requires_grad_(False)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-4).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=1000
    )
    return model, optimizers, schedulers


class _State:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def _manager(peer: str, folder: Path, parts: tuple[Any, ...], state: _State) -> Any:
    from torchtitan.components.checkpointer import CheckpointManager

    from cryosnap.integrations.torchtitan import CryosnapCheckpointManager

    model, optimizers, schedulers = parts
    common = {"enable": True, "folder": str(folder / peer), "interval": 1, "keep_latest_k": 0}
    if peer == "dcp-async":
        config: Any = CheckpointManager.Config(async_mode="async", **common)
    else:
        config = CryosnapCheckpointManager.Config(chunk_bytes=CHUNK_BYTES, **common)
    return config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
    )


def _step(parts: tuple[Any, ...], ckpt: Any, width: int) -> float:
    """One training step as torchtitan's Trainer runs it; what its barrier waited."""
    import torch

    model, optimizers, schedulers = parts
    model(torch.randn(8, width)).square().mean().backward()
    t0 = time.perf_counter()
    ckpt.maybe_wait_for_staging()
    waited = time.perf_counter() - t0
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    return waited


def _written(peer: str, ckpt: Any, folder: Path, step: int, rank: int) -> int:
    if peer == "cryosnap":
        return int(ckpt.save_future.result().written_bytes)
    ckpt.maybe_wait_for_saving()
    files = [f for f in (folder / peer / f"step-{step}").iterdir() if f.is_file()]
    mine = [f for f in files if f.name.startswith(f"__{rank}_")]
    if rank == 0:
        mine += [f for f in files if f.name == ".metadata"]
    return sum(f.stat().st_size for f in mine)


def _round(peer: str, ckpt: Any, parts: tuple[Any, ...], state: _State, args: Any) -> dict:
    import torch.distributed as dist

    rank, folder = dist.get_rank(), Path(args.dir)
    got: dict[str, list[float]] = {"stall": [], "durable": [], "written": []}
    for _ in range(2):
        state.step += 1
        _step(parts, ckpt, args.width)
        gc.collect()
        dist.barrier()
        done: list[float] = []  # when DCP's future completed
        t0 = time.perf_counter()
        ckpt.save(state.step)
        call = time.perf_counter() - t0
        if peer == "dcp-async":
            ckpt.save_future.add_done_callback(
                lambda _f, done=done: done.append(time.perf_counter())
            )
        waited = _step(parts, ckpt, args.width)  # the next step: its barrier
        state.step += 1
        written = _written(peer, ckpt, folder, state.step - 1, rank)
        durable = ckpt.save_future.result().seconds if peer == "cryosnap" else done[0] - t0
        got["stall"].append(call + waited)
        got["durable"].append(durable)
        got["written"].append(written)
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.load(step=state.step - 1)
    got["restore"] = [time.perf_counter() - t0]
    return got


def worker(args: argparse.Namespace) -> None:
    """One rank: train, then alternate the peers' rounds; write this rank's figures."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    parts = _parts(args)
    state = _State()
    managers = {peer: _manager(peer, Path(args.dir), parts, state) for peer in PEERS}
    for _ in range(args.warmup):
        _step(parts, managers["cryosnap"], args.width)
    params = sum(p.numel() for p in parts[0].parameters())
    results: dict[str, list[dict[str, Any]]] = {peer: [] for peer in PEERS}
    for r in range(args.rounds):
        for peer in PEERS if r % 2 == 0 else PEERS[::-1]:
            results[peer].append(_round(peer, managers[peer], parts, state, args))
    for ckpt in managers.values():
        ckpt.close()
    out = Path(args.worker) / f"rank-{dist.get_rank()}.json"
    out.write_text(json.dumps({"params": params, **results}))
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------


def launch(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    command = [sys.executable, str(HERE), "--worker", str(folder / "out"), "--dir", str(folder)]
    for name in ("width", "layers", "rounds", "warmup", "frozen", "mode"):
        command += [f"--{name}", str(getattr(args, name))]
    return h.launch_ranks(command, folder / "out", timeout_s=LAUNCH_TIMEOUT_S, cwd=HERE.parent)


def _figures(ranks: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """Per save, the slowest rank's figure; then medians over the rounds."""
    rounds = ranks[0][peer]
    saves = [(i, j) for i in range(len(rounds)) for j in range(2)]
    stalls = [max(r[peer][i]["stall"][j] for r in ranks) for i, j in saves]
    durables = [max(r[peer][i]["durable"][j] for r in ranks) for i, j in saves]
    restores = [max(r[peer][i]["restore"][0] for r in ranks) for i in range(len(rounds))]
    return {
        "first_stall_s": stalls[0],
        "stall_s": h.median(stalls[1:]),
        "durable_s": h.median(durables[1:]),
        "restore_s": h.median(restores),
        "first_save_bytes_per_rank": [r[peer][0]["written"][0] for r in ranks],
        "second_save_bytes_per_rank": [r[peer][-1]["written"][-1] for r in ranks],
        "saves": len(stalls),
    }


def report(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {peer: _figures(ranks, peer) for peer in PEERS}
    rows = [
        [
            peer,
            h.format_s(f["first_stall_s"]),
            h.format_s(f["stall_s"]),
            h.format_s(f["durable_s"]),
            " / ".join(h.format_bytes(b) for b in f["first_save_bytes_per_rank"]),
            " / ".join(h.format_bytes(b) for b in f["second_save_bytes_per_rank"]),
            h.format_s(f["restore_s"]),
        ]
        for peer, f in summary.items()
    ]
    headers = [
        "manager",
        "stall 1st",
        "stall",
        "durable",
        "1st save r0 / r1",
        "last save r0 / r1",
        "restore",
    ]
    print(h.format_table(headers, rows))
    print("stall, durable: the first save of the run, then the median of the later saves")
    for key in ("stall_s", "durable_s", "restore_s"):
        ratio = summary["dcp-async"][key] / max(summary["cryosnap"][key], 1e-9)
        print(f"{key[:-2]}: dcp-async / cryosnap = {ratio:.2f}x")
    return summary


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--frozen", type=float, default=0.5, help="fraction of layers frozen")
    parser.add_argument("--mode", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    h.framework_main(
        args,
        "torchtitan",
        worker=worker,
        launch=launch,
        report=report,
        describe=lambda ranks: (
            f"{ranks[0]['params'] / 1e6:.1f}M parameters, 2 gloo ranks ({args.mode}), "
            f"{args.rounds} round(s), frozen {args.frozen:.0%} of the layers"
        ),
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
