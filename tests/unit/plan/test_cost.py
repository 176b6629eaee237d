"""cryosnap.plan.predict: the cost model's formulas, its regimes, its validation, the level
costs it feeds the planner, and its collective counts against a real save's.

The formulas are checked against hand-written arithmetic (docs/PLANNING.md, "Time to durable");
the collective counts against the rounds a SimulatedWorld counts during real Checkpointer saves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cryosnap import Checkpointer
from cryosnap.plan import (
    FailureClass,
    JobShape,
    Machine,
    parse_bytes,
    parse_rate,
    parse_seconds,
    plan,
    predict,
)
from cryosnap.plan._cost import (
    PARITY_COLLECTIVES,
    PARTNER_COLLECTIVES,
    PERSISTENT_COLLECTIVES,
    RETENTION_COLLECTIVES,
    SCRATCH_COLLECTIVES,
)
from cryosnap.testing import SimulatedRank, SimulatedWorld

GB = 1e9
GIB = 1 << 30


def machine(**overrides: object) -> Machine:
    values: dict[str, object] = {
        "memcpy_bytes_per_second": 20 * GB,
        "hash_bytes_per_second": 10 * GB,
        "local_bytes_per_second": 4 * GB,
        "pfs_bytes_per_second": 1000 * GB,
        "node_bytes_per_second": 25 * GB,
        "latency_seconds": 1e-3,
    }
    values.update(overrides)
    return Machine(**values)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# the formulas


def test_a_save_through_scratch_follows_the_formulas() -> None:
    shape = JobShape(64, 4, GIB, replicated_bytes=2 * GIB)
    m = machine()
    p = predict(shape, m)
    part, share = 3 * GIB, GIB + 2 * GIB / 64
    stages = math.ceil(math.log2(64))  # 6 stages of 1 ms per collective
    assert p.captured_bytes_per_rank == part
    assert p.stall_seconds == pytest.approx(part / (20 * GB))
    scratch, persistent = p.levels
    # the node's 4 ranks share its 4 GB/s; hashing (10 GB/s) overlaps and is faster
    assert scratch.seconds == pytest.approx(
        4 * part / (4 * GB) + SCRATCH_COLLECTIVES * stages * 1e-3
    )
    # the flush of several ranks reads each share back (the node's 4 ranks share its read
    # rate, the write's where none is given), then writes it: each rank gets
    # min(1000 GB/s / 64, 25 GB/s / 4) = 6.25 GB/s of the shared level
    read = 4 * share / (4 * GB)
    coordination = (PERSISTENT_COLLECTIVES + RETENTION_COLLECTIVES) * stages * 1e-3
    assert persistent.seconds == pytest.approx(read + share / (6.25 * GB) + coordination)
    assert scratch.durable_seconds == pytest.approx(p.stall_seconds + scratch.seconds)
    assert persistent.durable_seconds == pytest.approx(scratch.durable_seconds + persistent.seconds)
    assert scratch.written_bytes_per_rank == part
    assert persistent.written_bytes_per_rank == pytest.approx(share)
    assert dict(scratch.terms)["write"] > dict(scratch.terms)["hash"]


def test_one_rank_flushes_by_a_copy_whose_read_hash_and_write_add_up() -> None:
    m = machine(local_read_bytes_per_second=2 * GB, pfs_bytes_per_second=3 * GB)
    flush = predict(JobShape(1, 1, GIB), m, retention=False).level("persistent")
    assert flush.seconds == pytest.approx(GIB / (2 * GB) + GIB / (10 * GB) + GIB / (3 * GB))
    rewrite = predict(JobShape(2, 1, GIB), m, retention=False).level("persistent")
    stage = 1e-3 * PERSISTENT_COLLECTIVES
    assert rewrite.seconds == pytest.approx(GIB / (2 * GB) + GIB / (1.5 * GB) + stage)
    assert dict(rewrite.terms)["read"] == pytest.approx(GIB / (2 * GB))


def test_saving_straight_to_the_shared_level_copies_only_a_share() -> None:
    shape = JobShape(8, 8, GIB, replicated_bytes=8 * GIB)
    p = predict(shape, machine(), scratch=False, retention=False)
    share = GIB + GIB  # its state and 1/8 of the replicated 8 GiB
    assert p.captured_bytes_per_rank == share
    # the other 7/8 of the replicated state are hashed in place while the program waits
    assert p.stall_seconds == pytest.approx(share / (20 * GB) + 7 * GIB / (10 * GB))
    (persistent,) = p.levels
    assert persistent.name == "persistent"
    assert persistent.collectives == PERSISTENT_COLLECTIVES


def test_the_shared_level_is_limited_by_injection_then_by_the_aggregate() -> None:
    m = machine(pfs_bytes_per_second=100 * GB, node_bytes_per_second=10 * GB, latency_seconds=0)
    times = {
        n: predict(JobShape(n, 8, GIB), m, scratch=False).level("persistent").seconds
        for n in (8, 64, 1024, 4096)
    }
    # up to 80 ranks the node's 10 GB/s over 8 ranks bounds each rank: flat in N
    assert times[8] == pytest.approx(GIB / (10 * GB / 8))
    assert times[64] == pytest.approx(times[8])
    # past it the aggregate does: the time grows as N
    assert times[4096] == pytest.approx(4096 * GIB / (100 * GB))
    assert times[4096] / times[1024] == pytest.approx(4.0)


def test_fewer_cores_than_ranks_slow_the_copy_and_the_hashing() -> None:
    shape = JobShape(8, 8, GIB)
    fast = machine(local_bytes_per_second=1000 * GB)
    slow = machine(local_bytes_per_second=1000 * GB, cores_per_node=2)
    assert predict(shape, slow).stall_seconds == pytest.approx(
        4 * predict(shape, fast).stall_seconds
    )
    hashed = dict(predict(shape, slow).levels[0].terms)["hash"]
    assert hashed == pytest.approx(4 * GIB / (10 * GB))
    assert machine(cores_per_node=16).cpu_share(8) == 1.0


def test_one_rank_runs_no_collective_stage() -> None:
    p = predict(JobShape(1, 1, GIB), machine(latency_seconds=1.0))
    assert all(dict(lv.terms)["coordination"] == 0 for lv in p.levels)
    assert machine().collective_seconds(2) == pytest.approx(1e-3)
    assert machine().collective_seconds(1025) == pytest.approx(11e-3)


@pytest.mark.parametrize(
    ("partner", "parity_per_byte", "sent_per_byte", "base"),
    [
        (True, 1.0, 1.0, PARTNER_COLLECTIVES),
        ("xor", 1 / 7, 1.0, PARITY_COLLECTIVES),
        ("rs:4+2", 2 / 4, 2.0, PARITY_COLLECTIVES),
    ],
)
def test_redundancy_adds_its_network_its_parity_and_its_windows(
    partner: bool | str, parity_per_byte: float, sent_per_byte: float, base: int
) -> None:
    shape = JobShape(32, 4, 256 << 20)
    m = machine(latency_seconds=0)
    plain = predict(shape, m).levels[0]
    level = predict(shape, m, partner=partner).levels[0]
    part = 256 << 20
    assert level.written_bytes_per_rank == pytest.approx(part * (1 + parity_per_byte))
    network = 4 * part * sent_per_byte / (25 * GB)
    parity = 4 * part * parity_per_byte / (4 * GB)
    assert level.seconds == pytest.approx(plain.seconds + max(network, parity))
    windows = math.ceil(part * sent_per_byte / (64 << 20))
    assert level.collectives == SCRATCH_COLLECTIVES + base + windows


# ---------------------------------------------------------------------------------------------
# what feeds the planner


def test_level_costs_charge_each_level_its_write_and_the_first_the_stall() -> None:
    p = predict(JobShape(256, 8, 2 * GIB, replicated_bytes=GIB), machine())
    scratch, persistent = p.level_costs()
    assert scratch.name == "scratch" and persistent.name == "persistent"
    assert scratch.save_seconds == pytest.approx(p.stall_seconds + p.levels[0].seconds)
    assert persistent.save_seconds == pytest.approx(p.levels[1].seconds)
    assert persistent.restart_seconds == p.levels[1].restart_seconds
    result = plan(
        p.level_costs(),
        [FailureClass("crash", 3600.0, "scratch"), FailureClass("outage", 86400.0, 1)],
    )
    # a level never takes versions faster than its write finishes
    for level, cost in zip(result.levels, p.level_costs(), strict=True):
        assert level.interval_seconds > cost.save_seconds


def test_to_dict_names_every_level_and_term() -> None:
    doc = predict(JobShape(4, 2, GIB), machine()).to_dict()
    assert doc["nodes"] == 2 and doc["ranks"] == 4
    assert [lv["name"] for lv in doc["levels"]] == ["scratch", "persistent"]
    assert set(doc["levels"][0]["terms"]) == {"hash", "write", "coordination"}
    assert doc["levels"][1]["collectives"] == PERSISTENT_COLLECTIVES + RETENTION_COLLECTIVES


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: JobShape(0, 1, 1), ValueError, "ranks"),
        (lambda: JobShape(4, 8, 1), ValueError, "ranks_per_node"),
        (lambda: JobShape(4, 2, 0), ValueError, r"state_bytes \+ replicated_bytes"),
        (lambda: JobShape(4, 2, -1), ValueError, "state_bytes"),
        (lambda: JobShape(4, 2, 1.5), TypeError, "state_bytes"),  # type: ignore[arg-type]
        (lambda: machine(local_bytes_per_second=0), ValueError, "local_bytes_per_second"),
        (lambda: machine(hash_bytes_per_second=math.nan), ValueError, "hash_bytes_per_second"),
        (lambda: machine(latency_seconds=-1), ValueError, "latency_seconds"),
        (lambda: machine(cores_per_node=0), ValueError, "cores_per_node"),
        (lambda: predict(JobShape(4, 2, 1), machine(), partner="raid"), ValueError, "partner"),
        (lambda: predict(JobShape(4, 2, 1), machine(), partner="rs:1+1"), ValueError, "K >= 2"),
        (
            lambda: predict(JobShape(4, 2, 1), machine(), partner="xor", xor_set_size=2),
            ValueError,
            "xor_set_size",
        ),
        (
            lambda: predict(JobShape(4, 2, 1), machine(), scratch=False, partner=True),
            ValueError,
            "without scratch",
        ),
        (lambda: predict("shape", machine()), TypeError, "JobShape"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_names_the_argument(build: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        build()  # type: ignore[operator]


def test_an_unknown_level_is_a_key_error_naming_the_levels() -> None:
    with pytest.raises(KeyError, match="levels: persistent"):
        predict(JobShape(2, 1, 1), machine(), scratch=False).level("scratch")


@pytest.mark.parametrize(
    ("text", "rate"),
    [("2GB/s", 2e9), ("1.5 GiB/s", 1.5 * GIB), ("800MB/s", 8e8), ("100/s", 100.0)],
)
def test_parse_rate(text: str, rate: float) -> None:
    assert parse_rate(text) == pytest.approx(rate)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5us", 5e-6), ("2ms", 2e-3), ("1.5s", 1.5), ("90", 90.0), ("10m", 600.0), ("1e-6s", 1e-6)],
)
def test_parse_seconds(text: str, seconds: float) -> None:
    assert parse_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["2GB", "fast/s", "2 GB/h", "", "-1GB/s"])
def test_parse_rate_refuses(text: str) -> None:
    assert parse_rate(text) is None


@pytest.mark.parametrize("text", ["5 parsecs", "soon", "", "-2s"])
def test_parse_seconds_refuses(text: str) -> None:
    assert parse_seconds(text) is None


def test_parse_bytes_is_the_units_module_one() -> None:
    assert parse_bytes("4GiB") == 4 * GIB


# ---------------------------------------------------------------------------------------------
# the collective counts against a real save's


def _call(save: Callable[[SimulatedRank, int], None], c: SimulatedRank, *, step: int) -> None:
    save(c, step)


def _rounds(tmp: Path, *, scratch: bool, keep: int | None) -> int:
    """The collectives each of 2 ranks runs in a steady-state save (the third)."""
    world = SimulatedWorld(2, timeout=60.0)
    ckpts: dict[int, Checkpointer] = {}
    model = np.arange(4096, dtype=np.float32)

    def open_rank(c: SimulatedRank) -> None:
        ckpts[c.rank] = Checkpointer(
            tmp / "run",
            scratch=str(tmp / "scratch") if scratch else None,
            comm=c,
            keep=keep,
            chunk_bytes=4096,
        )

    def save(c: SimulatedRank, step: int) -> None:
        state = {"model": model + step, "shard": np.full(64, c.rank + step)}
        ckpts[c.rank].save(step, state, replicated=["model"]).result()

    world.run(open_rank)
    try:
        for step in (1, 2):
            world.run(functools.partial(_call, save, step=step))
        world.reset()
        world.run(lambda c: save(c, 3))
        rounds = {counters.rounds for counters in world.all_counters()}
    finally:
        world.run(lambda c: ckpts[c.rank].close())
    assert len(rounds) == 1
    return rounds.pop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("scratch", "keep"), [(False, None), (False, 1), (True, None), (True, 1)])
def test_the_model_counts_the_collectives_a_save_runs(
    tmp_path: Path, scratch: bool, keep: int | None
) -> None:
    expected = predict(
        JobShape(2, 1, 512, replicated_bytes=16384),
        machine(),
        scratch=scratch,
        retention=keep is not None,
    )
    assert _rounds(tmp_path, scratch=scratch, keep=keep) == sum(
        lv.collectives for lv in expected.levels
    )
