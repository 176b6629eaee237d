"""Reed-Solomon sets (``partner="rs:K+M"``): threads as ranks, each on a "node" of its own (a
scratch directory; its name through ``cryosnap._run.redundancy.partner.node_name``), up to M
nodes' scratch wiped between runs. The rebuilt parts must be bit-exact and verified, or not
come back at all."""

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
from cryosnap._run.redundancy.rs import (
    Code,
    RSIndex,
    element_of,
    holder_of,
    parse_rs,
    rs_sets,
    stripe_of,
)
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointFormatError, MissingDependencyError
from cryosnap.storage import LocalStore

from ..distributed.test_coordinator import run_ranks

pytest.importorskip("zfec")

_NODE = threading.local()


@pytest.fixture(autouse=True)
def _nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_partner, "node_name", lambda: _NODE.name)


def state_of(rank: int, step: int) -> dict[str, Any]:
    """Parts of different sizes (the code pads to the largest), a sparse change per step."""
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


def parity_dir(tmp: Path, rank: int) -> Path:
    return node(tmp, rank) / "rs" / f"rank-{rank:05d}"


def run_steps(
    tmp: Path, spec: str, world: int, steps: tuple[int, ...], **kw: Any
) -> list[tuple[list[int], Any]]:
    """Open the run on ``world`` ranks, save ``steps``; the scratch steps and the restored
    state of each rank."""

    def body(c: Coordinator) -> tuple[list[int], Any]:
        _NODE.name = f"n{c.rank}"
        kw.setdefault("chunk_bytes", 4096)
        with cryosnap.Checkpointer(
            tmp / "run", scratch=node(tmp, c.rank), comm=c, partner=spec, **kw
        ) as ckpt:
            for step in steps:
                ckpt.save(step, state_of(c.rank, step), replicated=["model"]).result()
            return ckpt.status().steps["scratch"], ckpt.restore()

    return run_ranks(world, body)


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "lock" not in p.name.lower()
    }


def parity_of(tmp: Path, rank: int) -> dict[str, list[bytes]]:
    """Each index of ``rank``'s parity store, and the parity bytes it names."""
    store = LocalStore(parity_dir(tmp, rank))
    out = {}
    for key in store.list("index"):
        idx = RSIndex.from_json(store.read(key), key)
        out[key] = [store.read(k) for k in idx.parity_keys]
    return out


# -- the argument, the sets and the layout ---------------------------------------------------


def test_the_argument_is_parsed_and_bad_ones_named() -> None:
    assert parse_rs("rs:4+2") == (4, 2)
    for bad, match in [
        ("rs:4", "'rs:K\\+M'"),
        ("rs:4+x", "'rs:K\\+M'"),
        ("rs:4+0", "M=0"),
        ("rs:1+2", "K=1"),
        ("rs:200+100", "255"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_rs(bad)


def test_the_checkpointer_validates_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="M=0"):
        cryosnap.Checkpointer(tmp_path / "a", scratch=tmp_path / "s", partner="rs:4+0")
    with pytest.raises(ValueError, match=r"partner=.rs:4\+2.*scratch="):
        cryosnap.Checkpointer(tmp_path / "a", partner="rs:4+2")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "zfec" else real(n, *a)
    )
    with pytest.raises(MissingDependencyError, match=r"cryosnap\[rs\]"):
        cryosnap.Checkpointer(tmp_path / "a", scratch=tmp_path / "s", partner="rs:2+1")


def test_more_nodes_needed_than_the_job_has_is_refused_at_open(tmp_path: Path) -> None:
    def body(c: Coordinator) -> None:
        _NODE.name = f"n{c.rank}"
        with pytest.raises(ValueError, match="K\\+M = 6 distinct nodes, but they run on 4"):
            cryosnap.Checkpointer(
                tmp_path / "r", scratch=node(tmp_path, c.rank), comm=c, partner="rs:4+2"
            )

    run_ranks(4, body)


