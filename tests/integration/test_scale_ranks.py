"""Real ranks at scale (#52): 64 MPI ranks and 16 gloo ranks save, are SIGKILLed, resume.

Each job (tests/integration/scale_job.py) runs three times on one kind of group: uninterrupted
to the last step; killed whole (every rank SIGKILLed) with a save in flight after a durable
version; relaunched on the killed run, where it resumes. The resumed run's last version is
bit-exact against the uninterrupted run's, and every run's per-rank counters (through
CountingCoordinator) equal a SimulatedWorld's of the same size running the same job on a run in
the same state (a copy of the killed run). make test runs 8 MPI and 4 gloo ranks; make
test-deep 64 MPI ranks (oversubscribed) and 16 gloo ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration import scale_job

HERE = Path(__file__).resolve()
JOB = HERE.parent / "scale_job.py"
ROOT = HERE.parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
STEPS = 5  # versions 0 .. 4
KILL_AT = 1  # version 1 durable, version 2 in flight when the job is killed


def launch_mpi(world: int, out: Path, run: Path, kill_at: int, timeout: float) -> list[Any]:
    """``scale_job.py mpi`` on ``world`` MPI ranks; each rank's report (none when killed)."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (requirements-dev.txt)")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}: the mpich wheel is not installed")
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    args = [str(out), str(run), str(STEPS), str(kill_at)]
    cmd = [str(MPIEXEC), "-n", str(world), sys.executable, str(JOB), "mpi", *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if kill_at >= 0:
        assert proc.returncode != 0 and not list(out.glob("rank-*.json")), log
        return []
    assert proc.returncode == 0, f"mpiexec exited {proc.returncode}:\n{log}"
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def launch_gloo(world: int, out: Path, run: Path, kill_at: int, timeout: float) -> list[Any]:
    """``scale_job.py gloo`` on ``world`` processes (test_dist_torch's launcher)."""
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    from tests.integration import test_dist_torch

    killed = frozenset(range(world)) if kill_at >= 0 else frozenset()
    args = (str(run), str(STEPS), str(kill_at))
    got = test_dist_torch.launch(
        "gloo", world, out, *args, script=JOB, killed=killed, timeout=timeout
    )
    return [] if killed else got


def simulate(world: int, run: Path) -> list[dict[str, Any]]:
    """The same job on a SimulatedWorld of ``world`` ranks: each rank's report."""
    from cryosnap.testing import SimulatedWorld

    sim = SimulatedWorld(world, timeout=scale_job.TIMEOUT)
    return sim.run(lambda c: scale_job.job(c, run, steps=STEPS))


def expected(rank: int, step: int) -> dict[str, Any]:
    state = scale_job.initial(rank)
    for _ in range(step):
        state = scale_job.train(state, rank)
    return state


def same_counters(real: list[dict[str, Any]], simulated: list[dict[str, Any]]) -> None:
    """Every rank's counters equal the simulation's, field by field (the counting
    coordinator pickles what arrives as the simulated world pickles what was sent)."""
    for rank, (got, sim) in enumerate(zip(real, simulated, strict=True)):
        assert got["uncounted"] == [], rank
        assert got["counters"] == sim["counters"], (rank, got["counters"], sim["counters"])


def bits(tree: Any) -> dict[str, Any]:
    return {k: np.asarray(v).tobytes() + str(np.asarray(v).dtype).encode() for k, v in tree.items()}


def kill_and_resume(tmp_path: Path, world: int, launch: Any, timeout: float) -> None:
    """The three runs and their checks (the paths have equal lengths: the ranks tell each
    other file names, whose sizes are counted)."""
    import cryosnap
    from cryosnap import engine
    from cryosnap.storage import LocalStore

    full, killed, copy = (tmp_path / d / "run" for d in ("full", "kill", "copy"))
    results = launch(world, tmp_path / "full-out", full, -1, timeout)
    same_counters(results, simulate(world, tmp_path / "sim1" / "run"))
    assert engine.list_steps(LocalStore(full)) == [STEPS - 2, STEPS - 1]  # keep=2

    launch(world, tmp_path / "kill-out", killed, KILL_AT, timeout)
    durable = engine.list_steps(LocalStore(killed))
    # The version in flight was committed whole or not at all; the one before it survives.
    assert durable in ([KILL_AT - 1, KILL_AT], [KILL_AT, KILL_AT + 1]), durable
    shutil.copytree(killed.parent, copy.parent)
    resumed = launch(world, tmp_path / "resume-out", killed, -1, timeout)
    assert {got["resumed_from"] for got in resumed} == {durable[-1]}
    same_counters(resumed, simulate(world, copy))
    for rank in range(world):
        want = bits(expected(rank, STEPS - 1))
        assert bits(cryosnap.load(killed, rank=rank)) == want, rank
        assert bits(cryosnap.load(full, rank=rank)) == want, rank


@pytest.mark.timeout(240)
def test_eight_mpi_ranks_are_killed_resume_bit_exact_and_count_as_simulated(
    tmp_path: Path,
) -> None:
    kill_and_resume(tmp_path, 8, launch_mpi, 180)


@pytest.mark.timeout(240)
def test_four_gloo_ranks_are_killed_resume_bit_exact_and_count_as_simulated(
    tmp_path: Path,
) -> None:
    kill_and_resume(tmp_path, 4, launch_gloo, 180)


@pytest.mark.deep
@pytest.mark.timeout(3600)
def test_sixty_four_mpi_ranks_are_killed_resume_bit_exact_and_count_as_simulated(
    tmp_path: Path,
) -> None:
    kill_and_resume(tmp_path, 64, launch_mpi, 1200)


@pytest.mark.deep
@pytest.mark.timeout(2400)
def test_sixteen_gloo_ranks_are_killed_resume_bit_exact_and_count_as_simulated(
    tmp_path: Path,
) -> None:
    kill_and_resume(tmp_path, 16, launch_gloo, 900)


def report(kind: str, world: int) -> None:
    """Print one uninterrupted job's per-rank counters beside the simulation's (the figures
    of docs/PERFORMANCE.md): ``python tests/integration/test_scale_ranks.py mpi:64 gloo:16``."""
    import tempfile
    import time

    launch = launch_mpi if kind == "mpi" else launch_gloo
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        real = launch(world, Path(tmp) / "full-out", Path(tmp) / "full" / "run", -1, 1200)
        wall = time.perf_counter() - t0
        sim = simulate(world, Path(tmp) / "sim1" / "run")
    same = all(r["counters"] == s["counters"] for r, s in zip(real, sim, strict=True))
    print(f"{kind}, {world} ranks: every rank equal to the simulation's: {same}; {wall:.1f} s")
    print(f"  rank 0: {real[0]['counters']}")
    for pick in (min, max):
        figures = {k: pick(r["counters"][k] for r in real[1:]) for k in real[0]["counters"]}
        print(f"  ranks 1-{world - 1}, {pick.__name__}: {figures}")


if __name__ == "__main__":  # the forkserver of the gloo ranks imports this module as main
    for arg in sys.argv[1:]:
        kind, world = arg.split(":")
        report(kind, int(world))
