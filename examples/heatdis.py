"""heatdis: 2-D heat diffusion over MPI ranks, checkpointed with cryosnap.

VeloC's heatdis example in Python (mpi4py + numpy): the grid is split by rows over the ranks,
each iteration exchanges one halo row with each neighbour (Sendrecv) and takes a Jacobi step.
Every K iterations each rank saves its rows; at start the newest version is restored, so a
job killed at any moment resumes where its last checkpoint left it, bit for bit.

    mpiexec -n 4 python examples/heatdis.py --config cryosnap.toml --iterations 600 --every 50

With ``--state file`` each rank writes its rows to ``<files>/rank-<r>/grid.npy`` itself
(np.save, as an HDF5 code writes its file) and checkpoints that file (``cryosnap.File``).

docs/HPC.md walks through it: the configuration file, the job script and its epilogue.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import cryosnap
from cryosnap.dist import MPICoordinator

HOT = 100.0  # the temperature held along the grid's top edge


def local_rows(rows: int, rank: int, size: int) -> int:
    """How many of the grid's ``rows`` rank ``rank`` of ``size`` owns."""
    return rows // size + (1 if rank < rows % size else 0)


def initial_grid(rows: int, cols: int, rank: int) -> np.ndarray:
    """This rank's rows and one halo row above and below: cold, the top edge hot."""
    grid = np.zeros((rows + 2, cols), dtype=np.float64)
    if rank == 0:
        grid[0, :] = HOT  # rank 0's upper halo is the fixed boundary
    return grid


def exchange_halos(comm: MPI.Comm, grid: np.ndarray) -> None:
    """Send my first and last rows to my neighbours, receive theirs into my halo rows."""
    rank, size = comm.Get_rank(), comm.Get_size()
    up = rank - 1 if rank > 0 else MPI.PROC_NULL
    down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    comm.Sendrecv(grid[1], dest=up, recvbuf=grid[-1], source=down)
    comm.Sendrecv(grid[-2], dest=down, recvbuf=grid[0], source=up)


def step(grid: np.ndarray, out: np.ndarray) -> None:
    """One Jacobi step of the interior into ``out`` (the left and right columns stay fixed)."""
    out[1:-1, 1:-1] = 0.25 * (grid[:-2, 1:-1] + grid[2:, 1:-1] + grid[1:-1, :-2] + grid[1:-1, 2:])


def run(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    grid = initial_grid(local_rows(args.rows, rank, size), args.cols, rank)
    new = grid.copy()
    start = 0
    # The file-based variant (--state file) writes its rows with its own I/O, as an HDF5 code
    # would: one file per rank, in a directory per rank; the checkpoint holds that file.
    own = args.files / f"rank-{rank:05d}" / "grid.npy"
    if args.state == "file":
        own.parent.mkdir(parents=True, exist_ok=True)
    # Where and how to checkpoint comes from the configuration file and CRYOSNAP_* variables
    # (the job script puts scratch on the node's $TMPDIR); the program gives the participants.
    # partner = "xor" there (or $CRYOSNAP_PARTNER) protects scratch with XOR parity sets
    # instead of partner copies: the program does not change (docs/HPC.md).
    with cryosnap.Checkpointer.from_config(args.config, comm=MPICoordinator(comm)) as ckpt:
        if ckpt.latest_step() is not None:
            if args.state == "file":
                # restore(into=) rewrites the file, every chunk verified; the program reads it.
                saved = ckpt.restore(into={"grid": cryosnap.File(own), "iteration": 0})
                grid[1:-1] = np.load(own)
            else:
                saved = ckpt.restore()  # the newest version every rank has, verified
                grid[1:-1] = saved["grid"]
            start = int(saved["iteration"])
        new[:] = grid
        t0 = time.perf_counter()
        for it in range(start, args.iterations):
            if args.every and it > start and it % args.every == 0:
                # Returns once the rows (or the file's bytes) are copied out; scratch, partner
                # and persistent follow in the background.
                if args.state == "file":
                    np.save(own, grid[1:-1])  # the program's own output
                    ckpt.save(it, {"grid": cryosnap.File(own), "iteration": it})
                else:
                    ckpt.save(it, {"grid": grid[1:-1], "iteration": it})
                if rank == 0:
                    print(f"checkpoint at iteration {it}", flush=True)
            exchange_halos(comm, grid)
            step(grid, new)
            grid, new = new, grid
        loop_seconds = time.perf_counter() - t0
    parts = comm.gather(grid[1:-1], root=0)
    if parts is not None:  # rank 0
        print(f"done: {args.iterations - start} iterations in {loop_seconds:.3f} s", flush=True)
        if args.out is not None:
            np.save(args.out, np.concatenate(parts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="2-D heat diffusion, checkpointed by cryosnap")
    parser.add_argument("--config", type=Path, required=True, help="cryosnap TOML file")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument("--every", type=int, default=50, help="checkpoint every K (0: never)")
    parser.add_argument("--out", type=Path, default=None, help="save the final grid (.npy)")
    parser.add_argument(
        "--state",
        choices=("memory", "file"),
        default="memory",
        help="checkpoint the rows in memory, or a file the program writes (cryosnap.File)",
    )
    parser.add_argument(
        "--files",
        type=Path,
        default=Path("heatdis-files"),
        help="--state file: the directory of the per-rank files (<files>/rank-<r>/grid.npy)",
    )
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
