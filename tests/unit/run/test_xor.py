"""XOR parity sets (``partner="xor"``): threads as ranks, each on a "node" of its own (a scratch
directory; its name through ``cryosnap._run.redundancy.partner.node_name``), a node's scratch wiped
between runs. The rebuilt part must be bit-exact and verified, or not come back at all."""

from __future__ import annotations

import json
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
from cryosnap._run.redundancy.xor import ParityIndex, segment_bytes, segment_of, set_size, xor_sets
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointFormatError
from cryosnap.storage import LocalStore

from ..distributed.test_coordinator import run_ranks

_NODE = threading.local()
WORLD = 4


@pytest.fixture(autouse=True)
def _nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_partner, "node_name", lambda: _NODE.name)
    monkeypatch.setenv("CRYOSNAP_XOR_SET_SIZE", "4")


def state_of(rank: int, step: int) -> dict[str, Any]:
    """Parts of different sizes (the XOR pads to the largest), a sparse change per step."""
    rng = np.random.default_rng(7)
    model = rng.standard_normal(24 << 10).astype(np.float32)
    model[: 1024 * (step % 3)] += step
    own = np.full(1000 + 700 * rank, rank * 100 + step, np.int64)
    return {"model": model, "own": own, "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in ("model", "own")) and a["step"] == b["step"]


def node(tmp: Path, rank: int) -> Path:
    return tmp / f"node-{rank}"


def own_dir(tmp: Path, rank: int) -> Path:
    return node(tmp, rank) / f"rank-{rank:05d}"


def open_ckpt(tmp: Path, c: Coordinator, **kw: Any) -> cryosnap.Checkpointer:
    _NODE.name = f"n{c.rank}"
    kw.setdefault("chunk_bytes", 4096)
    return cryosnap.Checkpointer(
        tmp / "run", scratch=node(tmp, c.rank), comm=c, partner="xor", **kw
    )


def save_steps(tmp: Path, steps: tuple[int, ...], **kw: Any) -> None:
    def body(c: Coordinator) -> None:
        with open_ckpt(tmp, c, **kw) as ckpt:
            for step in steps:
                ckpt.save(step, state_of(c.rank, step), replicated=["model"]).result()

    run_ranks(WORLD, body)


def reopen(tmp: Path, **kw: Any) -> list[tuple[list[int], Any]]:
    def body(c: Coordinator) -> tuple[list[int], Any]:
        with open_ckpt(tmp, c, **kw) as ckpt:
            return ckpt.status().steps["scratch"], ckpt.restore()

    return run_ranks(WORLD, body)


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "lock" not in p.name.lower()
    }


def parity_of(tmp: Path, rank: int) -> dict[str, bytes]:
    """Each index of ``rank``'s parity store, and the parity bytes it names."""
    store = LocalStore(node(tmp, rank) / "xor" / f"rank-{rank:05d}")
    out = {}
    for key in store.list("index"):
        idx = ParityIndex.from_json(store.read(key), key)
        out[key] = store.read(idx.parity_key)
    return out


# -- the sets and the layout -----------------------------------------------------------------


def test_sets_take_one_rank_of_each_node_of_a_group() -> None:
    assert xor_sets(["a", "b", "c", "d"], 4) == [[0, 1, 2, 3]]
    assert xor_sets(["a", "b", "c", "d"], 8) == [[0, 1, 2, 3]]
    # 8 nodes of 2 ranks, k=4: two groups of 4 nodes, two sets in each.
    nodes = [f"n{r // 2}" for r in range(16)]
    sets = xor_sets(nodes, 4)
    assert sorted(r for s in sets for r in s) == list(range(16))
    assert all(len(s) == 4 and len({nodes[r] for r in s}) == 4 for s in sets)
    # 9 nodes, k=8: balanced groups of 5 and 4, never a set of one.
    assert sorted(len(s) for s in xor_sets([f"n{i}" for i in range(9)], 8)) == [4, 5]


def test_sets_refuse_a_rank_without_another_node() -> None:
    with pytest.raises(ValueError, match="at least two nodes"):
        xor_sets(["a", "a", "a"], 8)
    with pytest.raises(ValueError, match="rank 1 on 'a'"):
        xor_sets(["a", "a", "b"], 8)


def test_set_size_from_the_environment() -> None:
    assert set_size({}) == 8
    assert set_size({"CRYOSNAP_XOR_SET_SIZE": "5"}) == 5
    for bad in ("2", "x", "-1"):
        with pytest.raises(ValueError, match="CRYOSNAP_XOR_SET_SIZE"):
            set_size({"CRYOSNAP_XOR_SET_SIZE": bad})


def test_each_member_segment_is_covered_by_exactly_one_other_member() -> None:
    for k in (3, 4, 8):
        for member in range(k):
            covered = sorted(segment_of(h, member, k) for h in range(k) if h != member)
            assert covered == list(range(k - 1))
    assert segment_bytes([10, 30, 0], 4) == 10
    assert segment_bytes([31], 4) == 11


