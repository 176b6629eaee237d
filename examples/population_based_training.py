"""Population-based training with forks that share storage.

Four members fit the same noisy linear model with SGD, each with its own learning rate, on
top of a frozen 4 MiB embedding (as a fine-tuning keeps its pretrained part). Every
``--every`` steps each member saves a version; the worst half then *forks* from the best
member's newest version (``cryosnap.Run(best).fork(step, dest)``: its manifests only, the best
member's data files are shared) and perturbs the learning rate it inherited. At the end the
script prints the members' losses and lineages, and the bytes the runs hold on disk against
what full copies of every fork would have held.

    .venv/bin/python examples/population_based_training.py --dir /tmp/pbt

Runs in a few seconds on a laptop; every version of every member restores bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

import cryosnap

FEATURES = 256
SAMPLES = 4096


def problem(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    w_true = rng.standard_normal(FEATURES).astype(np.float32)
    y = x @ w_true + 0.1 * rng.standard_normal(SAMPLES).astype(np.float32)
    return x, y


def loss(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    return float(np.mean((x @ w - y) ** 2))


def train(x: np.ndarray, y: np.ndarray, state: dict, steps: int) -> None:
    """``steps`` SGD steps on mini-batches, in place (the batch order is in the state)."""
    rng = np.random.default_rng(state["seed"])
    for _ in range(steps):
        idx = rng.integers(0, SAMPLES, 64)
        grad = 2 * x[idx].T @ (x[idx] @ state["w"] - y[idx]) / len(idx)
        state["momentum"] = 0.9 * state["momentum"] + grad
        state["w"] -= state["lr"] * state["momentum"]
        state["step"] += 1
    state["seed"] = int(rng.integers(1 << 31))


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--every", type=int, default=50, help="SGD steps between exploits")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="cryosnap-pbt-"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    x, y = problem()
    rng = np.random.default_rng(1)
    frozen = np.random.default_rng(2).standard_normal(1 << 20).astype(np.float32)
    paths = [root / f"member{m}-gen0" for m in range(args.members)]
    states = [
        {
            "embedding": frozen,
            "w": np.zeros(FEATURES, np.float32),
            "momentum": np.zeros(FEATURES, np.float32),
            "lr": float(10 ** rng.uniform(-4, -2)),
            "seed": m,
            "step": 0,
        }
        for m in range(args.members)
    ]
    copies = 0  # the bytes full copies of the forked versions would have taken
    for round_ in range(args.rounds):
        for path, state in zip(paths, states, strict=True):
            train(x, y, state, args.every)
            with cryosnap.Checkpointer(path) as ckpt:
                ckpt.save(state["step"], state, metrics={"loss": loss(x, y, state["w"])}).result()
        ranked = sorted(range(args.members), key=lambda m: loss(x, y, states[m]["w"]))
        best = ranked[0]
        step = states[best]["step"]
        for m in ranked[args.members // 2 :]:  # exploit: the worst half forks from the best
            dest = root / f"member{m}-gen{round_ + 1}"
            fork = cryosnap.Run(paths[best]).fork(step, dest)
            copies += fork.summary(step).logical_bytes
            paths[m] = dest
            states[m] = cryosnap.load(dest)
            states[m]["lr"] *= float(rng.choice([0.8, 1.25]))  # explore
            states[m]["seed"] = int(rng.integers(1 << 31))
        print(
            f"round {round_}: losses "
            + " ".join(f"{loss(x, y, s['w']):.4f}" for s in states)
            + f"; best member {best} (lr {states[best]['lr']:.2e}) at step {step}"
        )
    runs = sorted(p for p in root.iterdir() if p.is_dir())
    on_disk = sum(tree_bytes(p) for p in runs)
    full = on_disk + copies
    for path in paths:
        lineage = cryosnap.Run(path).lineage()
        chain = " <- ".join(os.path.basename(a) for a in lineage.ancestors) or "(no fork)"
        print(f"{path.name}: {chain}")
    print(
        f"{len(runs)} runs hold {on_disk / 2**20:.2f} MiB on disk; full copies of the "
        f"forked versions would hold {full / 2**20:.2f} MiB ({full / on_disk:.1f}x)"
    )


if __name__ == "__main__":
    main()
