"""Restores that read straight into ``into=``'s own tensors and arrays (``tree.direct_targets``,
two passes in ``engine.fetch``), the reads verified as they land, and the fallbacks: nothing in
``into`` changes before every chunk verified, overlapping or non-contiguous targets keep the
copy, and errors name the first damage in blob order whatever the read order."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap import engine
from cryosnap._format.keys import manifest_key
from cryosnap._format.manifest import Manifest
from cryosnap._format.skeleton import blob_paths
from cryosnap._state import check_into, direct_targets, flatten
from cryosnap._state import into as into_module
from cryosnap.engine.fetch import _execute
from cryosnap.storage import LocalStore, Store, open_store
from cryosnap.testing import FaultyStore

from ..support import snapshot

CHUNK = 4096
STEP = 3


@pytest.fixture(autouse=True)
def _direct_small_leaves() -> Iterator[None]:
    """The states here are small: every leaf may be read into directly."""
    with engine.read_limits(direct_min_bytes=0):
        yield


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "big": torch.from_numpy(rng.standard_normal(50_000).astype(np.float32)),  # 49 chunks
        "half": torch.from_numpy(rng.standard_normal((30, 70)).astype(np.float32)).bfloat16(),
        "arr": rng.standard_normal((40, 60)),
        "ints": np.arange(5000, dtype=np.int16),
        "param": torch.nn.Parameter(torch.from_numpy(rng.standard_normal(3000).astype(np.float32))),
        "list": [torch.arange(7), np.arange(3.0)],
        "step": 7,
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    def zero(x: Any) -> Any:
        if isinstance(x, torch.nn.Parameter):
            return torch.nn.Parameter(torch.zeros_like(x), requires_grad=x.requires_grad)
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, np.ndarray):
            return np.zeros_like(x)
        if isinstance(x, list):
            return [zero(v) for v in x]
        return x

    return {k: zero(v) for k, v in state.items()}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a.detach(), b.detach()))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, list):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _unmapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local runs are read with preadv, as on a network file system, instead of mapped."""
    monkeypatch.setattr(LocalStore, "map_file", lambda self, key: None)