def test_an_index_naming_a_file_outside_the_store_is_refused() -> None:
    good = {
        "format": 1, "step": 3, "generation": 0, "ranks": [0, 1, 2], "rank": 1,
        "segment_bytes": 10, "parity": {"key": "parity/000000000003-ab.xor", "nbytes": 10},
        "members": {
            str(r): {"files": [["data/x.dat", 20]], "needs": ["data/x.dat"], "record": "{}"}
            for r in range(3)
        },
    }  # fmt: skip
    idx = ParityIndex.from_json(json.dumps(good).encode(), "test")
    assert idx.key == "index/000000000003.json" and idx.members[2].nbytes == 20
    for bad in (
        {**good, "parity": {"key": "../../etc/passwd", "nbytes": 1}},
        {**good, "members": {"0": good["members"]["0"]}},  # not its set
        {**good, "segment_bytes": -1},
        {**good, "format": 2},
    ):
        with pytest.raises(CheckpointFormatError):
            ParityIndex.from_json(json.dumps(bad).encode(), "test")


def test_partner_xor_needs_scratch_and_two_nodes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="partner='xor'"):
        cryosnap.Checkpointer(tmp_path / "a", partner="xor")
    with pytest.raises(ValueError, match="False, True, 'xor' or 'rs:K\\+M'"):
        cryosnap.Checkpointer(tmp_path / "a", scratch=tmp_path / "s", partner="parity")

    def body(c: Coordinator) -> None:
        _NODE.name = "n0"
        with pytest.raises(ValueError, match="at least two nodes"):
            cryosnap.Checkpointer(tmp_path / "b", scratch=tmp_path / "s", comm=c, partner="xor")

    run_ranks(2, body)


# -- the parity and the rebuild ----------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 3001])
def test_a_wiped_node_is_rebuilt_bit_exact_from_the_others_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    if window is not None:  # many rounds, windows across file boundaries
        monkeypatch.setattr(_partner, "WINDOW_BYTES", window)
    save_steps(tmp_path, (1, 2, 3))
    # Each rank holds one parity file per version, about a third of the largest part (k=4).
    for rank in range(WORLD):
        store = LocalStore(node(tmp_path, rank) / "xor" / f"rank-{rank:05d}")
        idx = ParityIndex.from_json(store.read("index/000000000003.json"), "test")
        assert idx.ranks == (0, 1, 2, 3)
        largest = max(m.nbytes for m in idx.members.values())
        assert idx.parity_bytes <= -(-largest // 3)
        assert store.size(idx.parity_key) == idx.parity_bytes
    before = files_of(own_dir(tmp_path, 2))
    parity_before = parity_of(tmp_path, 2)
    # Node 2 loses its scratch, the persistent level its newest version (not flushed yet).
    shutil.rmtree(node(tmp_path, 2))
    (tmp_path / "run" / commit_key(3)).unlink()
    for rank, (steps, restored) in enumerate(reopen(tmp_path)):
        assert 3 in steps
        assert same(restored, state_of(rank, 3))
    assert files_of(own_dir(tmp_path, 2)) == before  # bit-exact, records included
    assert parity_of(tmp_path, 2) == parity_before  # its own parity recomputed, too
    cryosnap.Run(own_dir(tmp_path, 2)).verify(3)


def test_two_lost_nodes_of_one_set_fall_back_to_the_persistent_level(tmp_path: Path) -> None:
    save_steps(tmp_path, (1, 2))
    shutil.rmtree(node(tmp_path, 0))
    shutil.rmtree(node(tmp_path, 3))
    for rank, (_steps, restored) in enumerate(reopen(tmp_path)):
        assert same(restored, state_of(rank, 2))  # from the persistent level
    for rank in (0, 3):
        assert engine.list_steps(LocalStore(own_dir(tmp_path, rank))) == []


def test_incremental_versions_rebuild_through_their_chain(tmp_path: Path) -> None:
    """Each version's parity covers what it wrote; a rebuilt incremental version needs the
    files of its base too, whose parity outlives the base's commit record."""
    save_steps(tmp_path, (1, 2, 3, 4, 5), keep_scratch=2, full_every=3)
    record = engine.read_commit(LocalStore(own_dir(tmp_path, 1)), 5)
    assert record.incremental and len(record.chain) > 1
    store = LocalStore(node(tmp_path, 1) / "xor" / "rank-00001")
    # Kept: the versions on scratch (4, 5) and every older one their chains read.
    assert {int(k[6:18]) for k in store.list("index")} == {*record.chain, 4}
    assert len(store.list("parity")) == len(store.list("index"))
    before = files_of(own_dir(tmp_path, 1))
    shutil.rmtree(node(tmp_path, 1))
    for step in (4, 5):
        (tmp_path / "run" / commit_key(step)).unlink()
    for rank, (steps, restored) in enumerate(reopen(tmp_path, keep_scratch=2, full_every=3)):
        assert list(steps)[-2:] == [4, 5]
        assert same(restored, state_of(rank, 5))
    after = files_of(own_dir(tmp_path, 1))
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) == set(before)


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_damaged_parity_is_caught_by_the_hash_check_and_falls_back(
    tmp_path: Path, where: str
) -> None:
    save_steps(tmp_path, (1, 2))
    holder = LocalStore(node(tmp_path, 0) / "xor" / "rank-00000")
    idx = ParityIndex.from_json(holder.read("index/000000000002.json"), "test")
    path = node(tmp_path, 0) / "xor" / "rank-00000" / idx.parity_key
    raw = bytearray(path.read_bytes())
    # Rank 0's parity covers rank 1's third segment (segment_of(0, 1, 4) == 2): its first
    # byte lies in rank 1's data file, its last in rank 1's manifest (the payload's end).
    last = idx.members[1].nbytes - 2 * idx.segment_bytes - 1
    raw[0 if where == "data" else last] ^= 0x5A
    path.write_bytes(bytes(raw))
    shutil.rmtree(node(tmp_path, 1))
    for rank, (_steps, restored) in enumerate(reopen(tmp_path)):
        assert same(restored, state_of(rank, 2))  # from the persistent level
    # Step 2 was not committed on rank 1's scratch (it failed verification): at open the
    # version on some ranks' scratch only (and persistent) stays served by the persistent level.
    assert 2 not in engine.list_steps(LocalStore(own_dir(tmp_path, 1)))


