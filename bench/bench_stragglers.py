"""A straggler (issue #52): one rank's storage is slow; does it delay the others' capture?

N ranks (``--ranks``, default 4) each save ``--mib`` MiB (half a replicated model, each rank
writing 1/N of it, half its own), every byte new at each version, to one run on local disk.
Rank 1's store is a :class:`cryosnap.testing.FaultyStore` that, on "straggler" rounds, sleeps
``--delay`` seconds (default 1) before committing its data file of that version (an injected
storage delay: a slow disk, a busy OST). Rounds alternate, ``--repeat`` times each after an
untimed first version: a save with no straggler, then one with. Per save every rank times its
``save()`` call (the stall: the capture) and until ``result()`` returns (the commit: durable on
every rank); each round starts after a barrier. Figures: the others' stall is the median of
every rank's but the straggler's over the rounds (and the median over rounds of their largest,
noisier: the most of three samples of a loaded machine), the commit the most of any rank per
round, its median over rounds.

The ranks are a :class:`cryosnap.testing.SimulatedWorld` (``--mode sim``: threads of this
process) or real gloo processes (``--mode gloo``, torchrun's environment on 127.0.0.1, this
script started once per rank). The targets printed as PASS / FAIL: the others' stall with a
straggler within 1.2x of the stall without, and the commit later by the delay (0.8x to 2x of
it; the straggler's write itself and the others' gather add to it).

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_stragglers.py --mode sim gloo --ranks 4
--mib 16 --delay 1 --repeat 5`` (about a minute on 2 cores; ``--json FILE`` writes every
sample).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import _harness as h

HERE = Path(__file__).resolve()
STRAGGLER = 1
TIMEOUT = 600.0


def state_of(rank: int, step: int, mib: float) -> dict[str, Any]:
    n = int(mib * (1 << 20) / 16)  # float64: half the MiB replicated, half the rank's own
    model = np.random.default_rng(0).standard_normal(n) + step
    own = np.random.default_rng(100 + rank).standard_normal(n) + step
    return {"model": model, "own": own}


def rank_rounds(coord: Any, run: Path, *, mib: float, delay: float, repeat: int) -> dict[str, Any]:
    """One rank's saves: an untimed first one, then ``repeat`` pairs (none, straggler)."""
    import cryosnap
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    rank = coord.rank
    slow: set[str] = set()  # the data files of the straggler's slow version, by step prefix

    def fault(op: str, key: str) -> None:
        if op == "writer.commit" and rank == STRAGGLER and any(p in key for p in slow):
            time.sleep(delay)
            slow.clear()  # once per version

    sync = coord.channel("bench")
    got: dict[str, Any] = {"none": [], "straggler": []}
    store = FaultyStore(LocalStore(run), fault=fault)
    with cryosnap.Checkpointer(store, comm=coord, chunk_bytes=1 << 20) as ckpt:
        ckpt.save(0, state_of(rank, 0, mib), replicated=["model"]).result(timeout=TIMEOUT)
        for i in range(2 * repeat):
            step, mode = i + 1, ("none", "straggler")[i % 2]
            state = state_of(rank, step, mib)
            if mode == "straggler":
                slow.add(f"data/{step:012d}-")
            sync.barrier(timeout=TIMEOUT)
            t0 = time.perf_counter()
            pending = ckpt.save(step, state, replicated=["model"])
            stall = time.perf_counter() - t0
            pending.result(timeout=TIMEOUT)
            got[mode].append({"stall": stall, "commit": time.perf_counter() - t0})
    return got


def simulated(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    from cryosnap.testing import SimulatedWorld

    world = SimulatedWorld(args.ranks, timeout=TIMEOUT)
    opts = {"mib": args.mib, "delay": args.delay, "repeat": args.repeat}
    return world.run(lambda c: rank_rounds(c, folder / "run", **opts))


def gloo(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    command = [sys.executable, str(HERE), "--worker", str(folder), *_passed(args)]
    return h.launch_ranks(command, folder / "out", world=args.ranks, timeout_s=TIMEOUT)


def _passed(args: argparse.Namespace) -> list[str]:
    return ["--mib", str(args.mib), "--delay", str(args.delay), "--repeat", str(args.repeat)]


def worker(args: argparse.Namespace) -> None:
    import datetime

    import torch.distributed as dist

    from cryosnap.dist import TorchCoordinator

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    folder = Path(args.worker)
    coord = TorchCoordinator(timeout=TIMEOUT)
    got = rank_rounds(coord, folder / "run", mib=args.mib, delay=args.delay, repeat=args.repeat)
    (folder / "out" / f"rank-{dist.get_rank()}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def summary(ranks: list[dict[str, Any]], delay: float) -> dict[str, Any]:
    """Per mode: the median of the others' stalls (every rank but the straggler, every round),
    the median over rounds of their largest, and the median over rounds of the commit."""
    out: dict[str, Any] = {}
    for mode in ("none", "straggler"):
        rounds = range(len(ranks[0][mode]))
        others = [r for r in range(len(ranks)) if r != STRAGGLER]
        stall = [ranks[r][mode][i]["stall"] for r in others for i in rounds]
        worst = [max(ranks[r][mode][i]["stall"] for r in others) for i in rounds]
        commit = [max(got[mode][i]["commit"] for got in ranks) for i in rounds]
        out[mode] = {
            "stall": h.median(stall),
            "stall_worst": h.median(worst),
            "commit": h.median(commit),
        }
    out["stall_ratio"] = out["straggler"]["stall"] / max(out["none"]["stall"], 1e-9)
    out["commit_growth"] = out["straggler"]["commit"] - out["none"]["commit"]
    out["commit_growth_per_delay"] = out["commit_growth"] / delay
    return out


def report(mode: str, got: dict[str, Any], ranks: int) -> list[h.Check]:
    rows = [
        [
            what,
            h.format_ms(got[what]["stall"]),
            h.format_ms(got[what]["stall_worst"]),
            h.format_ms(got[what]["commit"]),
        ]
        for what in ("none", "straggler")
    ]
    print(f"\n{mode}, {ranks} ranks (rank {STRAGGLER} the straggler)")
    headers = ["save", "others' stall", "their largest", "commit (all durable)"]
    print(h.format_table(headers, rows))
    ratio, growth = got["stall_ratio"], got["commit_growth_per_delay"]
    return [
        h.Check(f"{mode}: the others' stall with a straggler", ratio <= 1.2, f"{ratio:.2f}x"),
        h.Check(
            f"{mode}: the commit later by the delay",
            0.8 <= growth <= 2.0,
            f"{got['commit_growth']:.3f} s = {growth:.2f}x the delay",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", nargs="+", choices=["sim", "gloo"], default=["sim", "gloo"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    before = h.load_average()
    print(h.command_line())
    results: dict[str, Any] = {}
    checks: list[h.Check] = []
    for mode in args.mode:
        with tempfile.TemporaryDirectory(prefix="bench-stragglers-", dir=args.dir) as tmp:
            ranks = (simulated if mode == "sim" else gloo)(args, Path(tmp))
        results[mode] = {"summary": summary(ranks, args.delay), "ranks": ranks}
        checks += report(mode, results[mode]["summary"], args.ranks)
    print()
    for check in checks:
        print(check.line())
    h.print_load(before)
    h.write_json(args.json, {"environment": h.environment(), **results})


if __name__ == "__main__":
    main()
