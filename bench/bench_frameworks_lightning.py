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

``--strategy fsdp``: the same training sharded (FSDP1 over the 2 ranks, one flat parameter).
Lightning's ``FSDPStrategy`` refuses the CPU (``accelerator_connector``: "requires a GPU
accelerator", a check on its own class only) and passes torch's FSDP no device there; the
peers are what a Lightning FSDP user on the CPU can run: **torch**: ``FSDPStrategy`` with
``state_dict_type="sharded"``, in a subclass that only names the CPU device to torch's FSDP
(:func:`_cpu_fsdp`), its own ``save_checkpoint`` (every rank its ``ShardedTensor`` shards of
the model and of ``FSDP.optim_state_dict`` through ``torch.distributed.checkpoint.save``, rank
0 ``meta.pt``), durable when each rank's files are fsynced; **async**: the same state through
``dcp.async_save`` (the copy in the call, the write in a thread on a gloo group of its own,
one save in flight); **cryosnap**: ``CryosnapFSDPStrategy`` (each rank its own shards, lazily).
Bytes: each rank's files (rank 0: ``.metadata`` and ``meta.pt`` too) or ``written_bytes``.

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
import threading
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

    from cryosnap.integrations.lightning import CryosnapDDPStrategy, CryosnapFSDPStrategy

    options: dict[str, Any] = {"callbacks": list(extra.pop("callbacks", []))}
    fsdp = args.strategy == "fsdp"
    if peer == "cryosnap":
        every = args.every if extra.pop("saving", True) else None
        saving: dict[str, Any] = {
            "every_n_steps": every,
            "chunk_bytes": CHUNK_BYTES,
            "save_on_train_end": False,
        }
        gloo = {"process_group_backend": "gloo"}
        strategy: Any = (
            CryosnapFSDPStrategy(where / "run", fsdp_options=gloo, **saving)
            if fsdp
            else CryosnapDDPStrategy(where / "run", ddp_options=gloo, **saving)
        )
        options["enable_checkpointing"] = False
    elif fsdp:
        strategy = _cpu_fsdp(peer == "async", extra.pop("record", None))
        if extra.pop("saving", True):
            files = ModelCheckpoint(
                dirpath=where / "files", every_n_train_steps=args.every, save_top_k=-1
            )
            options["callbacks"].append(files)
        else:
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


def _cpu_fsdp(asynchronous: bool, record: dict[str, list[Any]] | None) -> Any:
    """Lightning's ``FSDPStrategy(state_dict_type="sharded")``, told the device.

    Lightning refuses its FSDP on the CPU (a check on its own class only) and passes torch's
    FSDP no device there, which torch then refuses: this subclass wraps the model as
    ``FSDPStrategy`` does, naming the CPU (as ``CryosnapFSDPStrategy`` does), and nothing else.
    Its saves are Lightning's own: the sharded state dicts (``ShardedTensor``s of the model and
    of ``FSDP.optim_state_dict``) through ``torch.distributed.checkpoint.save``, every rank its
    shards, rank 0 the rest of the checkpoint (``meta.pt``). With ``asynchronous`` the same
    state goes through ``dcp.async_save`` instead (the copy in the call, the write in a
    thread, on a gloo group of its own; one save in flight), as a user would write it: Lightning
    has no asynchronous sharded save, and ``AsyncCheckpointIO`` is never called by
    ``FSDPStrategy``. DCP's own stager cannot copy the ``ShardedTensor``s of FSDP1's sharded
    state dict (``data_ptr`` is not supported on them): the call copies each local shard itself
    (:func:`_copied`), which is what that stager would do."""
    import torch
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.checkpoint.state_dict_saver import async_save
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):
        pending: tuple[Any, threading.Event] | None = None
        group: Any = None

        def finish(self) -> None:
            """Wait for the save in flight: written, and its files fsynced and counted."""
            if self.pending is not None:
                future, done = self.pending
                done.wait()
                future.result()
                self.pending = None

        def _setup_model(self, model: Any) -> Any:
            return FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )

        def save_checkpoint(
            self, checkpoint: Any, filepath: Any, storage_options: Any = None
        ) -> None:
            if not asynchronous:
                super().save_checkpoint(checkpoint, filepath, storage_options)
                return
            path = Path(self.broadcast(filepath))
            path.mkdir(parents=True, exist_ok=True)
            self.finish()
            state = {"model": checkpoint.pop("state_dict")}
            for i, optim in enumerate(checkpoint.pop("optimizer_states", [])):
                state[f"optimizer_{i}"] = optim
            if self.group is None:  # its own group: the write's collectives run beside training's
                self.group = torch.distributed.new_group(backend="gloo")
            future: Any = async_save(
                _copied(state),
                checkpoint_id=path,
                process_group=self.group,
                async_stager=_Staged(),
            )
            if self.global_rank == 0:
                torch.save(checkpoint, path / _METADATA_FILENAME)
            done, rank = threading.Event(), self.global_rank

            def written(f: Any) -> None:
                try:
                    if f.exception() is None and record is not None:
                        _written(record, path, rank)
                finally:
                    done.set()

            self.pending = (future, done)
            future.add_done_callback(written)

    return CPUFSDPStrategy(state_dict_type="sharded", process_group_backend="gloo")


