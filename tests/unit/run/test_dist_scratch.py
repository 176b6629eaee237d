"""Node-local scratch in a distributed run: each rank's whole part on its node, the persistent level
written again with the replicated state split, partner copies on another node.

The ranks are threads of this process (``InProcessGroup``); "nodes" are scratch directories, and the
node each rank runs on is given through ``cryosnap._run.redundancy.partner.node_name`` (a process
sets ``$CRYOSNAP_NODE``; threads share one environment). tests/integration/test_dist_torch.py runs
the same with gloo processes."""

from __future__ import annotations

import contextlib
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
import cryosnap._run.redundancy.partner as _partner
from cryosnap import engine
from cryosnap._format.keys import commit_key
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointError, StorageError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from ..distributed.test_coordinator import run_ranks

_NODE = threading.local()


@pytest.fixture(autouse=True)
def _nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_partner, "node_name", lambda: _NODE.name)


def state_of(rank: int, step: int) -> dict[str, Any]:
    model = np.arange(96 << 10, dtype=np.float32)
    model[: 4096 * (step % 3)] += step  # the same sparse change on every rank
    return {"model": model, "own": np.full(2048, rank * 100 + step, np.int64), "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        np.array_equal(a["model"], b["model"])
        and np.array_equal(a["own"], b["own"])
        and a["step"] == b["step"]
    )


def _persistent_bytes_by_rank(run: Path, step: int) -> dict[int, int]:
    """Bytes of the data files each rank wrote for ``step`` on the persistent level."""
    out: dict[int, int] = {}
    record = engine.read_commit(LocalStore(run), step)
    for key in record.data_files:
        name = Path(key).name
        if name.startswith(f"{step:012d}-r"):
            rank = int(name.split("-r")[1][:5])
            out[rank] = out.get(rank, 0) + (run / key).stat().st_size
    return out


def test_scratch_holds_each_rank_whole_part_and_persistent_gets_the_split(
    tmp_path: Path,
) -> None:
    run, scratch = tmp_path / "run", tmp_path / "scratch"

    def body(c: Coordinator) -> list[Any]:
        _NODE.name = "n0"
        with cryosnap.Checkpointer(run, scratch=scratch, comm=c, chunk_bytes=4096) as ckpt:
            for step in (1, 2, 3):
                info = ckpt.save(step, state_of(c.rank, step), replicated=["model"]).result()
                assert info.tiers == ("scratch", "persistent")
            restored = ckpt.restore()
        return [restored]

    got = run_ranks(2, body)
    for rank, (restored,) in enumerate(got):
        assert same(restored, state_of(rank, 3))
        own = scratch / f"rank-{rank:05d}"
        # Each rank's scratch is a run of its own, with its whole part: it restores alone.
        assert engine.list_steps(LocalStore(own)) == [2, 3]  # keep_scratch=2
        assert same(cryosnap.load(own, step=3), state_of(rank, 3))
        assert same(cryosnap.load(run, step=3, rank=rank), state_of(rank, 3))
    # The first (full) version on the persistent level: the model written once, half each.
    written = _persistent_bytes_by_rank(run, 1)
    model = state_of(0, 1)["model"].nbytes
    own = state_of(0, 1)["own"].nbytes
    for rank in (0, 1):
        assert abs(written[rank] - own - model / 2) <= 0.1 * model / 2
    assert engine.list_steps(LocalStore(run)) == [1, 2, 3]


def test_a_rank_restarting_without_its_scratch_reads_the_persistent_level(tmp_path: Path) -> None:
    run, scratch = tmp_path / "run", tmp_path / "scratch"

    def save(c: Coordinator) -> None:
        _NODE.name = "n0"
        with cryosnap.Checkpointer(run, scratch=scratch, comm=c) as ckpt:
            for step in (1, 2):
                ckpt.save(step, state_of(c.rank, step), replicated=["model"])

    run_ranks(2, save)
    shutil.rmtree(scratch / "rank-00001")

    def restore(c: Coordinator) -> Any:
        _NODE.name = "n0"
        with cryosnap.Checkpointer(run, scratch=scratch, comm=c) as ckpt:
            return ckpt.restore()

    for rank, restored in enumerate(run_ranks(2, restore)):
        assert same(restored, state_of(rank, 2))