@pytest.fixture(params=["local", "local-read", "memory"])
def location(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    if request.param == "local-read":
        _unmapped(monkeypatch)
    loc = str(tmp_path / "run") if request.param != "memory" else f"memory://{uuid.uuid4()}"
    cryosnap.save(loc, _state(), step=STEP, chunk_bytes=CHUNK)
    return loc


def _data_file(location: str) -> tuple[Store, str, Manifest]:
    store = open_store(location)
    manifest = Manifest.from_json(store.read(manifest_key(STEP, 0)), "test")
    (key,) = manifest.data_files
    return store, key, manifest


def _segment(manifest: Manifest, leaf: str) -> tuple[int, int]:
    """(offset, nbytes) of the one stored run of the blob of ``leaf`` (a full version)."""
    blob = blob_paths(manifest.skeleton, len(manifest.blobs)).index(leaf)
    rows = manifest.blobs[blob].table
    assert len(rows) == 1
    return int(rows[0][2]), int(rows[0][3])


def _damage(location: str, pos: int) -> None:
    store, key, _manifest = _data_file(location)
    data = bytearray(store.read(key))
    data[pos] ^= 0x5A
    root = store.capabilities.local_path
    if root is not None:
        (root / key).write_bytes(bytes(data))
    else:
        store.write(key, bytes(data))


# ---------------------------------------------------------------------------------------------
# which leaves are read into directly


def test_direct_targets_picks_plain_contiguous_cpu_leaves() -> None:
    state = _state()
    skeleton = flatten(state).skeleton
    into = _zeros_like(state)
    found = direct_targets(skeleton, into)
    assert {id(v) for v in found.values()} == {
        id(into["big"]),
        id(into["half"]),
        id(into["arr"]),
        id(into["ints"]),
        id(into["param"]),
        id(into["list"][0]),
        id(into["list"][1]),
    }


def test_direct_targets_leaves_out_what_needs_the_copy() -> None:
    state = _state()
    skeleton = flatten(state).skeleton
    into = _zeros_like(state)
    into["arr"] = np.asfortranarray(into["arr"])  # not C-contiguous
    wide = torch.zeros(2, 3000)
    into["param"] = wide[0]  # contiguous view: kept
    into["ints"] = np.zeros(10_000, np.int16)[::2]  # strided view: not contiguous
    with torch.inference_mode():
        into["half"] = torch.zeros(30, 70, dtype=torch.bfloat16)  # an inference tensor
    check_into(skeleton, into)
    chosen = {id(v) for v in direct_targets(skeleton, into).values()}
    assert id(into["big"]) in chosen
    assert id(into["param"]) in chosen  # a Parameter's place taken by a plain tensor
    assert id(into["arr"]) not in chosen
    assert id(into["ints"]) not in chosen
    assert id(into["half"]) not in chosen


def test_direct_targets_leave_overlapping_leaves_to_the_copy() -> None:
    state = {"a": torch.arange(600.0), "b": torch.arange(600.0) + 1, "c": torch.zeros(10)}
    skeleton = flatten(state).skeleton
    base = torch.zeros(1000)
    into = {"a": base[:600], "b": base[400:], "c": torch.zeros(10)}  # a and b overlap
    chosen = {id(v) for v in direct_targets(skeleton, into).values()}
    assert chosen == {id(into["c"])}
    # Views of one storage that do not overlap are read into directly, both.
    base = torch.zeros(1300)
    into = {"a": base[:600], "b": base[600:1200], "c": base[1290:]}
    assert len(direct_targets(skeleton, into)) == 3
    # An array sharing memory with a tensor counts as an overlap, as does one leaf used twice.
    t = torch.zeros(600)
    into = {"a": t, "b": t, "c": torch.zeros(10)}
    assert {id(v) for v in direct_targets(skeleton, into).values()} == {id(into["c"])}
    arr = np.zeros(600, np.float32)
    into = {"a": torch.from_numpy(arr), "b": torch.zeros(600), "c": torch.zeros(10)}
    assert len(direct_targets(skeleton, into)) == 3
    state["c"] = np.zeros(600, np.float32)
    skeleton = flatten(state).skeleton
    into = {"a": torch.from_numpy(arr), "b": torch.zeros(600), "c": arr}
    assert {id(v) for v in direct_targets(skeleton, into).values()} == {id(into["b"])}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 64), st.integers(1, 24), st.booleans()), min_size=0, max_size=12
    )
)
def test_the_bulk_overlap_check_finds_every_pair(spans: list[tuple[int, int, bool]]) -> None:
    """into._overlapping (sorted, in numpy) against every pair: a target overlapping any other
    span (a target or a leaf that keeps the copy) is left to the copy, the others are not."""
    rows: list[tuple[int, int, int]] = []
    for lo, n, target in spans:
        rows.append((lo, lo + n, len([r for r in rows if r[2] >= 0]) if target else -1))
    want = {
        w
        for i, (lo, hi, w) in enumerate(rows)
        if w >= 0 and any(lo < b and a < hi for j, (a, b, _w) in enumerate(rows) if j != i)
    }
    assert into_module._overlapping(np.array(rows, np.int64).reshape(-1, 3)) == want


def test_direct_targets_keep_the_copy_for_small_leaves() -> None:
    state = {"a": torch.zeros(1000), "b": torch.zeros(100_000)}
    skeleton = flatten(state).skeleton
    into = {"a": torch.ones(1000), "b": torch.ones(100_000)}
    assert len(direct_targets(skeleton, into)) == 2
    chosen = direct_targets(skeleton, into, min_bytes=4001)
    assert [id(v) for v in chosen.values()] == [id(into["b"])]


class _Sub(torch.Tensor):
    pass


def test_direct_targets_pick_none_beside_a_tensor_subclass() -> None:
    state = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
    skeleton = flatten(state).skeleton
    into = {"a": torch.ones(1000), "b": torch.ones(1000).as_subclass(_Sub)}
    assert direct_targets(skeleton, into) == {}


