"""One rank of an MPI job whose program dies between a scratch commit and its flush:
``mpiexec -n N python flush_job.py RUN SCRATCH_BASE [shared]``. Each rank's node-local scratch
is ``SCRATCH_BASE/node-<rank>`` (with ``shared``: ``SCRATCH_BASE``, one node); rank 0 is
SIGKILLed as the flush of step 2 starts writing to the persistent level (mpiexec then ends the
job), so step 2 is on every rank's scratch only.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

TIMEOUT = 60.0


def state_of(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(rank)
    w = rng.standard_normal(32 << 10).astype(np.float32)
    w[: 1024 * step] += step
    shared = np.arange(16 << 10, dtype=np.float64) * step  # the same on every rank
    return {"w": w, "shared": shared, "rank": rank, "step": step}


def main(run: Path, scratch_base: Path, shared: bool) -> None:
    from mpi4py import MPI

    import cryosnap
    from cryosnap.dist import MPICoordinator
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    armed = {"on": False}

    def fault(op: str, key: str) -> None:
        if armed["on"] and rank == 0 and op == "open_writer" and key.startswith("data/"):
            os.kill(os.getpid(), signal.SIGKILL)

    persistent = FaultyStore(LocalStore(run), fault=fault)
    coord = MPICoordinator(comm, timeout=TIMEOUT)
    scratch = scratch_base if shared else scratch_base / f"node-{rank}"
    with cryosnap.Checkpointer(
        persistent, scratch=scratch, comm=coord, chunk_bytes=16 << 10
    ) as ckpt:
        ckpt.save(1, state_of(rank, 1), replicated=["shared"]).result(timeout=TIMEOUT)
        armed["on"] = True
        ckpt.save(2, state_of(rank, 2), replicated=["shared"]).result(timeout=TIMEOUT)
    print("finished without crashing", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] == ["shared"])