def test_sets_take_one_rank_of_each_node_of_a_group() -> None:
    assert rs_sets(["a", "b", "c"], 2, 1) == [[0, 1, 2]]
    # 7 nodes, K+M = 3: two groups (3 and 4 nodes); 4 nodes of 2 ranks, K+M=4: two sets.
    assert sorted(len(s) for s in rs_sets([f"n{i}" for i in range(7)], 2, 1)) == [3, 4]
    nodes = [f"n{r // 2}" for r in range(8)]
    sets = rs_sets(nodes, 2, 2)
    assert all(len({nodes[r] for r in s}) == 4 for s in sets) and len(sets) == 2
    with pytest.raises(ValueError, match="fewer than K\\+M = 3"):
        rs_sets(["a", "a", "b", "c"], 2, 1)


@pytest.mark.parametrize(("n", "m"), [(3, 1), (6, 2), (7, 3)])
def test_every_stripe_holds_one_block_of_each_member(n: int, m: int) -> None:
    for s in range(n):
        assert sorted(element_of(p, s, n, m) for p in range(n)) == list(range(n))
        for b in range(n):
            p = holder_of(s, b, n, m)
            assert element_of(p, s, n, m) == b and stripe_of(p, b, n, m) == s


def test_the_code_rebuilds_any_m_lost_blocks() -> None:
    code = Code(4, 2)
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 256, 100, np.uint8).tobytes() for _ in range(4)]
    blocks = {**dict(enumerate(data)), 4: code.parity(data, 4), 5: code.parity(data, 5)}
    for lost in [(0, 1), (2, 5), (4, 5), (3,)]:
        known = {b: v for b, v in blocks.items() if b not in lost}
        assert all(code.block(known, b) == blocks[b] for b in lost)


def test_an_index_naming_a_file_outside_the_store_is_refused() -> None:
    good = {
        "format": 1, "code": "rs", "step": 3, "generation": 0, "ranks": [0, 1, 2, 3],
        "rank": 1, "m": 2, "segment_bytes": 10,
        "parity": [{"key": "parity/a-0.rs", "nbytes": 10}, {"key": "parity/a-1.rs", "nbytes": 10}],
        "members": {
            str(r): {"files": [["data/x.dat", 20]], "needs": ["data/x.dat"], "record": "{}"}
            for r in range(4)
        },
    }  # fmt: skip
    idx = RSIndex.from_json(json.dumps(good).encode(), "test")
    assert idx.parity_keys == ("parity/a-0.rs", "parity/a-1.rs")
    for bad in (
        {**good, "parity": [{"key": "../../etc/passwd", "nbytes": 1}] * 2},
        {**good, "parity": good["parity"][:1]},  # not M files
        {**good, "members": {"0": good["members"]["0"]}},  # not its set
        {**good, "m": 3},
        {**good, "code": "xor"},
    ):
        with pytest.raises(CheckpointFormatError):
            RSIndex.from_json(json.dumps(bad).encode(), "test")