def _copied(obj: Any) -> Any:
    """``obj`` with every tensor, and every local shard of a ``ShardedTensor``, cloned."""
    import torch
    from torch.distributed._shard.sharded_tensor import (  # type: ignore[attr-defined]
        Shard,
        ShardedTensor,
    )

    if isinstance(obj, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, obj.metadata())
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


class _Staged:
    """DCP's ``AsyncStager`` for a state the caller copied already (:func:`_copied`)."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _rank_files(path: Path, rank: int) -> list[Path]:
    """The files of a sharded checkpoint that ``rank`` wrote (rank 0: the metadata too)."""
    mine = [f for f in path.iterdir() if f.name.startswith(f"__{rank}_")]
    return mine + ([f for f in path.iterdir() if not f.name.startswith("__")] if rank == 0 else [])


def _written(record: dict[str, list[Any]], path: Path, rank: int) -> None:
    """This rank's files of a sharded checkpoint fsynced: when, and their bytes."""
    files = _rank_files(path, rank)
    for f in files:
        h.fsync_path(f)
    record["ended"].append(time.perf_counter())
    record["bytes"].append(sum(f.stat().st_size for f in files))


def _sharded_saves(peer: str, where: Path, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Lightning's sharded FSDP saves (``torch``: ``dcp.save``; ``async``: ``dcp.async_save``)."""
    record: dict[str, list[Any]] = {"call": [], "start": [], "ended": [], "bytes": []}
    trainer = _trainer(peer, where, args, args.steps, record=record)
    original = trainer.save_checkpoint

    def save(*a: Any, **kw: Any) -> Any:
        gc.collect()
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            record["start"].append(t0)
            record["call"].append(time.perf_counter() - t0)
            if peer == "torch":
                _written(record, Path(trainer.strategy.broadcast(a[0])), rank)

    trainer.save_checkpoint = save
    trainer.fit(_module(args.width, args.layers, args.frozen), _loader(args.width))
    trainer.strategy.finish()
    durable = [e - s for s, e in zip(record["start"], record["ended"], strict=True)]
    last = trainer.checkpoint_callback.best_model_path
    return {"stall": record["call"], "durable": durable, "written": record["bytes"], "last": last}


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
        ddp_async = peer == "async" and args.strategy == "ddp"
        extra = {"io": _timed_io({"ended": [], "bytes": []})} if ddp_async else {}
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
        elif args.strategy == "fsdp":
            got = _sharded_saves(peer, where, args, rank)
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
    for name in ("width", "layers", "steps", "every", "frozen", "strategy"):
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


NAMES = {
    "ddp": {
        "torch": "ModelCheckpoint, TorchCheckpointIO",
        "async": "ModelCheckpoint, AsyncCheckpointIO",
        "cryosnap": "CryosnapDDPStrategy",
    },
    "fsdp": {
        "torch": "ModelCheckpoint, FSDPStrategy sharded (dcp.save)",
        "async": "ModelCheckpoint, the same state through dcp.async_save",
        "cryosnap": "CryosnapFSDPStrategy",
    },
}


def report(ranks: list[dict[str, Any]], strategy: str = "ddp") -> dict[str, Any]:
    summary = {peer: _figures(ranks, peer) for peer in PEERS}
    names = NAMES[strategy]
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
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    h.framework_main(
        args,
        "lightning",
        worker=worker,
        launch=launch,
        report=lambda ranks: report(ranks, args.strategy),
        describe=lambda ranks: (
            f"{ranks[0]['params'] / 1e6:.1f}M parameters ({args.frozen:.0%} of the layers "
            f"frozen), {args.strategy.upper()}, 2 gloo ranks, {args.steps} steps, a save every "
            f"{args.every}"
        ),
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
