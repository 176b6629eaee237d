"""A small DeepSpeed training on CPU (``DS_ACCELERATOR=cpu``, gloo) for test_deepspeed.py,
launched by ``torchrun``; its checkpoints go through cryosnap's DeepSpeed engine.

The user code is what the README shows: ``deepspeed.initialize``, then ``install(engine,
run)`` (or ``register()`` and a ``"cryosnap"`` config section), then DeepSpeed's own
``engine.save_checkpoint(run, tag=...)`` / ``engine.load_checkpoint(run)``. The data of global
step ``s`` is a function of ``s`` and the rank alone, so a resumed training sees the batches an
uninterrupted one sees. Scenarios:

    train    train STEPS steps, saving every EVERY (``--resume``: load the newest first);
             rank 0 prints ``loss S HEX``, ``saved S`` and ``final DIGEST``
    checks   the engine's contract in one training: lazy capture, 1/N bytes, incremental
             bytes, resume in process, bad input; each rank writes ``OUT/rank-N.json``
    world    load a version saved at another data-parallel size
    stage    load a version saved at another ZeRO stage
    fp32     train, save tag "s3" and dump the live engine's full fp32 weights of that save
             (``OUT/reference.pt``); rank 0 then consolidates the version into
             ``OUT/by-step.safetensors`` and ``OUT/by-tag.safetensors`` (and reports errors)

    torchrun --nproc-per-node 2 deepspeed_job.py train RUN OUT --stage 2 --steps 12 --every 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from torch import nn

import cryosnap
from cryosnap.dist import LocalCoordinator
from cryosnap.integrations import deepspeed as cs_ds

IN, WIDTH, OUT_FEATURES, MICRO = 256, 1024, 8, 4


class Net(nn.Module):
    """A frozen base (``frozen``: as a LoRA adapter's) under a trained head."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(IN, WIDTH)
        self.head = nn.Sequential(
            nn.Tanh(), nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, OUT_FEATURES)
        )
        self.base.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.base(x))
        return out


def config(stage: int, *, section: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if section is not None:
        out[cs_ds.CONFIG_KEY] = section
    return out


def make_engine(stage: int, *, frozen: bool = False, cfg: dict[str, Any] | None = None) -> Any:
    model = Net(frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=params, config=cfg or config(stage)
    )
    return engine


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + torch.distributed.get_rank())
    return torch.randn(MICRO, IN, generator=g), torch.randn(MICRO, OUT_FEATURES, generator=g)


