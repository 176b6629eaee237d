"""The HF ``Trainer`` under DDP: its own checkpoints beside cryosnap's callback (issue 50).

Two gloo ranks (processes started by this script with torchrun's environment: ``MASTER_ADDR`` =
127.0.0.1, a free port, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, gloo on ``lo``, one OpenMP
thread each) train a GPT-2 built from a config (nothing downloaded; default 12 layers of 768,
a 32000-token vocabulary: 110M parameters, AdamW) with the real ``Trainer`` on random tokens,
``--steps`` optimizer steps with a save every ``--every`` steps, once per peer in one launch:

- **hf**: the Trainer's default (``save_strategy="steps"``): rank 0 writes ``model.safetensors``,
  ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``, ``training_args.bin``; each rank
  its ``rng_state_<rank>.pth``. Synchronous, and never fsynced: "durable" is the call plus an
  fsync of the files each rank wrote, made right after it (its time is left out of the stall).
- **cryosnap**: ``CryosnapCallback(dir, save_steps=...)`` with ``save_strategy="no"``: every rank
  writes 1/N of model, optimizer, scheduler and trainer state and its own RNG states; the
  save returns once the state is captured, "durable" is ``SaveInfo.seconds`` (the save call to
  the commit of the version, fsynced), bytes are ``SaveInfo.written_bytes``.

Per save: **call** (how long the save blocked the training loop on that rank: the Trainer's
``_save_checkpoint``, the callback's ``on_step_end``), **step excess** (the interval between the
start of the save's step and the next one, less the median interval of steps without a save:
what the job lost, a rank waiting for another in the next all-reduce included), **durable**,
and the **bytes** each rank wrote (first and second save). Then a fresh Trainer resumes from the
last save (``train(resume_from_checkpoint=<checkpoint dir>)``, ``=True`` for cryosnap) with
nothing left to train: **restore** is the time from the ``train`` call to ``on_train_begin``
less the same for a fresh training just before it in the same process (what the resume adds:
reading and loading model, optimizer, scheduler, trainer state; the page cache is warm for
both peers). Figures are the maximum over the ranks.

Run: ``.venv/bin/python bench/bench_frameworks_trainer.py`` (about 5 minutes on 2 cores;
``--layers 2 --embd 256`` for a smoke run of a minute). Each rank holds the model, its gradients
and AdamW state (about 2 GiB at 110M parameters), plus cryosnap's staging copy of its share.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve()
PEERS = ("hf", "cryosnap")


# -- inside a rank ---------------------------------------------------------------------------------


def _trainer(peer: str, where: Path, options: argparse.Namespace, callbacks: list[Any]) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    from cryosnap.integrations.transformers import CryosnapCallback

    set_seed(0)
    config = GPT2Config(
        vocab_size=options.vocab,
        n_positions=options.tokens,
        n_embd=options.embd,
        n_layer=options.layers,
        n_head=max(1, options.embd // 64),
    )
    ids = torch.randint(0, options.vocab, (64, options.tokens), generator=torch.Generator())
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(where / "hf"),
        use_cpu=True,
        per_device_train_batch_size=1,
        max_steps=options.steps,
        learning_rate=1e-4,
        save_strategy="steps" if peer == "hf" else "no",
        save_steps=options.every,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    if peer == "cryosnap":
        callbacks = [CryosnapCallback(where / "run", save_steps=options.every), *callbacks]
    return Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=dataset, callbacks=callbacks
    )


def _timeline() -> Any:
    from transformers import TrainerCallback

    class Timeline(TrainerCallback):
        """When training began and each optimizer step started (perf_counter seconds)."""

        def __init__(self) -> None:
            self.called = 0.0
            self.began = 0.0
            self.starts: dict[int, float] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.began = time.perf_counter()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.starts[state.global_step + 1] = time.perf_counter()

    return Timeline()


def _timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - t0)

    return call


def _fsync_tree(path: Path, rank: int) -> int:
    """fsync the files of an HF checkpoint this rank wrote; their bytes."""
    total = 0
    for file in sorted(path.iterdir()):
        rng = file.name.startswith("rng_state")
        if (rng and file.name != f"rng_state_{rank}.pth") or (not rng and rank != 0):
            continue
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        total += file.stat().st_size
    return total


def _hf_saves(trainer: Any, rank: int) -> dict[str, list[float]]:
    """Time each of the Trainer's own saves, then fsync what this rank wrote."""
    out: dict[str, list[float]] = {"call": [], "fsync": [], "bytes": []}
    original = trainer._save_checkpoint

    def save(*args: Any, **kwargs: Any) -> Any:
        result = _timed(out["call"], original)(*args, **kwargs)
        t0 = time.perf_counter()
        folder = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
        out["bytes"].append(float(_fsync_tree(folder, rank)))
        out["fsync"].append(time.perf_counter() - t0)
        return result

    trainer._save_checkpoint = save
    return out


