"""cryosnap.testing.CountingCoordinator: SimulatedWorld's counters on another group's ranks.

The same body run on a SimulatedWorld and on an InProcessGroup wrapped in CountingCoordinator
counts the same, collective by collective and for whole Checkpointer saves; a coordinator that
keeps no counters says so with a CountersNotKeptError.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap.dist import Coordinator, InProcessGroup, LocalCoordinator
from cryosnap.errors import CoordinationError, CountersNotKeptError
from cryosnap.testing import (
    CountingCoordinator,
    RankCounters,
    SimulatedWorld,
    counters_of,
)

WORLD = 4


def _on_group(body: Callable[[Coordinator], Any], world: int = WORLD) -> list[RankCounters]:
    """``body`` on each rank of an InProcessGroup wrapped in CountingCoordinator; the counters."""
    group = InProcessGroup(world, timeout=30)
    coords = [CountingCoordinator(group.coordinator(r)) for r in range(world)]
    failed: list[BaseException] = []

    def main(c: CountingCoordinator) -> None:
        try:
            body(c)
        except BaseException as exc:  # re-raised below
            failed.append(exc)
            group.abort(str(exc))

    threads = [threading.Thread(target=main, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if failed:
        raise failed[0]
    assert all(not c.uncounted for c in coords)
    return [counters_of(c) for c in coords]


def _simulated(body: Callable[[Coordinator], Any], world: int = WORLD) -> list[RankCounters]:
    sim = SimulatedWorld(world, timeout=30)
    sim.run(body)
    return sim.all_counters()


def _collectives(c: Coordinator) -> None:
    c.all_gather({"rank": c.rank, "pad": "x" * (c.rank * 7)})
    root = c.world_size - 1
    c.broadcast(list(range(50)) if c.rank == root else None, root=root)
    c.barrier()
    side = c.channel("side")
    side.exchange({(c.rank + 1) % c.world_size: b"y" * (c.rank + 3), c.rank: b"self"})
    side.exchange({})
    c.channel("side").all_gather(c.rank)


@pytest.mark.parametrize("world", [1, 2, WORLD])
def test_each_collective_counts_as_the_simulated_world_counts(world: int) -> None:
    real = _on_group(_collectives, world)
    assert real == _simulated(_collectives, world)
    assert real[0].rounds == 6  # the channels' collectives add up on the rank


def _saves(run: Path) -> Callable[[Coordinator], None]:
    def body(c: Coordinator) -> None:
        model = np.arange(4096, dtype=np.float32)
        with cryosnap.Checkpointer(run, comm=c, chunk_bytes=4096, keep=2) as ckpt:
            for step in range(3):
                shard = np.full(32, c.rank * 1000 + step, dtype=np.int64)
                state = {"model": model + step, "shard": shard}
                ckpt.save(step, state, replicated=["model"]).result(timeout=30)
            ckpt.restore()

    return body


@pytest.mark.timeout(120)
def test_checkpointer_saves_count_as_on_the_simulated_world(tmp_path: Path) -> None:
    """Three saves, retention and a restore of 4 ranks: the same messages, bytes and rounds
    per rank through an InProcessGroup as on a SimulatedWorld (same path length: the paths
    the ranks tell each other are the same size)."""
    real = _on_group(_saves(tmp_path / "aaa" / "run"))
    simulated = _simulated(_saves(tmp_path / "bbb" / "run"))
    assert real == simulated
    assert min(c.rounds for c in real) > 3


def test_counters_reset_and_count_a_collective_a_newer_protocol_adds() -> None:
    class WithScatter(LocalCoordinator):
        def scatter(self, objs: list[Any] | None, *, root: int = 0) -> Any:
            assert objs is not None
            return objs[self.rank]

    c = CountingCoordinator(WithScatter())
    c.barrier()
    assert c.counters() == RankCounters(rounds=1)
    c.reset()
    assert c.counters() == RankCounters()
    assert c.gather("x") == ["x"]  # in the protocol: counted (nothing travels in a world of 1)
    assert c.counters().rounds == 1 and c.uncounted == frozenset()
    assert c.scatter(["y"]) == "y"
    assert c.counters().rounds == 2 and c.uncounted == {"scatter"}
    assert c.channel("a") is c.channel("a")
    assert c.inner.world_size == 1


@pytest.mark.parametrize("coord", [LocalCoordinator(), InProcessGroup(2).coordinator(0), "x"])
def test_counters_asked_of_a_group_that_keeps_none(coord: object) -> None:
    with pytest.raises(CountersNotKeptError, match="keeps no message counters: wrap") as err:
        counters_of(coord)
    assert isinstance(err.value, CoordinationError)


def test_only_a_coordinator_is_wrapped() -> None:
    with pytest.raises(TypeError, match="inner"):
        CountingCoordinator("comm")  # type: ignore[arg-type]