def train_step(engine: Any) -> float:
    """One optimizer step on the batch of the engine's next global step; the loss (this rank's)."""
    x, y = batch(engine.global_steps)
    loss = ((engine(x) - y) ** 2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def weights(engine: Any) -> dict[str, torch.Tensor]:
    """The full model weights (gathered at ZeRO stage 3), copied."""
    params = list(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters([p for _n, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def state_bytes(engine: Any) -> dict[str, int]:
    """What the version of this step should cost, from DeepSpeed's side: the bytes of the
    model states file every rank holds alike (ZeRO 0-2: the module, and at stage 0 the
    optimizer state too), of the trained and of the frozen parameters."""
    stage_ = engine.zero_optimization_stage()
    tensors = [] if stage_ == 3 else list(engine.module.state_dict().values())
    if stage_ == 0:
        for state in engine.optimizer.state_dict()["state"].values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    unique = {(t.data_ptr(), t.nbytes) for t in tensors}  # the aliases (frozen fragments) once
    params = list(engine.module.parameters())
    return {
        "replicated": sum(nbytes for _ptr, nbytes in unique),
        "trained": sum(
            4 * p.ds_numel if stage_ == 3 else 4 * p.numel() for p in params if p.requires_grad
        ),
        "frozen": sum(
            4 * p.ds_numel if stage_ == 3 else 4 * p.numel() for p in params if not p.requires_grad
        ),
    }


def rank() -> int:
    return int(torch.distributed.get_rank())


def say(*words: object) -> None:
    if rank() == 0:
        print(*words, flush=True)


def report(out: Path, result: dict[str, Any]) -> None:
    (out / f"rank-{rank()}.json").write_text(json.dumps(result, indent=1))


# -- train ----------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    """Train, saving every ``--every`` steps; ``--resume``: load the newest version first."""
    if args.register:
        cs_ds.register()
        section = {"path": str(args.run), "chunk_bytes": args.chunk_bytes}
        engine = make_engine(args.stage, cfg=config(args.stage, section=section))
        assert isinstance(engine.checkpoint_engine, cs_ds.CryosnapCheckpointEngine)
    else:
        engine = make_engine(args.stage)
        cs_ds.install(engine, args.run, chunk_bytes=args.chunk_bytes)
    if args.resume:
        path, client = engine.load_checkpoint(args.run)
        assert path is not None and client["position"] == engine.global_steps, client
        say("resumed", engine.global_steps)
    while engine.global_steps < args.steps:
        loss = train_step(engine)
        say("loss", engine.global_steps, loss.hex())
        if engine.global_steps % args.every == 0:
            position = engine.global_steps
            engine.save_checkpoint(
                args.run, tag=f"step{position}", client_state={"position": position}
            )
            say("saved", position)
        if args.sleep:
            time.sleep(args.sleep)  # a window for the test's SIGKILL between steps
    say("final", digest(weights(engine)))
    engine.destroy()


# -- checks ---------------------------------------------------------------------------------------


class Opaque:
    """An object cryosnap stores only with allow_pickle."""


def expect(error: type[BaseException], call: Callable[[], Any]) -> str:
    """Run ``call``; the message of the ``error`` it must raise."""
    try:
        call()
    except error as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{call} did not raise {error.__name__}")


def checks(args: argparse.Namespace) -> None:
    """The engine's contract, in one training of ``--stage`` on a frozen base."""
    engine = make_engine(args.stage, frozen=True)
    cs = cs_ds.install(engine, args.run, chunk_bytes=args.chunk_bytes)
    result: dict[str, Any] = {"stage": args.stage}
    losses = [train_step(engine)]  # global step 1
    result["pickle"] = expect(
        TypeError,
        lambda: engine.save_checkpoint(args.run, tag="bad", client_state={"obj": Opaque()}),
    )
    losses.append(train_step(engine))  # 2
    engine.save_checkpoint(args.run, tag="a", client_state={"position": 2})
    result["bytes"] = state_bytes(engine)
    at_a = weights(engine)
    losses.append(train_step(engine))  # 3: commits "a" before its optimizer step
    pending_a = cs.pending
    after_3 = weights(engine)
    result["step_changed_weights"] = digest(at_a) != digest(after_3)
    engine.save_checkpoint(args.run, tag="b", client_state={"position": 3})
    result["same_step"] = expect(
        cryosnap.CheckpointExistsError, lambda: engine.save_checkpoint(args.run, tag="b2")
    )
    pending_b = cs.pending  # "b" was committed by the save of "b2"
    assert pending_a is not None and pending_b is not None and pending_a is not pending_b
    result["info"] = [_info(pending_a.result()), _info(pending_b.result())]
    result["tags"] = cs.tags()
    _loads(engine, args, result, at_a=at_a, after_3=after_3, loss_3=losses[2])
    _back_pressure(engine, cs, args, result)
    _elsewhere(engine, cs, args, result)
    engine.destroy()
    if rank() == 0:
        result["verified"] = cryosnap.Run(args.run).verify().ok
    report(args.out, result)


def _info(info: cryosnap.SaveInfo) -> dict[str, Any]:
    return {
        "step": info.step,
        "logical": info.logical_bytes,
        "written": info.written_bytes,
        "chunks": info.chunks,
        "new_chunks": info.new_chunks,
        "stall": info.stall_seconds,
    }


def _loads(
    engine: Any,
    args: argparse.Namespace,
    result: dict[str, Any],
    *,
    at_a: dict[str, torch.Tensor],
    after_3: dict[str, torch.Tensor],
    loss_3: float,
) -> None:
    """Loading: bad tags and flags, and tag "a" then step 3 again, as the first time."""
    run = args.run
    result["missing_tag"] = expect(
        cryosnap.CheckpointNotFoundError, lambda: engine.load_checkpoint(run, tag="nope")
    )
    if args.stage == 3:
        result["no_optimizer"] = expect(
            cryosnap.UnsupportedError,
            lambda: engine.load_checkpoint(run, tag="a", load_optimizer_states=False),
        )
    else:
        path, _client = engine.load_checkpoint(run, tag="b", load_module_only=True)
        result["module_only"] = path is not None and digest(weights(engine)) == digest(after_3)
    scheduler = engine.lr_scheduler.state_dict()
    path, client = engine.load_checkpoint(run, tag="a", load_lr_scheduler_states=False)
    result["kept_scheduler"] = engine.lr_scheduler.state_dict() == scheduler
    path, client = engine.load_checkpoint(run, tag="a")
    result["load_path"] = path
    result["client"] = {k: v for k, v in client.items() if k == "position"}
    result["global_steps"] = engine.global_steps
    result["lazy_capture"] = digest(weights(engine)) == digest(at_a)
    again = train_step(engine)  # step 3 once more, from "a"
    result["resumed_loss"] = again == loss_3
    result["resumed_weights"] = digest(weights(engine)) == digest(after_3)


def _back_pressure(
    engine: Any,
    cs: cs_ds.CryosnapCheckpointEngine,
    args: argparse.Namespace,
    result: dict[str, Any],
) -> None:
    """Saves at consecutive steps: each commit waits while the one before is written (never
    a hang); every version lands."""
    done = []
    for _ in range(3):  # global steps 3, 4, 5: step 3 again supersedes the "b" of before "a"
        position = engine.global_steps
        engine.save_checkpoint(args.run, tag=f"c{position}", client_state={"position": position})
        result[f"weights_c{position}"] = digest(weights(engine))
        previous = cs.pending
        train_step(engine)  # commits c{position} once the previous version is written
        done.append(previous is not None and previous.done())
    result["previous_done"] = done
    engine.checkpoint_engine.commit_pending()
    cs.checkpointer.wait()
    result["tags_end"] = cs.tags()


def _elsewhere(
    engine: Any,
    cs: cs_ds.CryosnapCheckpointEngine,
    args: argparse.Namespace,
    result: dict[str, Any],
) -> None:
    """A save directory other than the run, as the HF Trainer's (checkpoint-N, no tag): the
    version is the run's, DeepSpeed's tag folder is made there, a load from there finds it."""
    folder = args.out / "hf" / f"checkpoint-{engine.global_steps}"
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(str(folder))
    saved = digest(weights(engine))
    train_step(engine)
    path, _client = engine.load_checkpoint(str(folder))
    result["elsewhere"] = {
        "tag_folder": (folder / tag).is_dir(),
        "load_path": os.path.relpath(path, folder),
        "weights": digest(weights(engine)) == saved,
        "tags": cs.tags(folder),
    }


# -- another data-parallel size, another stage ----------------------------------------------------


def world(args: argparse.Namespace) -> None:
    """Load tag "b" of a run saved at another data-parallel size (``--stage``: its stage)."""
    engine = make_engine(args.stage, frozen=True)
    cs_ds.install(engine, args.run, chunk_bytes=args.chunk_bytes)
    result: dict[str, Any] = {}
    if args.stage == 0:  # every file saved alike by every rank: the whole state loads
        path, client = engine.load_checkpoint(args.run, tag="c5")
        result["full"] = path is not None and client["position"] == 5
    else:
        result["full"] = expect(
            cryosnap.WorldSizeError, lambda: engine.load_checkpoint(args.run, tag="c5")
        )
    if args.stage != 3:
        path, _client = engine.load_checkpoint(args.run, tag="c5", load_module_only=True)
        result["module_only"] = path is not None
        result["weights"] = digest(weights(engine))
    engine.destroy()
    report(args.out, result)


def stage(args: argparse.Namespace) -> None:
    """Load tag "c5" of a run saved at another ZeRO stage (``--stage``: this engine's)."""
    engine = make_engine(args.stage, frozen=True)
    cs_ds.install(engine, args.run, chunk_bytes=args.chunk_bytes)
    result = {
        "stage": expect(
            cryosnap.StateMismatchError, lambda: engine.load_checkpoint(args.run, tag="c5")
        )
    }
    engine.destroy()
    report(args.out, result)


# -- consolidation ------------------------------------------------------------------------------


def full_fp32(engine: Any) -> dict[str, torch.Tensor]:
    """The full fp32 master weights of every parameter, gathered from the live engine
    (collective: every rank calls it)."""
    return {
        n: deepspeed.utils.safe_get_full_fp32_param(p).detach().clone()
        for n, p in engine.module.named_parameters()
    }


def fp32(args: argparse.Namespace) -> None:
    """Train to step 3, save "s3", dump the fp32 weights of that save; consolidate on rank 0."""
    engine = make_engine(args.stage)
    cs_ds.install(engine, args.run, chunk_bytes=args.chunk_bytes)
    for _ in range(3):
        train_step(engine)
    engine.save_checkpoint(args.run, tag="s3")
    reference = full_fp32(engine)  # the version is captured at the next step, before it
    train_step(engine)
    engine.save_checkpoint(args.run, tag="s4")
    engine.destroy()
    if rank() != 0:
        return
    torch.save(reference, args.out / "reference.pt")
    result: dict[str, Any] = {
        "by_step": cs_ds.consolidate(args.run, args.out / "by-step.safetensors", step=3),
        "by_tag": cs_ds.consolidate(args.run, args.out / "by-tag.safetensors", tag="s3"),
        "newest": cs_ds.consolidate(args.run, args.out / "newest.safetensors"),
    }
    plain = args.out / "plain"
    with cryosnap.Checkpointer(plain, comm=LocalCoordinator()) as ckpt:  # rank 0 alone
        ckpt.save(1, {"w": torch.zeros(3)}).result()
    result["plain"] = expect(
        cryosnap.CheckpointFormatError,
        lambda: cs_ds.consolidate(plain, args.out / "plain.safetensors", step=1),
    )
    result["missing_tag"] = expect(
        cryosnap.CheckpointNotFoundError,
        lambda: cs_ds.consolidate(args.run, args.out / "x.safetensors", tag="nope"),
    )
    result["left"] = sorted(os.listdir(args.out))
    report(args.out, result)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "checks", "world", "stage", "fp32"])
    parser.add_argument("run", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--chunk-bytes", type=int, default=16 << 10)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--register", action="store_true")
    args = parser.parse_args(argv)
    args.run = str(args.run)
    args.out.mkdir(parents=True, exist_ok=True)
    deepspeed.init_distributed(dist_backend="gloo")
    scenarios = {"train": train, "checks": checks, "world": world, "stage": stage, "fp32": fp32}
    scenarios[args.scenario](args)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
