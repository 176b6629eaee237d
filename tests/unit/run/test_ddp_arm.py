"""The restore's arming of ``into=``'s modules for an exact DDP resume (cryosnap._run.ddp),
in one process: what is armed, and the forwards that keep or remove the hook. DDP itself, on
gloo ranks: tests/integration/test_ddp_auto_resume.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cryosnap
from cryosnap._run import ddp


def _hooks(module: torch.nn.Module) -> int:
    return len(module._forward_pre_hooks)


def test_a_restore_outside_torch_distributed_arms_nothing(tmp_path: Path) -> None:
    cryosnap.save(tmp_path / "run", {"model": torch.nn.Linear(2, 1)})
    model = torch.nn.Linear(2, 1)
    cryosnap.load(tmp_path / "run", into={"model": model})
    assert _hooks(model) == 0


@pytest.fixture
def distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ddp, "_distributed", lambda torch: True)


@pytest.mark.usefixtures("distributed")
def test_a_restore_arms_each_module_of_into_once(tmp_path: Path) -> None:
    state = {"a": torch.nn.Linear(2, 1), "list": [torch.nn.Linear(2, 1)], "w": torch.zeros(2)}
    cryosnap.save(tmp_path / "run", state)
    cryosnap.load(tmp_path / "run", into=state)
    cryosnap.load(tmp_path / "run", into=state)
    assert [_hooks(state["a"]), _hooks(state["list"][0])] == [1, 1]
    ddp.disarm(state["a"])
    ddp.disarm(state["a"])
    assert _hooks(state["a"]) == 0


@pytest.mark.usefixtures("distributed")
def test_forwards_without_grad_keep_the_hook_and_one_outside_ddp_removes_it() -> None:
    model = torch.nn.Linear(2, 1)
    ddp.arm({"model": model})
    with torch.no_grad():
        model(torch.zeros(1, 2))
    assert _hooks(model) == 1  # an evaluation before training: the training forward decides
    model(torch.zeros(1, 2))
    assert _hooks(model) == 0  # trained without DDP: nothing to warm up
