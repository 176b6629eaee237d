"""DeepSpeed's own checkpoint engine beside cryosnap's: ``engine.save_checkpoint`` /
``load_checkpoint`` through DeepSpeed's default ``TorchCheckpointEngine`` and through
``cryosnap.integrations.deepspeed`` on the same ZeRO training (issue 50).

Two ranks (processes started by this script with torchrun's environment: gloo on 127.0.0.1,
``OMP_NUM_THREADS=1``, ``DS_ACCELERATOR=cpu``) train an MLP of ``--layers`` square Linear
layers of ``--width`` (default 8 x 3584: 102.8M parameters, 411 MB of fp32; Adam's state and
ZeRO's fp32 master copy: 1.2 GB more, split across the ranks) at ZeRO ``--stage`` (default 2).
One DeepSpeed engine; after ``--warmup`` steps, ``--rounds`` rounds each run, in alternating
order, two saves a training step apart and a restore:

- **torch**: DeepSpeed's default engine (``torch.save`` of each file, after DeepSpeed cloned
  every tensor; the model states file from data-parallel rank 0, each rank its optimizer
  shard). Stall: the ``save_checkpoint`` call; durable: the call, then an ``fsync`` of the
  files this rank wrote (DeepSpeed does not sync); bytes: the size of those files. Restore:
  ``load_checkpoint(dir, tag)``.
- **cryosnap**: the same calls with cryosnap's engine installed. Stall: the
  ``save_checkpoint`` call (it collects the files' dicts) plus the capture in the next
  ``engine.step()`` (DeepSpeed's commit, before the optimizer step: ``SaveInfo.stall_seconds``);
  durable: the call plus ``SaveInfo.seconds`` (from the commit to durable, the training going
  on meanwhile); bytes: ``SaveInfo.written_bytes`` (each rank 1/N of the model states file and
  its own shard; the second save only the chunks that changed). Restore:
  ``load_checkpoint(run, tag)`` (every chunk verified).

Figures per save are the slowest rank's, then the median over the rounds (the first save of
each peer apart: cryosnap's allocates its staging and writes in full); bytes are per rank.
Restores read what the page cache holds of the files just written, for both. Nothing is
asserted.

Run: ``.venv/bin/python bench/bench_frameworks_deepspeed.py`` (a few minutes on 2 cores;
``--width 1024 --layers 4`` for a smoke run). Each rank holds the model, its gradients, its
share of the optimizer state, DeepSpeed's buckets and cryosnap's staging: about 3 GB per rank
at the default size.
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


# -- the ranks' side -----------------------------------------------------------------------------


def _engine(width: int, layers: int, stage: int) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _step(engine: Any, width: int) -> None:
    import torch

    x = torch.randn(4, width)
    engine.backward(engine(x).square().mean())
    engine.step()


def _mine(folder: Path, rank: int) -> list[Path]:
    """The files of a tag folder that DeepSpeed's default engine wrote from rank ``rank``."""
    names = [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
    if rank == 0:
        names.append("mp_rank_00_model_states.pt")
    return [folder / n for n in names if (folder / n).exists()]


def _torch_round(engine: Any, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    stalls, durables, written = [], [], []
    for _ in range(2):  # a training step, a save, another step, another save
        _step(engine, args.width)
        tag = f"torch{engine.global_steps}"
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(str(folder), tag=tag)
        stalls.append(time.perf_counter() - t0)
        files = _mine(folder / tag, rank)
        for f in files:
            h.fsync_path(f)  # DeepSpeed does not sync: durable once its files are
        durables.append(time.perf_counter() - t0)
        written.append(sum(f.stat().st_size for f in files))
    dist.barrier()
    t0 = time.perf_counter()
    engine.load_checkpoint(str(folder), tag=tag)
    restore = time.perf_counter() - t0
    dist.barrier()
    if rank == 0:
        h.rmtree(folder)
    return {"stall": stalls, "durable": durables, "written": written, "restore": restore}


def _cryosnap_round(engine: Any, args: argparse.Namespace, ours: Any, run: Path) -> dict[str, Any]:
    import torch.distributed as dist

    stalls, durables, written = [], [], []
    for _ in range(2):
        _step(engine, args.width)
        tag = f"cryosnap{engine.global_steps}"
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(str(run), tag=tag)
        call = time.perf_counter() - t0
        _step(engine, args.width)  # commits (captures) the version before its optimizer step
        info = ours.pending.result()
        stalls.append(call + info.stall_seconds)
        durables.append(call + info.seconds)
        written.append(info.written_bytes)
    dist.barrier()
    t0 = time.perf_counter()
    engine.load_checkpoint(str(run), tag=tag)
    restore = time.perf_counter() - t0
    return {"stall": stalls, "durable": durables, "written": written, "restore": restore}


class _Engines:
    """One DeepSpeed engine, its checkpoints through DeepSpeed's default engine or cryosnap's
    (install() sets three attributes of the engine; this puts either set back)."""

    def __init__(self, engine: Any, run: Path) -> None:
        from cryosnap.integrations.deepspeed import install

        self.engine = engine
        self.default = (engine.checkpoint_engine, engine.save_non_zero_checkpoint)
        self.ours = install(engine, run, chunk_bytes=CHUNK_BYTES, keep=2)
        self.cryosnap = (engine.checkpoint_engine, True, engine.load_checkpoint)

    def use(self, peer: str) -> None:
        e = self.engine
        if peer == "torch":
            self.ours.commit_pending()
            e.checkpoint_engine, e.save_non_zero_checkpoint = self.default
            vars(e).pop("load_checkpoint", None)  # DeepSpeedEngine.load_checkpoint again
        else:
            e.checkpoint_engine, e.save_non_zero_checkpoint, e.load_checkpoint = self.cryosnap


def worker(args: argparse.Namespace) -> None:
    """One rank: train, then alternate the peers' rounds; write this rank's figures."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(args.width, args.layers, args.stage)
    for _ in range(args.warmup):
        _step(engine, args.width)
    params = sum(p.numel() for p in engine.module.parameters())
    base = Path(args.dir)
    engines = _Engines(engine, base / "cryosnap-run")
    results: dict[str, list[dict[str, Any]]] = {"torch": [], "cryosnap": []}
    for r in range(args.rounds):
        for peer in ["torch", "cryosnap"] if r % 2 == 0 else ["cryosnap", "torch"]:
            engines.use(peer)
            if peer == "torch":
                results[peer].append(_torch_round(engine, args, base / f"torch-{r}"))
            else:
                results[peer].append(
                    _cryosnap_round(engine, args, engines.ours, base / "cryosnap-run")
                )
    engines.ours.close()
    rank = torch.distributed.get_rank()
    out = Path(args.worker) / f"rank-{rank}.json"
    out.write_text(json.dumps({"params": params, **results}))
    torch.distributed.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------


def launch(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    command = [sys.executable, str(HERE), "--worker", str(folder / "out"), "--dir", str(folder)]
    for name in ("width", "layers", "rounds", "warmup", "stage"):
        command += [f"--{name}", str(getattr(args, name))]
    return h.launch_ranks(
        command,
        folder / "out",
        timeout_s=LAUNCH_TIMEOUT_S,
        cwd=HERE.parent,
        env={"DS_ACCELERATOR": "cpu"},
    )


def _figures(ranks: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """Per save, the slowest rank's figure; then medians over the saves (each peer's first
    save of the run apart)."""
    rounds = ranks[0][peer]
    saves = [(i, j) for i in range(len(rounds)) for j in range(len(rounds[i]["stall"]))]
    stalls = [max(r[peer][i]["stall"][j] for r in ranks) for i, j in saves]
    durables = [max(r[peer][i]["durable"][j] for r in ranks) for i, j in saves]
    restores = [max(r[peer][i]["restore"] for r in ranks) for i in range(len(rounds))]
    return {
        "first_stall_s": stalls[0],
        "first_durable_s": durables[0],
        "stall_s": h.median(stalls[1:] or stalls),
        "durable_s": h.median(durables[1:] or durables),
        "restore_s": h.median(restores),
        "first_save_bytes_per_rank": [r[peer][0]["written"][0] for r in ranks],
        "second_save_bytes_per_rank": [r[peer][0]["written"][-1] for r in ranks],
        "saves": len(stalls),
    }


def report(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {peer: _figures(ranks, peer) for peer in ("torch", "cryosnap")}
    rows = [
        [
            peer,
            h.format_s(f["first_stall_s"]),
            h.format_s(f["stall_s"]),
            h.format_s(f["first_durable_s"]),
            h.format_s(f["durable_s"]),
            " / ".join(h.format_bytes(b) for b in f["first_save_bytes_per_rank"]),
            " / ".join(h.format_bytes(b) for b in f["second_save_bytes_per_rank"]),
            h.format_s(f["restore_s"]),
        ]
        for peer, f in summary.items()
    ]
    headers = [
        "engine",
        "stall 1st",
        "stall",
        "durable 1st",
        "durable",
        "1st save r0 / r1",
        "2nd save r0 / r1",
        "restore",
    ]
    print(h.format_table(headers, rows))
    print("stall, durable: each engine's first save of the run, then the median of the later saves")
    for key in ("stall_s", "durable_s", "restore_s"):
        ratio = summary["torch"][key] / max(summary["cryosnap"][key], 1e-9)
        print(f"{key[:-2]}: torch / cryosnap = {ratio:.2f}x")
    return summary


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    h.framework_main(
        args,
        "deepspeed",
        worker=worker,
        launch=launch,
        report=report,
        describe=lambda ranks: (
            f"{ranks[0]['params'] / 1e6:.1f}M parameters, ZeRO stage {args.stage}, 2 gloo ranks, "
            f"{args.rounds} round(s)"
        ),
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
