"""State dicts in columns (_format/columns.py, docs/FORMAT.md "State dicts in columns"): a dict
of tensor leaves is written as one list per field, read back as the same tree (fresh, into=,
keys=, through the chain of an incremental version, written again by a flush), checked in
bulk, and every malformed column refused with an error naming the manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap import cli
from cryosnap._format import columns
from cryosnap._format.manifest import COLUMNS_FORMAT_VERSION, Manifest
from cryosnap._state import Restorer, direct_targets
from cryosnap._state.restore_columns import ColumnTargets
from cryosnap.errors import CheckpointFormatError, IntegrityError, StateMismatchError
from cryosnap.storage import LocalStore

from ..support import assert_same, rewrite_version

N = columns.MIN_LEAVES


def _manifest(run: Path, step: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        (run / "versions" / f"{step:012d}" / "rank-00000.json").read_bytes()
    )
    return doc


def _model(n: int = 3 * N, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict: small tensors (packed) of several dtypes and shapes, 0-d and empty ones,
    a Parameter requiring grad, and one large tensor (a blob of its own)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out[f"l{i}.weight"] = torch.randn(4, 3, generator=g)
        elif kind == 1:
            out[f"l{i}.bias"] = torch.randn(3, generator=g).to(torch.bfloat16)
        elif kind == 2:
            out[f"l{i}.count"] = torch.tensor(i, dtype=torch.int64)
        elif kind == 3:
            out[f"l{i}.mask"] = torch.rand(5, generator=g) > 0.5
        elif kind == 4:
            out[f"l{i}.empty"] = torch.empty(0, 3)
        else:
            out[f"l{i}.z"] = torch.randn(2, 2, dtype=torch.complex64, generator=g)
    out["embed"] = torch.randn(300, 300, generator=g)  # 360 KB: not packed
    out["l0.weight"] = torch.nn.Parameter(out["l0.weight"])
    return out


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    into: dict[str, Any] = {}
    for k, v in state.items():
        z = torch.zeros_like(v.detach())
        if isinstance(v, torch.nn.Parameter):
            z = torch.nn.Parameter(z, requires_grad=v.requires_grad)
        into[k] = z
    return into


def _snapshot(into: dict[str, Any]) -> dict[str, Any]:
    """Each leaf's identity and bytes (a tensor's), or the leaf itself."""
    return {
        k: (id(v), v.detach().view(-1).view(torch.uint8).tolist() if v.numel() else [])
        if isinstance(v, torch.Tensor)
        else v
        for k, v in into.items()
    }


@pytest.fixture(params=["mapped", "read"])
def reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "read":
        monkeypatch.setattr(LocalStore, "map_file", lambda self, key: None)
    return str(request.param)


def test_a_state_dict_is_written_in_columns_and_restores(tmp_path: Path, reading: str) -> None:
    state = {"model": _model(), "step": 3, "few": {"a": torch.ones(2)}}
    run = tmp_path / "run"
    with cryosnap.Checkpointer(str(run), stats=False) as ckpt:  # columns alone say 4
        ckpt.save(1, state).result()
    doc = _manifest(run, 1)
    assert doc["format_version"] == COLUMNS_FORMAT_VERSION
    model, few = doc["tree"]["v"][0], doc["tree"]["v"][2]
    assert set(model) == {"t", "k", "cols"} and "v" not in model
    assert "cols" not in few  # fewer leaves than MIN_LEAVES: one node per leaf
    assert model["k"] == list(state["model"])
    assert_same(state, cryosnap.load(str(run)))
    into = {"model": _zeros_like(state["model"]), "step": 0, "few": {"a": torch.zeros(2)}}
    before = {k: id(v) for k, v in into["model"].items()}
    out = cryosnap.load(str(run), into=into)
    assert out is into and {k: id(v) for k, v in into["model"].items()} == before
    assert_same(state, into)
    assert_same({"model": state["model"]}, cryosnap.load(str(run), keys=["model"]))


def test_a_run_without_a_large_state_dict_keeps_its_format_version(tmp_path: Path) -> None:
    state = {"w": {f"k{i}": torch.ones(2) for i in range(N - 1)}}
    with cryosnap.Checkpointer(str(tmp_path / "run"), stats=False) as ckpt:
        ckpt.save(1, state).result()
    assert _manifest(tmp_path / "run", 1)["format_version"] == 2  # packed, no columns


def test_restore_into_a_state_dict_in_columns_is_filled_in_place_through_a_checkpointer(
    tmp_path: Path,
) -> None:
    state = _model(seed=1)
    with cryosnap.Checkpointer(tmp_path / "run", chunk_bytes=1 << 16) as ckpt:
        ckpt.save(1, state).result()
        for v in state.values():  # the next version differs in every leaf
            with torch.no_grad():
                v.copy_(torch.ones_like(v)) if v.dtype != torch.bool else v.fill_(True)
        ckpt.save(2, state).result()
    assert _manifest(tmp_path / "run", 2)["base"] is not None  # incremental over step 1
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        into = _zeros_like(state)
        ckpt.restore(into=into)
    assert_same(state, into)


def test_a_flush_writes_the_columns_again(tmp_path: Path) -> None:
    state = {"model": _model(seed=2)}
    with cryosnap.Checkpointer(
        tmp_path / "persistent", scratch=str(tmp_path / "scratch"), stats=False
    ) as c:
        c.save(1, state).result()
    assert _manifest(tmp_path / "scratch", 1)["format_version"] == COLUMNS_FORMAT_VERSION
    assert _manifest(tmp_path / "persistent", 1)["format_version"] == COLUMNS_FORMAT_VERSION
    assert_same(state, cryosnap.load(str(tmp_path / "persistent")))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.__setitem__("l1.bias", torch.zeros(3)), "l1.bias: saved bfloat16"),
        (lambda s: s.__setitem__("l0.weight", torch.zeros(3, 4)), "l0.weight: saved float32"),
        (lambda s: s.pop("l2.count"), "missing from into=: \\['l2.count'\\]"),
        (lambda s: s.__setitem__("extra", torch.zeros(1)), "unexpected: \\['extra'\\]"),
    ],
)
def test_a_mismatch_in_a_state_dict_in_columns_names_the_leaf_and_changes_nothing(
    tmp_path: Path, change: Any, match: str
) -> None:
    state = _model(seed=3)
    cryosnap.save(str(tmp_path / "run"), state, step=1)
    into = _zeros_like(state)
    change(into)
    snapshot = _snapshot(into)
    with pytest.raises(StateMismatchError, match=match):
        cryosnap.load(str(tmp_path / "run"), into=into)
    assert _snapshot(into) == snapshot


def test_into_leaves_that_cannot_be_filled_directly_take_the_copy(tmp_path: Path) -> None:
    """A non-contiguous tensor, tensors overlapping each other (views of one buffer) and an
    inference tensor among a state dict in columns: the restore fills them all by copying."""
    state = {f"t{i}": torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i in range(N)}
    cryosnap.save(str(tmp_path / "run"), state, step=1)
    into = {k: torch.zeros(2, 3) for k in state}
    into["t0"] = torch.zeros(3, 2).t()  # not contiguous
    shared = torch.zeros(2, 3)
    into["t1"], into["t2"] = shared, shared  # the same memory twice: the last copy wins
    into["t3"] = torch._neg_view(torch.zeros(2, 3))  # its values are its bytes negated
    into["t4"] = 7  # no tensor: replaced by the one restored
    cryosnap.load(str(tmp_path / "run"), into=into)
    for k in state:
        if k != "t1":
            assert torch.equal(into[k], state[k]), k


def test_damage_in_a_pack_of_a_state_dict_in_columns_names_it_and_changes_nothing(
    tmp_path: Path, reading: str
) -> None:
    state = _model(seed=4)
    cryosnap.save(str(tmp_path / "run"), state, step=1, chunk_bytes=4096)
    (data,) = (tmp_path / "run" / "data").iterdir()
    doc = _manifest(tmp_path / "run", 1)
    pack = doc["tree"]["cols"]["b"][0]  # l0.weight's
    (_kind, _file, offset, _nbytes), *_rest = doc["blobs"][pack][2]
    raw = bytearray(data.read_bytes())
    raw[offset + 1] ^= 0xFF  # a byte of l0.weight
    data.write_bytes(bytes(raw))
    into = _zeros_like(state)
    snapshot = _snapshot(into)
    with pytest.raises(IntegrityError, match=r"l0\.weight \(packed with \d+ more tensors\)"):
        cryosnap.load(str(tmp_path / "run"), step=1, into=into)
    assert _snapshot(into) == snapshot


def _rewrite(run: Path, edit: Any) -> None:
    def manifest(doc: dict[str, Any]) -> None:
        edit(doc["tree"]["cols"])

    rewrite_version(
        lambda k: (run / k).read_bytes(),
        lambda k, b: (run / k).write_bytes(b),
        1,
        manifest=manifest,
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.__setitem__("dtype", c["dtype"][:-1]),  # a leaf short
        lambda c: c.__setitem__("dtype", [99] * len(c["dtype"])),  # no such dtype
        lambda c: c.__setitem__("ndim", [-1] * len(c["ndim"])),
        lambda c: c.__setitem__("ndim", [65] * len(c["ndim"])),
        lambda c: c.__setitem__("dims", c["dims"][:-1]),  # dims do not add up
        lambda c: c.__setitem__("dims", [2**62 + 1] * len(c["dims"])),
        lambda c: c.__setitem__("b", [1.5] * len(c["b"])),
        lambda c: c.__setitem__("b", ["0"] * len(c["b"])),
        lambda c: c.__setitem__("b", [2**70] * len(c["b"])),
        lambda c: c.__setitem__("b", [[0]] * len(c["b"])),
        lambda c: c.__setitem__("at", [-2] * len(c["at"])),
        lambda c: c.__setitem__("at", [2**63 - 8] * len(c["at"])),  # would wrap at + bytes
        lambda c: c.__setitem__("flags", [4] * len(c["flags"])),
        lambda c: c.__setitem__("devices", [0]),
        lambda c: c.__setitem__("extra", []),
        lambda c: c.pop("flags"),
        lambda c: c.clear(),
    ],
)
def test_malformed_columns_are_refused_naming_the_manifest(tmp_path: Path, edit: Any) -> None:
    state = {f"t{i}": torch.ones(2) * i for i in range(N)}
    cryosnap.save(str(tmp_path / "run"), state, step=1)
    _rewrite(tmp_path / "run", edit)
    with pytest.raises(CheckpointFormatError, match=r"rank-00000\.json.*malformed"):
        cryosnap.load(str(tmp_path / "run"), step=1)


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.__setitem__("b", [10**6] * len(c["b"])),  # no such blob
        lambda c: c.__setitem__("at", [3] * len(c["at"])),  # misaligned, overlapping
        lambda c: c.__setitem__("at", [0] * len(c["at"])),  # overlapping
        lambda c: c.__setitem__("at", [-1] * len(c["at"])),  # a pack claimed by all
        lambda c: c.__setitem__("at", [1 << 30] * len(c["at"])),  # past the pack
        lambda c: c.__setitem__("at", [2**63 - 8] * len(c["at"])),  # far past, near int64's end
        lambda c: c.__setitem__("dims", [3] * len(c["dims"])),  # more bytes than saved
    ],
)
def test_columns_that_claim_what_the_blobs_do_not_hold_are_refused(
    tmp_path: Path, edit: Any, into: bool
) -> None:
    state = {f"t{i}": torch.ones(2) * i for i in range(N)}
    cryosnap.save(str(tmp_path / "run"), state, step=1)
    _rewrite(tmp_path / "run", edit)
    target = {k: torch.zeros(3 if "dims" in repr(edit) else 2) for k in state} if into else None
    with pytest.raises((CheckpointFormatError, StateMismatchError)):
        cryosnap.load(str(tmp_path / "run"), step=1, into=target)


def test_the_cli_reads_a_run_in_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _model(seed=5)
    run = str(tmp_path / "run")
    cryosnap.save(run, state, step=1)
    state["l0.weight"].data[0, 0] += 1
    cryosnap.save(run, state, step=2)
    assert cli.main(["inspect", run, "--step", "1", "--json"]) == 0
    leaves = {leaf["path"] for leaf in json.loads(capsys.readouterr().out)["leaves"]}
    assert leaves == set(state)
    assert cli.main(["diff", run, "1", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["leaves"]
    changed = [row for row in rows if row["status"] not in ("same", "unchanged")]
    assert [row["path"] for row in changed] == ["l0.weight"]
    assert cli.main(["verify", run]) == 0
    out = tmp_path / "out.safetensors"
    assert cli.main(["export", run, "--step", "2", str(out)]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(out))
    assert set(exported) == set(state)
    assert torch.equal(exported["embed"], state["embed"])


_dtypes = st.sampled_from(
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
    ]
)
_leaf = st.tuples(_dtypes, st.lists(st.integers(0, 5), max_size=3), st.booleans())


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(leaves=st.lists(_leaf, min_size=N, max_size=3 * N), chunk=st.sampled_from([4096, 1 << 20]))
def test_round_trip_of_state_dicts_in_columns(
    tmp_path_factory: pytest.TempPathFactory, leaves: list[Any], chunk: int
) -> None:
    g = torch.Generator().manual_seed(len(leaves))
    state: dict[str, Any] = {}
    for i, (dtype, shape, param) in enumerate(leaves):
        t = (torch.rand(shape, generator=g) * 100).to(dtype)
        state[f"p{i}"] = torch.nn.Parameter(t, requires_grad=False) if param else t
    run = tmp_path_factory.mktemp("cols") / "run"
    cryosnap.save(str(run), state, step=1, chunk_bytes=chunk)
    body = (run / "versions" / f"{1:012d}" / "rank-00000.json").read_bytes()
    manifest = Manifest.from_json(body, "test")
    assert manifest.format_version >= COLUMNS_FORMAT_VERSION  # 6 with float leaves' stats
    assert Manifest.from_json(manifest.to_json(), "test") == manifest  # written again the same
    assert_same(state, cryosnap.load(str(run)))
    into = _zeros_like(state)
    cryosnap.load(str(run), into=into)
    assert_same(state, into)


def test_encode_refuses_what_columns_cannot_hold() -> None:
    leaf = {"t": "torch", "dtype": "float32", "shape": [2], "device": "cpu", "b": 0}
    assert columns.encode([dict(leaf, b=i) for i in range(N)]) is not None
    assert columns.encode([dict(leaf, b=i) for i in range(N - 1)]) is None
    for odd in (
        dict(leaf, view={"offset": 0, "stride": [1]}),
        dict(leaf, dtensor={}),
        dict(leaf, shape=[2.0]),
        dict(leaf, param=False),
        {"t": "int", "v": 1},
    ):
        assert columns.encode([*[dict(leaf, b=i) for i in range(N)], odd]) is None
    parsed = columns.parse(columns.encode([dict(leaf, b=i, at=4 * i) for i in range(N)]), N, "x")
    assert parsed.nodes() == [dict(leaf, b=i, at=4 * i) for i in range(N)]
    assert parsed.elements().tolist() == [2] * N
    assert np.array_equal(parsed.with_blobs([5] * N).b, [5] * N)


def _parsed(run: Path, step: int = 1) -> Manifest:
    body = (run / "versions" / f"{step:012d}" / "rank-00000.json").read_bytes()
    return Manifest.from_json(body, "test")


def test_into_a_state_dict_in_columns_is_checked_and_claimed_in_bulk(tmp_path: Path) -> None:
    state = _model(seed=6)
    cryosnap.save(str(tmp_path / "run"), state, step=1)
    manifest = _parsed(tmp_path / "run")
    into = _zeros_like(state)
    targets = direct_targets(manifest.skeleton, into, min_bytes=256 << 10)
    assert list(targets) == [id(manifest.skeleton)]  # the node, not 3*N leaves
    (found,) = targets.values()
    assert isinstance(found, ColumnTargets)
    assert found.leaves == [into[k] for k in state]
    restorer = Restorer(manifest.skeleton, [b.nbytes for b in manifest.blobs], allow_pickle=False)
    views = restorer.allocate(targets)
    embed = manifest.skeleton["cols"]["b"][list(state).index("embed")]
    assert restorer.direct[embed] and views[embed].nbytes == state["embed"].nbytes
    assert sum(len(fills[0]) for fills in restorer._packs.column_fills) == sum(
        1 for v in state.values() if 0 < v.nbytes < 256 << 10
    )
    # What the restore makes of it: into='s own tensors, filled.
    cryosnap.load(str(tmp_path / "run"), into=into)
    assert_same(state, into)


def test_overlapping_leaves_of_a_state_dict_in_columns_are_left_to_the_copy(
    tmp_path: Path,
) -> None:
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(N)}
    cryosnap.save(str(tmp_path / "run"), state, step=1)
    manifest = _parsed(tmp_path / "run")
    into = {k: torch.zeros(4) for k in state}
    base = torch.zeros(6)
    into["t0"], into["t1"] = base[:4], base[2:]  # overlapping
    targets = direct_targets(manifest.skeleton, into)
    nodes = manifest.skeleton["cols"].nodes()
    assert set(targets) == {id(n) for n in nodes[2:]}  # leaf by leaf, the two left out
    cryosnap.load(str(tmp_path / "run"), into=into)
    for k in list(state)[2:]:
        assert torch.equal(into[k], state[k])
    assert torch.equal(into["t1"], state["t1"])  # copied last


def test_keys_of_a_state_in_columns_fill_into(tmp_path: Path) -> None:
    state = {"model": _model(seed=7), "optim": {"lr": 0.1}}
    cryosnap.save(str(tmp_path / "run"), state, step=1)
    into = {"model": _zeros_like(state["model"]), "optim": {"lr": 0.0}}
    out = cryosnap.load(str(tmp_path / "run"), keys=["model"], into=into)
    assert_same(state["model"], into["model"])
    assert into["optim"] == {"lr": 0.0} and list(out) == ["model"]


def test_a_module_and_its_optimizer_restore_through_columns(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])  # 12 tensors
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    run = tmp_path / "run"
    cryosnap.save(str(run), {"model": model, "opt": opt}, step=1)
    assert "cols" in _manifest(run, 1)["tree"]["v"][0]["v"]  # the module's state dict
    model2 = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    cryosnap.load(str(run), into={"model": model2, "opt": opt2})
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())
    wrong = torch.nn.Sequential(*[torch.nn.Linear(4, 5) for _ in range(6)])
    with pytest.raises(StateMismatchError, match=r"model/0\.weight"):
        cryosnap.load(str(run), into={"model": wrong, "opt": opt2})


def test_a_fresh_restore_allocates_a_state_dict_in_columns_in_bulk(tmp_path: Path) -> None:
    state = _model(seed=8)
    cryosnap.save(str(tmp_path / "run"), state, step=1)
    manifest = _parsed(tmp_path / "run")
    restorer = Restorer(manifest.skeleton, [b.nbytes for b in manifest.blobs], allow_pickle=False)
    restorer.allocate()
    assert restorer._columns.fresh == [manifest.skeleton]  # not walked leaf by leaf
    out = cryosnap.load(str(tmp_path / "run"))
    assert_same(state, out)
    packed = [k for k, v in state.items() if 0 < v.nbytes < 1 << 18]
    ptrs = {out[k].untyped_storage().data_ptr() for k in packed}
    assert len(ptrs) == len(packed)  # each packed leaf a storage of its own


def test_a_shape_whose_bytes_would_wrap_int64_is_refused(tmp_path: Path) -> None:
    """1824726041 x 631832658 complex128 elements: 16 * that is 2**64 + 32, which int64 wraps
    to 32 bytes, inside t0's place in the pack; the restore names the leaf instead."""
    state = {f"t{i}": torch.ones(2, 2, dtype=torch.complex128) for i in range(N)}
    cryosnap.save(str(tmp_path / "run"), state, step=1)

    def edit(c: dict[str, Any]) -> None:
        c["dims"] = [1824726041, 631832658, *c["dims"][2:]]

    _rewrite(tmp_path / "run", edit)
    with pytest.raises(CheckpointFormatError, match="t0"):
        cryosnap.load(str(tmp_path / "run"), step=1)
