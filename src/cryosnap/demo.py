"""The main job, ``make demo`` (``python -m cryosnap.demo``): train, get killed, resume exactly.

A small recommendation-style model (a sparse embedding table trained with SparseAdam, a dense
MLP head with dropout trained with Adam) trains on synthetic, skewed data. It checkpoints with a
:class:`cryosnap.Checkpointer`: asynchronous (lazy capture: only the optimizer steps wait),
incremental (only the chunks whose content changed are written: the embedding rows that were
hot), with retention. The training process is SIGKILLed at a random step, restarted, resumes
from the newest checkpoint and finishes; its final weights must equal, bit for bit, those of an
uninterrupted run. A summary compares the stall per checkpoint with ``torch.save`` + fsync of
the same state, shows the bytes each version wrote and the restore time.

Runs as three processes: the parent (this module's ``main``), the killed child and the resumed
child (``--child``), so the kill is a real SIGKILL of a real process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .progress import human_bytes

__all__ = ["main"]

ROWS, DIM, HIDDEN, BATCH = 200_000, 64, 1024, 4096


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - the demo needs the torch extra
        sys.exit("cryosnap demo: needs torch (pip install 'cryosnap[torch]')")
    return torch


def build(seed: int) -> tuple[Any, Any, Any]:
    torch = _torch()
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(ROWS, DIM, sparse=True),
            "head": torch.nn.Sequential(
                torch.nn.Linear(DIM, HIDDEN),
                torch.nn.ReLU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(HIDDEN, 1),
            ),
        }
    )
    sparse = torch.optim.SparseAdam(list(model["emb"].parameters()), lr=1e-2)
    dense = torch.optim.Adam(model["head"].parameters(), lr=1e-3)
    return model, sparse, dense


def batch(step: int) -> tuple[Any, Any]:
    """The batch of ``step``: a pure function of the step, so a resumed run sees the same data.
    Ids follow a skewed popularity over the 5% of items that are in fashion, as in
    recommendation data: most embedding rows stay untouched between checkpoints."""
    torch = _torch()
    g = torch.Generator().manual_seed(1_000_003 * step + 7)
    ids = (torch.rand(BATCH, generator=g) ** 3 * (ROWS // 20)).long()
    target = torch.sin(ids.float() / 977.0).unsqueeze(1)
    return ids, target


def train_step(model: Any, sparse: Any, dense: Any, step: int) -> float:
    ids, target = batch(step)
    sparse.zero_grad()
    dense.zero_grad()
    loss = (model["head"](model["emb"](ids)) - target).pow(2).mean()
    loss.backward()
    sparse.step()
    dense.step()
    return float(loss.detach())


def child(run: Path, steps: int, every: int, kill_at: int | None, log: Path) -> None:
    """Train (resuming if a checkpoint exists) and checkpoint every ``every`` steps."""
    import cryosnap

    torch = _torch()
    torch.set_num_threads(1)
    model, sparse, dense = build(seed=0)
    state: dict[str, Any] = {
        "model": model,
        "sparse": sparse,
        "dense": dense,
        "step": 0,
        "rng": torch.get_rng_state(),
    }
    events = log.open("a")
    with cryosnap.Checkpointer(run, keep=4, chunk_bytes=4 << 10, full_every=8) as ckpt:
        if ckpt.latest_step() is not None:
            t0 = time.perf_counter()
            ckpt.restore(into=state)
            torch.set_rng_state(state["rng"])
            restore_s = time.perf_counter() - t0
            events.write(
                json.dumps({"event": "restore", "step": state["step"], "seconds": restore_s}) + "\n"
            )
            events.flush()
        pending: list[Any] = []
        for step in range(state["step"], steps):
            train_step(model, sparse, dense, step)
            if kill_at is not None and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if (step + 1) % every == 0:
                state["step"] = step + 1
                state["rng"] = torch.get_rng_state()
                pending.append(ckpt.save(step + 1, state, lazy=True))
            for p in [p for p in pending if p.done()]:
                info = p.result()
                pending.remove(p)
                events.write(json.dumps({"event": "save", **_info(info)}) + "\n")
                events.flush()
        for p in pending:
            events.write(json.dumps({"event": "save", **_info(p.result())}) + "\n")
    torch.save(model.state_dict(), run.parent / "final.pt")
    events.close()


def _info(info: Any) -> dict[str, Any]:
    return {
        "step": info.step,
        "stall_seconds": info.stall_seconds,
        "seconds": info.seconds,
        "written_bytes": info.written_bytes,
        "logical_bytes": info.logical_bytes,
        "incremental": info.incremental,
    }


def _torch_save_seconds(workdir: Path) -> float:
    """torch.save + fsync of the same state as the demo checkpoints, median of 3."""
    torch = _torch()
    model, sparse, dense = build(seed=0)
    for step in range(3):
        train_step(model, sparse, dense, step)
    state = {
        "model": model.state_dict(),
        "sparse": sparse.state_dict(),
        "dense": dense.state_dict(),
    }
    times = []
    for i in range(3):
        path = workdir / f"torch-{i}.pt"
        t0 = time.perf_counter()
        with path.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
        path.unlink()
    return sorted(times)[1]


def _spawn(args: list[str]) -> int:
    cmd = [sys.executable, "-m", "cryosnap.demo", "--child", *args]
    return subprocess.run(cmd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cryosnap demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="demo-run", help="work directory (default ./demo-run)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random kill step")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Path(args.dir).absolute()
    if args.child:
        child(work / "ckpt", args.steps, args.every, args.kill_at, work / "events.jsonl")
        return 0

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    kill_at = random.Random(args.seed).randrange(args.every + 1, args.steps - args.every)
    common = ["--dir", str(work), "--steps", str(args.steps), "--every", str(args.every)]
    print(
        f"cryosnap demo: training {args.steps} steps, checkpoint every {args.every} "
        f"(async, lazy capture, incremental) into {work / 'ckpt'}"
    )
    print(f"  1. training process, SIGKILLed at step {kill_at} ...")
    code = _spawn([*common, "--kill-at", str(kill_at)])
    print(f"     exited with {code} ({'killed by SIGKILL' if code == -9 else 'unexpected'})")
    if code != -9:
        return 1
    print("  2. restarted: resumes from the newest checkpoint and finishes ...")
    if _spawn(common) != 0:
        return 1
    (work / "final.pt").rename(work / "final-resumed.pt")

    print("  3. reference run, never interrupted ...")
    torch = _torch()
    torch.set_num_threads(1)
    model, sparse, dense = build(seed=0)
    for step in range(args.steps):
        train_step(model, sparse, dense, step)
    resumed = torch.load(work / "final-resumed.pt", weights_only=True)
    reference = model.state_dict()
    exact = all(torch.equal(resumed[k], reference[k]) for k in reference)

    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    saves = [e for e in events if e["event"] == "save"]
    restores = [e for e in events if e["event"] == "restore"]
    torch_save = _torch_save_seconds(work)
    print()
    print(
        f"{'step':>5} {'kind':>11} {'stall ms':>9} {'vs torch.save':>13} "
        f"{'written':>10} {'of state':>9} {'durable s':>9}"
    )
    for e in saves:
        kind = "incremental" if e["incremental"] else "full"
        print(
            f"{e['step']:>5} {kind:>11} {e['stall_seconds'] * 1e3:>9.1f} "
            f"{e['stall_seconds'] / torch_save:>12.1%} {human_bytes(e['written_bytes']):>10} "
            f"{e['written_bytes'] / e['logical_bytes']:>9.1%} {e['seconds']:>9.3f}"
        )
    inc = [e for e in saves if e["incremental"]]
    logical = saves[-1]["logical_bytes"]
    print()
    print(f"state: {human_bytes(logical)}; torch.save + fsync of it: {torch_save * 1e3:.0f} ms")
    stalls = sorted(e["stall_seconds"] for e in saves)
    print(
        f"median stall per checkpoint: {stalls[len(stalls) // 2] * 1e3:.1f} ms "
        f"({stalls[len(stalls) // 2] / torch_save:.1%} of torch.save)"
    )
    if inc:
        mean_inc = sum(e["written_bytes"] for e in inc) / len(inc)
        print(
            f"incremental versions wrote {human_bytes(mean_inc)} on average "
            f"({mean_inc / logical:.1%} of the state)"
        )
    for r in restores:
        print(
            f"killed at step {kill_at}; resumed from step {r['step']} "
            f"(restore {r['seconds'] * 1e3:.0f} ms)"
        )
    print(f"final weights equal an uninterrupted run, bit for bit: {'YES' if exact else 'NO'}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