def test_partner_copy_restores_after_a_node_scratch_is_wiped(tmp_path: Path) -> None:
    run = tmp_path / "run"

    def node_dir(rank: int) -> Path:
        return tmp_path / f"node-{rank % 2}"  # ranks 0, 2 on node 0; 1, 3 on node 1

    def save(c: Coordinator) -> None:
        _NODE.name = f"n{c.rank % 2}"
        with cryosnap.Checkpointer(
            run, scratch=node_dir(c.rank), comm=c, partner=True, chunk_bytes=4096
        ) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(step, state_of(c.rank, step), replicated=["model"]).result()

    run_ranks(4, save)
    # Node n0's ranks are copied to n1's and back, in turn: 0 <-> 1, 2 <-> 3 (partner_map).
    for owner, holder in {0: 1, 1: 0, 2: 3, 3: 2}.items():
        copy = node_dir(holder) / "partner" / f"rank-{owner:05d}"
        assert same(cryosnap.load(copy, step=3), state_of(owner, 3))
    # Node 0 loses its scratch, and the persistent level its newest version (not flushed
    # yet, say): the restore must come from the partner copies.
    shutil.rmtree(node_dir(0))
    (run / commit_key(3)).unlink()

    def restore(c: Coordinator) -> Any:
        _NODE.name = f"n{c.rank % 2}"
        with cryosnap.Checkpointer(run, scratch=node_dir(c.rank), comm=c, partner=True) as ckpt:
            assert 3 in ckpt.status().steps["scratch"]
            return ckpt.restore()

    for rank, restored in enumerate(run_ranks(4, restore)):
        assert same(restored, state_of(rank, 3))
    for rank in (0, 2):
        assert engine.list_steps(LocalStore(node_dir(rank) / f"rank-{rank:05d}"))[-1] == 3


def test_a_version_on_some_ranks_scratch_only_is_dropped_at_open(tmp_path: Path) -> None:
    """A rank killed between the ranks' scratch commit records: the version is on the others'
    scratch only; at the next open it is removed there, and the ranks agree on the previous
    one (and may save the step again)."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"

    def save(c: Coordinator) -> None:
        _NODE.name = "n0"
        with cryosnap.Checkpointer(run, scratch=scratch, comm=c) as ckpt:
            for step in (1, 2):
                ckpt.save(step, state_of(c.rank, step)).result()

    run_ranks(2, save)
    (scratch / "rank-00001" / commit_key(2)).unlink()
    (run / commit_key(2)).unlink()

    def reopen(c: Coordinator) -> Any:
        _NODE.name = "n0"
        with cryosnap.Checkpointer(run, scratch=scratch, comm=c) as ckpt:
            restored = ckpt.restore()
            ckpt.save(2, state_of(c.rank, 2)).result()
            return restored

    for rank, restored in enumerate(run_ranks(2, reopen)):
        assert same(restored, state_of(rank, 1))
        assert engine.list_steps(LocalStore(scratch / f"rank-{rank:05d}")) == [1, 2]


def test_partner_needs_scratch_and_two_nodes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="partner=True"):
        cryosnap.Checkpointer(tmp_path / "a", partner=True)

    def body(c: Coordinator) -> None:
        _NODE.name = "n0"
        with pytest.raises(ValueError, match="at least two nodes"):
            cryosnap.Checkpointer(tmp_path / "b", scratch=tmp_path / "s", comm=c, partner=True)

    run_ranks(2, body)


def test_partner_copies_of_versions_not_yet_persistent_outlive_keep_scratch(
    tmp_path: Path,
) -> None:
    """keep_scratch retires partner copies, but never one of a version the next level has not
    committed: the owner's flush may lag, and the copy may be all that is left of it."""
    copy, persistent = tmp_path / "copy", tmp_path / "persistent"
    for step in (1, 2, 3, 4):
        cryosnap.save(copy, {"x": np.full(64, step)}, step=step)
    for step in (1, 2):
        cryosnap.save(persistent, {"x": np.full(64, step)}, step=step)
    partners = _partner.Partners(rank=0, target=1, held={1: LocalStore(copy)})
    partners.retire(1, LocalStore(persistent))
    assert engine.list_steps(LocalStore(copy)) == [3, 4]
    # Once the next level has them, keep_scratch alone decides.
    cryosnap.save(persistent, {"x": np.full(64, 3)}, step=3)
    partners.retire(1, LocalStore(persistent))
    assert engine.list_steps(LocalStore(copy)) == [4]


