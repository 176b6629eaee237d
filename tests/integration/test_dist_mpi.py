"""MPICoordinator with real processes: ``mpiexec -n N python test_dist_mpi.py SCENARIO OUT_DIR``.

mpiexec is MPICH's, from the ``mpich`` wheel (installed into the virtualenv's bin by
requirements-dev.txt), and mpi4py finds that library at run time. Each rank writes what it saw
to ``OUT_DIR/rank-N.json`` and the test checks it; a scenario that raises fails the job.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve()
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT = 30.0  # collectives of the healthy scenarios (a hang guard, never reached)
SHORT = 0.5  # collectives that are meant to time out


def launch(scenario: str, world: int, out: Path) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` MPI ranks; what each rank reported, by rank."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (requirements-dev.txt)")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}: the mpich wheel is not installed")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(MPIEXEC), "-n", str(world), sys.executable, str(HERE), scenario, str(out)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        log = proc.communicate(timeout=180)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, f"mpiexec exited {proc.returncode}:\n{log}"
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def state_of(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(rank)
    w = rng.standard_normal(16 << 10).astype(np.float32)
    w[: 1024 * (step % 4)] += step  # a sparse change per step: incremental versions
    return {"w": w, "rank": rank, "step": step}


# What each rank receives in the "exchange" scenario, by channel: (source, bytes) by receiver.
# Rank 0 sends 64 MiB + 3 bytes (callers window large files at 64 MiB); rank 2 sends to both
# others; on "bytes", one payload is empty and rank 1 sends to itself.
BIG = (64 << 20) + 3
EXCHANGED = {
    "main": [[(2, 5000)], [(0, BIG), (2, 7)], [(1, 1000)]],
    "bytes": [[(1, 10)], [(1, 3), (2, 20)], [(0, 0)]],
}


def payload(src: int, dst: int, nbytes: int) -> bytes:
    """A deterministic payload of its own for each (source, destination) pair."""
    return np.random.default_rng([src, dst]).bytes(nbytes)


def digest(data: bytes) -> list[Any]:
    return [len(data), hashlib.sha256(data).hexdigest()]


# -- the tests ----------------------------------------------------------------------------------


def test_collectives_of_three_ranks(tmp_path: Path) -> None:
    results = launch("collectives", 3, tmp_path)
    for rank, got in enumerate(results):
        assert got["rank"] == rank and got["world"] == 3
        assert got["gathered"] == [{"rank": r, "pad": "x" * r} for r in range(3)]
        assert got["root"] == "from 1"
        # gather: everything on the root (unequal lengths, its own included), None elsewhere
        expected = [{"rank": r, "pad": "y" * (3 - r)} for r in range(3)] if rank == 2 else None
        assert got["gathered_to_2"] == expected
        assert got["agreed"] == 2 * 3
        assert got["side"] == [0, 10, 20] and got["cached"] is True
        # Two threads, each on its own channel, in opposite orders on different ranks.
        assert got["threads"] == {"a": [0, 1, 2], "b": [0, -1, -2]}
        assert "JSON-like" in got["not_json"]


def test_exchange_of_three_ranks(tmp_path: Path) -> None:
    results = launch("exchange", 3, tmp_path)
    for rank, got in enumerate(results):
        for channel in ("main", "bytes"):
            expected = {str(s): digest(payload(s, rank, n)) for s, n in EXCHANGED[channel][rank]}
            assert got[channel] == expected, (rank, channel)
        assert got["after"] == [0, 1, 2]


def test_a_rank_that_never_arrives_is_an_error_on_the_others(tmp_path: Path) -> None:
    survivor, _ = launch("absent", 2, tmp_path)
    assert survivor["absent"] == (
        "CoordinationError: rank 0: barrier 1 on MPI channel 'main/late' did not complete "
        f"within {SHORT:g} s (a participant hangs or did not arrive)"
    )
    assert survivor["absent_exchange"] == (
        "CoordinationError: rank 0: exchange 1 on MPI channel 'main/late-bytes' did not "
        f"complete within {SHORT:g} s (a participant hangs or did not arrive)"
    )


@pytest.mark.parametrize("world", [2, 4])
def test_a_checkpointer_on_every_rank(tmp_path: Path, world: int) -> None:
    import cryosnap
    from cryosnap import engine
    from cryosnap.storage import LocalStore

    results = launch("checkpointer", world, tmp_path)
    run = tmp_path / "run"
    assert engine.list_steps(LocalStore(run)) == [3, 4, 5]
    assert engine.read_commit(LocalStore(run), 5).world_size == world
    for rank, got in enumerate(results):
        assert got["due"] == [0, 2, 4, 5]  # rank 0's policy (every 2), rank 1 preempted at 5
        assert got["incremental"][-1] and not got["incremental"][0]
        assert got["restored"] == 5
        assert "already open for writing" in got["second_writer"]
        for step in (3, 4, 5):
            part = cryosnap.load(run, step=step, rank=rank)
            np.testing.assert_array_equal(part["w"], state_of(rank, step)["w"])


def test_xor_parity_rebuilds_a_wiped_node(tmp_path: Path) -> None:
    """``partner="xor"`` on 4 MPI ranks, each on a "node" of its own ($CRYOSNAP_NODE): node 1's
    scratch is wiped and the persistent level lacks the newest version; at the next open rank 1
    gets its part back from the other three's files and parity, and every rank restores it."""
    import shutil

    from cryosnap._format.keys import commit_key

    launch("xor_save", 4, tmp_path)
    shutil.rmtree(tmp_path / "node-1")
    (tmp_path / "run" / commit_key(3)).unlink()
    for rank, got in enumerate(launch("xor_restore", 4, tmp_path)):
        assert got["scratch"] == [2, 3]
        assert got["restored"] == digest(state_of(rank, 3)["w"].tobytes())