# -- the parity and the rebuild ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "world", "lost"),
    [("rs:2+1", 3, (1,)), ("rs:4+2", 6, (2,)), ("rs:4+2", 6, (0, 4))],
)
def test_lost_nodes_are_rebuilt_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, world: int, lost: tuple[int, ...]
) -> None:
    monkeypatch.setattr(_partner, "WINDOW_BYTES", 5001)  # many rounds, across file bounds
    k, m = parse_rs(spec)
    run_steps(tmp_path, spec, world, (1, 2, 3))
    # Each rank holds M parity files per version, each 1/K of the largest part.
    for rank in range(world):
        store = LocalStore(parity_dir(tmp_path, rank))
        idx = RSIndex.from_json(store.read("index/000000000003.json"), "test")
        largest = max(x.nbytes for x in idx.members.values())
        assert idx.ranks == tuple(range(world)) and idx.m == m
        assert [store.size(p) for p in idx.parity_keys] == [-(-largest // k)] * m
    before = {r: files_of(own_dir(tmp_path, r)) for r in lost}
    parity_before = {r: parity_of(tmp_path, r) for r in lost}
    for r in lost:
        shutil.rmtree(node(tmp_path, r))
    (tmp_path / "run" / commit_key(3)).unlink()  # the persistent level lacks the newest
    for rank, (steps, restored) in enumerate(run_steps(tmp_path, spec, world, ())):
        assert 3 in steps
        assert same(restored, state_of(rank, 3))
    for r in lost:
        assert files_of(own_dir(tmp_path, r)) == before[r]  # bit-exact, records included
        after = parity_of(tmp_path, r)
        assert sorted(after) == sorted(parity_before[r])
        assert all(after[i] == parity_before[r][i] for i in after)  # parity recomputed too
        cryosnap.Run(own_dir(tmp_path, r)).verify(3)


def test_more_than_m_lost_nodes_fall_back_to_the_persistent_level(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_steps(tmp_path, "rs:2+1", 3, (1, 2))
    shutil.rmtree(node(tmp_path, 0))
    shutil.rmtree(node(tmp_path, 2))
    with caplog.at_level("WARNING", logger="cryosnap"):
        results = run_steps(tmp_path, "rs:2+1", 3, ())
    for rank, (_steps, restored) in enumerate(results):
        assert same(restored, state_of(rank, 2))  # from the persistent level
    for rank in (0, 2):
        assert engine.list_steps(LocalStore(own_dir(tmp_path, rank))) == []
    assert "RS set [0, 1, 2]: ranks [0, 2] lost versions" in caplog.text
    assert "persistent level" in caplog.text


def test_parity_retention_follows_scratch_retention(tmp_path: Path) -> None:
    run_steps(tmp_path, "rs:2+1", 3, (1, 2, 3, 4), keep_scratch=2, full_every=1)
    for rank in range(3):
        store = LocalStore(parity_dir(tmp_path, rank))
        assert [int(k[6:18]) for k in store.list("index")] == [3, 4]
        assert len(store.list("parity")) == 2  # M=1 file per kept version


def test_incremental_versions_rebuild_through_their_chain(tmp_path: Path) -> None:
    """A rebuilt incremental version needs its base's files too: their parity outlives the
    base's commit record on scratch."""
    kw: dict[str, Any] = {"keep_scratch": 2, "full_every": 3}
    run_steps(tmp_path, "rs:2+1", 3, (1, 2, 3, 4, 5), **kw)
    record = engine.read_commit(LocalStore(own_dir(tmp_path, 1)), 5)
    assert record.incremental and len(record.chain) > 1
    store = LocalStore(parity_dir(tmp_path, 1))
    assert {int(k[6:18]) for k in store.list("index")} == {*record.chain, 4}
    before = files_of(own_dir(tmp_path, 1))
    shutil.rmtree(node(tmp_path, 1))
    for step in (4, 5):
        (tmp_path / "run" / commit_key(step)).unlink()
    for rank, (steps, restored) in enumerate(run_steps(tmp_path, "rs:2+1", 3, (), **kw)):
        assert list(steps)[-2:] == [4, 5]
        assert same(restored, state_of(rank, 5))
    after = files_of(own_dir(tmp_path, 1))
    assert set(after) == set(before)
    assert {k: v for k, v in after.items() if k in before} == before


@pytest.mark.parametrize(
    ("where", "rank"), [("parity", 0), ("index", 0), ("parity", 2), ("index", 2)]
)
def test_damaged_parity_is_never_used_unverified(tmp_path: Path, where: str, rank: int) -> None:
    """Rank 1 is lost; rank 0 plans its rebuild, rank 2 only sends."""
    run_steps(tmp_path, "rs:2+1", 3, (1, 2))
    holder = parity_dir(tmp_path, rank)
    idx = RSIndex.from_json(LocalStore(holder).read("index/000000000002.json"), "test")
    if where == "parity":
        path = holder / idx.parity_keys[0]
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x5A
        path.write_bytes(bytes(raw))
    else:  # an index pointing outside its store
        doc = json.loads(idx.to_json())
        doc["parity"][0]["key"] = "../../../etc/passwd"
        (holder / "index/000000000002.json").write_text(json.dumps(doc))
    shutil.rmtree(node(tmp_path, 1))
    for rank, (_steps, restored) in enumerate(run_steps(tmp_path, "rs:2+1", 3, ())):
        assert same(restored, state_of(rank, 2))  # from the persistent level
    assert 2 not in engine.list_steps(LocalStore(own_dir(tmp_path, 1)))


def test_config_takes_partner_rs() -> None:
    from cryosnap._run.config import config_arguments

    env = {"CRYOSNAP_PARTNER": "RS:4+2"}
    assert config_arguments({"path": "/r"}, {}, environ=env)["partner"] == "rs:4+2"
