"""Packs of small tensors (tree._Packer, Restorer._packed): small CPU tensors saved back to back in
shared blobs of at most one chunk, each coming back as a tensor of its own, every byte verified.
The restore runs both mapped (a local run) and read (the same run through preadv, as on a
network file system)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap import cli
from cryosnap._state import PACK_BYTES, PACK_LEAF_FRACTION, flatten
from cryosnap.errors import CheckpointFormatError, IntegrityError
from cryosnap.storage import LocalStore

from ..support import assert_same, rewrite_version

CHUNK = 4096
LEAF_MAX = CHUNK // PACK_LEAF_FRACTION  # what a pack of one 4 KiB chunk takes


@pytest.fixture(params=["mapped", "read"])
def reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "read":
        monkeypatch.setattr(LocalStore, "map_file", lambda self, key: None)
    return str(request.param)


def _manifest(run: Path, step: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        (run / "versions" / f"{step:012d}" / "rank-00000.json").read_bytes()
    )
    return doc


def _leaves(node: Any) -> list[dict[str, Any]]:
    if node["t"] in ("dict", "odict", "list", "tuple"):
        return [leaf for v in node["v"] for leaf in _leaves(v)]
    return [node]


def _small_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            f"layer{i}": {
                "weight": torch.randn(4, 5, generator=g),
                "bias": torch.randn(5, generator=g).to(torch.bfloat16),
                "flag": torch.tensor([i % 2 == 0]),
                "count": torch.tensor(i, dtype=torch.int64),
            }
            for i in range(40)
        },
        "big": torch.randn(5000, generator=g),
        "optim": {"step": torch.tensor(3.0), "lr": 0.1},
    }


def test_small_tensors_share_packs_and_come_back_on_their_own(tmp_path: Path, reading: str) -> None:
    state = _small_state()
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    doc = _manifest(tmp_path, 1)
    leaves = _leaves(doc["tree"])
    packed = [leaf for leaf in leaves if "at" in leaf]
    assert len(packed) == 161  # every tensor but "big" (20 KB, more than a pack's quarter)
    packs = {leaf["b"] for leaf in packed}
    assert len(doc["blobs"]) == len(packs) + 1
    for b in packs:
        assert doc["blobs"][b][0] <= CHUNK
    items = {"float32": 4, "bfloat16": 2, "bool": 1, "int64": 8}
    assert all(leaf["at"] % items[leaf["dtype"]] == 0 for leaf in packed)

    loaded = cryosnap.load(tmp_path)
    assert_same(loaded, state)
    # Each leaf is a tensor of its own: growing one in place leaves its pack mates alone.
    layer = loaded["model"]["layer0"]
    before = {k: v.clone() for k, v in loaded["model"]["layer1"].items()}
    layer["weight"].add_(1.0)
    layer["bias"].zero_()
    for k, v in loaded["model"]["layer1"].items():
        assert torch.equal(v, before[k])
    ptrs = {t.untyped_storage().data_ptr() for t in loaded["model"]["layer3"].values()}
    assert len(ptrs) == 4
    assert loaded["model"]["layer2"]["weight"].untyped_storage().nbytes() == 4 * 5 * 4


def test_packs_never_mix_replicated_and_other_keys() -> None:
    # A flat state dict (every tensor a top-level key) packs across its keys...
    state = {k: {"a": torch.ones(3), "b": torch.zeros(2)} for k in ("x", "y", "z")}
    assert len(flatten(state, pack_bytes=CHUNK).blobs) == 1
    # ...but replicated state is chosen by top-level key, and a blob belongs to the key of its
    # first leaf: a pack never mixes keys saved as replicated with the others.
    flat = flatten(state, pack_bytes=CHUNK, pack_apart=["y"])
    assert [b.key[0] for b in flat.blobs] == ["x", "y", "z"]
    flat = flatten(state, pack_bytes=CHUNK, pack_apart=["x", "y"])
    assert [b.key[0] for b in flat.blobs] == ["x", "z"]


def test_what_is_not_packed() -> None:
    base = torch.arange(10, dtype=torch.float32)
    state = {
        "shared": [base[:4], base[4:]],  # views of one storage: one blob with views
        "array": np.ones((3, 2), np.float32, order="F"),  # arrays in Fortran order stay alone
        "big": torch.ones(LEAF_MAX // 4 + 1),  # past a quarter of a pack
        "empty": torch.ones(0),
        "small": torch.ones(LEAF_MAX // 4),
    }
    flat = flatten(state, pack_bytes=CHUNK)
    nodes = {k: v for k, v in zip(flat.skeleton["k"], flat.skeleton["v"], strict=True)}
    assert all("view" in n and "at" not in n for n in nodes["shared"]["v"])
    assert "at" not in nodes["array"] and "at" not in nodes["big"] and "at" not in nodes["empty"]
    assert nodes["small"]["at"] == 0
    # Without pack_bytes (flatten's default) nothing is packed.
    assert not any("at" in leaf for leaf in _leaves(flatten(state).skeleton))
    # Packs are capped, whatever the chunk size.
    many = {"m": [torch.ones(1024) for i in range(600)]}  # 4 KiB each, 2.4 MB
    sizes = [b.nbytes for b in flatten(many, pack_bytes=64 << 20).blobs]
    assert max(sizes) <= PACK_BYTES and len(sizes) == 3


def test_a_pack_is_a_private_copy() -> None:
    t = torch.zeros(8)
    flat = flatten({"t": t}, pack_bytes=CHUNK)
    t.fill_(5.0)  # the program goes on changing its tensor: the pack keeps what was saved
    assert not flat.blobs[0].host_view().tobytes().strip(b"\x00")
    assert flat.blobs[0].origin == 0  # lazy capture has nothing to wait for


def test_a_pack_is_every_leaf_back_to_back_and_zeros_between() -> None:
    """A pack's bytes: each leaf at its aligned offset, zeros in the alignment gaps before it
    (every byte of a version is defined), whatever the pack's memory held before: the first
    flatten's fresh packs and a reused flatten's packs, filled by copies made together."""
    g = torch.Generator().manual_seed(4)
    state = {
        f"k{i}": t
        for i in range(300)
        for t in (
            torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
            torch.randn(5, generator=g).double(),
        )
    }
    state = {f"k{i}": v for i, v in enumerate(state.values())}
    state.update(
        {f"u{i}": torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g) for i in range(300)}
    )
    state.update({f"d{i}": torch.randn(3, generator=g).double() for i in range(300)})

    def expected(flat: Any) -> dict[int, bytes]:
        out: dict[int, bytearray] = {}
        leaves = [(n["b"], n["at"], k) for k, n in zip(state, flat.skeleton["v"], strict=True)]
        for b, at, k in leaves:
            data = state[k].numpy().tobytes()
            buf = out.setdefault(b, bytearray(flat.blobs[b].nbytes))
            buf[at : at + len(data)] = data
        return {b: bytes(v) for b, v in out.items()}

    cache = cryosnap._state.FlattenCache()
    first = cache.flatten(state, pack_bytes=CHUNK)
    packed = expected(first)
    assert len(packed) > 2 and all(len(v) <= CHUNK for v in packed.values())
    assert {b: first.blobs[b].host_view().tobytes() for b in packed} == packed
    for blob in first.blobs:  # the memory the next flatten reuses, dirtied
        blob.host_view()[:] = b"\xab" * blob.nbytes
    for t in state.values():
        t.add_(1)
    again = cache.flatten(state, pack_bytes=CHUNK)
    assert cache.reused == 1
    assert {b: again.blobs[b].host_view().tobytes() for b in packed} == expected(again)


def test_lazy_save_keeps_the_values_of_the_save_call(tmp_path: Path) -> None:
    state = _small_state()
    expected = {k: v.clone() for k, v in state["model"]["layer5"].items()}
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        pending = ckpt.save(1, state, lazy=True)
        for v in state["model"]["layer5"].values():
            v.zero_() if v.dtype != torch.bool else v.logical_not_()
        pending.result()
    loaded = cryosnap.load(tmp_path)
    for k, v in expected.items():
        assert torch.equal(loaded["model"]["layer5"][k], v)


def test_into_fills_packed_leaves_in_place(tmp_path: Path, reading: str) -> None:
    state = _small_state()
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    into = _small_state(seed=1)
    weight = into["model"]["layer7"]["weight"]
    cryosnap.load(tmp_path, into=into)
    assert into["model"]["layer7"]["weight"] is weight
    assert_same(into, state)


def test_incremental_rewrites_only_the_changed_pack(tmp_path: Path) -> None:
    state = _small_state()
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, incremental=True) as ckpt:
        first = ckpt.save(1, state).result()
        state["model"]["layer20"]["bias"].add_(1)
        second = ckpt.save(2, state).result()
    assert first.written_bytes > 3 * CHUNK
    assert 0 < second.written_bytes <= CHUNK  # one pack: one chunk
    assert_same(cryosnap.load(tmp_path, step=2), state)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.bool, torch.int64]
            ),
            st.lists(st.integers(0, 6), min_size=0, max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=60,
    ),
    st.sampled_from([CHUNK, 1 << 16]),
)
def test_round_trip_of_packed_leaves(
    tmp_path_factory: pytest.TempPathFactory,
    specs: list[tuple[torch.dtype, list[int], bool]],
    chunk: int,
) -> None:
    g = torch.Generator().manual_seed(len(specs))
    state: dict[str, Any] = {}
    for i, (dtype, shape, param) in enumerate(specs):
        t = (torch.randn(shape, generator=g) * 50).to(dtype)
        if param and dtype.is_floating_point:
            t = torch.nn.Parameter(t)
        state.setdefault(f"k{i % 3}", []).append(t)
    run = tmp_path_factory.mktemp("run")
    cryosnap.save(run, state, step=1, chunk_bytes=chunk)
    assert_same(cryosnap.load(run), state)
    shutil.rmtree(run)


_ARRAY_DTYPES = ["<f4", ">f8", "<i2", ">u4", "|b1", "<c8", "<M8[s]", "|u1", "|V3"]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_ARRAY_DTYPES),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
            st.sampled_from(["C", "F", "strided", "read-only"]),
        ),
        min_size=1,
        max_size=60,
    ),
    st.sampled_from([CHUNK, 1 << 16]),
)
def test_round_trip_of_dicts_of_arrays_fresh_and_into(
    tmp_path_factory: pytest.TempPathFactory,
    specs: list[tuple[str, list[int], str]],
    chunk: int,
) -> None:
    """Dicts of arrays of any dtype, byte order, shape and layout (packed or not, each
    pack's later leaves taken the short way) come back byte for byte, fresh and into a dict
    of arrays of their dtypes and shapes, filled in place."""
    rng = np.random.default_rng(len(specs))
    state: dict[str, Any] = {}
    for i, (descr, shape, layout) in enumerate(specs):
        dtype = np.dtype(descr)
        raw = rng.integers(0, 256, (int(np.prod(shape)) * 2 + 1) * dtype.itemsize, np.uint8)
        whole = raw[: int(np.prod(shape)) * 2 * dtype.itemsize].view(dtype)
        if layout == "strided":
            a = whole[::2].reshape(shape)  # every other element: not contiguous
        else:
            a = whole[: int(np.prod(shape))].reshape(shape, order="F" if layout == "F" else "C")
        if layout == "read-only":
            a.flags.writeable = False
        state.setdefault(f"d{i % 2}", {})[f"a{i}"] = a
    run = tmp_path_factory.mktemp("run")
    cryosnap.save(run, state, step=1, chunk_bytes=chunk)

    def same(got: dict[str, Any]) -> None:
        for key, arrays in state.items():
            assert list(got[key]) == list(arrays)
            for name, a in arrays.items():
                b = got[key][name]
                assert (b.dtype, b.shape) == (a.dtype, a.shape), name
                assert b.tobytes() == a.tobytes(), name

    same(cryosnap.load(run))
    into = {k: {n: np.zeros(a.shape, a.dtype) for n, a in v.items()} for k, v in state.items()}
    ids = {k: [id(a) for a in v.values()] for k, v in into.items()}
    cryosnap.load(run, into=into)
    assert {k: [id(a) for a in v.values()] for k, v in into.items()} == ids
    same(into)
    shutil.rmtree(run)


def test_damage_in_a_pack_names_a_leaf_and_is_refused(tmp_path: Path, reading: str) -> None:
    state = _small_state()
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    (data,) = (tmp_path / "data").iterdir()
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF  # inside the first pack
    data.write_bytes(bytes(raw))
    with pytest.raises(
        IntegrityError, match=r"model/layer0/weight \(packed with \d+ more tensors\)"
    ):
        cryosnap.load(tmp_path, step=1)


def _rewrite(run: Path, edit: Any) -> None:
    """Edit the manifest's skeleton, keeping the commit record's hash of it right."""
    store = LocalStore(run)
    rewrite_version(store.read, store.write, 1, manifest=lambda doc: edit(doc["tree"]))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda leaf: leaf.update(at=leaf["at"] + 1), "malformed pack offset"),
        (lambda leaf: leaf.update(at=1 << 40), "malformed pack offset"),
        (lambda leaf: leaf.update(at=-16), "malformed pack offset"),
        (lambda leaf: leaf.update(at="0"), "malformed pack offset"),
        (lambda leaf: leaf.update(at=8), "overlaps the leaf packed before it"),
        (lambda leaf: leaf.update(view={"offset": 0, "stride": [1]}), "both packed and a view"),
        (lambda leaf: leaf.pop("at"), "needs 20 bytes, its blob has|claimed twice"),
    ],
)
def test_malformed_pack_offsets_are_refused(
    tmp_path: Path, edit: Any, message: str, reading: str
) -> None:
    state = {"m": {"a": torch.ones(3), "w": torch.ones(5)}}  # one pack: w at 12
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)

    def change(tree: dict[str, Any]) -> None:
        edit(tree["v"][0]["v"][1])

    _rewrite(tmp_path, change)
    with pytest.raises(CheckpointFormatError, match=message):
        cryosnap.load(tmp_path, step=1)


def test_cli_inspect_and_diff_name_packed_leaves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {"a": {"x": torch.ones(3), "y": torch.zeros(4)}, "b": {"z": torch.ones(2)}}
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, incremental=True) as ckpt:
        ckpt.save(1, state).result()
        state["b"]["z"].add_(1)
        ckpt.save(2, state).result()
    cli.main(["inspect", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    rows = {leaf["path"]: leaf for leaf in out["leaves"]}
    assert rows["a/y"]["bytes"] == 16 and rows["a/y"].get("shared_with") is None
    assert out["totals"]["blobs"] == 1 and out["totals"]["chunks"] == 1
    # The three share one chunk, which changed: only b/z's own bytes did.
    cli.main(["diff", str(tmp_path), "1", "2", "--json"])
    diff = json.loads(capsys.readouterr().out)
    assert [(r["path"], r["changed_bytes"]) for r in diff["leaves"]] == [("b/z", 8)]
    # A damaged chunk is named, not compared.
    (data,) = sorted((tmp_path / "data").iterdir())[1:]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    assert cli.main(["diff", str(tmp_path), "1", "2"]) != 0
    assert "does not match its hash" in capsys.readouterr().err


def test_the_capture_writes_a_pack_from_where_it_lies() -> None:
    from cryosnap._run.capture.staging import StagingPool, capture_to_slabs
    from cryosnap._run.results import CaptureTracker
    from cryosnap.engine.items import Piece

    state = {"m": [torch.full((10,), float(i)) for i in range(5)], "big": torch.ones(2000)}
    flat = flatten(state, pack_bytes=CHUNK)
    assert [b.private for b in flat.blobs] == [False, True]
    batches: list[Any] = []
    tracker = CaptureTracker(len(flat.blobs))
    copied = capture_to_slabs(
        flat,
        StagingPool(slab_bytes=4 * CHUNK, budget_bytes=None),
        chunk_bytes=CHUNK,
        emit=batches.append,
        tracker=tracker,
    )
    pieces = [p for b in batches for p in b.pieces if isinstance(p, Piece)]
    pack = [p for p in pieces if p.blob == 1]
    address = flat.blobs[1].source.data_ptr()
    assert len(pack) == 1 and np.frombuffer(pack[0].view, np.uint8).ctypes.data == address
    assert copied == flat.logical_bytes
    tracker.finish()
    assert tracker.captured()
    # With a change mask (device diff) or chunks other ranks write, it is copied as any blob.
    batches.clear()
    capture_to_slabs(
        flat,
        StagingPool(slab_bytes=4 * CHUNK, budget_bytes=None),
        chunk_bytes=CHUNK,
        emit=batches.append,
        tracker=CaptureTracker(len(flat.blobs)),
        changed={1: np.array([True])},
    )
    (piece,) = [p for b in batches for p in b.pieces if isinstance(p, Piece) and p.blob == 1]
    assert bytes(piece.view) == flat.blobs[1].host_view().tobytes()
    assert np.frombuffer(piece.view, np.uint8).ctypes.data != address


def test_diff_reads_a_changed_pack_once_per_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"m": [torch.full((4,), float(i)) for i in range(200)]}  # one pack of 3,200 bytes
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, incremental=True) as ckpt:
        ckpt.save(1, state).result()
        for i in range(0, 200, 2):
            state["m"][i].add_(1)  # every other tensor changes
        ckpt.save(2, state).result()
    reads: list[str] = []
    real = LocalStore.read_ranges

    def counting(self: LocalStore, key: str, ranges: Any) -> None:
        reads.append(key)
        real(self, key, ranges)

    monkeypatch.setattr(LocalStore, "read_ranges", counting)
    assert cli.main(["diff", str(tmp_path), "1", "2", "--json"]) == 0
    diff = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in diff["leaves"]] == [f"m/{i}" for i in range(0, 200, 2)]
    assert len(reads) == 2  # the pack's chunk of each version, not one per tensor


def test_a_manifest_with_packs_says_format_version_2(tmp_path: Path) -> None:
    # Readers from before packs read format_version 1 only: they refuse such a manifest by its
    # version ("upgrade cryosnap") instead of taking a packed tensor for damage.
    # stats=False: float leaves' statistics would say 6 (docs/FORMAT.md, "Statistics").
    with cryosnap.Checkpointer(tmp_path / "packed", stats=False) as ckpt:
        ckpt.save(1, {"a": torch.ones(3), "b": torch.zeros(2)}).result()
    with cryosnap.Checkpointer(tmp_path / "plain", stats=False) as ckpt:
        ckpt.save(1, {"a": b"abc", "w": torch.ones(100_000)}).result()
    assert _manifest(tmp_path / "packed", 1)["format_version"] == 2
    assert _manifest(tmp_path / "plain", 1)["format_version"] == 1
    for run in ("packed", "plain"):
        commit = tmp_path / run / "versions" / f"{1:012d}" / "COMMIT.json"
        assert json.loads(commit.read_bytes())["format_version"] == 1
        assert len(cryosnap.load(tmp_path / run)["a"]) == 3


def test_into_copies_packed_leaves_only_once_every_chunk_verified(
    tmp_path: Path, reading: str
) -> None:
    state = _small_state()
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    (data,) = (tmp_path / "data").iterdir()
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # the last pack's last byte
    data.write_bytes(bytes(raw))
    into = _small_state(seed=1)
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in into["model"].items()}
    with pytest.raises(IntegrityError):
        cryosnap.load(tmp_path, step=1, into=into)
    for k, v in into["model"].items():  # every packed target as it was
        for n, t in v.items():
            assert torch.equal(t, before[k][n])


def test_into_packed_targets_of_every_kind(tmp_path: Path, reading: str) -> None:
    # Packed leaves filled by a copy of their bytes (contiguous CPU tensors and Parameters of
    # their dtype and shape), and the ones that keep the copy through a tensor: a transposed
    # view, two leaves over one storage, a leaf into= holds as a numpy array.
    g = torch.Generator().manual_seed(3)
    state = {
        "w": torch.randn(6, 4, generator=g),
        "p": torch.nn.Parameter(torch.randn(5, generator=g)),
        "t": torch.randn(4, 6, generator=g),
        "a": torch.randn(3, generator=g),
        "b": torch.randn(3, generator=g),
        "i": torch.arange(7),
    }
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    assert all("at" in leaf for leaf in _leaves(_manifest(tmp_path, 1)["tree"]))
    shared = torch.zeros(6)
    into: dict[str, Any] = {
        "w": torch.zeros(6, 4),
        "p": torch.nn.Parameter(torch.zeros(5)),
        "t": torch.zeros(6, 4).T,  # not contiguous
        "a": shared[:3],
        "b": shared[3:],
        "i": torch.zeros(7, dtype=torch.int64),
    }
    held = dict(into)
    versions = {k: v._version for k, v in into.items()}
    cryosnap.load(tmp_path, into=into)
    for k, v in into.items():
        assert v is held[k]
        assert torch.equal(v.detach(), state[k].detach())
        assert v._version > versions[k]  # autograd sees the in-place change
    assert into["p"].requires_grad
    assert torch.equal(shared, torch.cat([state["a"], state["b"]]))


def test_into_refuses_a_packed_leaf_of_another_dtype_or_shape(tmp_path: Path) -> None:
    from cryosnap.errors import StateMismatchError

    cryosnap.save(tmp_path, {"m": {"a": torch.ones(3), "b": torch.ones(4)}}, step=1)
    for wrong in (torch.zeros(4, dtype=torch.float64), torch.zeros(5)):
        into = {"m": {"a": torch.zeros(3), "b": wrong}}
        with pytest.raises(StateMismatchError, match="m/b"):
            cryosnap.load(tmp_path, into=into)
        assert not into["m"]["a"].any()  # nothing filled


def _small_arrays(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "f4": rng.standard_normal(10).astype(np.float32),
        "i2": np.arange(7, dtype=np.int16),
        "scalar": np.array(3.5),
        "record": np.array([(1, 2), (3, 4), (5, 6)], dtype=[("x", "<i4"), ("y", "u1")]),
        "big_endian": np.arange(5, dtype=">i4"),
        "flags": np.array([True, False, True]),
        "c8": (rng.standard_normal(4) + 1j).astype(np.complex64),
        "days": np.arange(3).astype("datetime64[D]"),
        "grid": rng.standard_normal((6, 5)),
        "fortran": np.asfortranarray(rng.standard_normal((4, 3))),  # alone: never packed
        "large": rng.standard_normal(CHUNK),  # past a pack's quarter: alone
        "empty": np.zeros((0, 3)),
        "t": torch.ones(3),  # a torch tensor's pack of its own
    }


def test_small_arrays_share_packs_and_come_back_on_their_own(tmp_path: Path, reading: str) -> None:
    state = _small_arrays()
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, stats=False) as ckpt:
        ckpt.save(1, state).result()
    doc = _manifest(tmp_path, 1)
    assert doc["format_version"] == 5  # readers from before packed arrays refuse it
    nodes = dict(zip(doc["tree"]["k"], doc["tree"]["v"], strict=True))
    alone = {"fortran", "large", "empty"}
    assert {k for k, n in nodes.items() if "at" not in n} == alone
    packs = {nodes[k]["b"] for k in state if k not in alone and k != "t"}
    assert len(packs) == 1 and nodes["t"]["b"] not in packs
    for k, n in nodes.items():  # each at a multiple of its element size
        if k not in alone and k != "t":
            assert n["at"] % state[k].dtype.itemsize == 0

    loaded = cryosnap.load(tmp_path)
    assert_same(loaded, state)
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape
    # Each array is one of its own: changing one leaves its pack mates alone.
    before = {k: v.copy() for k, v in loaded.items() if isinstance(v, np.ndarray)}
    loaded["i2"][:] = -1
    loaded["f4"] += 1
    for k in ("scalar", "record", "big_endian", "flags", "grid"):
        assert np.array_equal(loaded[k], before[k])


def test_into_fills_packed_arrays_in_place(tmp_path: Path, reading: str) -> None:
    state = _small_arrays()
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(1, state).result()
        state["i2"] += 5
        ckpt.save(2, state).result()  # incremental: the pack's one chunk changed
        into = {
            k: np.zeros_like(v) if isinstance(v, np.ndarray) else torch.zeros_like(v)
            for k, v in state.items()
        }
        ids = {k: id(v) for k, v in into.items()}
        out = ckpt.restore(into=into)
    assert {k: id(v) for k, v in out.items()} == ids
    assert_same(into, state)


def test_damage_in_a_pack_of_arrays_names_a_leaf(tmp_path: Path, reading: str) -> None:
    state = {f"a{i}": np.full(5, i, np.float32) for i in range(30)}
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    (data,) = (tmp_path / "data").iterdir()
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF  # inside the only pack
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"a0 \(packed with 29 more arrays\)"):
        cryosnap.load(tmp_path, step=1)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda leaf: leaf.update(at=leaf["at"] + 1), "malformed pack offset"),
        (lambda leaf: leaf.update(at=1 << 40), "malformed pack offset"),
        (lambda leaf: leaf.update(at=-8), "malformed pack offset"),
        (lambda leaf: leaf.update(at=None), "malformed pack offset"),
        (lambda leaf: leaf.update(at=8), "overlaps the leaf packed before it"),
        (lambda leaf: leaf.pop("at"), "holds 20 bytes|claimed twice|bytes"),
        (lambda leaf: leaf.update(dtype="|V0"), "packed with elements of 0 bytes"),
    ],
)
def test_malformed_offsets_of_packed_arrays_are_refused(
    tmp_path: Path, edit: Any, message: str, reading: str
) -> None:
    state = {"a": np.ones(3, np.float32), "w": np.ones(5, np.float32)}  # one pack: w at 12
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    _rewrite(tmp_path, lambda tree: edit(tree["v"][1]))
    with pytest.raises(CheckpointFormatError, match=message):
        cryosnap.load(tmp_path, step=1)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda leaf: leaf.update(at=13), "malformed pack offset"),  # inside, misaligned
        (lambda leaf: leaf.update(shape=[2, 2]), "overlaps the leaf packed before it"),
        (lambda leaf: leaf.update(shape=[40]), "malformed pack offset"),  # past the pack
        (lambda leaf: leaf.update(b=0), "claimed twice"),  # the array alone
        (lambda leaf: leaf.update(b=-1), "invalid blob reference"),
        (lambda leaf: leaf.update(dtype="<f8"), "malformed pack offset"),  # 12 % 8
        (lambda leaf: leaf.update(order="F"), "."),  # taken the long way: read as saved
    ],
)
def test_the_middle_leaf_of_a_pack_of_arrays_is_checked_as_the_first(
    tmp_path: Path, edit: Any, message: str, reading: str
) -> None:
    """A pack's later leaves take a shorter path than its first (no call per check): each
    edit of the middle one is refused as the first leaf's would be."""
    state = {
        "alone": np.ones(2000, np.float32),  # blob 0: not packed
        "a": np.ones(3, np.float32),  # 12 bytes at 0
        "w": np.full(2, 2.0, np.float32),  # at 12
        "z": np.full(2, 3.0, np.float32),  # at 20
    }
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    cryosnap.load(tmp_path, step=1)  # every descr parsed before
    _rewrite(tmp_path, lambda tree: edit(tree["v"][2]))
    if message == ".":
        got = cryosnap.load(tmp_path, step=1)
        assert got["w"].tolist() == [2.0, 2.0] and got["z"].tolist() == [3.0, 3.0]
        return
    with pytest.raises(CheckpointFormatError, match=message):
        cryosnap.load(tmp_path, step=1)


def test_a_cryosnap_from_before_packed_arrays_refuses_them(tmp_path: Path) -> None:
    """It reads format versions 1 to 4: version 5 is refused by its number, asking for an
    upgrade, not taken for damage."""
    from cryosnap._format.document import parse_json

    with cryosnap.Checkpointer(tmp_path, stats=False) as ckpt:  # float stats would say 6
        ckpt.save(1, {"a": np.ones(3)}).result()
    body = (tmp_path / "versions" / f"{1:012d}" / "rank-00000.json").read_bytes()
    with pytest.raises(CheckpointFormatError, match=r"format_version 5 is not supported.*upgrade"):
        parse_json(body, "test", (1, 2, 3, 4))


def test_cli_inspect_and_diff_of_packed_arrays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {"x": np.ones(3), "y": np.zeros(4, np.int8), "z": np.arange(6.0)}
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, incremental=True) as ckpt:
        ckpt.save(1, state).result()
        state["z"][2] = -1
        ckpt.save(2, state).result()
    assert cli.main(["inspect", str(tmp_path), "--step", "1", "--json"]) == 0
    leaves = {r["path"]: r for r in json.loads(capsys.readouterr().out)["leaves"]}
    assert [leaves[k]["bytes"] for k in ("x", "y", "z")] == [24, 4, 48]
    assert leaves["y"]["packed_with"] == "x" and leaves["z"]["packed_with"] == "x"
    assert cli.main(["diff", str(tmp_path), "1", "2", "--json"]) == 0
    changed = {r["path"] for r in json.loads(capsys.readouterr().out)["leaves"]}
    assert changed == {"z"}


