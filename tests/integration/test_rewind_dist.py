"""Rewinds in a distributed run with two levels (issue 55), on real MPI processes.

Superseding (test_supersede.py) was tested on one process or one level: there the persistent
level gets each version by a copy of scratch's files, whose chains are right. With several
ranks and scratch, every rank writes its part to the persistent level again (``Rewriter``),
through a chain of its own that the rewind did not restart: a re-saved step was written on
top of the version it superseded, and every later version on the persistent level was
unreadable. Here programs of sessions (lose scratch, open, restore or rewind, save, close)
drawn by Hypothesis run on 4 ranks with partner copies, XOR parity or neither; after every
session each rank checks, as its users would after losing the node:

- ``Run.verify`` of the persistent level and of its own scratch: every version OK;
- a Checkpointer on the persistent level alone (scratch lost) restores the newest version,
  bit for bit the state the model says.

This file is also the ranks' script: ``mpiexec -n 4 python test_rewind_dist.py OUT PROGRAM``.
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = Path(__file__).resolve()
MPIEXEC = Path(sys.executable).parent / "mpiexec"
WORLD = 4
KEEP, KEEP_SCRATCH = 4, 2


def state(rank: int, step: int, trajectory: int) -> dict[str, Any]:
    """The state of ``rank`` at ``step`` of a trajectory (a rewound program computes another);
    a sparse change per step, so versions are incremental, and a replicated part."""
    g = np.full((64, 64), float(rank), dtype=np.float64)
    g[: 4 * (step % 5 + 1)] += step + 1000 * trajectory
    model = np.arange(2048, dtype=np.float32) + step + 1000 * trajectory
    return {"g": g, "model": model, "step": step, "trajectory": trajectory}


# -- the model ----------------------------------------------------------------------------------


def expected(program: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """After each session: the versions of the run (step -> trajectory, what ``keep`` leaves on
    the persistent level) and the version a restore without a step returns."""
    versions: dict[int, int] = {}
    trajectory, out = 0, []
    for session in program:
        back = session["back"]
        if session.get("damage") and versions:
            # The newest version is damaged everywhere: a restore falls back to the one
            # before, and the program saves on from there.
            del versions[max(versions)]
            back = 0
        if back is not None and versions:
            steps = sorted(versions)
            fork = steps[max(0, len(steps) - 1 - back)]
            if (fork != steps[-1] or session.get("damage")) and not session.get("same"):
                trajectory = session["id"]
            start = fork
        else:
            start = max(versions, default=0)
        for i in range(session["saves"]):
            step = start + 1 + i
            if i == 0:  # the first save supersedes every version after the fork
                versions = {s: t for s, t in versions.items() if s < step}
            versions[step] = trajectory
            versions = dict(sorted(versions.items())[-KEEP:])
        newest = max(versions, default=None)
        out.append(
            {
                "versions": sorted(versions),
                "newest": None if newest is None else [newest, versions[newest]],
            }
        )
    return out


sessions = st.fixed_dictionaries(
    {
        # Steps back from the newest version to restore (0: the newest; None: no restore).
        "back": st.one_of(st.none(), st.integers(0, 3)),
        "saves": st.integers(1, 3),
        # Before the session: no scratch lost, one node's, or every node's.
        "lose": st.sampled_from(["none", "one", "all"]),
    }
)


def programs(min_size: int = 2, max_size: int = 4) -> st.SearchStrategy[list[dict[str, Any]]]:
    def number(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**s, "id": i + 1} for i, s in enumerate(items)]

    return st.lists(sessions, min_size=min_size, max_size=max_size).map(number)


def launch(tmp: Path, program: list[dict[str, Any]], redundancy: str) -> list[list[Any]]:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (requirements-dev.txt)")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}: the mpich wheel is not installed")
    if redundancy == "rs":
        pytest.importorskip("zfec", reason="zfec is not installed (the rs extra)")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "program.json").write_text(json.dumps({"sessions": program, "mode": redundancy}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(MPIEXEC), "-n", str(WORLD), sys.executable, str(HERE), str(tmp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mpiexec exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def check(program: list[dict[str, Any]], results: list[list[Any]]) -> None:
    want = expected(program)
    for rank, got in enumerate(results):
        assert len(got) == len(program), rank
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            where = f"rank {rank}, after session {i + 1} of {program}"
            assert g["steps"] == w["versions"], where
            assert g["persistent_damaged"] == [], where
            assert g["scratch_damaged"] == [], where
            assert g["from_persistent"] == w["newest"], where
            assert g["exact"], where


_SETTINGS = settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@pytest.mark.parametrize("redundancy", ["none", "partner", "xor"])
@_SETTINGS
@given(program=programs())
def test_rewinds_on_four_ranks_and_two_levels(
    tmp_path: Path, redundancy: str, program: list[dict[str, Any]]
) -> None:
    check(program, launch(tmp_path / "case", program, redundancy))


@pytest.mark.deep
@pytest.mark.parametrize("redundancy", ["none", "partner", "xor", "rs"])
@settings(_SETTINGS, max_examples=8)
@given(program=programs(3, 6))
def test_rewinds_on_four_ranks_and_two_levels_at_length(
    tmp_path: Path, redundancy: str, program: list[dict[str, Any]]
) -> None:
    check(program, launch(tmp_path / "case", program, redundancy))


@pytest.mark.parametrize("redundancy", ["none", "partner"])
def test_the_issue_55_reproduction(tmp_path: Path, redundancy: str) -> None:
    """Save 1-3; restore 2 and save 3-5 (the re-saved step 3 holds the same state as the one
    it supersedes): every level verifies, and the persistent level alone restores step 5."""
    program: list[dict[str, Any]] = [
        {"id": 1, "back": None, "saves": 3, "lose": "none"},
        {"id": 2, "back": 1, "saves": 3, "lose": "none", "same": True},
    ]
    results = launch(tmp_path / "case", program, redundancy)
    for got in results:
        assert got[-1]["steps"] == [2, 3, 4, 5]
    check(program, results)


@pytest.mark.parametrize("redundancy", ["none", "partner"])
def test_a_fallback_past_damage_on_every_level(tmp_path: Path, redundancy: str) -> None:
    """Step 3's data is damaged on every level (scratch, partner copies, persistent): the
    restore falls back to step 2 and the program saves 3 and 4 again."""
    program: list[dict[str, Any]] = [
        {"id": 1, "back": None, "saves": 3, "lose": "none"},
        {"id": 2, "back": None, "saves": 2, "lose": "none", "damage": True},
    ]
    results = launch(tmp_path / "case", program, redundancy)
    for got in results:
        assert got[-1]["restored"] == 2
        assert got[-1]["steps"] == [1, 2, 3, 4] and got[-1]["from_persistent"] == [4, 2]
    check(program, results)


@pytest.mark.parametrize("redundancy", ["none", "partner", "xor", "rs"])
def test_a_restart_that_finds_scratch_ahead_of_persistent(tmp_path: Path, redundancy: str) -> None:
    """Step 3 reached scratch but not the persistent level (its record there is gone: a
    flush that never finished); the next job rewinds to 1: the open hands step 3 over, the
    rewind supersedes it, and every level stays readable."""
    program: list[dict[str, Any]] = [
        {"id": 1, "back": None, "saves": 3, "lose": "none"},
        {"id": 2, "back": 2, "saves": 3, "lose": "none", "unflushed": True},
    ]
    check(program, launch(tmp_path / "case", program, redundancy))


def test_the_model() -> None:
    program: list[dict[str, Any]] = [
        {"id": 1, "back": None, "saves": 3, "lose": "none"},
        {"id": 2, "back": 1, "saves": 1, "lose": "all"},
        {"id": 3, "back": 0, "saves": 2, "lose": "one"},
    ]
    assert expected(program) == [
        {"versions": [1, 2, 3], "newest": [3, 0]},
        {"versions": [1, 2, 3], "newest": [3, 2]},
        {"versions": [2, 3, 4, 5], "newest": [5, 2]},
    ]


# -- the ranks' side ------------------------------------------------------------------------------


def _node_of(rank: int, mode: str) -> int:
    return rank if mode in ("xor", "rs") else rank % 2  # XOR and RS sets: a node per rank


def _open(out: Path, comm: Any, mode: str) -> Any:
    import cryosnap
    from cryosnap.dist import MPICoordinator

    c = MPICoordinator(comm, timeout=60)
    node = _node_of(c.rank, mode)
    os.environ["CRYOSNAP_NODE"] = f"n{node}"
    partner: Any = {"none": False, "partner": True, "xor": "xor", "rs": "rs:2+2"}[mode]
    return cryosnap.Checkpointer(
        out / "persistent",
        scratch=out / f"node-{node}",
        keep=KEEP,
        keep_scratch=KEEP_SCRATCH,
        comm=c,
        partner=partner,
        chunk_bytes=4096,
    )


def _session(
    out: Path, comm: Any, mode: str, session: dict[str, Any], trajectory: int, seen: dict[str, Any]
) -> int:
    """One session of the program; returns the trajectory it saved in."""
    rank = comm.Get_rank()
    with _open(out, comm, mode) as ckpt:
        steps = ckpt.steps()
        start = steps[-1] if steps else 0
        if session.get("damage") and steps:
            got = ckpt.restore()  # falls back past the damaged newest version
            seen["restored"] = got["step"]
            trajectory, start = session["id"], got["step"]
        elif session["back"] is not None and steps:
            fork = steps[max(0, len(steps) - 1 - session["back"])]
            got = ckpt.restore(step=fork)
            assert got["step"] == fork
            trajectory = got["trajectory"]
            if fork != steps[-1] and not session.get("same"):
                trajectory = session["id"]  # else the program recomputes the same states
            start = fork
        for i in range(session["saves"]):
            step = start + 1 + i
            ckpt.save(step, state(rank, step, trajectory), replicated=["model"]).result()
    return trajectory


def _check(out: Path, comm: Any, mode: str) -> dict[str, Any]:
    """What a user sees with this rank's scratch lost: every level verified, and the newest
    version restored from the persistent level alone."""
    import cryosnap
    from cryosnap.dist import MPICoordinator

    rank = comm.Get_rank()
    node = _node_of(rank, mode)
    report = cryosnap.Run(out / "persistent").verify()
    seen: dict[str, Any] = {
        "persistent_damaged": [f"{c.step}: {c.damage}" for c in report.damaged],
        "scratch_damaged": [],
    }
    own = out / f"node-{node}" / f"rank-{rank:05d}"
    if own.exists():
        seen["scratch_damaged"] = [
            f"{c.step}: {c.damage}" for c in cryosnap.Run(own).verify().damaged
        ]
    comm.Barrier()
    with cryosnap.Checkpointer(
        out / "persistent", comm=MPICoordinator(comm, timeout=60), keep=KEEP
    ) as alone:
        seen["steps"] = alone.steps()
        got = alone.restore() if seen["steps"] else None
    if got is None:
        seen["from_persistent"], seen["exact"] = None, True
    else:
        seen["from_persistent"] = [got["step"], got["trajectory"]]
        want = state(rank, got["step"], got["trajectory"])
        seen["exact"] = bool(
            np.array_equal(got["g"], want["g"]) and np.array_equal(got["model"], want["model"])
        )
    comm.Barrier()
    return seen


def _lose(out: Path, comm: Any, mode: str, lose: str) -> None:
    rank = comm.Get_rank()
    node = _node_of(rank, mode)
    comm.Barrier()
    # One rank per node removes the node's scratch (node 0 for "one").
    if rank == node and (lose == "all" or (lose == "one" and node == 0)):
        shutil.rmtree(out / f"node-{node}", ignore_errors=True)
    comm.Barrier()


def _break(out: Path, comm: Any, session: dict[str, Any]) -> None:
    """Before a session, on rank 0 (the files are all on this machine): the newest version's
    data damaged on every level, or its commit record gone from the persistent level."""
    from cryosnap import engine
    from cryosnap._format.keys import commit_key
    from cryosnap.storage import LocalStore

    comm.Barrier()
    persistent = LocalStore(out / "persistent")
    versions = engine.list_versions(persistent)
    if comm.Get_rank() == 0 and versions:
        newest = max(versions)
        if session.get("damage"):
            for path in out.rglob(f"data/{newest:012d}-*.dat"):
                with open(path, "r+b") as f:
                    f.seek(8)
                    byte = f.read(1)
                    f.seek(8)
                    f.write(bytes([byte[0] ^ 0xFF]))
        if session.get("unflushed"):
            (out / "persistent" / commit_key(newest, versions[newest])).unlink()
    comm.Barrier()


def main(out: Path) -> None:
    import warnings

    from mpi4py import MPI

    warnings.simplefilter("ignore")  # fallbacks warn; the checks say what matters
    comm = MPI.COMM_WORLD
    job = json.loads((out / "program.json").read_text())
    mode, trajectory, seen = job["mode"], 0, []
    for session in job["sessions"]:
        _lose(out, comm, mode, session["lose"])
        _break(out, comm, session)
        now: dict[str, Any] = {}
        trajectory = _session(out, comm, mode, session, trajectory, now)
        seen.append({**now, **_check(out, comm, mode)})
    (out / f"rank-{comm.Get_rank()}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
