"""Restore to a CUDA device: ``map_location="cuda"``, ``into=`` CUDA tensors filled in place,
and a 1 GiB restore timed against ``torch.load(..., map_location="cuda")`` (printed, never
asserted).

Run on a machine with a GPU: ``PYTHONPATH=src python3 -m pytest -m gpu tests/gpu``; without
one every test here is skipped (tests/conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cryosnap

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers: equal bits, NaN payloads and -0.0 included."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b.to(a.device)))
    )


def _tensors(tree: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{path}/{i}")


def _trained_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(512, 256).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 512, device="cuda")).square().mean().backward()
        opt.step()
    base = torch.randn(1000, device="cuda")
    return {
        "big": torch.randn(64 * MiB, device="cuda"),  # 256 MiB of float32
        "half": torch.randn(3, 1000, device="cuda", dtype=torch.bfloat16),
        "model": model,
        "optim": opt,
        "tied": (base[:600], base[400:].view(20, 30)),  # views of one storage
        "param": nn.Parameter(torch.randn(17, device="cuda")),
        "step": 2,
    }


def test_load_with_map_location_cuda_is_bitwise_and_on_the_device(tmp_path: Path) -> None:
    state = _trained_state()
    cryosnap.save(tmp_path / "run", state, step=1)
    out = cryosnap.load(tmp_path / "run", map_location="cuda")

    expected = {
        "big": state["big"],
        "half": state["half"],
        "model": state["model"].state_dict(),
        "optim": state["optim"].state_dict(),
        "tied": state["tied"],
        "param": state["param"],
    }
    got = dict(_tensors(out))
    want = dict(_tensors(expected))
    assert set(got) == set(want)
    for path, t in got.items():
        assert t.device.type == "cuda", path
        assert _same(want[path], t), path
    assert type(out["param"]) is nn.Parameter and out["param"].requires_grad
    a, b = out["tied"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert out["step"] == 2

    # The restored state loads into a fresh model and optimizer on the GPU, and trains on.
    model = nn.Linear(512, 256).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.load_state_dict(out["model"])
    opt.load_state_dict(out["optim"])
    model(torch.randn(8, 512, device="cuda")).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()

    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        again = ckpt.restore(map_location=torch.device("cuda", 0))
    assert again["big"].device == torch.device("cuda", 0) and _same(state["big"], again["big"])


def test_into_cuda_tensors_are_filled_in_place(tmp_path: Path) -> None:
    state = _trained_state()
    cryosnap.save(tmp_path / "run", state, step=1)
    into = {
        "big": torch.zeros_like(state["big"]),
        "half": torch.zeros(1000, 3, device="cuda", dtype=torch.bfloat16).t(),  # not contiguous
        "model": nn.Linear(512, 256).cuda(),
        "optim": None,
        "tied": (torch.zeros(600, device="cuda"), torch.zeros(20, 30, device="cuda")),
        "param": nn.Parameter(torch.zeros(17, device="cuda")),
        "step": 0,
    }
    into["optim"] = torch.optim.Adam(into["model"].parameters(), lr=1e-3)
    filled = [into["big"], into["half"], *into["tied"], into["param"]]
    ptrs = [t.data_ptr() for t in filled]
    # Work queued on the caller's stream before load must land first: the copies wait for it.
    into["big"].fill_(1.0)
    torch.cuda._sleep(50_000_000)  # keep the current stream busy (a spin kernel of ~cycles)
    into["big"].fill_(2.0)

    out = cryosnap.load(tmp_path / "run", into=into)

    assert out is into
    assert [t.data_ptr() for t in filled] == ptrs
    for key in ("big", "half", "param"):
        assert into[key].device.type == "cuda" and _same(state[key], into[key]), key
    for mine, theirs in zip(into["tied"], state["tied"], strict=True):
        assert _same(theirs, mine)
    for name, t in into["model"].state_dict().items():
        assert _same(state["model"].state_dict()[name], t), name
    assert into["step"] == 2


def test_a_restore_to_cuda_copies_each_blob_while_the_others_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pipelined: the feed's thread copies each blob once it verified; the caller restores
    # on a stream of its own, which the copies wait for and its later work waits on.
    from cryosnap._state import DeviceFeed
    from cryosnap.engine import _read

    feeds: list[DeviceFeed] = []

    class Counting(DeviceFeed):
        def __init__(self, groups: Any, **kw: Any) -> None:
            super().__init__(groups, **kw)
            feeds.append(self)

    monkeypatch.setattr(_read, "DeviceFeed", Counting)
    state = _trained_state()
    cryosnap.save(tmp_path / "run", state, step=1)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the caller's stream is busy as the restore starts
        out = cryosnap.load(tmp_path / "run", map_location="cuda")
        doubled = out["big"] * 2  # queued on the caller's stream: after the copies
    stream.synchronize()
    (feed,) = feeds
    assert feed.late == 0
    assert _same(state["big"], out["big"]) and _same(state["big"] * 2, doubled)
    assert _same(state["param"], out["param"]) and type(out["param"]) is nn.Parameter
    a, b = out["tied"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert _same(state["tied"][1], b)


def _timed(fn: Any) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def test_time_a_1_gib_restore_to_the_device_against_torch_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    # 1 GiB: a few large tensors and many small ones, as a model's state is.
    state = {f"w{i}": torch.randn(32 * MiB, device="cuda") for i in range(7)}  # 7 x 128 MiB
    state["small"] = [torch.randn(32 * 1024, device="cuda") for i in range(1024)]  # 128 MiB
    nbytes = sum(t.numel() * t.element_size() for _p, t in _tensors(state))
    cryosnap.save(tmp_path / "run", state, step=1)
    torch.save(state, tmp_path / "state.pt")
    into = {k: torch.empty_like(v) for k, v in state.items() if k != "small"}
    into["small"] = [torch.empty_like(t) for t in state["small"]]

    rows = []
    for attempt in range(2):  # the first pass warms CUDA, the pinned pool and the page cache
        t_cpu, _ = _timed(lambda: cryosnap.load(tmp_path / "run"))
        t_dev, out = _timed(lambda: cryosnap.load(tmp_path / "run", map_location="cuda"))
        t_into, _ = _timed(lambda: cryosnap.load(tmp_path / "run", into=into))
        t_torch, ref = _timed(
            lambda: torch.load(tmp_path / "state.pt", map_location="cuda", weights_only=True)
        )
        rows.append((attempt, t_cpu, t_dev, t_into, t_torch))
    assert all(_same(state[k], out[k]) for k in state if k != "small")
    assert all(_same(a, b) for a, b in zip(state["small"], out["small"], strict=True))
    assert all(_same(a, b) for a, b in zip(state["small"], into["small"], strict=True))
    assert all(_same(state[k], ref[k]) for k in state if k != "small")

    gib = nbytes / (1 << 30)
    with capsys.disabled():
        print(f"\nrestore of {gib:.2f} GiB ({len(state) - 1 + 1024} tensors), seconds (GiB/s):")
        for attempt, t_cpu, t_dev, t_into, t_torch in rows:
            print(
                f"  pass {attempt}: cryosnap.load (CPU) {t_cpu:.3f} ({gib / t_cpu:.2f}); "
                f"load(map_location='cuda') {t_dev:.3f} ({gib / t_dev:.2f}); "
                f"load(into=cuda) {t_into:.3f} ({gib / t_into:.2f}); "
                f"torch.load(map_location='cuda') {t_torch:.3f} ({gib / t_torch:.2f})"
            )