@pytest.mark.parametrize("parsed", [False, True])
def test_into_a_dict_of_arrays_is_checked_leaf_by_leaf(
    tmp_path: Path, parsed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dict of arrays is checked without a call per array once its descrs are parsed (and
    the long way before): the same mismatches refused, naming the leaf, nothing filled;
    a strided or read-only target never filled in place."""
    from cryosnap._state import dtypes

    if not parsed:  # no descr parsed in this process yet
        for descr in list(dtypes.NP_DTYPES):
            monkeypatch.delitem(dtypes.NP_DTYPES, descr)
    state = {f"a{i}": np.full(4, i, np.float32) for i in range(20)}
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=CHUNK)
    if parsed:
        cryosnap.load(tmp_path)
    wrong = [
        ("a3", np.zeros(4, np.float64), "a3"),
        ("a5", np.zeros(5, np.float32), "a5"),
        ("a7", np.zeros(4, np.float32).astype(">f4"), "a7"),
    ]
    for key, target, where in wrong:
        into = {k: np.zeros_like(v) for k, v in state.items()}
        into[key] = target
        with pytest.raises(cryosnap.errors.StateMismatchError, match=where):
            cryosnap.load(tmp_path, into=into)
        assert not any(v.any() for v in into.values())  # nothing filled
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    into = {k: np.zeros_like(v) for k, v in state.items()}
    into["a2"] = frozen
    with pytest.raises(cryosnap.errors.StateMismatchError, match=r"a2.*read-only"):
        cryosnap.load(tmp_path, into=into)
    into = {k: np.zeros_like(v) for k, v in state.items()}
    base = np.zeros(8, np.float32)
    into["a9"] = base[::2]  # strided: filled by a copy, its base's other elements untouched
    out = cryosnap.load(tmp_path, into=into)
    assert all(np.array_equal(out[k], state[k]) for k in state)
    assert np.array_equal(base[::2], state["a9"]) and not base[1::2].any()