@pytest.mark.parametrize("kind", ["sparse", "subclass"])
def test_unusual_into_tensors_behave_as_before(tmp_path: Path, kind: str) -> None:
    cryosnap.save(tmp_path, {"w": torch.arange(10_000.0).reshape(100, 100)}, chunk_bytes=CHUNK)
    if kind == "sparse":
        with pytest.raises(cryosnap.CheckpointError, match="filling into= failed"):
            cryosnap.load(tmp_path, into={"w": torch.zeros(100, 100).to_sparse()})
        return
    w = torch.zeros(100, 100).as_subclass(_Sub)
    out = cryosnap.load(tmp_path, into={"w": w})
    assert out["w"] is w
    assert torch.equal(w.as_subclass(torch.Tensor), torch.arange(10_000.0).reshape(100, 100))


def test_direct_targets_skip_stateful_objects() -> None:
    model = torch.nn.Linear(4, 3)
    state = {"model": model, "w": torch.ones(3)}
    skeleton = flatten(state).skeleton
    into = {"model": torch.nn.Linear(4, 3), "w": torch.zeros(3)}
    assert {id(v) for v in direct_targets(skeleton, into).values()} == {id(into["w"])}


# ---------------------------------------------------------------------------------------------
# restores into


def test_into_is_filled_in_place(location: str) -> None:
    into = _zeros_like(_state())
    leaves = {k: v for k, v in into.items() if k != "step"}
    version = into["param"]._version
    out = cryosnap.load(location, into=into)
    assert out is into
    for k, v in leaves.items():
        assert into[k] is v
        assert _equal(_state()[k], v), k
    assert isinstance(into["param"], torch.nn.Parameter) and into["param"].requires_grad
    # As a copy_ would: autograd sees the in-place change.
    assert into["param"]._version > version


def test_small_leaves_are_read_once_by_default(tmp_path: Path) -> None:
    defaults = engine.ReadLimits()  # the default threshold, not this module's
    assert _state()["big"].nbytes < defaults.direct_min_bytes  # the largest leaf
    cryosnap.save(tmp_path, _state(), step=STEP, chunk_bytes=CHUNK)
    read: list[int] = []
    store = FaultyStore(LocalStore(tmp_path))
    inner = store.read_ranges

    def counting(key: str, ranges: Any) -> None:
        inner(key, ranges)
        read.append(sum(v.nbytes for _o, bufs in ranges for v in bufs))

    store.read_ranges = counting  # type: ignore[method-assign]
    into = _zeros_like(_state())
    engine.read_part(store, STEP, into=into, limits=defaults)
    logical = Manifest.from_json(store.read(manifest_key(STEP, 0)), "t").logical_bytes
    assert sum(read) < logical + 4 * (64 << 10)
    assert all(_equal(_state()[k], into[k]) for k in into)


