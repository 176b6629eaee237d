"""The job this process was started in, read from its environment: mpiexec, torchrun or none.

:func:`job_coordinator` opens the coordinator of that job for a tool that runs as one process
per rank (``cryosnap flush`` in a job script's epilogue), initializing torch.distributed's gloo
group under torchrun when nobody has, and says how to undo what it opened. Caller's thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from cryosnap.dist._common import DEFAULT_TIMEOUT_SECONDS
from cryosnap.dist._local import LocalCoordinator
from cryosnap.dist._mpi import MPICoordinator
from cryosnap.dist._torch import TorchCoordinator, initialized_world
from cryosnap.errors import CoordinationError

__all__ = ["job_coordinator", "launcher"]

# The world size each MPI launcher sets in its processes' environment: MPICH's and Intel MPI's
# hydra (and Slurm's PMI), Open MPI, MVAPICH.
_MPI_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def _nothing() -> None:
    return None


def launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """``"torchrun"``, ``"mpi"`` or None (a process on its own, or a world of one)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env and _size(env, "WORLD_SIZE") > 1:
        return "torchrun"
    if any(_size(env, name) > 1 for name in _MPI_SIZES):
        return "mpi"
    return None


def _size(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env.get(name, "1"))
    except ValueError:
        return 1


def job_coordinator(
    *, timeout: float = DEFAULT_TIMEOUT_SECONDS
) -> tuple[LocalCoordinator | MPICoordinator | TorchCoordinator, Callable[[], None]]:
    """The participants of the job this process belongs to, and what closes what was opened
    for them: torch.distributed when it is initialized or torchrun started this process, the
    MPI world under an MPI launcher, else a world of one."""
    if initialized_world():
        return TorchCoordinator(timeout=timeout), _nothing
    kind = launcher()
    if kind == "torchrun":
        return _torchrun(timeout)
    if kind == "mpi":
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise CoordinationError(
                f"started by an MPI launcher, but mpi4py cannot be imported ({exc}): "
                "pip install 'cryosnap[mpi]'"
            ) from exc
        return MPICoordinator(MPI.COMM_WORLD, timeout=timeout), _nothing
    return LocalCoordinator(), _nothing


def _torchrun(timeout: float) -> tuple[TorchCoordinator, Callable[[], None]]:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise CoordinationError(
            f"started by torchrun, but torch cannot be imported ({exc})"
        ) from exc
    if dist.is_initialized():  # by the program, with a world of one
        return TorchCoordinator(timeout=timeout), _nothing
    dist.init_process_group("gloo")
    return TorchCoordinator(timeout=timeout), dist.destroy_process_group
