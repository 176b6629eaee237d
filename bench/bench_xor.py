"""Scratch space and rebuild time of ``partner=True`` against ``partner="xor"`` (issue #29) and
``partner="rs:K+M"`` (issue #58).

The script starts itself under ``mpiexec -n RANKS`` (MPICH from the ``mpich`` wheel), each
rank on a "node" of its own (``$CRYOSNAP_NODE=node-<r>``, scratch ``<dir>/node-<r>``), so one
XOR set of k = RANKS (an RS set of K = RANKS - M). For each mode (``--modes``), in a fresh
directory: every rank saves one full version of
``--mib`` MiB of its own (random fp32, nothing de-duplicates; "on scratch": that save until
``result(tier="scratch")``, the partner copy or the parity included), then its node's scratch
bytes are counted (every file under ``node-<r>`` but the lock); the run is opened again
untouched (the baseline open), then once more after node 1's scratch was wiped (nodes 1..M
for ``rs:K+M``): that open rebuilds their parts (from the partner's copy, or from the others'
files and parity);
each open is timed on every rank (the maximum is the job's), ``--repeat`` times, medians.
Nothing is asserted: the space goal (xor at most 1.5x a part per node) prints PASS / FAIL.

Run: ``.venv/bin/python bench/bench_xor.py --ranks 4 --mib 256 --repeat 3 --dir /tmp``; RS
against XOR on 6 nodes: ``... --ranks 6 --modes True,xor,rs:5+1,rs:4+2``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve()
MODES = "True,xor"


def modes(text: str) -> list[bool | str]:
    return [True if m == "True" else m for m in text.split(",")]


def lost_nodes(mode: bool | str) -> list[int]:
    """The nodes wiped before the rebuild: node 1, or nodes 1..M of ``rs:K+M``."""
    if isinstance(mode, str) and mode.startswith("rs:"):
        return list(range(1, 1 + int(mode.rsplit("+", 1)[1])))
    return [1]


def node_bytes(node: Path) -> int:
    return sum(p.stat().st_size for p in node.rglob("*") if p.is_file() and "lock" not in p.name)


def _open(comm: Any, root: Path, node: Path, mode: bool | str) -> Any:
    import cryosnap
    from cryosnap.dist import MPICoordinator

    c = MPICoordinator(comm, timeout=600)
    return cryosnap.Checkpointer(root / "run", scratch=node, comm=c, partner=mode)


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    os.environ["CRYOSNAP_NODE"] = f"node-{rank}"
    state = {"x": np.random.default_rng(rank).standard_normal(args.mib << 18, dtype=np.float32)}
    out: dict[str, Any] = {}
    for mode in modes(args.modes):
        samples: dict[str, list[float]] = {"save": [], "open": [], "rebuild": []}
        for r in range(args.repeat):
            root = Path(args.dir) / f"{mode}-{r}"
            node = root / f"node-{rank}"

            with _open(comm, root, node, mode) as c:
                comm.Barrier()
                t0 = time.perf_counter()
                c.save(1, state).result(tier="scratch")
                samples["save"].append(time.perf_counter() - t0)
            comm.Barrier()
            out[f"{mode}-bytes"] = node_bytes(node)
            out["part"] = node_bytes(node / f"rank-{rank:05d}")
            for kind in ("open", "rebuild"):
                if kind == "rebuild" and rank in lost_nodes(mode):
                    shutil.rmtree(node)
                comm.Barrier()
                t0 = time.perf_counter()
                c = _open(comm, root, node, mode)
                samples[kind].append(time.perf_counter() - t0)
                c.close()
            comm.Barrier()
            if rank == 0:
                shutil.rmtree(root)
        out[str(mode)] = samples
    (Path(args.dir) / f"rank-{rank}.json").write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks, one node each (4)")
    parser.add_argument("--mib", type=int, default=64, help="each rank's state, MiB (64)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each mode (3)")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--modes", default=MODES, help=f"partner= values ({MODES}; rs:K+M)")
    parser.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        rank_main(args)
        return
    load_before = h.load_average()
    with h.scratch_dir("bench-xor-", args.dir) as tmp:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = [
            str(mpiexec),
            "-n",
            str(args.ranks),
            sys.executable,
            str(HERE),
            "--rank-side",
            "--mib",
            str(args.mib),
            "--repeat",
            str(args.repeat),
            "--dir",
            str(tmp),
            "--modes",
            args.modes,
        ]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(args.ranks)]
    part = max(r["part"] for r in ranks)
    print(f"{args.ranks} ranks on {args.ranks} nodes, one part: {part / 2**20:.1f} MiB")
    print(
        f"{'partner=':<14}{'scratch/node':>16}{'x part':>8}{'on scratch':>12}{'open':>10}"
        f"{'open, lost':>14}{'lost':>6}"
    )
    for mode in modes(args.modes):
        per_node = max(r[f"{mode}-bytes"] for r in ranks)
        med = {
            k: h.median([max(r[str(mode)][k][i] for r in ranks) for i in range(args.repeat)])
            for k in ("save", "open", "rebuild")
        }
        print(
            f"{mode!r:<14}{per_node / 2**20:>12.1f} MiB{per_node / part:>8.2f}"
            f"{med['save']:>11.2f}s{med['open']:>9.2f}s{med['rebuild']:>13.2f}s"
            f"{len(lost_nodes(mode)):>6}"
        )
        if mode == "xor":
            check = h.Check("xor: at most 1.5x a part per node", per_node <= 1.5 * part, "")
            print(check.line())
    h.print_load(load_before)


if __name__ == "__main__":
    main()