def test_a_failed_flush_is_retried_by_every_rank_alike(tmp_path: Path) -> None:
    """The flush into the persistent level is made of collectives: when one rank's write fails
    once, every rank's attempt fails, they agree to retry, and the second attempt lands."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    failed: list[str] = []

    def fault(op: str, key: str) -> None:
        if op == "open_writer" and "000000000002-r00001" in key and not failed:
            failed.append(key)
            raise StorageError(f"injected: {key}")

    def body(c: Coordinator) -> list[Any]:
        _NODE.name = "n0"
        persistent = FaultyStore(LocalStore(run), fault=fault if c.rank == 1 else _no_fault)
        with cryosnap.Checkpointer(
            persistent, scratch=scratch, comm=c, chunk_bytes=4096, flush_retry_seconds=30
        ) as ckpt:
            infos = [
                ckpt.save(step, state_of(c.rank, step), replicated=["model"]).result(
                    tier="persistent"
                )
                for step in (1, 2, 3)
            ]
            restored = ckpt.restore()
        return [infos, restored]

    got = run_ranks(2, body, timeout=60)
    assert failed, "the fault was injected"
    assert engine.list_steps(LocalStore(run)) == [1, 2, 3]
    for rank, (infos, restored) in enumerate(got):
        assert [i.tiers for i in infos] == [("scratch", "persistent")] * 3
        assert same(restored, state_of(rank, 3))
        for step in (1, 2, 3):
            assert same(cryosnap.load(run, step=step, rank=rank), state_of(rank, step))


def test_a_flush_failing_on_one_rank_until_time_runs_out_fails_on_every_rank(
    tmp_path: Path,
) -> None:
    """Retries end alike: the version stays on scratch, reported failed on the persistent
    level by every rank, and the next version goes up normally."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"

    def fault(op: str, key: str) -> None:
        if op == "open_writer" and "000000000002-r00001" in key:
            raise StorageError(f"injected: {key}")

    def body(c: Coordinator) -> list[Any]:
        _NODE.name = "n0"
        persistent = FaultyStore(LocalStore(run), fault=fault if c.rank == 1 else _no_fault)
        with cryosnap.Checkpointer(
            persistent, scratch=scratch, comm=c, chunk_bytes=4096, flush_retry_seconds=0.5
        ) as ckpt:
            ckpt.save(1, state_of(c.rank, 1), replicated=["model"]).result(tier="persistent")
            second = ckpt.save(2, state_of(c.rank, 2), replicated=["model"])
            with pytest.raises(CheckpointError, match="injected"):
                second.result(tier="persistent")
            assert second.result(tier="scratch").tiers == ("scratch",)
            third = ckpt.save(3, state_of(c.rank, 3), replicated=["model"])
            return [third.result(tier="persistent").tiers]

    for (tiers,) in run_ranks(2, body, timeout=60):
        assert tiers == ("scratch", "persistent")
    assert engine.list_steps(LocalStore(run)) == [1, 3]
    for rank in (0, 1):
        assert engine.list_steps(LocalStore(scratch / f"rank-{rank:05d}"))[-2:] == [2, 3]


def _no_fault(op: str, key: str) -> None:
    return None