@pytest.mark.deep
def test_rs_parity_rebuilds_two_wiped_nodes(tmp_path: Path) -> None:
    """``partner="rs:2+2"`` on 4 MPI ranks, each on a "node" of its own: nodes 1 and 3 are
    wiped (M = 2 of the set) and the persistent level lacks the newest version; at the next
    open both get their parts back, decoded from the other two's files and parity."""
    import shutil

    from cryosnap._format.keys import commit_key

    pytest.importorskip("zfec", reason="zfec is not installed (the rs extra)")
    launch("rs_save", 4, tmp_path)
    for n in (1, 3):
        shutil.rmtree(tmp_path / f"node-{n}")
    (tmp_path / "run" / commit_key(3)).unlink()
    for rank, got in enumerate(launch("rs_restore", 4, tmp_path)):
        assert got["scratch"] == [2, 3]
        assert got["restored"] == digest(state_of(rank, 3)["w"].tobytes())


# -- the ranks' side ------------------------------------------------------------------------------


def _collectives(comm: Any) -> dict[str, Any]:
    import threading

    from cryosnap.dist import MPICoordinator, agree

    c = MPICoordinator(comm, timeout=TIMEOUT)
    rank = c.rank
    got: dict[str, Any] = {"rank": rank, "world": c.world_size}
    got["gathered"] = c.all_gather({"rank": rank, "pad": "x" * rank})  # unequal lengths
    got["root"] = c.broadcast(f"from {rank}", root=1)
    got["gathered_to_2"] = c.gather({"rank": rank, "pad": "y" * (3 - rank)}, root=2)
    got["agreed"] = agree(c, rank * 3, max)
    c.barrier()
    side = c.channel("side")
    got["side"] = side.all_gather(rank * 10)
    got["cached"] = c.channel("side") is side
    a, b = c.channel("a"), c.channel("b")
    threads: dict[str, Any] = {}

    def on_a() -> None:
        threads["a"] = a.all_gather(rank)

    # Rank 0 starts "b" first, the others "a": one shared communicator would match them wrongly.
    t = threading.Thread(target=on_a)
    if rank != 0:
        t.start()
    threads["b"] = b.all_gather(-rank)
    if rank == 0:
        t.start()
    t.join()
    got["threads"] = threads
    try:
        c.all_gather(object())
    except TypeError as exc:
        got["not_json"] = str(exc)
    return got