def _cryosnap_saves(trainer: Any) -> tuple[dict[str, list[float]], list[Any]]:
    """Time the callback's step ends that saved; keep each PendingSave for its SaveInfo."""
    from transformers import TrainerCallback

    from cryosnap.integrations.transformers import CryosnapCallback

    callback = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, CryosnapCallback)
    )
    out: dict[str, list[float]] = {"call": [], "fsync": []}
    pendings: list[Any] = []
    original = callback.on_step_end

    def step_end(args: Any, state: Any, control: Any, **kw: Any) -> Any:
        before = len(pendings)
        t0 = time.perf_counter()
        result = original(args, state, control, **kw)
        if len(pendings) > before:
            out["call"].append(time.perf_counter() - t0)
            out["fsync"].append(0.0)
        return result

    class Spy(TrainerCallback):
        """After the callback opened its Checkpointer: keep what each save returns."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ckpt = callback._saver.ckpt
            assert ckpt is not None
            save = ckpt.save

            def spied(*a: Any, **k: Any) -> Any:
                pending = save(*a, **k)
                pendings.append(pending)
                return pending

            ckpt.save = spied  # type: ignore[method-assign]

    callback.on_step_end = step_end  # type: ignore[method-assign]
    trainer.add_callback(Spy())
    return out, pendings


def _gaps(starts: dict[int, float]) -> dict[int, float]:
    """Seconds from the start of each step to the start of the next."""
    steps = sorted(starts)
    return {s: starts[n] - starts[s] for s, n in itertools.pairwise(steps)}


def _plain_step(starts: dict[int, float], saved: list[int]) -> float:
    """The median step without a save (the first step, which warms up, left out)."""
    plain = [g for s, g in _gaps(starts).items() if s not in saved and s > 1]
    return statistics.median(plain) if plain else 0.0


def _excess(starts: dict[int, float], saved: list[int]) -> list[float]:
    """The interval after each saved step less the median interval without a save."""
    gaps, plain = _gaps(starts), _plain_step(starts, saved)
    return [gaps[s] - plain for s in saved if s in gaps]


def _peer(peer: str, where: Path, options: argparse.Namespace, rank: int) -> dict[str, Any]:
    timeline = _timeline()
    trainer = _trainer(peer, where, options, [timeline])
    pendings: list[Any] = []
    if peer == "hf":
        saves = _hf_saves(trainer, rank)
    else:
        saves, pendings = _cryosnap_saves(trainer)
    timeline.called = time.perf_counter()
    trainer.train()
    saved = list(range(options.every, options.steps, options.every))  # not the last: no next step
    excess = _excess(timeline.starts, saved)
    if peer == "hf":
        durable = [c + f for c, f in zip(saves["call"], saves["fsync"], strict=True)]
        written = saves["bytes"]
        excess = [e - f for e, f in zip(excess, saves["fsync"], strict=False)]
    else:
        infos = [p.result() for p in pendings]
        durable = [i.seconds for i in infos]
        written = [float(i.written_bytes) for i in infos]
    del trainer
    gc.collect()
    return {
        "call": saves["call"],
        "excess": excess,
        "durable": durable,
        "bytes": written,
        "restore": _restore(peer, where, options),
        "step": _plain_step(timeline.starts, saved),
    }


def _restore(peer: str, where: Path, options: argparse.Namespace) -> float:
    """Seconds from ``train(resume_from_checkpoint=...)`` to ``on_train_begin``, less the same
    for a fresh training (another Trainer, another folder, no resume): what the resume adds."""
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            control.should_training_stop = True

    fresh, resumed = _timeline(), _timeline()
    trainer = _trainer(peer, where / "fresh", options, [fresh, Stop()])
    fresh.called = time.perf_counter()
    trainer.train()
    del trainer
    gc.collect()
    trainer = _trainer(peer, where, options, [resumed])
    target: Any = True if peer == "cryosnap" else str(where / "hf" / f"checkpoint-{options.steps}")
    resumed.called = time.perf_counter()
    trainer.train(resume_from_checkpoint=target)
    del trainer
    gc.collect()
    return float((resumed.began - resumed.called) - (fresh.began - fresh.called))


def worker(options: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    base = Path(options.dir)
    got = {peer: _peer(peer, base / peer, options, rank) for peer in options.peers}
    if dist.is_initialized():
        dist.barrier()
    (base / f"rank-{rank}.json").write_text(json.dumps(got))


# -- the parent ------------------------------------------------------------------------------------


def _launch(options: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    port = h.free_port()
    argv = [sys.executable, str(HERE), "--worker", "--dir", str(folder), *_passed(options)]
    procs = [
        subprocess.Popen(argv, env=h.torchrun_env(r, options.ranks, port))
        for r in range(options.ranks)
    ]
    codes = [p.wait(timeout=options.timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    return [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(options.ranks)]


def _passed(options: argparse.Namespace) -> list[str]:
    keys = ("layers", "embd", "vocab", "tokens", "steps", "every")
    return [
        *(x for k in keys for x in (f"--{k}", str(getattr(options, k)))),
        "--peers",
        *options.peers,
    ]


def _worst(per: list[dict[str, Any]], key: str, i: int) -> float:
    """The largest figure ``key`` of save ``i`` over the ranks."""
    return float(max(p[key][i] for p in per if len(p[key]) > i))


def _report(ranks: list[dict[str, Any]], options: argparse.Namespace) -> list[list[str]]:
    rows = []
    for peer in options.peers:
        per = [r[peer] for r in ranks]
        worst = functools.partial(_worst, per)
        for i in range(len(per[0]["call"])):
            rows.append(
                [
                    peer,
                    str(i + 1),
                    h.format_s(worst("call", i)),
                    h.format_s(worst("excess", i)) if per[0]["excess"][i:] else "-",
                    h.format_s(worst("durable", i)),
                    " / ".join(h.format_bytes(p["bytes"][i]) for p in per),
                    h.format_s(max(p["restore"] for p in per)) if i == 0 else "",
                    h.format_s(max(p["step"] for p in per)) if i == 0 else "",
                ]
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=32, help="sequence length")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--dir", help="where the temporary folder goes")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options)
        return
    before = h.load_average()
    params = 12 * options.layers * options.embd**2 + (options.vocab + options.tokens) * options.embd
    print(
        f"GPT-2, {options.layers} layers of {options.embd}, vocabulary {options.vocab}: "
        f"about {params / 1e6:.0f}M parameters, AdamW; {options.ranks} gloo ranks"
    )
    with h.scratch_dir("cryosnap-trainer-", options.dir) as folder:
        ranks = _launch(options, folder)
    head = ["peer", "save", "call", "step excess", "durable", "bytes per rank", "restore", "step"]
    print(h.format_table(head, _report(ranks, options)))
    h.print_load(before)
    h.write_json(options.json, {"environment": h.environment(), "ranks": ranks})


if __name__ == "__main__":
    main()