def test_the_flush_reads_only_this_ranks_share_of_the_replicated_state(tmp_path: Path) -> None:
    """Each rank rewrites only its share on the persistent level, so it reads (and verifies)
    only that share from its scratch; the other ranks' chunks go up by their recorded hashes.
    A damaged chunk of another rank's share on one scratch does not stop the flush."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"

    def fault(op: str, key: str) -> None:
        if op == "open_writer" and key.startswith("data/000000000001-"):
            raise StorageError(f"injected: {key}")

    def save(c: Coordinator) -> None:
        _NODE.name = "n0"
        persistent = FaultyStore(LocalStore(run), fault=fault)
        ckpt = cryosnap.Checkpointer(
            persistent, scratch=scratch, comm=c, chunk_bytes=4096, flush_retry_seconds=0
        )
        try:
            pending = ckpt.save(1, state_of(c.rank, 1), replicated=["model"])
            pending.result(tier="scratch")
            with pytest.raises(CheckpointError, match="injected"):
                pending.result(tier="persistent")
        finally:
            with contextlib.suppress(CheckpointError):
                ckpt.close()

    run_ranks(2, save)
    assert engine.list_steps(LocalStore(run)) == []
    # Rank 1's scratch: the first chunk of "model" (rank 0's share) is damaged.
    (data,) = (scratch / "rank-00001" / "data").glob("000000000001-*.dat")
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))

    def reopen(c: Coordinator) -> None:
        _NODE.name = "n0"
        with cryosnap.Checkpointer(run, scratch=scratch, comm=c, chunk_bytes=4096):
            pass  # open hands the version left on scratch to the persistent level; close waits

    run_ranks(2, reopen)
    assert engine.list_steps(LocalStore(run)) == [1]
    for rank in (0, 1):
        assert same(cryosnap.load(run, step=1, rank=rank), state_of(rank, 1))
    with pytest.raises(cryosnap.IntegrityError):
        cryosnap.load(scratch / "rank-00001", step=1)


def test_a_rewind_supersedes_on_every_rank_and_a_wiped_node_does_not_bring_it_back(
    tmp_path: Path,
) -> None:
    """Superseding (issue 26) in a distributed run with scratch and partner copies: the first
    save after a rewind supersedes the later versions on the persistent level, on every rank's
    scratch and in the partner copies; a node that loses its scratch gets the new trajectory
    back from its partner, never the abandoned one."""
    run = tmp_path / "run"

    def node_dir(rank: int) -> Path:
        return tmp_path / f"node-{rank % 2}"

    def open_run(c: Coordinator) -> cryosnap.Checkpointer:
        _NODE.name = f"n{c.rank % 2}"
        return cryosnap.Checkpointer(
            run, scratch=node_dir(c.rank), comm=c, partner=True, chunk_bytes=4096, keep_scratch=3
        )

    def rewound(rank: int, step: int) -> dict[str, Any]:
        out = state_of(rank, step)
        out["own"] = out["own"] + 7  # what the rewound program computes differs
        return out

    def save(c: Coordinator) -> None:
        with open_run(c) as ckpt:
            for step in (1, 2, 3, 4):
                ckpt.save(step, state_of(c.rank, step), replicated=["model"]).result()

    def rewind(c: Coordinator) -> list[int]:
        with open_run(c) as ckpt:
            assert same(ckpt.restore(step=2), state_of(c.rank, 2))
            ckpt.save(3, rewound(c.rank, 3), replicated=["model"]).result()
            return ckpt.steps()

    run_ranks(4, save)
    assert run_ranks(4, rewind) == [[1, 2, 3]] * 4
    assert engine.list_steps(LocalStore(run)) == [1, 2, 3]
    for rank in range(4):
        assert same(cryosnap.load(run, rank=rank), rewound(rank, 3))
        assert engine.list_steps(LocalStore(node_dir(rank) / f"rank-{rank:05d}"))[-1] == 3
    # Node 0 loses its scratch, and the persistent level its newest record (not flushed,
    # say): ranks 0 and 2 must get step 3 of the new trajectory from their partners.
    shutil.rmtree(node_dir(0))
    newest = engine.read_commit(LocalStore(run), 3)
    (run / newest.key).unlink()

    def restore(c: Coordinator) -> tuple[list[int], Any]:
        with open_run(c) as ckpt:
            return ckpt.steps(), ckpt.restore()

    for rank, (steps, restored) in enumerate(run_ranks(4, restore)):
        assert steps == [1, 2, 3]
        assert same(restored, rewound(rank, 3))
