"""cryosnap.testing.SimulatedWorld: the Coordinator protocol on N threads, and its counters.

Exact counts for known collectives (the logical model of RankCounters' docstring), the errors
of a rank that does not arrive or calls another collective, and real Checkpointer saves whose
per-rank counts the scale benchmark reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap.dist import Coordinator, agree
from cryosnap.errors import CoordinationError
from cryosnap.testing import RankCounters, SimulatedRank, SimulatedWorld
from cryosnap.testing._world import pickled


def _size(obj: Any) -> int:
    return len(pickled(obj))


def test_a_simulated_rank_is_a_coordinator() -> None:
    world = SimulatedWorld(3)
    assert isinstance(world.coordinator(2), Coordinator)
    assert isinstance(world.coordinator(0).channel("writer"), Coordinator)


def test_collectives_return_what_a_group_returns() -> None:
    def body(c: SimulatedRank) -> Any:
        gathered = c.all_gather({"rank": c.rank})
        root = c.broadcast(f"from {c.rank}", root=1)
        c.barrier()
        got = c.exchange({(c.rank + 1) % 4: bytes([c.rank]) * (c.rank + 1)})
        side = c.channel("side").all_gather(c.rank * 10)
        return gathered, root, got, side

    results = SimulatedWorld(4, timeout=10).run(body)
    for rank, (gathered, root, got, side) in enumerate(results):
        assert gathered == [{"rank": r} for r in range(4)]
        assert root == "from 1"
        src = (rank - 1) % 4
        assert got == {src: bytes([src]) * (src + 1)}
        assert side == [0, 10, 20, 30]


def test_all_gather_counts_one_send_and_every_other_ranks_bytes() -> None:
    world = SimulatedWorld(5, timeout=10)
    objs = [b"x" * (10 * r) for r in range(5)]
    world.run(lambda c: c.all_gather(objs[c.rank]))
    sizes = [_size(o) for o in objs]
    for rank, counted in enumerate(world.all_counters()):
        assert counted == RankCounters(
            messages_sent=1,
            messages_received=4,
            bytes_sent=sizes[rank],
            bytes_received=sum(sizes) - sizes[rank],
            rounds=1,
        )


def test_broadcast_barrier_and_exchange_counts() -> None:
    world = SimulatedWorld(4, timeout=10)
    payload = list(range(100))

    def body(c: SimulatedRank) -> None:
        c.broadcast(payload if c.rank == 2 else None, root=2)
        c.barrier()
        # rank r sends r+1 bytes to rank 0, and 7 bytes to itself (free)
        c.exchange({0: b"a" * (c.rank + 1), c.rank: b"b" * 7} if c.rank else {0: b"self"})

    world.run(body)
    size = _size(payload)
    counted = world.all_counters()
    sizes = 8 * 3  # the exchange's all-to-all of int64 sizes, each way
    # The broadcast's binary tree from rank 2: 2 -> 3, 0; 3 -> 1. The barrier's from rank 0:
    # every rank sends rank 0 one message, then 0 -> 1, 2; 1 -> 3.
    # rank 0: receives the broadcast; 3 barrier messages in, 2 out; 2+3+4 exchange bytes in 3
    assert counted[0] == RankCounters(2, 1 + 3 + 3, sizes, size + 2 + 3 + 4 + sizes, 3)
    assert counted[1] == RankCounters(1 + 1 + 1, 1 + 1, 2 + sizes, size + sizes, 3)
    assert counted[2] == RankCounters(2 + 1 + 1, 1, 2 * size + 3 + sizes, sizes, 3)
    assert counted[3] == RankCounters(1 + 1 + 1, 1 + 1, size + 4 + sizes, size + sizes, 3)
    world.reset()
    assert world.counters(3) == RankCounters()
    assert world.leader_seconds == 0.0


def test_gather_counts_one_send_per_rank_and_everything_on_the_root() -> None:
    world = SimulatedWorld(5, timeout=10)
    objs = [b"x" * (10 * r) for r in range(5)]
    got = world.run(lambda c: c.gather(objs[c.rank], root=3))
    assert got == [None, None, None, objs, None]
    sizes = [_size(o) for o in objs]
    counted = world.all_counters()
    for rank in (0, 1, 2, 4):
        assert counted[rank] == RankCounters(1, 0, sizes[rank], 0, 1)
    assert counted[3] == RankCounters(0, 4, 0, sum(sizes) - sizes[3], 1)


def test_a_broadcast_is_a_tree_no_rank_sends_more_than_two_copies() -> None:
    world = SimulatedWorld(100, timeout=60)
    payload = b"y" * 1000
    got = world.run(lambda c: c.broadcast(payload if c.rank == 7 else None, root=7))
    assert got == [payload] * 100
    size = _size(payload)
    counted = world.all_counters()
    assert max(c.bytes_sent for c in counted) == 2 * size
    assert all(c.bytes_received == size for r, c in enumerate(counted) if r != 7)
    # Every rank but the root receives exactly once: 99 copies sent in all.
    assert sum(c.messages_sent for c in counted) == 99
    assert counted[7].bytes_received == 0


def test_agree_decides_on_the_leader_and_tells_everyone() -> None:
    world = SimulatedWorld(16, timeout=60)
    got = world.run(lambda c: agree(c, c.rank * 3, max))
    assert got == [45] * 16
    counted = world.all_counters()
    # Each rank but the leader sends its value once and receives the decision once.
    assert all(c.messages_received == 1 and c.rounds == 2 for c in counted[1:])
    assert counted[0].messages_received == 15


def test_a_decision_the_leader_cannot_make_fails_on_every_rank() -> None:
    world = SimulatedWorld(4, timeout=30)

    def decide(values: list[Any]) -> Any:
        raise ValueError("no quorum")

    def body(c: SimulatedRank) -> str:
        try:
            agree(c, c.rank, decide)
        except CoordinationError as exc:
            return str(exc)
        except ValueError as exc:
            return f"leader: {exc}"
        return "decided"

    told = world.run(body)
    assert told[0] == "leader: no quorum"
    assert all("could not decide: ValueError: no quorum" in t for t in told[1:])


def test_a_world_of_one_communicates_nothing() -> None:
    world = SimulatedWorld(1)
    [result] = world.run(lambda c: (c.all_gather(1), c.broadcast(2), c.exchange({0: b"me"})))
    assert result == ([1], 2, {0: b"me"})
    assert world.counters(0) == RankCounters(rounds=3)


def test_a_rank_that_does_not_arrive_is_a_coordination_error() -> None:
    world = SimulatedWorld(3, timeout=0.3)

    def body(c: SimulatedRank) -> Any:
        return None if c.rank == 2 else c.all_gather(c.rank)

    with pytest.raises(CoordinationError, match=r"rank\(s\) \[2\] did not arrive within 0.3 s"):
        world.run(body)


def test_ranks_calling_different_collectives_fail_on_every_rank() -> None:
    world = SimulatedWorld(3, timeout=30)

    def body(c: SimulatedRank) -> Any:
        try:
            return c.barrier() if c.rank == 1 else c.all_gather(c.rank)
        except CoordinationError as exc:
            return str(exc)

    told = world.run(body)
    assert all("called" in t and "where another rank called" in t for t in told)


def test_a_failing_rank_aborts_the_others_and_is_raised() -> None:
    world = SimulatedWorld(4, timeout=30)

    def body(c: SimulatedRank) -> None:
        if c.rank == 3:
            raise ValueError("boom")
        c.barrier()

    with pytest.raises(ValueError, match="boom"):
        world.run(body)
    with pytest.raises(CoordinationError, match="aborted: rank 3 failed: ValueError: boom"):
        world.coordinator(0).barrier()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="ranks"):
        SimulatedWorld(0)
    world = SimulatedWorld(2)
    with pytest.raises(ValueError, match="rank"):
        world.coordinator(2)
    with pytest.raises(ValueError, match="root"):
        world.coordinator(0).broadcast(1, root=5)
    with pytest.raises(ValueError, match="root"):
        world.coordinator(0).gather(1, root=2)
    with pytest.raises(ValueError, match="destination rank"):
        world.coordinator(0).exchange({9: b""})


@pytest.mark.timeout(120)
def test_checkpointer_saves_are_counted_per_rank(tmp_path: Path) -> None:
    """Every rank of a real save takes part in the same collectives; the leader's CPU is
    measured; and the restore reads each rank's own part back."""
    world = SimulatedWorld(6, timeout=60)
    model = np.arange(2048, dtype=np.float32)

    def body(c: SimulatedRank) -> Any:
        with cryosnap.Checkpointer(tmp_path / "run", comm=c, chunk_bytes=4096) as ckpt:
            state = {"model": model, "own": np.full(16, c.rank)}
            ckpt.save(1, state, replicated=["model"]).result()
            return ckpt.restore()

    restored = world.run(body)
    for rank, state in enumerate(restored):
        np.testing.assert_array_equal(state["own"], np.full(16, rank))
        np.testing.assert_array_equal(state["model"], model)
    counted = world.all_counters()
    assert len({c.rounds for c in counted}) == 1 and counted[0].rounds > 0
    assert all(c.bytes_received > 0 for c in counted)
    assert world.leader_seconds > 0


