"""The job of test_scale_ranks.py: N real ranks train, save, may be SIGKILLed whole, resume.

``mpiexec -n N python scale_job.py mpi OUT RUN STEPS KILL_AT`` (numpy only: no torch import in
an MPI rank) or ``python scale_job.py gloo OUT RUN STEPS KILL_AT`` with torchrun's environment.
Each rank opens a Checkpointer on ``RUN`` through a :class:`CountingCoordinator`, resumes from
the latest version if there is one, and trains to ``STEPS - 1``, saving every step. At
``KILL_AT`` (>= 0), once that version is durable, every rank trains one more step, starts its
save and meets the others in the program's own barrier; rank 0 then SIGKILLs every rank, itself
last: the whole job dies with a save in flight. A rank that ends normally writes
``OUT/rank-N.json``: where it resumed and its counters (those of the whole run, open to close).
:func:`job` is also what the test runs on a SimulatedWorld, for the counts to compare.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

TIMEOUT = 600.0  # collectives: 64 ranks on two loaded cores are slow, a dead one fails at once
MODEL_FLOATS = 4096  # 16 KiB replicated (each rank writes 1/N of it), as bench --workload scale
SHARD_INTS = 32  # 256 bytes of each rank's own
CHUNK_BYTES = 4096
KEEP = 2


def initial(rank: int) -> dict[str, Any]:
    model = np.random.default_rng(0).standard_normal(MODEL_FLOATS).astype(np.float32)
    return {"model": model, "shard": np.full(SHARD_INTS, rank, dtype=np.int64), "step": 0}


def train(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """One step: the next state from this one alone (a resume from a restored version that is
    not bit-exact drifts from the uninterrupted run)."""
    model = (state["model"] * np.float32(0.999) + np.float32(0.01)).astype(np.float32)
    shard = np.asarray(state["shard"]) * 3 + rank + 1
    return {"model": model, "shard": shard, "step": int(state["step"]) + 1}


def job(
    coord: Any,
    run: Path,
    *,
    steps: int,
    kill_at: int = -1,
    meet: Callable[[], None] | None = None,
    kill: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One rank's run (``coord``: its coordinator, wrapped here unless it counts already)."""
    import cryosnap
    from cryosnap.testing import CountingCoordinator, SimulatedRank, counters_of

    counting = coord if isinstance(coord, SimulatedRank) else CountingCoordinator(coord)
    rank = counting.rank
    got: dict[str, Any] = {"resumed_from": None}
    opts = {"comm": counting, "chunk_bytes": CHUNK_BYTES, "keep": KEEP}
    with cryosnap.Checkpointer(run, **opts) as ckpt:  # type: ignore[arg-type]
        latest = ckpt.latest_step()
        if latest is None:
            state = initial(rank)
            ckpt.save(0, state, replicated=["model"]).result(timeout=TIMEOUT)
        else:
            state = ckpt.restore()
            got["resumed_from"] = latest
        while state["step"] < steps - 1:
            state = train(state, rank)
            pending = ckpt.save(state["step"], state, replicated=["model"])
            if state["step"] == kill_at + 1:
                assert meet is not None and kill is not None
                meet()  # every rank's save of this step is captured and in flight
                kill()
            pending.result(timeout=TIMEOUT)
    if not isinstance(coord, SimulatedRank):
        got["uncounted"] = sorted(counting.uncounted)  # type: ignore[union-attr]
    got["counters"] = asdict(counters_of(counting))
    return got


def _kill_all(pids: list[int], rank: int) -> Callable[[], None]:
    def kill() -> None:
        if rank == 0:
            for pid in [*pids[1:], pids[0]]:  # itself last
                os.kill(pid, signal.SIGKILL)
        signal.pause()  # the others wait for rank 0's signal

    return kill


def _mpi(run: Path, steps: int, kill_at: int) -> tuple[int, dict[str, Any]]:
    import time

    from mpi4py import MPI

    from cryosnap.dist import MPICoordinator

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    pids = comm.allgather(os.getpid())

    def meet() -> None:
        # Polled, not MPI_Barrier: MPICH spins in a blocking call, 64 ranks on two cores.
        request = comm.Ibarrier()
        while not request.Test():
            time.sleep(0.005)

    coord = MPICoordinator(comm, timeout=TIMEOUT)
    got = job(coord, run, steps=steps, kill_at=kill_at, meet=meet, kill=_kill_all(pids, rank))
    return rank, got


def _gloo(run: Path, steps: int, kill_at: int) -> tuple[int, dict[str, Any]]:
    import datetime

    import torch.distributed as dist

    from cryosnap.dist import TorchCoordinator

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    coord = TorchCoordinator(timeout=TIMEOUT)
    got = job(
        coord, run, steps=steps, kill_at=kill_at, meet=dist.barrier, kill=_kill_all(pids, rank)
    )
    dist.destroy_process_group()
    return rank, got


def main(kind: str, out: Path, run: Path, steps: int, kill_at: int) -> None:
    rank, got = (_mpi if kind == "mpi" else _gloo)(run, steps, kill_at)
    (out / f"rank-{rank}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
