"""Accelerate's own checkpoints beside cryosnap's: ``accelerator.save_state`` / ``load_state``
against ``cryosnap.integrations.accelerate.Checkpoints`` on the same DDP training (issue 50).

Two ranks (processes started by this script with torchrun's environment: gloo on 127.0.0.1,
``OMP_NUM_THREADS=1``) train an MLP of ``--layers`` square Linear layers of ``--width``
(default 8 x 3584: 102.8M parameters, 411 MB of fp32; AdamW: 822 MB more) with
``Accelerator(cpu=True)``: DDP. After ``--warmup`` training steps, ``--rounds`` rounds each
run, in alternating order:

- **save_state**: ``accelerator.save_state(dir)`` between two training steps (safetensors
  for the model, ``torch.save`` for the optimizer, on rank 0; each rank its RNG file). Stall:
  the call (the loop waits for all of it); durable: the call, then an ``fsync`` of every file
  it wrote (save_state does not sync); bytes: the files each rank wrote. Restore:
  ``accelerator.load_state(dir)``.
- **cryosnap**: ``ckpts.save(step)`` (lazy) in the same place, then the next training step at
  once. Stall: ``SaveInfo.stall_seconds`` (the call and what the next ``optimizer.step()``
  waited for the copy); durable: ``SaveInfo.seconds``; bytes: ``SaveInfo.written_bytes``.
  The first save of the run is full, the next one (a training step later) writes what
  changed: with ``--frozen F``, the first F of the layers are frozen and not written again.
  Restore: ``ckpts.restore(step)`` (every chunk verified).

Figures per round are the maximum over the ranks (the job waits for its slowest rank), then
the median over the rounds; bytes are per rank. Restores read what the page cache holds of
the files just written, for both. Nothing is asserted.

``--fsdp``: the model sharded by Accelerate's FSDP2 path instead
(``FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")``,
which Accelerate takes on a CPU job only through :func:`cryosnap.testing.cpu_fsdp2_accelerator`;
``prepare`` is Accelerate's ``fully_shard``). Then ``save_state`` writes the model and the
optimizer with torch.distributed.checkpoint (each rank its ``__<rank>_0.distcp`` files, rank 0
the ``.metadata``), and ``Checkpoints`` each rank's DTensor shards; a rank's bytes are the files
it wrote (and fsyncs, for durable).

Run: ``.venv/bin/python bench/bench_frameworks_accelerate.py --rounds 2`` (a few minutes on 2
cores; ``--width 1024 --layers 4`` for a smoke run). Each rank holds the model, its gradients,
AdamW's state, DDP's buckets and cryosnap's staging of its share: about 3 GB per rank at the
default size.
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


def _prepared(width: int, layers: int, frozen: float, fsdp: bool) -> tuple[Any, ...]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, set_seed

    from cryosnap.testing import cpu_fsdp2_accelerator

    if fsdp:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"
        )
        accelerator = cpu_fsdp2_accelerator(plugin)
    else:
        accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for layer in list(model)[: int(frozen * layers)]:
        layer.requires_grad_(False)
    opt = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=1e-4)
    data = torch.utils.data.TensorDataset(torch.randn(256, width))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    return accelerator, model, opt, loader


def _step(accelerator: Any, model: Any, opt: Any, batches: Any) -> None:
    (x,) = next(batches)
    accelerator.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _owner(f: Path) -> int:
    """The rank that wrote a file of ``save_state``: its RNG file, under FSDP its DCP data
    files (``__<rank>_<n>.distcp``) are each rank's own; the rest rank 0's."""
    if f.name.startswith("random_states_"):
        return int(f.stem.split("_")[-1])
    if f.suffix == ".distcp":
        return int(f.name.split("_")[2])
    return 0


def _save_state_round(
    acc: Any, model: Any, opt: Any, batches: Any, folder: Path, fsdp: bool
) -> dict[str, Any]:
    gc.collect()
    acc.wait_for_everyone()
    t0 = time.perf_counter()
    acc.save_state(str(folder))
    stall = time.perf_counter() - t0
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    owned = [f for f in files if _owner(f) == acc.process_index]
    for f in owned if fsdp else files:  # save_state does not sync: durable once its files are
        h.fsync_path(f)
    durable = time.perf_counter() - t0
    acc.wait_for_everyone()
    written = sum(f.stat().st_size for f in owned)
    _step(acc, model, opt, batches)
    acc.wait_for_everyone()
    t0 = time.perf_counter()
    acc.load_state(str(folder))
    restore = time.perf_counter() - t0
    acc.wait_for_everyone()
    if acc.is_main_process:
        h.rmtree(folder)
    return {"stall": [stall], "durable": [durable], "written": [written], "restore": restore}


def _cryosnap_round(
    acc: Any, model: Any, opt: Any, batches: Any, ckpts: Any, step: int
) -> dict[str, Any]:
    infos = []
    for at in (step, step + 1):  # a training step, a save, another step, another save
        _step(acc, model, opt, batches)  # (after the last round's restore: a changed state)
        gc.collect()
        acc.wait_for_everyone()
        pending = ckpts.save(at)
        _step(acc, model, opt, batches)  # at once: its optimizer step waits for the copy
        infos.append(pending.result())
    acc.wait_for_everyone()
    t0 = time.perf_counter()
    ckpts.restore(step + 1)
    restore = time.perf_counter() - t0
    return {
        "stall": [i.stall_seconds for i in infos],
        "durable": [i.seconds for i in infos],
        "written": [i.written_bytes for i in infos],
        "restore": restore,
    }


def worker(args: argparse.Namespace) -> None:
    """One rank: train, then alternate the peers' rounds; write this rank's figures."""
    import torch

    from cryosnap.integrations.accelerate import Checkpoints

    acc, model, opt, loader = _prepared(args.width, args.layers, args.frozen, args.fsdp)

    def batches() -> Any:
        while True:
            yield from loader

    it = batches()
    for _ in range(args.warmup):
        _step(acc, model, opt, it)
    params = sum(p.numel() for p in model.parameters())
    results: dict[str, list[dict[str, Any]]] = {"save_state": [], "cryosnap": []}
    base = Path(args.dir)
    with Checkpoints(acc, base / "cryosnap-run", chunk_bytes=CHUNK_BYTES, keep=2) as ckpts:
        # The first version of a run is full: its figures are the "first save" of round 0.
        for r in range(args.rounds):
            order = ["save_state", "cryosnap"] if r % 2 == 0 else ["cryosnap", "save_state"]
            for peer in order:
                if peer == "save_state":
                    folder = base / f"save_state-{r}"  # the same on every rank
                    got = _save_state_round(acc, model, opt, it, folder, args.fsdp)
                    results[peer].append(got)
                else:
                    got = _cryosnap_round(acc, model, opt, it, ckpts, 2 * r + 1)
                    results[peer].append(got)
    out = Path(args.worker) / f"rank-{acc.process_index}.json"
    out.write_text(json.dumps({"params": params, "threads": torch.get_num_threads(), **results}))


# -- the parent ----------------------------------------------------------------------------------


def launch(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    command = [sys.executable, str(HERE), "--worker", str(folder / "out"), "--dir", str(folder)]
    for name in ("width", "layers", "rounds", "warmup", "frozen"):
        command += [f"--{name}", str(getattr(args, name))]
    command += ["--fsdp"] if args.fsdp else []
    return h.launch_ranks(command, folder / "out", timeout_s=LAUNCH_TIMEOUT_S, cwd=HERE.parent)


def _figures(ranks: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """Per save, the slowest rank's figure; then medians over the saves (the first save of
    the run, which allocates cryosnap's staging, apart)."""
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
    summary = {peer: _figures(ranks, peer) for peer in ("save_state", "cryosnap")}
    rows = []
    for peer, f in summary.items():
        rows.append(
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
        )
    headers = [
        "peer",
        "stall 1st",
        "stall",
        "durable 1st",
        "durable",
        "1st save r0 / r1",
        "2nd save r0 / r1",
        "restore",
    ]
    print(h.format_table(headers, rows))
    print("stall, durable: the first save of the run, then the median of the later saves")
    for key in ("stall_s", "durable_s", "restore_s"):
        ratio = summary["save_state"][key] / max(summary["cryosnap"][key], 1e-9)
        print(f"{key[:-2]}: save_state / cryosnap = {ratio:.2f}x")
    return summary


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--frozen", type=float, default=0.0, help="fraction of layers frozen")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (Accelerate's) not DDP")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    h.framework_main(
        args,
        "accelerate",
        worker=worker,
        launch=launch,
        report=report,
        describe=lambda ranks: (
            f"{ranks[0]['params'] / 1e6:.1f}M parameters, 2 gloo ranks, "
            f"{'FSDP2' if args.fsdp else 'DDP'}, {args.rounds} round(s), "
            f"frozen {args.frozen:.0%} of the layers"
        ),
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
