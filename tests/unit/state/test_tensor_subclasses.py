"""Tensor subclasses and wrappers in a state: stored when their bytes can be read (a plain
subclass as a tensor), else a ``TypeError`` naming the leaf's path, never an internal error or
a crash. DTensors (stored as their local shards with their layout) are in
tests/integration/test_dtensor_dist.py, on real gloo ranks.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import cryosnap  # noqa: E402


class _Wrapper(torch.Tensor):  # type: ignore[misc]
    """A wrapper subclass (as torch's own tests write them): no storage of its own."""

    elem: Any

    @staticmethod
    def __new__(cls, elem: Any) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem: Any) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_map

        def unwrap(x: Any) -> Any:
            return x.elem if isinstance(x, _Wrapper) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class _Tagged(torch.Tensor):  # type: ignore[misc]
    """A plain subclass: the tensor's own storage."""


def _fake() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(4, 4)


def _nested() -> Any:
    return torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: _Wrapper(torch.randn(3)), "_Wrapper is a tensor subclass whose bytes cannot"),
        (_fake, "FakeTensor is a tensor subclass whose bytes cannot be read .its storage holds"),
        (_nested, "NestedTensor is a tensor subclass whose bytes cannot be read"),
    ],
    ids=["wrapper", "fake", "nested"],
)
def test_a_subclass_without_readable_bytes_is_a_type_error_naming_its_path(
    tmp_path: Path, make: Any, why: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        leaf = make()
    with pytest.raises(TypeError, match=f"cannot checkpoint model/layers/1: .*{why}"):
        cryosnap.save(tmp_path / "a", {"model": {"layers": [torch.zeros(2), leaf]}})
    with cryosnap.Checkpointer(tmp_path / "b") as ckpt:
        with pytest.raises(TypeError, match="cannot checkpoint model/layers/1: "):
            ckpt.save(0, {"model": {"layers": [torch.zeros(2), leaf]}})
        ckpt.save(0, {"model": torch.ones(2)}).result()  # the run goes on
        assert ckpt.steps() == [0]


def test_a_vmapped_tensor_is_a_type_error_naming_its_path(tmp_path: Path) -> None:
    def save(v: Any) -> Any:
        cryosnap.save(tmp_path, {"batch": {"x": v}})
        return v

    with pytest.raises(TypeError, match=r"cannot checkpoint batch/x: .*BatchedTensorImpl"):
        torch.func.vmap(save)(torch.randn(2, 3))


def test_a_wrapper_is_pickled_with_allow_pickle(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, {"w": _Wrapper(torch.arange(3.0))}, allow_pickle=True)
    got = cryosnap.load(tmp_path, allow_pickle=True)["w"]
    assert type(got) is _Wrapper and torch.equal(got.elem, torch.arange(3.0))


def test_a_plain_subclass_is_stored_as_its_tensor(tmp_path: Path) -> None:
    t = torch.randn(5, 7).as_subclass(_Tagged)
    cryosnap.save(tmp_path, {"t": t})
    got = cryosnap.load(tmp_path)["t"]
    assert type(got) is torch.Tensor and torch.equal(got, t.as_subclass(torch.Tensor))
    target = {"t": torch.zeros(5, 7).as_subclass(_Tagged)}
    cryosnap.load(tmp_path, into=target)
    assert torch.equal(target["t"].as_subclass(torch.Tensor), t.as_subclass(torch.Tensor))
