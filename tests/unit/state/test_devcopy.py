"""The device copier (pinned slabs, run here on the CPU) and restore's ``map_location``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cryosnap
import cryosnap._state.device as _devcopy
from cryosnap import engine
from cryosnap._state import Restorer, apply_into, check_into, flatten
from cryosnap._state import into as state_into
from cryosnap._state.device import (
    DeviceFeed,
    _Copier,
    _job,
    copy_to_device,
    target_device,
    to_device,
)
from cryosnap.storage import open_store

from ..support import TORCH_DTYPES, make_tensor, tensor_bytes

# ---------------------------------------------------------------------------------------------
# the copier


@pytest.mark.parametrize("slab_bytes", [1, 24, 4096])
def test_every_dtype_and_size_arrives_bitwise(slab_bytes: int) -> None:
    shapes = [(0,), (1,), (7,), (3, 0, 2), (), (5, 9), (130,)]
    sources = [
        make_tensor(dtype, shape, seed=i * 31 + j)
        for i, dtype in enumerate(TORCH_DTYPES)
        for j, shape in enumerate(shapes)
    ]
    moved = to_device(sources, "cpu", slab_bytes=slab_bytes, slabs=3)
    for src, out in zip(sources, moved, strict=True):
        assert out.dtype == src.dtype and out.shape == src.shape and out.is_contiguous()
        assert tensor_bytes(out) == tensor_bytes(src)
        if src.numel():
            assert out.data_ptr() != src.data_ptr()


def test_a_tensor_larger_than_a_slab_goes_in_pieces_through_few_slabs() -> None:
    src = make_tensor(torch.float64, (1000,), seed=1)  # 8000 bytes
    dst = torch.zeros_like(src)
    copier = _Copier(torch, [_job(torch, src, dst)], slab_bytes=512, slabs=3)
    copier.run()
    assert torch.equal(dst.view(torch.int64), src.view(torch.int64))
    assert len(copier.slabs) == 3 and copier.turn == 8000 // 512  # 16 fills, 3 slabs reused


def test_small_tensors_are_packed_several_to_a_slab() -> None:
    sources = [make_tensor(torch.int32, (4,), seed=i) for i in range(40)]  # 16 bytes each
    dsts = [torch.zeros_like(s) for s in sources]
    jobs = [_job(torch, s, d) for s, d in zip(sources, dsts, strict=True)]
    copier = _Copier(torch, jobs, slab_bytes=256, slabs=4)
    copier.run()
    assert all(torch.equal(s, d) for s, d in zip(sources, dsts, strict=True))
    # 640 bytes fill three 256-byte slabs (16 tensors to a slab); a fourth is not allocated.
    assert copier.turn == 2 and len(copier.slabs) == 3


def _groups() -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    sources = {
        0: [make_tensor(torch.float32, (3000,), seed=1)],  # larger than a slab: in pieces
        1: [make_tensor(torch.int16, (5,), seed=i) for i in range(30)],  # packed in groups
        2: [make_tensor(torch.float64, (4, 3), seed=2).t()],  # not contiguous: via a copy
        3: [torch.empty(0)],  # nothing to copy: no group
    }
    return {k: [(s, torch.zeros_like(s)) for s in srcs] for k, srcs in sources.items()}


def _copied(groups: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> bool:
    return all(tensor_bytes(s) == tensor_bytes(d) for pairs in groups.values() for s, d in pairs)


def _feed_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cryosnap-device"]


def test_a_feed_copies_each_group_it_is_told_is_ready_in_any_order() -> None:
    groups = _groups()
    feed = DeviceFeed(groups, slab_bytes=1024, slabs=2)
    for key in (2, 1, 7, 1, 0, 3):  # a key of no group, one twice, an empty group
        feed.ready(key)
    feed.close()
    assert _copied(groups) and feed.late == 0 and not _feed_threads()


def test_a_feed_copies_the_groups_never_said_ready_when_closed() -> None:
    groups = _groups()
    feed = DeviceFeed(groups, slab_bytes=1024, slabs=2)
    feed.ready(1)
    feed.close()
    assert _copied(groups) and feed.late == 2  # 0 and 2; 3 holds no bytes


def test_an_aborted_feed_stops_and_a_failed_copy_is_raised_by_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feed = DeviceFeed(_groups())
    feed.ready(0)
    feed.abort()
    assert not _feed_threads()

    def add(self: _Copier, job: Any) -> None:
        raise RuntimeError("copy failed (injected)")

    monkeypatch.setattr(_Copier, "add", add)
    feed = DeviceFeed(_groups())
    feed.ready(1)
    with pytest.raises(RuntimeError, match="injected"):
        feed.close()
    assert not _feed_threads()


def test_a_feed_checks_its_pairs_before_its_thread_starts() -> None:
    with pytest.raises(ValueError, match="cannot fill"):
        DeviceFeed({0: [(torch.ones(3), torch.ones(4))]})
    assert not _feed_threads()


def test_groups_break_where_the_destination_device_changes_and_without_foreach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # meta destinations stand in for a second device; only the CPU ones can be checked.
    sources = [make_tensor(torch.float32, (8,), seed=i) for i in range(12)]
    dsts = [torch.zeros(8) if i % 3 else torch.empty(8, device="meta") for i in range(12)]
    monkeypatch.delattr(torch, "_foreach_copy_", raising=False)
    copy_to_device(list(zip(sources, dsts, strict=True)), slab_bytes=100, slabs=2)
    for i, (src, dst) in enumerate(zip(sources, dsts, strict=True)):
        if i % 3:
            assert tensor_bytes(src) == tensor_bytes(dst)


def test_small_state_allocates_one_small_slab() -> None:
    src = torch.arange(10, dtype=torch.int16)
    copier = _Copier(torch, [_job(torch, src, torch.empty_like(src))], slab_bytes=1 << 20, slabs=4)
    copier.run()
    assert len(copier.slabs) == 1 and copier.slabs[0].buf.numel() == 20


def test_non_contiguous_destinations_and_sources() -> None:
    base = make_tensor(torch.float32, (6, 5), seed=3)
    pairs = [
        (base, torch.zeros(5, 6).t()),  # transposed destination
        (base[:, ::2], torch.zeros(6, 6)[:, ::2]),  # strided source and destination
        (base.t(), torch.zeros(5, 6)),  # transposed source
        (torch.tensor([2.5]), torch.zeros(1, 3)[0, 1:2]),  # one element at an odd offset
    ]
    cplx = make_tensor(torch.complex64, (4,), seed=4)
    pairs.append((cplx.conj(), torch.zeros(4, dtype=torch.complex64)))  # lazily conjugated src
    pairs.append((cplx, torch.zeros(4, dtype=torch.complex64).conj()))  # and destination
    copy_to_device(pairs, slab_bytes=16, slabs=2)
    for src, dst in pairs:
        assert tensor_bytes(dst) == tensor_bytes(src)


def test_leaf_parameters_are_filled_without_autograd_complaints() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    copy_to_device([(torch.ones(3), param)])
    assert torch.equal(param.detach(), torch.ones(3)) and param.grad_fn is None


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        (torch.zeros(3), torch.zeros(3, dtype=torch.float64), "cannot fill"),
        (torch.zeros(3), torch.zeros(4), "cannot fill"),
        (torch.zeros(3, device="meta"), torch.zeros(3), "from host tensors"),
        (np.zeros(3), torch.zeros(3), "copies tensors"),
    ],
)
def test_a_bad_pair_is_refused_before_anything_is_copied(src: Any, dst: Any, match: str) -> None:
    first = torch.zeros(2)
    with pytest.raises(ValueError, match=match):
        copy_to_device([(torch.ones(2), first), (src, dst)])
    assert torch.equal(first, torch.zeros(2))


def test_nothing_to_copy() -> None:
    copy_to_device([])
    copy_to_device([(torch.empty(0), torch.empty(0)), (torch.empty(2, 0), torch.empty(2, 0))])
    with pytest.raises(ValueError, match="slab_bytes"):
        copy_to_device([], slab_bytes=0)


# ---------------------------------------------------------------------------------------------
# map_location: the argument


def test_target_device_accepts_str_and_torch_device() -> None:
    assert target_device(None) is None
    assert target_device("cpu") == torch.device("cpu")
    assert target_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("value", [3, b"cpu", ["cpu"], torch.zeros(1)])
def test_a_map_location_of_another_type_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"map_location must be None, a str or a torch\.device"):
        target_device(value)


@pytest.mark.parametrize("value", ["bogus", "cuda:x", "", "meta"])
def test_a_device_torch_rejects_is_a_value_error(value: str) -> None:
    with pytest.raises(ValueError, match="map_location="):
        target_device(value)


@pytest.mark.parametrize("value", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_without_cuda_is_a_value_error(monkeypatch: pytest.MonkeyPatch, value: object) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"map_location=.*CUDA is not available"):
        target_device(value)


# ---------------------------------------------------------------------------------------------
# map_location: load and restore


def _tied_state() -> dict[str, Any]:
    torch.manual_seed(0)
    base = torch.arange(24, dtype=torch.float32)
    lin = torch.nn.Linear(3, 2)
    return {
        "a": base[:12].view(3, 4),  # two views of one storage
        "b": base[6:].view(3, 6)[:, ::2],
        "w": lin.weight,  # a Parameter
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "g": torch.zeros(2, requires_grad=True),
        "arr": np.arange(4, dtype=np.int16),
        "raw": b"bytes",
        "n": 7,
    }


def _check_restored(saved: dict[str, Any], out: dict[str, Any], device: str) -> None:
    for key in ("a", "b", "w", "frozen", "g"):
        assert out[key].device == torch.device(device), key
        assert torch.equal(out[key].detach(), saved[key].detach()), key
        assert out[key].requires_grad == saved[key].requires_grad, key
    assert type(out["w"]) is torch.nn.Parameter and type(out["frozen"]) is torch.nn.Parameter
    assert type(out["g"]) is torch.Tensor
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert out["b"].stride() == saved["b"].stride()
    assert isinstance(out["arr"], np.ndarray) and np.array_equal(out["arr"], saved["arr"])
    assert out["raw"] == b"bytes" and out["n"] == 7


@pytest.mark.parametrize("where", ["cpu", torch.device("cpu")])
def test_load_and_restore_with_map_location_cpu(tmp_path: Path, where: Any) -> None:
    saved = _tied_state()
    cryosnap.save(tmp_path / "run", saved, step=1)
    _check_restored(saved, cryosnap.load(tmp_path / "run", map_location=where), "cpu")
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        _check_restored(saved, ckpt.restore(map_location=where), "cpu")
        _check_restored(saved, ckpt.restore(1, map_location=where), "cpu")


def test_restorer_to_device_keeps_views_shared_and_parameters(tmp_path: Path) -> None:
    # The move itself, on the CPU (restore skips it there): every leaf lands in new memory.
    saved = _tied_state()
    flat = flatten(saved)
    restorer = Restorer(flat.skeleton, [b.nbytes for b in flat.blobs], allow_pickle=False)
    for blob, view in zip(flat.blobs, restorer.allocate(), strict=True):
        view[:] = blob.host_view()
    before = restorer.build()
    restorer.to_device(torch.device("cpu"))
    out = restorer.build()
    _check_restored(saved, out, "cpu")
    for key in ("a", "w", "g"):
        assert out[key].untyped_storage().data_ptr() != before[key].untyped_storage().data_ptr()


def test_read_part_moves_the_verified_tree(tmp_path: Path) -> None:
    # "meta" stands in for a GPU here: the public API refuses it, the engine does not check.
    saved = _tied_state()
    cryosnap.save(tmp_path / "run", saved, step=1)
    out = engine.read_part(open_store(tmp_path / "run"), 1, device=torch.device("meta"))
    for key in ("a", "b", "w", "g"):
        assert out[key].device.type == "meta" and out[key].shape == saved[key].shape
    assert type(out["w"]) is torch.nn.Parameter and out["g"].requires_grad
    assert out["a"].untyped_storage().nbytes() == out["b"].untyped_storage().nbytes() == 92
    assert isinstance(out["arr"], np.ndarray) and out["n"] == 7


def test_map_location_errors_come_before_any_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nothing-here"  # a read would raise CheckpointNotFoundError
    with pytest.raises(TypeError, match="map_location"):
        cryosnap.load(missing, map_location=0)
    with pytest.raises(ValueError, match="map_location='bogus'"):
        cryosnap.load(missing, map_location="bogus")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"map_location='cuda'.*CUDA is not available"):
        cryosnap.load(missing, map_location="cuda")


def test_map_location_with_into_is_refused(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}
    cryosnap.save(tmp_path / "run", state, step=1)
    into = {"w": torch.zeros(3)}
    with pytest.raises(ValueError, match="map_location='cpu' cannot be combined with into="):
        cryosnap.load(tmp_path / "run", into=into, map_location="cpu")
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        with pytest.raises(ValueError, match="cannot be combined with into="):
            ckpt.restore(into=into, map_location=torch.device("cpu"))
        with pytest.raises(TypeError, match="map_location"):
            ckpt.restore(map_location=1.5)
    assert torch.equal(into["w"], torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# into= tensors on a device


def test_apply_into_sends_device_fills_through_the_copier_in_one_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches: list[list[tuple[Any, Any]]] = []
    monkeypatch.setattr(state_into, "copy_to_device", lambda pairs: batches.append(list(pairs)))
    saved = {"gpu": [torch.ones(2), torch.ones(3)], "cpu": torch.ones(4), "arr": np.ones(2)}
    flat = flatten(saved)
    loaded = {"gpu": [torch.full((2,), 5.0), torch.full((3,), 6.0)], "cpu": torch.full((4,), 7.0)}
    loaded["arr"] = np.full(2, 8.0)
    # meta tensors stand in for GPU ones: on no CPU, so they take the device path.
    into = {"gpu": [torch.empty(2, device="meta"), torch.empty(3, device="meta")]}
    into |= {"cpu": torch.zeros(4), "arr": np.zeros(2)}
    check_into(flat.skeleton, into)
    apply_into(flat.skeleton, loaded, into)
    assert len(batches) == 1
    assert [(src, dst) for src, dst in batches[0]] == [
        (loaded["gpu"][0], into["gpu"][0]),
        (loaded["gpu"][1], into["gpu"][1]),
    ]
    assert torch.equal(into["cpu"], loaded["cpu"]) and np.array_equal(into["arr"], loaded["arr"])


def test_device_copier_is_the_one_apply_into_uses() -> None:
    assert vars(state_into)["copy_to_device"] is _devcopy.copy_to_device


def test_replicated_only_reads_move_too(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"model": {"w": torch.ones(4)}, "n": 3}, replicated=["model"]).result()
        on_cpu = ckpt.restore(replicated_only=True, map_location="cpu")
    assert torch.equal(on_cpu["model"]["w"], torch.ones(4)) and set(on_cpu) == {"model"}
    store = open_store(tmp_path / "run")
    out = engine.read_part(store, 1, replicated_only=True, device=torch.device("meta"))
    assert out["model"]["w"].device.type == "meta" and set(out) == {"model"}