def test_a_truncated_parity_file_falls_back(tmp_path: Path) -> None:
    save_steps(tmp_path, (1,))
    holder = node(tmp_path, 3) / "xor" / "rank-00003"
    idx = ParityIndex.from_json(LocalStore(holder).read("index/000000000001.json"), "test")
    (holder / idx.parity_key).write_bytes((holder / idx.parity_key).read_bytes()[:100])
    shutil.rmtree(node(tmp_path, 2))
    for rank, (_steps, restored) in enumerate(reopen(tmp_path)):
        assert same(restored, state_of(rank, 1))
    assert engine.list_steps(LocalStore(own_dir(tmp_path, 2))) == []


def test_a_rewind_supersedes_and_a_wiped_node_gets_the_new_trajectory_back(
    tmp_path: Path,
) -> None:
    """Superseded versions are never rebuilt: after a rewind to step 2 and a new step 3, a
    wiped node gets the new step 3 back from the parity, never the abandoned 3 or 4."""

    def rewound(rank: int, step: int) -> dict[str, Any]:
        out = state_of(rank, step)
        out["own"] = out["own"] + 7
        return out

    save_steps(tmp_path, (1, 2, 3, 4), keep_scratch=4)

    def rewind(c: Coordinator) -> list[int]:
        with open_ckpt(tmp_path, c, keep_scratch=4) as ckpt:
            assert same(ckpt.restore(step=2), state_of(c.rank, 2))
            ckpt.save(3, rewound(c.rank, 3), replicated=["model"]).result()
            return ckpt.steps()

    assert run_ranks(WORLD, rewind) == [[1, 2, 3]] * WORLD
    shutil.rmtree(node(tmp_path, 3))
    newest = engine.read_commit(LocalStore(tmp_path / "run"), 3)
    (tmp_path / "run" / newest.key).unlink()
    for rank, (steps, restored) in enumerate(reopen(tmp_path, keep_scratch=4)):
        assert list(steps) == [1, 2, 3]
        assert same(restored, rewound(rank, 3))
    assert engine.read_commit(LocalStore(own_dir(tmp_path, 3)), 3).lineage == newest.lineage


def test_config_takes_partner_xor() -> None:
    from cryosnap._run.config import config_arguments

    args = config_arguments({"path": "/r", "partner": "xor"}, {}, environ={})
    assert args["partner"] == "xor"
    env = {"CRYOSNAP_PARTNER": "XOR"}
    assert config_arguments({"path": "/r"}, {}, environ=env)["partner"] == "xor"


def test_a_node_with_two_scratch_devices_is_rebuilt_on_both(tmp_path: Path) -> None:
    """Data files striped over two devices: the parity covers each, the rebuild puts each
    back on its device (the key names it)."""

    def body(c: Coordinator, save: bool) -> Any:
        _NODE.name = f"n{c.rank}"
        devices = [node(tmp_path, c.rank) / "nvme0", node(tmp_path, c.rank) / "nvme1"]
        with cryosnap.Checkpointer(
            tmp_path / "run", scratch=devices, comm=c, partner="xor", chunk_bytes=4096
        ) as ckpt:
            if save:
                for step in (1, 2):
                    ckpt.save(step, state_of(c.rank, step)).result()
                return None
            return ckpt.restore()

    run_ranks(WORLD, lambda c: body(c, True))
    lost = [node(tmp_path, 2) / d / "rank-00002" for d in ("nvme0", "nvme1")]
    before = [files_of(d) for d in lost]
    assert any(k.startswith("data/") for b in before for k in b)
    shutil.rmtree(node(tmp_path, 2))
    (tmp_path / "run" / commit_key(2)).unlink()
    for rank, restored in enumerate(run_ranks(WORLD, lambda c: body(c, False))):
        assert same(restored, state_of(rank, 2))
    assert [files_of(d) for d in lost] == before
