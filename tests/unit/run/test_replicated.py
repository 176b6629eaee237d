"""Replicated state (``save(step, state, replicated=...)``): written once in total, split across
ranks; every rank's part still describes (and verifies) all of its leaves; the divergence
check; restore at another world size.

The ranks are threads of this process (``cryosnap.dist.InProcessGroup``), with a small torch
model and its Adam optimizer as the replicated state and per-rank leaves beside them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._format.chunks import value_runs
from cryosnap._format.keys import manifest_key
from cryosnap._format.manifest import Manifest
from cryosnap._format.skeleton import blob_paths
from cryosnap._run import replicated
from cryosnap._state import flatten
from cryosnap.dist import Coordinator
from cryosnap.engine.write._shares import (
    STRIPES_PER_RANK,
    owner_runs,
    stripe_bytes,
    stripes_per_rank,
)
from cryosnap.errors import (
    CheckpointFormatError,
    IntegrityError,
    ReplicaDivergenceError,
    WorldSizeError,
)
from cryosnap.storage import LocalStore

from ..distributed.test_coordinator import run_ranks

torch = pytest.importorskip("torch")

CHUNK = 4096
OWN_BYTES = 8000  # each rank's own leaf: 1000 float64, unlike any other rank's


def make_model() -> Any:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.Linear(256, 64),
    )


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], dict[str, Any]]:
    """The replicated state every rank starts from: a model and its Adam state after a step."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    (model(torch.randn(8, 64)) * torch.randn(8, 64)).sum().backward()
    opt.step()
    return model.state_dict(), opt.state_dict()