def test_the_direct_path_reads_each_byte_twice_through_the_store(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, _state(), step=STEP, chunk_bytes=CHUNK)
    read: list[int] = []
    store = FaultyStore(LocalStore(tmp_path))
    inner = store.read_ranges

    def counting(key: str, ranges: Any) -> None:
        inner(key, ranges)
        read.append(sum(v.nbytes for _o, bufs in ranges for v in bufs))

    store.read_ranges = counting  # type: ignore[method-assign]
    into = _zeros_like(_state())
    engine.read_part(store, STEP, into=into)
    logical = Manifest.from_json(store.read(manifest_key(STEP, 0)), "t").logical_bytes
    assert logical <= sum(read) <= 2 * logical + 4 * (64 << 10)
    assert all(_equal(_state()[k], into[k]) for k in into)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_damage_anywhere_leaves_into_untouched(location: str, where: str) -> None:
    _store, _key, manifest = _data_file(location)
    offset, nbytes = _segment(manifest, "big")  # 49 chunks
    pos = {"start": offset, "middle": offset + nbytes // 2, "end": offset + nbytes - 1}[where]
    _damage(location, pos)
    into = _zeros_like(_state())
    before = snapshot(into)
    with pytest.raises(cryosnap.IntegrityError) as info:
        cryosnap.load(location, step=STEP, into=into)
    chunk = (pos - offset) // CHUNK
    assert f"leaf big: chunk {chunk} " in str(info.value)
    assert snapshot(into) == before


def test_the_first_damage_in_blob_order_is_named(location: str) -> None:
    _store, _key, manifest = _data_file(location)
    # Two damaged blobs: the message names the one first in blob order, whatever order the
    # reads ran in.
    paths = blob_paths(manifest.skeleton, len(manifest.blobs))
    for leaf in ("big", "ints"):
        offset, nbytes = _segment(manifest, leaf)
        _damage(location, offset + nbytes - 1)
    first = min(("big", "ints"), key=paths.index)
    chunk = {"big": 48, "ints": 2}[first]
    with pytest.raises(cryosnap.IntegrityError, match=f"leaf {first}: chunk {chunk} "):
        cryosnap.load(location, step=STEP)
    with pytest.raises(cryosnap.IntegrityError, match=f"leaf {first}: chunk {chunk} "):
        cryosnap.load(location, step=STEP, into=_zeros_like(_state()))


def _truncation_leaves_into_untouched(tmp_path: Path, leaf: str, keep: int) -> None:
    """The data file cut ``keep`` bytes into ``leaf``'s data: the restore names the leaf and
    into= stays as it was."""
    cryosnap.save(tmp_path, _state(), step=STEP, chunk_bytes=CHUNK)
    _store, key, manifest = _data_file(str(tmp_path))
    offset, _n = _segment(manifest, leaf)
    path = tmp_path / key
    path.write_bytes(path.read_bytes()[: offset + keep])
    into = _zeros_like(_state())
    before = snapshot(into)
    with pytest.raises(cryosnap.IntegrityError, match=rf"truncated.*leaf {leaf} cannot be read"):
        cryosnap.load(tmp_path, step=STEP, into=into)
    assert snapshot(into) == before


def test_truncated_file_leaves_into_untouched(tmp_path: Path) -> None:
    _truncation_leaves_into_untouched(tmp_path, "arr", 100)


def test_a_refusing_load_state_dict_comes_before_any_direct_fill(tmp_path: Path) -> None:
    class Refuses:
        def state_dict(self) -> dict[str, Any]:
            return {"x": 1}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise ValueError("no")

    cryosnap.save(tmp_path, {"obj": Refuses(), "w": torch.arange(5000.0)}, chunk_bytes=CHUNK)
    into = {"obj": Refuses(), "w": torch.zeros(5000)}
    with pytest.raises(cryosnap.StateMismatchError, match="refused"):
        cryosnap.load(tmp_path, into=into)
    assert not into["w"].any()


def test_a_file_that_changes_between_the_passes_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second pass verifies every read again: bytes that changed since the first pass never
    reach into=, and the restore fails. (From a cold file into= is staged, read once: no
    second pass; the files here count as warm.)"""
    cryosnap.save(tmp_path, _state(), step=STEP, chunk_bytes=CHUNK)
    _store, _key, manifest = _data_file(str(tmp_path))
    offset, nbytes = _segment(manifest, "big")
    second = _execute.PartReader.second_pass

    def damage_then_fill(self: Any) -> None:
        _damage(str(tmp_path), offset + nbytes // 2)
        second(self)

    monkeypatch.setattr(_execute.PartReader, "second_pass", damage_then_fill)
    into = _zeros_like(_state())
    with (
        engine.read_limits(cold_share=0.0),
        pytest.raises(cryosnap.IntegrityError, match="leaf big: chunk 24 "),
    ):
        cryosnap.load(tmp_path, step=STEP, into=into)
    # Whatever reached "big" is the version's own bytes (verified), the damaged chunk is not.
    want = _state()["big"].view(torch.uint8).reshape(-1)
    got = into["big"].view(torch.uint8).reshape(-1)
    written = got != 0
    assert torch.equal(got[written], want[written])
    bad = slice(24 * CHUNK, 25 * CHUNK)
    assert not got[bad].any()


def test_overlapping_into_views_are_filled_in_tree_order(location: str) -> None:
    state = {"a": torch.arange(3000.0), "b": -torch.arange(3000.0), "c": np.ones(2000)}
    cryosnap.save(location, state, step=STEP + 1, chunk_bytes=CHUNK)
    base = torch.zeros(5000)
    into = {"a": base[:3000], "b": base[2000:], "c": np.zeros(2000)}
    cryosnap.load(location, step=STEP + 1, into=into)
    want = torch.cat([torch.arange(2000.0), -torch.arange(3000.0)])
    assert torch.equal(base, want)  # a first, then b over the overlap: as copies in order
    assert (into["c"] == 1).all()


def test_non_contiguous_into_falls_back_to_the_copy(location: str) -> None:
    into = _zeros_like(_state())
    into["arr"] = np.asfortranarray(into["arr"])
    into["half"] = torch.zeros(70, 30, dtype=torch.bfloat16).t()
    arr, half = into["arr"], into["half"]
    cryosnap.load(location, step=STEP, into=into)
    assert into["arr"] is arr and into["half"] is half
    assert _equal(_state()["arr"], arr) and _equal(_state()["half"], half)


def test_inference_tensor_into_fails_as_before(location: str) -> None:
    into = _zeros_like(_state())
    with torch.inference_mode():
        into["big"] = torch.zeros(50_000)
    with pytest.raises(cryosnap.CheckpointError, match="filling into= failed"):
        cryosnap.load(location, step=STEP, into=into)


def test_scattered_chain_restores_into_and_damage_leaves_it_untouched(tmp_path: Path) -> None:
    # The gathered path (a blob scattered over many runs of its chain) into into=: gathered
    # into a private buffer, verified there, copied in place.
    rng = np.random.default_rng(5)
    arr = rng.standard_normal(1_000_003).astype(np.float32)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, full_every=16) as ckpt:
        for step in range(4):
            arr[rng.choice(arr.size, 400, replace=False)] += 1
            arr[-1] += 1
            ckpt.save(step, {"x": arr, "t": torch.from_numpy(arr[:5000].copy())}).result()
    store = LocalStore(tmp_path)
    part = engine.resolve_version(store, 3)
    runs = 1 + int(np.count_nonzero(np.diff(part.blobs[0].offsets) != CHUNK))
    assert runs > engine.ReadLimits().fragmented_runs
    into = {"x": np.zeros_like(arr), "t": torch.zeros(5000)}
    x = into["x"]
    cryosnap.load(tmp_path, step=3, into=into)
    assert into["x"] is x
    np.testing.assert_array_equal(x, arr)
    assert torch.equal(into["t"], torch.from_numpy(arr[:5000]))
    # Damage in a chunk gathered from the base's data file.
    base_key = engine.read_commit(store, 0).data_files[0]
    blob = part.blobs[0]
    live = np.flatnonzero(blob.files == part.files.index(base_key))
    raw = bytearray((tmp_path / base_key).read_bytes())
    raw[int(blob.offsets[live[len(live) // 2]]) + 7] ^= 0xFF
    (tmp_path / base_key).write_bytes(bytes(raw))
    into = {"x": np.zeros_like(arr), "t": torch.zeros(5000)}
    with pytest.raises(cryosnap.IntegrityError, match="leaf x"):
        cryosnap.load(tmp_path, step=3, into=into)
    assert not into["x"].any() and not into["t"].any()


def test_stores_without_a_local_path_read_once(location: str) -> None:
    store = open_store(location)
    into = _zeros_like(_state())
    engine.read_part(store, STEP, into=into)
    assert all(_equal(_state()[k], into[k]) for k in into)


# ---------------------------------------------------------------------------------------------
# many small leaves, large leaves split across tasks


def test_many_small_leaves_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    state: dict[str, Any] = {
        f"t{i}": torch.from_numpy(rng.standard_normal(int(rng.integers(0, 3000))).astype("f4"))
        for i in range(300)
    }
    state["large"] = torch.from_numpy(rng.standard_normal(100_000).astype(np.float32))
    cryosnap.save(tmp_path, state, chunk_bytes=CHUNK)
    into = {k: torch.full_like(v, 7.0) for k, v in state.items()}
    # Many tasks, leaves split over them.
    with engine.read_limits(io_batch_bytes=64 << 10, bounce_bytes=32 << 10):
        out = cryosnap.load(tmp_path)
        cryosnap.load(tmp_path, into=into)
    assert all(torch.equal(state[k], out[k]) for k in state)
    assert all(torch.equal(state[k], into[k]) for k in state)


def test_deduplicated_content_is_read_for_every_leaf(tmp_path: Path) -> None:
    state = {"a": torch.ones(5000), "b": torch.ones(5000), "c": torch.zeros(20_000)}
    info = cryosnap.save(tmp_path, state, chunk_bytes=CHUNK)
    assert info.written_bytes < 30_000 * 4 // 4  # stored once, referenced from several places
    into = {k: torch.full_like(v, 3.0) for k, v in state.items()}
    cryosnap.load(tmp_path, into=into)
    assert all(torch.equal(state[k], into[k]) for k in state)


@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count_restores(location: str, threads: int) -> None:
    into = _zeros_like(_state())
    with engine.read_limits(read_threads=threads, io_batch_bytes=16 << 10, bounce_bytes=8 << 10):
        cryosnap.load(location, step=STEP, into=into)
    assert all(_equal(_state()[k], into[k]) for k in into)


@pytest.mark.parametrize("into_given", [False, True])
def test_damage_among_many_small_leaves_is_named(tmp_path: Path, into_given: bool) -> None:
    """A task's small pieces are verified together: damage in any of them still names the
    first damaged leaf in blob order and its chunk, and leaves into= untouched."""
    rng = np.random.default_rng(2)
    state: dict[str, Any] = {
        f"t{i:03d}": torch.from_numpy(rng.standard_normal(int(rng.integers(1, 3000))).astype("f4"))
        for i in range(200)
    }
    loc = str(tmp_path / "run")
    cryosnap.save(loc, state, step=STEP, chunk_bytes=CHUNK)
    _store, _key, manifest = _data_file(loc)
    paths = blob_paths(manifest.skeleton, len(manifest.blobs))
    damaged = ["t150", "t077", "t078"]
    for leaf in damaged:
        offset, nbytes = _segment(manifest, leaf)
        _damage(loc, offset + nbytes - 1)
    first = min(damaged, key=paths.index)
    chunk = (_segment(manifest, first)[1] - 1) // CHUNK
    into = {k: torch.full_like(v, 7.0) for k, v in state.items()} if into_given else None
    before = snapshot(into) if into is not None else None
    with (
        engine.read_limits(io_batch_bytes=256 << 10, bounce_bytes=64 << 10),
        pytest.raises(cryosnap.IntegrityError, match=f"leaf {first}: chunk {chunk} "),
    ):
        cryosnap.load(loc, step=STEP, into=into)
    if into is not None:
        assert snapshot(into) == before


def test_damage_in_a_gathered_chunk_names_the_chunk(tmp_path: Path) -> None:
    """The gathered path verifies its chunks all at once: damage still names the chunk."""
    rng = np.random.default_rng(6)
    arr = rng.standard_normal(600_001).astype(np.float32)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, full_every=16) as ckpt:
        for step in range(4):
            arr[rng.choice(arr.size, 400, replace=False)] += 1
            ckpt.save(step, {"x": arr}).result()
    store = LocalStore(tmp_path)
    part = engine.resolve_version(store, 3)
    blob = part.blobs[0]
    runs = 1 + int(np.count_nonzero(np.diff(blob.offsets) != CHUNK))
    assert runs > engine.ReadLimits().fragmented_runs
    base_key = engine.read_commit(store, 0).data_files[0]
    live = np.flatnonzero(blob.files == part.files.index(base_key))
    chunks = [int(live[len(live) // 2]), int(live[-3])]
    raw = bytearray((tmp_path / base_key).read_bytes())
    for c in chunks:
        raw[int(blob.offsets[c]) + 11] ^= 0xFF
    (tmp_path / base_key).write_bytes(bytes(raw))
    with pytest.raises(cryosnap.IntegrityError, match=f"leaf x: chunk {min(chunks)} "):
        cryosnap.load(tmp_path, step=3)


@pytest.fixture
def sequential_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Every restore reads into='s leaves as from a cold cache: one reader in file order, the
    pool verifying (small tasks, so that there are many); records each probe's answer. The
    files count as warm: not the direct reads of cold files."""
    _unmapped(monkeypatch)
    probes: list[bool] = []

    def cold(self: Any, tasks: Any) -> bool:
        probes.append(True)
        return True

    monkeypatch.setattr(_execute.PartReader, "_cold", cold)
    with engine.read_limits(bounce_bytes=8 << 10, io_batch_bytes=16 << 10, cold_share=0.0):
        yield probes


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_sequential_reads_restore_into_and_name_damage(
    tmp_path: Path, sequential_reads: list[bool], threads: int
) -> None:
    location = str(tmp_path / "run")
    cryosnap.save(location, _state(), step=STEP, chunk_bytes=CHUNK)
    into = _zeros_like(_state())
    with engine.read_limits(read_threads=threads):  # within the fixture's limits
        cryosnap.load(location, step=STEP, into=into)
    assert all(_equal(_state()[k], into[k]) for k in into)
    assert sequential_reads  # both passes went the sequential way
    _store, _key, manifest = _data_file(location)
    offset, nbytes = _segment(manifest, "big")
    _damage(location, offset + nbytes // 2)
    into = _zeros_like(_state())
    before = snapshot(into)
    with (
        engine.read_limits(read_threads=threads),
        pytest.raises(cryosnap.IntegrityError, match=f"leaf big: chunk {nbytes // 2 // CHUNK} "),
    ):
        cryosnap.load(location, step=STEP, into=into)
    assert snapshot(into) == before


def test_sequential_reads_of_a_truncated_file_leave_into_untouched(
    tmp_path: Path, sequential_reads: list[bool]
) -> None:
    _truncation_leaves_into_untouched(tmp_path, "big", 10_000)


@pytest.mark.skipif(not hasattr(__import__("os"), "RWF_NOWAIT"), reason="needs preadv2 flags")
def test_the_cold_probe_tells_an_evicted_file_from_a_cached_one(tmp_path: Path) -> None:
    import os

    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    # Buffered: the page cache keeps what was saved (a direct write leaves it cold).
    cryosnap.save(LocalStore(tmp_path, direct_io=False), state, step=STEP, chunk_bytes=CHUNK)
    seen: list[bool] = []
    real = _execute.PartReader._cold

    def probe(self: Any, tasks: Any) -> bool:
        seen.append(real(self, tasks))
        return seen[-1]

    # The bounced reads' probe, not the cold files' (every file counts as warm).
    with (
        pytest.MonkeyPatch.context() as mp,
        engine.read_limits(bounce_bytes=64 << 10, cold_share=0.0),
    ):
        mp.setattr(_execute.PartReader, "_cold", probe)
        _unmapped(mp)
        into = {"w": torch.zeros(1 << 20)}
        cryosnap.load(tmp_path, step=STEP, into=into)  # the page cache holds what was saved
        assert seen and not any(seen)
        os.sync()
        for data in (tmp_path / "data").iterdir():
            fd = os.open(data, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        seen.clear()
        cryosnap.load(tmp_path, step=STEP, into=into)
        if not seen[0]:
            pytest.skip("this file system keeps the pages (or does not honour RWF_NOWAIT)")
        assert seen == [True, False]  # the second pass reads what the first one cached
        assert torch.equal(into["w"], state["w"])
