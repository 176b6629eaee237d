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
from cryosnap.dist import Coordinator
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
    # rank 0: receives the broadcast, 1+3 barrier messages, 2+3+4 exchange bytes in 3 messages
    assert counted[0] == RankCounters(1, 1 + 3 + 3, sizes, size + 2 + 3 + 4 + sizes, 3)
    assert counted[2] == RankCounters(1 + 1 + 1, 3, size + 3 + sizes, sizes, 3)
    assert counted[3] == RankCounters(1 + 1, 1 + 3, 4 + sizes, size + sizes, 3)
    world.reset()
    assert world.counters(3) == RankCounters()
    assert world.leader_seconds == 0.0


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
    assert small.rounds == large.rounds == 6
    assert _within(small.max_sent_bytes_but_leader, large.max_sent_bytes_but_leader)
    assert _within(small.manifest_bytes_per_rank, large.manifest_bytes_per_rank)
    # Every rank restores its own part: more than the replicated model, which each reads whole.
    assert large.restore_read_bytes_per_rank > 4096 * 4


@pytest.mark.timeout(240)
@pytest.mark.xfail(
    strict=True,
    reason="#52 part 1 is not built: the save's all-gathers and the commit record are O(N) per "
    "rank (docs/PERFORMANCE.md, 'Coordination at scale')",
)
def test_what_a_rank_receives_and_reads_is_flat_in_n() -> None:
    small, large = _figures(8, 64)
    assert _within(small.max_received_bytes_but_leader, large.max_received_bytes_but_leader)
    assert _within(small.max_sent_bytes_per_rank, large.max_sent_bytes_per_rank)
    assert _within(small.metadata_bytes_per_rank, large.metadata_bytes_per_rank)
    assert _within(small.restore_read_bytes_per_rank, large.restore_read_bytes_per_rank)


@pytest.mark.deep
@pytest.mark.timeout(1800)
def test_per_rank_counts_at_64_and_512_ranks() -> None:
    small, large = _figures(64, 512)
    assert small.rounds == large.rounds == 6
    assert _within(small.max_sent_bytes_but_leader, large.max_sent_bytes_but_leader)
    assert _within(small.manifest_bytes_per_rank, large.manifest_bytes_per_rank)
    # Today's O(N) per rank, pinned so that the change to O(1) (#52 part 1) updates it: what a
    # rank receives, and the leader sends, grow with the world (8x the ranks: over 4x the bytes).
    assert large.max_received_bytes_but_leader > 4 * small.max_received_bytes_but_leader
    assert large.max_sent_bytes_per_rank > 4 * small.max_sent_bytes_per_rank
