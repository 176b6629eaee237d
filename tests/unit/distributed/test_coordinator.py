"""The Coordinator seam: collectives, and a Checkpointer driven by several participants.

The participants are threads of this process (``cryosnap.dist.InProcessGroup``): every
orchestration decision that ranks must agree on goes through the coordinator, so these tests
prove the seam that torch.distributed and MPI coordinators plug into.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._format.keys import manifest_key
from cryosnap.dist import Coordinator, InProcessGroup, LocalCoordinator, agree
from cryosnap.errors import CheckpointError, CoordinationError, StorageError
from cryosnap.policy import EveryNSteps
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore


def run_ranks(
    world: int, body: Callable[[Coordinator], Any], *, timeout: float = 30.0
) -> list[Any]:
    """Run ``body(coordinator)`` on ``world`` threads; their results by rank (errors raised)."""
    group = InProcessGroup(world, timeout=timeout)
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def main(rank: int) -> None:
        try:
            results[rank] = body(group.coordinator(rank))
        except BaseException as exc:
            errors[rank] = exc
            group.abort(f"rank {rank} failed: {exc}")

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def state_of(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(rank)
    w = rng.standard_normal(32 << 10).astype(np.float32)
    w[: 1024 * (step % 4)] += step  # a sparse change per step: incremental versions
    return {"w": w, "rank": rank, "step": step}


# -- collectives ------------------------------------------------------------------------------


def test_collectives_of_a_group() -> None:
    def body(c: Coordinator) -> Any:
        gathered = c.all_gather({"rank": c.rank})
        root = c.broadcast(f"from {c.rank}", root=1)
        c.barrier()
        other = c.channel("side").all_gather(c.rank * 10)
        return gathered, root, other

    for gathered, root, other in run_ranks(3, body):
        assert gathered == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert root == "from 1"
        assert other == [0, 10, 20]


def test_gather_gives_everything_to_the_root_only() -> None:
    def body(c: Coordinator) -> Any:
        return c.gather({"rank": c.rank}, root=2), agree(c, c.rank + 1, sum)

    results = run_ranks(3, body)
    assert [r[0] for r in results] == [None, None, [{"rank": 0}, {"rank": 1}, {"rank": 2}]]
    assert [r[1] for r in results] == [6, 6, 6]


def test_a_gather_missing_a_participant_is_an_error_on_the_root() -> None:
    group = InProcessGroup(2)
    with pytest.raises(CoordinationError, match=r"rank\(s\) \[1\] did not arrive"):
        group.coordinator(0).gather("x", timeout=0.2)
    with pytest.raises(ValueError, match="root"):
        group.coordinator(0).gather("x", root=2)


def test_a_missing_participant_is_an_error_not_a_hang() -> None:
    group = InProcessGroup(2)
    with pytest.raises(CoordinationError, match=r"rank\(s\) \[1\] did not arrive"):
        group.coordinator(0).barrier(timeout=0.2)


def test_abort_fails_waiting_collectives() -> None:
    group = InProcessGroup(2)
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            group.coordinator(0).all_gather(1)
        except CoordinationError as exc:
            caught.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    group.abort("rank 1 crashed")
    t.join(30)
    assert caught and "rank 1 crashed" in str(caught[0])


def test_values_are_copied_between_participants() -> None:
    def body(c: Coordinator) -> Any:
        mine = {"items": [c.rank]}
        out = c.all_gather(mine)
        out[0]["items"].append("changed")
        return mine

    assert run_ranks(2, body) == [{"items": [0]}, {"items": [1]}]


def test_local_coordinator_is_a_world_of_one() -> None:
    c = LocalCoordinator()
    assert (c.rank, c.world_size) == (0, 1)
    assert c.all_gather(5) == [5] and c.broadcast("x") == "x" and c.channel("a") is c
    assert c.gather(7) == [7] and agree(c, 3, max) == 3
    with pytest.raises(ValueError, match="root=1"):
        c.gather(1, root=1)
    c.barrier()
    with pytest.raises(ValueError, match="root=1"):
        c.broadcast(1, root=1)
    assert isinstance(c, Coordinator)


def test_exchange_in_a_ring_and_to_one_rank() -> None:
    def body(c: Coordinator) -> Any:
        nxt = (c.rank + 1) % c.world_size
        ring = c.exchange({nxt: bytes([c.rank]) * (1000 + c.rank)})
        # Every rank to rank 0, in three kinds of buffer; rank 2's payload is empty.
        kinds: list[bytes | bytearray | memoryview] = [b"zero", bytearray(b"one"), memoryview(b"")]
        many = c.channel("side").exchange({0: kinds[c.rank]})
        nothing = c.exchange({})
        return ring, many, nothing

    results = run_ranks(3, body)
    for rank, (ring, _, nothing) in enumerate(results):
        prev = (rank - 1) % 3
        assert ring == {prev: bytes([prev]) * (1000 + prev)}
        assert nothing == {}
    assert results[0][1] == {0: b"zero", 1: b"one", 2: b""}
    assert all(type(v) is bytes for v in results[0][1].values())
    assert results[1][1] == results[2][1] == {}


def test_exchange_counts_as_one_collective_and_keeps_payloads_apart() -> None:
    def body(c: Coordinator) -> Any:
        sent = bytearray(b"mine")
        got = c.exchange({1 - c.rank: sent, c.rank: memoryview(sent)[1:3]})
        sent[:] = b"XXXX"  # the receiver's bytes are its own
        return got, c.all_gather(c.rank)

    (got0, gathered0), (got1, _) = run_ranks(2, body)
    assert got0 == {0: b"in", 1: b"mine"} and got1 == {0: b"mine", 1: b"in"}
    assert gathered0 == [0, 1]


def test_exchange_with_a_rank_that_never_arrives() -> None:
    def body(c: Coordinator) -> str | None:
        if c.rank == 2:
            return None  # never calls exchange
        with pytest.raises(CoordinationError) as info:
            c.exchange({1 - c.rank: b"x"}, timeout=0.2)
        return str(info.value)

    for message in run_ranks(3, body)[:2]:
        assert "collective 1 on channel 'main': rank(s) [2] did not arrive" in message


def test_exchange_checks_its_arguments_before_communicating() -> None:
    group = InProcessGroup(2)
    c = group.coordinator(0)
    with pytest.raises(ValueError, match="destination rank=2 is invalid"):
        c.exchange({2: b"x"})
    with pytest.raises(ValueError, match="destination rank=-1 is invalid"):
        c.exchange({-1: b"x"})
    with pytest.raises(TypeError, match=r"sends\[1\] must be bytes, bytearray or memoryview"):
        c.exchange({1: "text"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="sends must be a mapping"):
        c.exchange([b"x"])  # type: ignore[arg-type]
    # Nothing was issued: the next collective is still number 1.
    with pytest.raises(CoordinationError, match="collective 1 "):
        c.barrier(timeout=0.05)


def test_local_coordinator_exchanges_with_itself_only() -> None:
    c = LocalCoordinator()
    data = b"payload"
    assert c.exchange({}) == {}
    assert c.exchange({0: data})[0] is data  # bytes are immutable: returned as is
    assert c.exchange({0: bytearray(b"ab")}) == {0: b"ab"}
    assert c.exchange({0: memoryview(b"")}) == {0: b""}
    assert c.exchange({0: np.arange(6, dtype=np.uint8)[::2]}) == {0: b"\x00\x02\x04"}
    with pytest.raises(ValueError, match="destination rank=1 is invalid"):
        c.exchange({1: b"x"})
    with pytest.raises(TypeError, match=r"sends\[0\] must be bytes"):
        c.exchange({0: 5})  # type: ignore[dict-item]


def test_bad_comm_and_bad_group_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"comm must be None or a cryosnap\.dist\.Coordinator"):
        cryosnap.Checkpointer(tmp_path, comm="gloo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        InProcessGroup(0)
    with pytest.raises(ValueError, match="rank=2"):
        InProcessGroup(2).coordinator(2)


# -- a Checkpointer with several participants -----------------------------------------------


def test_every_rank_saves_its_part_and_rank_0_commits(tmp_path: Path) -> None:
    def body(c: Coordinator) -> Any:
        infos = []
        with cryosnap.Checkpointer(tmp_path, comm=c, chunk_bytes=4096, keep=3) as ckpt:
            for step in range(6):
                infos.append(ckpt.save(step, state_of(c.rank, step)).result(timeout=60))
            restored = ckpt.restore()
        return infos, restored

    results = run_ranks(3, body)
    store = LocalStore(tmp_path)
    assert engine.list_steps(store) == [3, 4, 5]
    record = engine.read_commit(store, 5)
    assert record.world_size == 3
    assert [m.key for m in record.manifests] == [manifest_key(5, r) for r in range(3)]
    for rank, (infos, restored) in enumerate(results):
        # Each rank's SaveInfo counts what it wrote itself; later versions are incremental.
        assert infos[0].written_bytes >= (32 << 12) and not infos[0].incremental
        assert infos[5].incremental and infos[5].written_bytes < infos[0].written_bytes
        assert restored["rank"] == rank and restored["step"] == 5
        for step in (3, 4, 5):
            got = cryosnap.load(tmp_path, step=step, rank=rank)
            np.testing.assert_array_equal(got["w"], state_of(rank, step)["w"])
    # Retention was decided once and every rank's index forgot the deleted files: every data
    # file left is needed by a kept version, and the kept versions load (checked above).
    kept = [engine.read_commit(store, s) for s in (3, 4, 5)]
    assert set(store.list("data")) == {f for r in kept for f in r.data_files}


def test_a_rank_that_fails_its_part_stops_the_commit_on_every_rank(tmp_path: Path) -> None:
    def body(c: Coordinator) -> Any:
        def fault(op: str, key: str) -> None:
            if c.rank == 1 and op == "open_writer" and key.startswith("data/000000000001"):
                raise StorageError("injected: rank 1 cannot write its part of step 1")

        store = FaultyStore(LocalStore(tmp_path), fault=fault)
        with cryosnap.Checkpointer(store, comm=c, chunk_bytes=4096) as ckpt:
            ckpt.save(0, state_of(c.rank, 0)).result(timeout=60)
            with pytest.raises(CheckpointError) as failed:
                ckpt.save(1, state_of(c.rank, 1)).result(timeout=60)
            ckpt.save(2, state_of(c.rank, 2)).result(timeout=60)
            return str(failed.value), ckpt.steps()

    (msg0, steps0), (msg1, steps1) = run_ranks(2, body)
    assert "rank 1: " in msg0 and "injected" in msg0  # rank 0 learns why it did not commit
    assert "injected" in msg1
    assert steps0 == steps1 == [0, 2]
    got = cryosnap.load(tmp_path, step=2, rank=1)
    np.testing.assert_array_equal(got["w"], state_of(1, 2)["w"])


def test_should_save_is_the_same_on_every_rank(tmp_path: Path) -> None:
    def body(c: Coordinator) -> list[int]:
        # Only rank 0's policy counts; rank 1 is preempted at step 5.
        policy = EveryNSteps(3 if c.rank == 0 else 100)
        due = []
        with cryosnap.Checkpointer(tmp_path, comm=c, policy=policy) as ckpt:
            for step in range(8):
                if c.rank == 1 and step == 5:
                    ckpt.preempted = True
                if ckpt.should_save(step):
                    due.append(step)
                    ckpt.save(step, {"s": step, "r": c.rank}).result(timeout=60)
        return due

    first, second = run_ranks(2, body)
    assert first == second == [0, 3, 5, 6, 7]


def test_restore_agrees_on_a_step_every_rank_can_read(tmp_path: Path) -> None:
    def save(c: Coordinator) -> None:
        with cryosnap.Checkpointer(tmp_path, comm=c, chunk_bytes=4096, incremental=False) as ck:
            for step in range(3):
                ck.save(step, state_of(c.rank, step)).result(timeout=60)

    run_ranks(2, save)
    # Rank 1's part of the newest version is damaged: both ranks resume from step 1.
    record = engine.read_commit(LocalStore(tmp_path), 2)
    victim = next(f for f in record.data_files if "-r00001-" in f)
    path = tmp_path / victim
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))

    def restore(c: Coordinator) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with cryosnap.Checkpointer(tmp_path, comm=c) as ckpt:
                return int(ckpt.restore()["step"])

    assert run_ranks(2, restore) == [1, 1]


def test_the_lock_is_taken_once_for_every_rank(tmp_path: Path) -> None:
    holder = cryosnap.Checkpointer(tmp_path)
    try:

        def body(c: Coordinator) -> str:
            with pytest.raises(CheckpointError, match="already open for writing") as info:
                cryosnap.Checkpointer(tmp_path, comm=c)
            return str(info.value)

        messages = run_ranks(2, body)
        assert messages[1].startswith("rank 1: the run's write lock")
    finally:
        holder.close()


def test_scratch_given_as_a_store_with_several_participants_is_refused_clearly(
    tmp_path: Path,
) -> None:
    # Each rank keeps its part under <scratch>/rank-<r>: a Store object has no such subpath.
    group = InProcessGroup(2)
    with pytest.raises(ValueError, match="not a Store"):
        cryosnap.Checkpointer(
            tmp_path / "p", scratch=LocalStore(tmp_path / "s"), comm=group.coordinator(0)
        )


def test_a_writer_whose_participants_stopped_agreeing_stops_saving(tmp_path: Path) -> None:
    # Rank 1 is stuck writing its part of step 1 past the collective timeout: rank 0's commit
    # agreement fails, and the channel is broken for good (as gloo's and MPI's are). Both
    # writers stop saving with a CoordinationError instead of timing out at every save.
    released = threading.Event()

    def body(c: Coordinator) -> Any:
        def fault(op: str, key: str) -> None:
            if c.rank == 1 and op == "writer.commit" and key.startswith("data/000000000001"):
                released.wait(30)

        store = FaultyStore(LocalStore(tmp_path), fault=fault)
        got: dict[str, str] = {}
        with cryosnap.Checkpointer(store, comm=c, chunk_bytes=4096) as ckpt:
            ckpt.save(0, state_of(c.rank, 0)).result(timeout=60)
            pending = ckpt.save(1, state_of(c.rank, 1))
            if c.rank == 0:
                with pytest.raises(CoordinationError):
                    pending.result(timeout=60)
                released.set()
            else:
                with pytest.raises(CheckpointError):
                    pending.result(timeout=60)
            with pytest.raises(CoordinationError, match="stopped saving") as stopped:
                ckpt.save(2, state_of(c.rank, 2))
            got["stopped"] = str(stopped.value)
        return got

    results = run_ranks(2, body, timeout=1.0)
    for got in results:
        assert "restart the job" in got["stopped"]
    assert engine.list_steps(LocalStore(tmp_path)) == [0]
