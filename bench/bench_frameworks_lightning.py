"""Lightning's own checkpoints beside cryosnap's strategy: ``ModelCheckpoint`` through the
default ``TorchCheckpointIO`` and through ``AsyncCheckpointIO`` against ``CryosnapDDPStrategy``
on the same DDP training (issue 51).

Two ranks (processes started by this script with torchrun's environment: gloo on 127.0.0.1,
``OMP_NUM_THREADS=1``) train a LightningModule of ``--layers`` square Linear layers of
``--width`` (default 8 x 2048: 33.6M parameters, 134 MB of fp32; AdamW: 268 MB more) with a
real ``Trainer(strategy=DDPStrategy)`` on the CPU, ``--steps`` optimizer steps with a save every
``--every`` steps, once per peer, one after the other in the same processes:

- **torch**: ``ModelCheckpoint(every_n_train_steps=E, save_top_k=-1)``, Lightning's default
  ``TorchCheckpointIO``: global rank 0 writes the whole checkpoint with ``torch.save``, the
  other rank waits at the barrier. Stall: ``trainer.save_checkpoint`` (the dump, the write, the
  barrier); durable: the call, then an ``fsync`` of the file (Lightning does not sync).
- **async**: the same with ``plugins=[AsyncCheckpointIO()]``: the call clones every tensor of
  the checkpoint and a thread writes it. Stall: the call; durable: from the call to the end
  of the thread's write and its ``fsync``.
- **cryosnap**: ``CryosnapDDPStrategy(run, every_n_steps=E)``, no ModelCheckpoint: every rank
  writes 1/N of the model and optimizer and its own state, lazily (the copy overlaps the next
  forward and backward). Stall: the save call (the dump, the flatten) plus what the next
  optimizer update waited for the copy; durable: ``SaveInfo.seconds``; bytes:
  ``SaveInfo.written_bytes`` of each rank.

Then each peer's last save is restored by a fresh Trainer that trains one more step:
**restore** is the time from ``fit`` to ``on_train_start`` less the same for a fresh training
in the same process (what the resume adds; the page cache is warm for every peer). Figures per
save are the maximum over the ranks (the job waits for its slowest), then the median over the
saves, the first save apart. Nothing is asserted.

``--frozen F`` freezes the first ``F`` of the layers (AdamW over the others): a later save
then changes only the trained layers and their moments, contiguous parts of the replicated
state, which the stripes of the replicated split spread over the ranks (the "2nd save" bytes).

Run: ``.venv/bin/python bench/bench_frameworks_lightning.py`` (a few minutes on 2 cores;
``--width 512 --layers 2`` for a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve()
PEERS = ("torch", "async", "cryosnap")
CHUNK_BYTES = 4 << 20
LAUNCH_TIMEOUT_S = 3600.0


# -- inside a rank ---------------------------------------------------------------------------------


def _module(width: int, layers: int, frozen: float = 0.0) -> Any:
    import torch
    from lightning.pytorch import LightningModule

    class Wide(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
            # The first layers frozen (a pretrained trunk): unchanged from save to save.
            self.net[: round(frozen * layers)].requires_grad_(False)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self) -> Any:
            trained = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.AdamW(trained, lr=1e-4)

    return Wide()


def _loader(width: int) -> Any:
    import torch

    data = torch.utils.data.TensorDataset(torch.randn(256, width))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


class _Clock:
    """When ``fit`` was called and when training started (perf_counter seconds)."""

    def __init__(self) -> None:
        self.called = 0.0
        self.began = 0.0

    def callback(self) -> Any:
        from lightning.pytorch import Callback

        clock = self

        class Began(Callback):
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                clock.began = time.perf_counter()

        return Began()


def _trainer(peer: str, where: Path, args: argparse.Namespace, steps: int, **extra: Any) -> Any:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy

    from cryosnap.integrations.lightning import CryosnapDDPStrategy

    options: dict[str, Any] = {"callbacks": list(extra.pop("callbacks", []))}
    if peer == "cryosnap":
        every = args.every if extra.pop("saving", True) else None
        strategy: Any = CryosnapDDPStrategy(
            where / "run",
            every_n_steps=every,
            chunk_bytes=CHUNK_BYTES,
            save_on_train_end=False,
            ddp_options={"process_group_backend": "gloo"},
        )
        options["enable_checkpointing"] = False
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
        if extra.pop("saving", True):
            files = ModelCheckpoint(
                dirpath=where / "files", every_n_train_steps=args.every, save_top_k=-1
            )
            options["callbacks"].append(files)
        else:
            options["enable_checkpointing"] = False
        if peer == "async":
            options["plugins"] = [AsyncCheckpointIO(extra.pop("io"))]
    return Trainer(
        max_steps=steps,
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=where,
        **options,
    )


def _timed_io(record: dict[str, list[float]]) -> Any:
    """Lightning's TorchCheckpointIO that notes when each write ended, fsynced."""
    from lightning.fabric.plugins import TorchCheckpointIO

    class Timed(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            h.fsync_path(Path(path))
            record["ended"].append(time.perf_counter())
            record["bytes"].append(Path(path).stat().st_size)

    return Timed()


def _torch_saves(peer: str, where: Path, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    record: dict[str, list[float]] = {"call": [], "start": [], "ended": [], "bytes": []}
    extra = {"io": _timed_io(record)} if peer == "async" else {}
    trainer = _trainer(peer, where, args, args.steps, **extra)
    original = trainer.save_checkpoint

    def save(*a: Any, **kw: Any) -> Any:
        gc.collect()
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            record["start"].append(t0)
            record["call"].append(time.perf_counter() - t0)
            if peer == "torch" and rank == 0:
                path = Path(a[0])
                h.fsync_path(path)
                record["ended"].append(time.perf_counter())
                record["bytes"].append(path.stat().st_size)

    trainer.save_checkpoint = save
    trainer.fit(_module(args.width, args.layers, args.frozen), _loader(args.width))
    if rank == 0:
        durable = [e - s for s, e in zip(record["start"], record["ended"], strict=True)]
        written = record["bytes"]
    else:  # rank 0 alone writes
        durable, written = list(record["call"]), [0] * len(record["call"])
    # The last file saved, as every rank knows it (rank 1 may list the folder before rank 0's
    # asynchronous write of it began).
    last = trainer.checkpoint_callback.best_model_path  # no monitor: the last saved
    return {"stall": record["call"], "durable": durable, "written": written, "last": last}


def _cryosnap_saves(where: Path, args: argparse.Namespace) -> dict[str, Any]:
    trainer = _trainer("cryosnap", where, args, args.steps)
    saver = trainer.strategy._saves._saver
    calls: list[float] = []
    waits: list[float] = []
    pendings: list[Any] = []
    save, wait = saver.save, saver.wait_captured

    def timed_save(*a: Any, **kw: Any) -> Any:
        gc.collect()
        t0 = time.perf_counter()
        saved = save(*a, **kw)
        if saved:
            calls.append(time.perf_counter() - t0)
            pendings.append(saver.pending)
            waits.append(0.0)
        return saved

    def timed_wait() -> None:
        t0 = time.perf_counter()
        wait()
        if waits:
            waits[-1] += time.perf_counter() - t0

    saver.save, saver.wait_captured = timed_save, timed_wait
    trainer.fit(_module(args.width, args.layers, args.frozen), _loader(args.width))
    infos = [p.result() for p in pendings]
    return {
        "stall": [c + w for c, w in zip(calls, waits, strict=True)],
        "durable": [i.seconds for i in infos],
        "written": [i.written_bytes for i in infos],
        "last": str(where / "run"),
    }


def _restore(peer: str, where: Path, args: argparse.Namespace, last: str) -> float:
    """What resuming from ``last`` adds to the start of a fit (a fresh one just before)."""
    seconds = []
    for path in (None, last):
        clock = _Clock()
        fresh = where / ("fresh" if path is None else "resumed")
        extra = {"io": _timed_io({"ended": [], "bytes": []})} if peer == "async" else {}
        trainer = _trainer(
            peer,
            fresh if peer != "cryosnap" or path is None else where,
            args,
            args.steps + 1,
            saving=False,
            callbacks=[clock.callback()],
            **extra,
        )
        gc.collect()
        clock.called = time.perf_counter()
        trainer.fit(
            _module(args.width, args.layers, args.frozen),
            _loader(args.width),
            ckpt_path=None if peer == "cryosnap" else path,  # the strategy resumes by itself
        )
        seconds.append(clock.began - clock.called)
    return seconds[1] - seconds[0]


def worker(args: argparse.Namespace) -> None:
    """One rank: each peer's training with its saves, then its restore."""
    import torch

    warnings.simplefilter("ignore")
    rank = int(os.environ["RANK"])
    base = Path(args.dir)
    results: dict[str, Any] = {}
    for peer in PEERS:
        where = base / peer
        if peer == "cryosnap":
            got = _cryosnap_saves(where, args)
        else:
            got = _torch_saves(peer, where, args, rank)
        got["restore"] = _restore(peer, where, args, got.pop("last"))
        results[peer] = got
    params = args.width * args.width * args.layers + args.width * args.layers
    out = Path(args.worker) / f"rank-{rank}.json"
    out.write_text(json.dumps({"params": params, "threads": torch.get_num_threads(), **results}))


# -- the parent ----------------------------------------------------------------------------------


def launch(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    command = [sys.executable, str(HERE), "--worker", str(folder / "out"), "--dir", str(folder)]
    for name in ("width", "layers", "steps", "every", "frozen"):
        command += [f"--{name}", str(getattr(args, name))]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH")]))}
    return h.launch_ranks(
        command, folder / "out", timeout_s=LAUNCH_TIMEOUT_S, cwd=HERE.parent, env=env
    )


def _figures(ranks: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """Per save the slowest rank's figure; medians over the saves, the first apart."""
    saves = range(len(ranks[0][peer]["stall"]))
    stalls = [max(r[peer]["stall"][i] for r in ranks) for i in saves]
    durables = [max(r[peer]["durable"][i] for r in ranks) for i in saves]
    return {
        "first_stall_s": stalls[0],
        "stall_s": h.median(stalls[1:] or stalls),
        "first_durable_s": durables[0],
        "durable_s": h.median(durables[1:] or durables),
        "bytes_per_rank": [r[peer]["written"][0] for r in ranks],
        "second_bytes_per_rank": [r[peer]["written"][min(1, len(saves) - 1)] for r in ranks],
        "restore_s": max(r[peer]["restore"] for r in ranks),
        "saves": len(stalls),
    }


def report(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {peer: _figures(ranks, peer) for peer in PEERS}
    names = {
        "torch": "ModelCheckpoint, TorchCheckpointIO",
        "async": "ModelCheckpoint, AsyncCheckpointIO",
        "cryosnap": "CryosnapDDPStrategy",
    }
    rows = [
        [
            names[peer],
            h.format_s(f["first_stall_s"]),
            h.format_s(f["stall_s"]),
            h.format_s(f["first_durable_s"]),
            h.format_s(f["durable_s"]),
            " / ".join(h.format_bytes(b) for b in f["bytes_per_rank"]),
            " / ".join(h.format_bytes(b) for b in f["second_bytes_per_rank"]),
            h.format_s(f["restore_s"]),
        ]
        for peer, f in summary.items()
    ]
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
    print("stall, durable: the first save, then the median of the later saves (max over ranks)")
    for peer in ("torch", "async"):
        for key in ("stall_s", "durable_s"):
            ratio = summary[peer][key] / max(summary["cryosnap"][key], 1e-9)
            print(f"{key[:-2]}: {peer} / cryosnap = {ratio:.2f}x")
    return summary


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument(
        "--frozen", type=float, default=0.0, help="the fraction of the layers frozen, the first"
    )
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    h.framework_main(
        args,
        "lightning",
        worker=worker,
        launch=launch,
        report=report,
        describe=lambda ranks: (
            f"{ranks[0]['params'] / 1e6:.1f}M parameters ({args.frozen:.0%} of the layers "
            f"frozen), 2 gloo ranks, {args.steps} steps, a save every {args.every}"
        ),
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