def replica(reference: tuple[dict[str, Any], dict[str, Any]]) -> tuple[Any, Any]:
    model = make_model()
    model.load_state_dict(reference[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.load_state_dict(reference[1])
    return model, opt


def state_of(rank: int, model: Any, opt: Any) -> dict[str, Any]:
    return {
        "model": model,
        "optim": opt,
        "rng": np.random.default_rng(100 + rank).standard_normal(1000),
        "data": {"epoch": 1, "position": 100 * rank},
    }


def replicated_bytes(model: Any, opt: Any) -> int:
    # Packed as a save packs them (small tensors share blobs, with alignment gaps).
    flat = flatten({"model": model, "optim": opt}, pack_bytes=CHUNK)
    return flat.logical_bytes


def assert_model_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def read_manifest(run: Path, step: int, rank: int) -> Manifest:
    store = LocalStore(run)
    return engine.read_manifest(store, engine.read_commit(store, step), rank)[0]


# -- the split ----------------------------------------------------------------------------------


def chunk_sizes(sizes: list[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The bytes of every chunk of the blobs laid end to end."""
    return np.concatenate(
        [np.minimum(CHUNK, n - np.arange(-(-n // CHUNK)) * CHUNK) for n in sizes]
        or [np.zeros(0, np.int64)]
    ).astype(np.int64)


def stripe_lengths(owners: list[Any], sizes: list[int]) -> list[tuple[int, int]]:
    """The stripes along the blobs laid end to end, as ``(owner, bytes)``."""
    along = np.concatenate(owners) if owners else np.zeros(0, np.int32)
    nbytes = chunk_sizes(sizes)
    return [(int(along[a]), int(nbytes[a:b].sum())) for a, b in value_runs(along)]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("scale", [3_000, 300_000, 3_000_000])
def test_shares_split_bytes_evenly_in_round_robin_stripes(world: int, scale: int) -> None:
    rng = np.random.default_rng(world * scale)
    sizes = [int(s) for s in rng.integers(0, scale, 40)]
    total = sum(sizes)
    owners = engine.assign_shares(sizes, world, CHUNK)
    per_rank = [0] * world
    for nbytes, own in zip(sizes, owners, strict=True):
        assert len(own) == -(-nbytes // CHUNK)
        for c, r in enumerate(own.tolist()):
            per_rank[r] += min(CHUNK, nbytes - c * CHUNK)
    assert sum(per_rank) == total
    # The last round aims every rank at 1/N: each is within one chunk of it.
    for got in per_rank:
        assert abs(got - total / world) <= CHUNK, (per_rank, total)
    stripes = stripe_lengths(owners, sizes)
    k = stripes_per_rank(total, world, CHUNK)
    if world == 1:
        assert len(stripes) <= 1
        return
    # Round robin: the next stripe is the next rank's (an empty stripe skips one), each rank
    # at most k runs along the layout, every stripe but the last round's exactly
    # stripe_bytes inside a blob and never shorter than a chunk.
    assert all((b[0] - a[0]) % world != 0 for a, b in itertools.pairwise(stripes))
    assert len(stripes) <= world * k
    assert all(sum(1 for r, _n in stripes if r == rank) <= k for rank in range(world))
    longest = max(n for _r, n in stripes)
    assert longest <= stripe_bytes(total, world, CHUNK) + 2 * k * CHUNK
    assert stripe_bytes(total, world, CHUNK) % CHUNK == 0
    if total >= 64 * world * CHUNK:
        assert k == STRIPES_PER_RANK


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_shares_spread_any_contiguous_change_within_one_stripe(world: int) -> None:
    """Whatever contiguous run of chunks changes, no rank's part of it exceeds 1/N of it by
    more than one stripe (a positional split would put it all on one or two ranks)."""
    rng = np.random.default_rng(world)
    sizes = [int(s) for s in rng.integers(0, 2_000_000, 12)]
    owners = engine.assign_shares(sizes, world, CHUNK)
    along = np.concatenate(owners)
    nbytes = chunk_sizes(sizes)
    longest = max(n for _r, n in stripe_lengths(owners, sizes))
    for _ in range(500):
        a, b = sorted(int(x) for x in rng.integers(0, len(along) + 1, 2))
        changed = int(nbytes[a:b].sum())
        per_rank = np.bincount(along[a:b], weights=nbytes[a:b], minlength=world)
        assert per_rank.max() <= changed / world + longest, (a, b, per_rank, longest)
    # The second half of the layout: every rank writes part of it.
    half = len(along) // 2
    assert set(along[half:].tolist()) == set(range(world))


@pytest.mark.parametrize("world", [2, 3, 5])
def test_owner_runs_follow_the_stripes_within_a_blob(world: int) -> None:
    sizes = [64 * world * CHUNK * 2]  # one blob of many stripes
    (owners,) = engine.assign_shares(sizes, world, CHUNK)
    runs = owner_runs(owners, 0, len(owners))
    assert sum(n for _a, n, _r in runs) == len(owners)
    assert [r for _a, _n, r in runs] == [j % world for j in range(len(runs))]
    assert len(runs) == world * STRIPES_PER_RANK
    for first, count in ((3, 40), (100, 1), (0, 0), (len(owners) - 5, 5)):
        got = owner_runs(owners, first, count)
        assert [(a, n) for a, n, _r in got] == [
            (first + a, b - a) for a, b in value_runs(owners[first : first + count])
        ]
        assert all((owners[a : a + n] == r).all() for a, n, r in got)


# -- saving: written once in total, split across ranks ------------------------------------------


@pytest.mark.parametrize(("world", "lazy"), [(2, False), (3, False), (2, True)])
def test_replicated_state_is_written_once_split_across_ranks(
    tmp_path: Path, world: int, lazy: bool, reference: Any
) -> None:
    run = tmp_path / "run"

    def body(c: Coordinator) -> Any:
        model, opt = replica(reference)
        with cryosnap.Checkpointer(run, comm=c, chunk_bytes=CHUNK) as ckpt:
            first = ckpt.save(
                0, state_of(c.rank, model, opt), replicated=["model", "optim"], lazy=lazy
            )
            first.wait_captured()
            info0 = first.result(timeout=60)
            with torch.no_grad():
                model[0].weight[0, :4] += 1.0  # the same sparse change on every rank
            info1 = ckpt.save(
                1, state_of(c.rank, model, opt), replicated=["model", "optim"]
            ).result(timeout=60)
        return info0, info1, model.state_dict()

    results = run_ranks(world, body)
    model, opt = replica(reference)
    total = replicated_bytes(model, opt)
    firsts = [info0 for info0, _info1, _sd in results]
    shares = [i.written_bytes - OWN_BYTES for i in firsts]
    # Each rank wrote its own leaf and about 1/world of the replicated state; the replicated
    # state was written once in total (Adam's 0-d step counters, equal, are stored once per
    # share: at most a few bytes less).
    mean = sum(shares) / world
    assert all(abs(s - mean) <= 0.1 * mean for s in shares), shares
    assert total - 64 <= sum(shares) <= total
    assert all(not i.incremental for i in firsts)
    # Each rank copied only its own share out of the program's memory (the others' chunks it
    # hashed in place): the ranks together copied the replicated state once.
    copied = [i.captured_bytes - OWN_BYTES for i in firsts]
    assert all(abs(c - total / world) <= 0.1 * total / world for c in copied), copied
    assert sum(copied) == total
    # The sparse change: one chunk, written by the one rank whose share holds it.
    seconds = [info1 for _info0, info1, _sd in results]
    assert all(i.incremental for i in seconds)
    assert sorted(i.written_bytes for i in seconds) == [0] * (world - 1) + [CHUNK]
    for rank in range(world):
        manifest = read_manifest(run, 0, rank)
        assert manifest.replicated == ("model", "optim")
        others = {f for f in manifest.data_files if f"-r{rank:05d}-" not in f}
        assert others, "each part references the chunks the other ranks wrote"
        for step, want in ((0, reference[0]), (1, results[rank][2])):
            got = cryosnap.load(run, step=step, rank=rank)
            assert_model_equal(got["model"], want)
            np.testing.assert_array_equal(got["rng"], state_of(rank, model, opt)["rng"])
            assert got["data"] == {"epoch": 1, "position": 100 * rank}
            assert got["optim"]["state"][0]["exp_avg"].equal(reference[1]["state"][0]["exp_avg"])
        engine.verify_part(LocalStore(run), 1, rank=rank)


@pytest.mark.parametrize("world", [2, 4])
def test_a_contiguous_changed_half_is_spread_over_the_ranks(tmp_path: Path, world: int) -> None:
    """An incremental save whose changes are one contiguous half of the replicated state (a
    trainable half, the layers after a frozen trunk): each rank writes 1/N of the change, give
    or take one stripe, not the half's owner all of it."""
    layers = 16
    weights = {f"w{i:02d}": torch.arange(16384, dtype=torch.float32) + i for i in range(layers)}
    run = tmp_path / "run"

    def body(c: Coordinator) -> Any:
        state = {"model": {k: v.clone() for k, v in weights.items()}}
        with cryosnap.Checkpointer(run, comm=c, chunk_bytes=CHUNK) as ckpt:
            first = ckpt.save(0, state, replicated=True).result(timeout=60)
            for i in range(layers // 2, layers):
                state["model"][f"w{i:02d}"] += 1.0  # the second half: trained
            second = ckpt.save(1, state, replicated=True).result(timeout=60)
        return first.written_bytes, second.written_bytes

    results = run_ranks(world, body)
    flat = flatten({"model": weights}, pack_bytes=CHUNK)
    total = flat.logical_bytes
    changed = total // 2
    split = replicated.plan(flat, True, world, CHUNK)
    sizes = [flat.blobs[i].nbytes for i in split.blobs]
    longest = max(n for _r, n in stripe_lengths([split.shares[i] for i in split.blobs], sizes))
    assert longest <= stripe_bytes(total, world, CHUNK) + 2 * STRIPES_PER_RANK * CHUNK
    firsts = [f for f, _s in results]
    seconds = [s for _f, s in results]
    assert sum(firsts) == total
    assert all(abs(f - total / world) <= CHUNK for f in firsts), firsts
    # Written once in total, spread within one stripe of 1/N per rank; every rank wrote.
    assert sum(seconds) == changed
    assert all(0 < s <= changed / world + longest for s in seconds), (seconds, longest)
    got = cryosnap.load(run, step=1, rank=world - 1)["model"]
    for i in range(layers):
        want = weights[f"w{i:02d}"] + (1.0 if i >= layers // 2 else 0.0)
        assert got[f"w{i:02d}"].equal(want)
    engine.verify_part(LocalStore(run), 1, rank=0)


def test_retention_keeps_the_files_other_ranks_parts_reference(
    tmp_path: Path, reference: Any
) -> None:
    def body(c: Coordinator) -> Any:
        model, opt = replica(reference)
        weights = []
        with cryosnap.Checkpointer(tmp_path, comm=c, chunk_bytes=CHUNK, keep=2) as ckpt:
            for step in range(5):
                with torch.no_grad():
                    model[2].weight[40 * step, :8] += 1.0
                state = state_of(c.rank, model, opt)
                lazy = step % 2 == 1  # lazy capture feeds the same writer path
                ckpt.save(step, state, lazy=lazy, replicated=["model", "optim"]).result()
                weights.append(model[2].weight.detach().clone())
        return weights

    weights = run_ranks(3, body)[0]
    store = LocalStore(tmp_path)
    assert engine.list_steps(store) == [3, 4]
    kept = [engine.read_commit(store, s) for s in (3, 4)]
    assert set(store.list("data")) == {f for r in kept for f in r.data_files}
    for step in (3, 4):
        for rank in range(3):
            got = cryosnap.load(tmp_path, step=step, rank=rank)
            assert got["model"]["2.weight"].equal(weights[step])


def test_a_rank_verifies_the_chunks_another_rank_wrote(tmp_path: Path, reference: Any) -> None:
    def save(c: Coordinator) -> None:
        model, opt = replica(reference)
        with cryosnap.Checkpointer(tmp_path, comm=c, chunk_bytes=CHUNK) as ckpt:
            ckpt.save(0, state_of(c.rank, model, opt), replicated=["model", "optim"]).result()

    run_ranks(2, save)
    # The first chunk rank 1's part reads from rank 0's data file: damage it there.
    mine = read_manifest(tmp_path, 0, 1)
    theirs = next(i for i, f in enumerate(mine.data_files) if "-r00000-" in f)
    blob, offset = next(
        (b, row[2])
        for b, entry in enumerate(mine.blobs)
        for row in entry.table.tolist()
        if row[0] == 0 and row[1] == theirs
    )
    victim = tmp_path / mine.data_files[theirs]
    raw = bytearray(victim.read_bytes())
    raw[offset] ^= 0xFF
    victim.write_bytes(bytes(raw))
    leaf = blob_paths(mine.skeleton, len(mine.blobs))[blob]
    assert leaf.startswith(("model/", "optim/"))
    with pytest.raises(IntegrityError, match=re.escape(leaf)):
        cryosnap.load(tmp_path, step=0, rank=1)


def test_the_manifest_records_the_replicated_keys() -> None:
    base = Manifest(
        step=1,
        rank=0,
        chunk_bytes=CHUNK,
        data_files=(),
        blobs=(),
        skeleton={"t": "dict", "k": [], "v": []},
        leaves=0,
        logical_bytes=0,
        created_unix=1.0,
    )
    assert b"replicated" not in base.to_json()  # absent unless set: format_version stays 1
    for keys in (None, True, ("model", 3)):
        manifest = dataclasses.replace(base, replicated=keys)
        assert Manifest.from_json(manifest.to_json(), "here").replicated == keys
    for bad in ("model", {"k": 1}, [1.5], False):
        doc = json.loads(base.to_json())
        doc["replicated"] = bad
        with pytest.raises(CheckpointFormatError, match="replicated"):
            Manifest.from_json(json.dumps(doc).encode(), "here")


def test_a_world_of_one_accepts_replicated_and_records_it(tmp_path: Path, reference: Any) -> None:
    model, opt = replica(reference)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        info = ckpt.save(0, state_of(0, model, opt), replicated=["model", "optim"]).result()
        with_keys = ckpt.restore(replicated_only=True)
    assert info.written_bytes >= replicated_bytes(model, opt) - 64 + OWN_BYTES
    assert read_manifest(tmp_path, 0, 0).replicated == ("model", "optim")
    assert set(with_keys) == {"model", "optim"}
    assert_model_equal(with_keys["model"], reference[0])


def test_replicated_is_checked_on_the_callers_thread(tmp_path: Path) -> None:
    state = {"w": np.zeros(4), 3: np.ones(2)}
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"'model' is not a top-level key"):
            ckpt.save(0, state, replicated=["w", "model"])
        with pytest.raises(TypeError, match="replicated must be True, None or a list"):
            ckpt.save(0, state, replicated="w")
        with pytest.raises(TypeError, match="keys are str or int"):
            ckpt.save(0, state, replicated=[1.5])
        with pytest.raises(ValueError, match="the state is not a dict"):
            ckpt.save(0, [np.zeros(4)], replicated=["w"])
        ckpt.save(0, state, replicated=[3, "w", 3]).result()
        ckpt.save(1, [np.zeros(4)], replicated=True).result()
        assert ckpt.steps() == [0, 1]
    assert read_manifest(tmp_path, 0, 0).replicated == (3, "w")
    assert read_manifest(tmp_path, 1, 0).replicated is True


# -- the divergence check -------------------------------------------------------------------------


def test_divergent_replicas_fail_on_every_rank_and_commit_nothing(
    tmp_path: Path, reference: Any
) -> None:
    def body(c: Coordinator) -> Any:
        model, opt = replica(reference)
        with cryosnap.Checkpointer(tmp_path, comm=c, chunk_bytes=CHUNK) as ckpt:
            ckpt.save(0, state_of(c.rank, model, opt), replicated=["model", "optim"]).result()
            if c.rank == 1:
                with torch.no_grad():  # a leaf of its own (a packed one names its pack's first)
                    model[2].weight[5, 5] += 1.0
            pending = ckpt.save(1, state_of(c.rank, model, opt), replicated=["model", "optim"])
            with pytest.raises(ReplicaDivergenceError) as diverged:
                pending.result(timeout=60)
            steps = ckpt.steps()
            # The ranks passed different keys: refused alike, nothing committed.
            keys = ["model"] if c.rank == 2 else ["model", "optim"]
            with pytest.raises(ReplicaDivergenceError) as argument:
                ckpt.save(2, state_of(c.rank, model, opt), replicated=keys).result(timeout=60)
            # The writer channel is still in step: a consistent save commits.
            model.load_state_dict(reference[0])
            ckpt.save(3, state_of(c.rank, model, opt), replicated=["model", "optim"]).result()
            return str(diverged.value), steps, str(argument.value), ckpt.steps()

    for message, steps, argument, after in run_ranks(3, body):
        expected = "replicated leaf model/2.weight differs between ranks: ranks [0, 2] vs ranks [1]"
        assert expected in message
        assert "nothing was committed" in message
        assert steps == [0]
        assert "the ranks passed different replicated=" in argument
        assert after == [0, 3]
    assert engine.list_steps(LocalStore(tmp_path)) == [0, 3]


# -- restore at another world size ----------------------------------------------------------------


def test_restore_with_fewer_and_more_ranks_than_saved(tmp_path: Path, reference: Any) -> None:
    def save(c: Coordinator) -> None:
        model, opt = replica(reference)
        with cryosnap.Checkpointer(tmp_path, comm=c, chunk_bytes=CHUNK) as ckpt:
            ckpt.save(0, state_of(c.rank, model, opt), replicated=["model", "optim"]).result()

    run_ranks(3, save)

    def fewer(c: Coordinator) -> Any:
        with cryosnap.Checkpointer(tmp_path, comm=c) as ckpt:
            with pytest.raises(WorldSizeError) as refused:
                ckpt.restore()
            return str(refused.value), ckpt.restore(replicated_only=True)

    # Fewer ranks than saved: saved rank 2's part would be dropped, so every rank refuses;
    # the replicated keys restore at any size, and load(rank=k) reads any saved part.
    for message, got in run_ranks(2, fewer):
        assert "saved by 3 rank(s) and 2 participant(s)" in message
        assert "rank 2 would be left unread" in message
        assert "replicated_only=True" in message and "rank=k" in message
        assert "restart at 3 ranks" in message
        assert set(got) == {"model", "optim"}
        assert_model_equal(got["model"], reference[0])
    for rank in range(3):
        assert cryosnap.load(tmp_path, rank=rank)["data"]["position"] == 100 * rank

    def more(c: Coordinator) -> Any:
        torch.manual_seed(1000 + c.rank)
        model = make_model()  # not the saved weights until restored
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        state = state_of(50 + c.rank, model, opt)
        rng_before = state["rng"].copy()
        with cryosnap.Checkpointer(tmp_path, comm=c) as ckpt:
            with pytest.raises(WorldSizeError) as missing:
                ckpt.restore()
            with pytest.raises(WorldSizeError):
                ckpt.restore(0)  # an explicit step alike
            got = ckpt.restore(into=state, replicated_only=True)
        np.testing.assert_array_equal(state["rng"], rng_before)  # not replicated: untouched
        assert set(got) == {"model", "optim"}
        return str(missing.value), model.state_dict(), opt.state_dict()

    for message, model_sd, opt_sd in run_ranks(4, more):
        assert "saved by 3 rank(s) and 4 participant(s)" in message
        assert "rank 3 would have no part of it" in message
        assert "replicated_only=True" in message and "rank=k" in message
        assert_model_equal(model_sd, reference[0])
        assert opt_sd["state"][1]["exp_avg_sq"].equal(reference[1]["state"][1]["exp_avg_sq"])
    with pytest.raises(WorldSizeError, match="rank 3 has no part"):
        cryosnap.load(tmp_path, rank=3)


def test_replicated_only_needs_a_version_with_replicated_keys(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, {"w": np.arange(4)}).result()
        with pytest.raises(cryosnap.CheckpointError, match="saved without replicated="):
            ckpt.restore(0, replicated_only=True)
        ckpt.save(1, {"w": np.arange(4), "r": np.ones(3)}, replicated=["w"]).result()
        with pytest.raises(cryosnap.StateMismatchError, match="holding the replicated keys"):
            ckpt.restore(1, into={"r": np.ones(3)}, replicated_only=True)
        got = ckpt.restore(1, replicated_only=True)
    assert list(got) == ["w"]
    np.testing.assert_array_equal(got["w"], np.arange(4))
    assert manifest_key(1, 0) in {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.json")}