# -- the scale workload: per-rank costs against the world size ------------------------------


def _within(small: float, large: float, fraction: float = 0.10) -> bool:
    return abs(large - small) <= fraction * small


def _figures(*worlds: int) -> list[Any]:
    from cryosnap.bench._scale import measure_scale

    return [measure_scale(n) for n in worlds]


@pytest.mark.timeout(240)
def test_what_a_rank_sends_and_the_rounds_of_a_save_are_flat_in_n() -> None:
    small, large = _figures(8, 64)
    assert small.rounds == large.rounds == 7
    assert _within(small.max_sent_bytes_but_leader, large.max_sent_bytes_but_leader)
    assert _within(small.manifest_bytes_per_rank, large.manifest_bytes_per_rank)
    # Every rank restores its own part and at most its share of the replicated model (read
    # once in the job, _run/read_once.py): less than the model, which it no longer reads whole.
    assert 4096 < large.restore_read_bytes_per_rank < 4096 * 4


@pytest.mark.timeout(240)
def test_what_a_rank_receives_and_reads_is_flat_in_n() -> None:
    """#52 part 1: gathers to the leader and tree broadcasts, and the commit record handed
    out by rank: every rank but the leader receives, reads and restores O(1) in N."""
    small, large = _figures(8, 64)
    assert _within(small.max_received_bytes_but_leader, large.max_received_bytes_but_leader)
    assert _within(small.max_sent_bytes_per_rank, large.max_sent_bytes_per_rank)
    assert _within(small.metadata_bytes_per_rank, large.metadata_bytes_per_rank)
    assert _within(small.restore_read_bytes_per_rank, large.restore_read_bytes_per_rank)


@pytest.mark.deep
@pytest.mark.timeout(1800)
def test_per_rank_counts_at_64_and_512_ranks() -> None:
    small, large = _figures(64, 512)
    assert small.rounds == large.rounds == 7
    assert _within(small.max_sent_bytes_but_leader, large.max_sent_bytes_but_leader)
    assert _within(small.manifest_bytes_per_rank, large.manifest_bytes_per_rank)
    # O(1) per rank (#52 part 1): what a rank receives, what any rank (the leader included)
    # sends, its metadata and its restore's reads do not grow with the world.
    assert _within(small.max_received_bytes_but_leader, large.max_received_bytes_but_leader)
    assert _within(small.max_sent_bytes_per_rank, large.max_sent_bytes_per_rank)
    assert _within(small.metadata_bytes_per_rank, large.metadata_bytes_per_rank)
    assert _within(small.restore_read_bytes_per_rank, large.restore_read_bytes_per_rank)
    # The leader's share is O(N), as designed: it receives every rank's part summary.
    assert large.max_received_bytes_per_rank > 4 * small.max_received_bytes_per_rank