def _exchange(comm: Any) -> dict[str, Any]:
    from cryosnap.dist import MPICoordinator

    c = MPICoordinator(comm, timeout=TIMEOUT)
    rank = c.rank
    side = c.channel("bytes")
    got: dict[str, Any] = {}
    for channel, coord in (("main", c), ("bytes", side)):
        sends = {
            dst: payload(src, dst, n)
            for dst, senders in enumerate(EXCHANGED[channel])
            for src, n in senders
            if src == rank
        }
        if rank == 1:  # a writable buffer, as well as bytes
            sends = {dst: bytearray(data) for dst, data in sends.items()}
        received = coord.exchange(sends)
        got[channel] = {str(src): digest(data) for src, data in received.items()}
    got["after"] = c.all_gather(rank)  # the exchange was one collective on each channel
    return got


def _absent(comm: Any) -> dict[str, Any]:
    from cryosnap.dist import MPICoordinator
    from cryosnap.errors import CoordinationError

    c = MPICoordinator(comm, timeout=TIMEOUT)
    late, late_bytes, done = c.channel("late"), c.channel("late-bytes"), c.channel("done")
    got: dict[str, Any] = {}
    if c.rank == 0:
        try:
            late.barrier(timeout=SHORT)
        except CoordinationError as exc:
            got["absent"] = f"CoordinationError: {exc}"
        try:
            late_bytes.exchange({1: b"for a rank that never comes"}, timeout=SHORT)
        except CoordinationError as exc:
            got["absent_exchange"] = f"CoordinationError: {exc}"
    done.barrier()  # rank 1 never enters the barrier on "late"
    return got


def _checkpointer(comm: Any) -> dict[str, Any]:
    import cryosnap
    from cryosnap.dist import MPICoordinator
    from cryosnap.errors import CheckpointError
    from cryosnap.policy import EveryNSteps

    rank = comm.Get_rank()
    run = Path(sys.argv[2]) / "run"
    got: dict[str, Any] = {"due": [], "incremental": []}
    policy = EveryNSteps(2 if rank == 0 else 100)
    c = MPICoordinator(comm, timeout=TIMEOUT)
    with cryosnap.Checkpointer(run, comm=c, chunk_bytes=4096, keep=3, policy=policy) as ckpt:
        for step in range(6):
            if rank == 1 and step == 5:
                ckpt.preempted = True
            if ckpt.should_save(step):
                got["due"].append(step)
            # Every rank saves every step (the agreement above is checked, not used).
            info = ckpt.save(step, state_of(rank, step)).result(timeout=TIMEOUT)
            got["incremental"].append(info.incremental)
        try:
            cryosnap.Checkpointer(run, comm=MPICoordinator(comm, timeout=TIMEOUT))
        except CheckpointError as exc:
            got["second_writer"] = str(exc)
    with cryosnap.Checkpointer(run, comm=MPICoordinator(comm, timeout=TIMEOUT)) as ckpt:
        restored = ckpt.restore()
        assert restored["rank"] == rank
        got["restored"] = int(restored["step"])
    return got


def _xor(comm: Any, *, save: bool, partner: str = "xor") -> dict[str, Any]:
    import cryosnap
    from cryosnap.dist import MPICoordinator

    rank = comm.Get_rank()
    out = Path(sys.argv[2])
    os.environ["CRYOSNAP_NODE"] = f"node-{rank}"  # one "node" per rank
    c = MPICoordinator(comm, timeout=TIMEOUT)
    got: dict[str, Any] = {}
    with cryosnap.Checkpointer(
        out / "run", scratch=out / f"node-{rank}", comm=c, partner=partner, chunk_bytes=4096
    ) as ckpt:
        if save:
            for step in (1, 2, 3):
                ckpt.save(step, state_of(rank, step)).result(timeout=TIMEOUT)
        else:
            got["scratch"] = list(ckpt.status().steps["scratch"])
            got["restored"] = digest(np.asarray(ckpt.restore()["w"]).tobytes())
    return got


def main(scenario: str, out: Path) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    scenarios = {
        "collectives": _collectives,
        "exchange": _exchange,
        "absent": _absent,
        "checkpointer": _checkpointer,
        "xor_save": lambda comm: _xor(comm, save=True),
        "xor_restore": lambda comm: _xor(comm, save=False),
        "rs_save": lambda comm: _xor(comm, save=True, partner="rs:2+2"),
        "rs_restore": lambda comm: _xor(comm, save=False, partner="rs:2+2"),
    }
    got = scenarios[scenario](comm)
    (out / f"rank-{comm.Get_rank()}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
