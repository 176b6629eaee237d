"""Which job launched this process, from its environment (``cryosnap flush`` per rank)."""

from __future__ import annotations

import pytest

from cryosnap.dist import LocalCoordinator
from cryosnap.dist._environ import job_coordinator, launcher


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"PMI_RANK": "0", "PMI_SIZE": "4"}, "mpi"),  # MPICH / Intel MPI hydra, Slurm PMI
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),  # Open MPI
        ({"MV2_COMM_WORLD_SIZE": "8"}, "mpi"),  # MVAPICH
        ({"PMI_SIZE": "1"}, None),  # mpiexec -n 1: a world of one
        ({"PMI_SIZE": "many"}, None),
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "1"}, "torchrun"),
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "1"}, None),
        ({"WORLD_SIZE": "2"}, None),  # not torchrun's
    ],
)
def test_the_launcher_is_read_from_the_environment(
    environ: dict[str, str], expected: str | None
) -> None:
    assert launcher(environ) == expected


def test_a_process_on_its_own_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    coord, close = job_coordinator()
    assert isinstance(coord, LocalCoordinator) and coord.world_size == 1
    close()
