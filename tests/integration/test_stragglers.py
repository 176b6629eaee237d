"""A straggler (#52): one rank's storage is slow; only the commit waits for it, not the others.

The straggler's data file commits (FaultyStore's ``writer.commit``) block until every other
rank's ``save()`` has returned: if a rank's capture waited for the straggler's write, the two
would wait for each other and the straggler's wait would run out. What is asserted is the
order (the others returned, then the straggler wrote, then every rank's version was durable),
on a SimulatedWorld of 4 ranks and on 4 real gloo processes. bench/bench_stragglers.py measures
the times (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve()
WORLD = 4
STRAGGLER = 2
WAIT = 60.0  # how long the straggler waits for the others (a hang guard: they come at once)


def state_of(rank: int, step: int) -> dict[str, Any]:
    model = np.random.default_rng(0).standard_normal(1 << 15) + step
    own = np.random.default_rng(100 + rank).standard_normal(1 << 15) + step
    return {"model": model, "own": own}


def rank_body(
    coord: Any,
    run: Path,
    *,
    others_returned: Callable[[], bool],
    returned: Callable[[int], None],
    wrote: Callable[[], None],
    written: Callable[[], bool],
) -> dict[str, Any]:
    """One rank: a first version, then one whose data file the straggler writes only once the
    others' ``save()`` returned. What it saw, in order."""
    import cryosnap
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    rank = coord.rank
    got: dict[str, Any] = {"events": []}
    armed = threading.Event()

    def fault(op: str, key: str) -> None:
        if rank != STRAGGLER or not armed.is_set() or op != "writer.commit":
            return
        deadline = time.monotonic() + WAIT
        while not others_returned() and time.monotonic() < deadline:
            time.sleep(0.01)
        got["events"].append("straggler writes" if others_returned() else "straggler gave up")
        wrote()

    store = FaultyStore(LocalStore(run), fault=fault)
    with cryosnap.Checkpointer(store, comm=coord, chunk_bytes=4096) as ckpt:
        ckpt.save(1, state_of(rank, 1), replicated=["model"]).result(timeout=WAIT)
        armed.set()
        pending = ckpt.save(2, state_of(rank, 2), replicated=["model"])
        got["captured"] = pending.captured()
        got["events"].append("returned")
        if rank != STRAGGLER:
            returned(rank)
        pending.result(timeout=2 * WAIT)
        got["events"].append("durable after the straggler wrote" if written() else "durable")
        got["steps"] = ckpt.steps()
    return got


def check(results: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(results):
        assert got["captured"] is True, rank
        assert got["steps"] == [1, 2], rank
        if rank == STRAGGLER:
            assert got["events"] == [
                "returned",
                "straggler writes",
                "durable after the straggler wrote",
            ]
        else:
            assert got["events"] == ["returned", "durable after the straggler wrote"], rank


@pytest.mark.timeout(180)
def test_a_straggler_on_a_simulated_world_delays_only_the_commit(tmp_path: Path) -> None:
    from cryosnap.testing import SimulatedWorld

    lock = threading.Lock()
    back: set[int] = set()
    done = threading.Event()

    def returned(rank: int) -> None:
        with lock:
            back.add(rank)

    def others() -> bool:
        with lock:
            return len(back) == WORLD - 1

    world = SimulatedWorld(WORLD, timeout=2 * WAIT)
    body = dict(others_returned=others, returned=returned, wrote=done.set, written=done.is_set)
    check(world.run(lambda c: rank_body(c, tmp_path / "run", **body)))  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_a_straggler_among_four_gloo_ranks_delays_only_the_commit(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    from tests.integration import test_dist_torch

    check(test_dist_torch.launch("gloo", WORLD, tmp_path, script=HERE, timeout=200))


# -- the ranks' side ------------------------------------------------------------------------------


def _gloo(out: Path) -> None:
    """One process of the gloo test: the events are files in ``out`` (one per rank)."""
    import datetime

    import torch.distributed as dist

    from cryosnap.dist import TorchCoordinator

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2 * WAIT))
    others = [out / f"returned-{r}" for r in range(WORLD) if r != STRAGGLER]
    got = rank_body(
        TorchCoordinator(timeout=2 * WAIT),
        out / "run",
        others_returned=lambda: all(p.exists() for p in others),
        returned=lambda rank: (out / f"returned-{rank}").touch(),
        wrote=(out / "written").touch,
        written=(out / "written").exists,
    )
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    _gloo(Path(sys.argv[2]))
