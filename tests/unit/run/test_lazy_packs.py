"""A lazy save of a state it saved before fills the packs of small tensors that an optimizer
of the state mutates on its capture thread, not in ``save()``: the version holds the values
the tensors had when ``save`` was called, even when the program rebinds a packed tensor
(``p.data = ...``) before the copies run, and the optimizer's step waits for them as for any
other leaf. Packs holding anything else (running statistics, a plain dict) are filled in
``save()``."""

from __future__ import annotations

import gc
import importlib
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import cryosnap

from ..support import assert_same

flatten_module = importlib.import_module("cryosnap._state.flatten")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)])


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # Adam's state: two small tensors per parameter, and its step
    return model, opt, {"model": model, "opt": opt}


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return type(state)((k, v.clone()) for k, v in state.items())


def _second_save_held(
    ckpt: cryosnap.Checkpointer,
    state: dict[str, Any],
    model: torch.nn.Module,
    go: threading.Event,
    change: Any = lambda: None,
) -> tuple[dict[str, Any], Any]:
    """Step 0 saved (a fresh flatten: its packs filled at once), ``change()``, then step 1
    saved lazily, its deferred copies held until ``go`` is set: the model's state as step 1
    saw it, and step 1's pending save."""
    go.set()
    ckpt.save(0, state, lazy=True).result()
    go.clear()
    change()
    return _clone(model.state_dict()), ckpt.save(1, state, lazy=True)


@pytest.fixture
def held_fill(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[object]]:
    """Deferred fills wait for the event; the list notes each DeferredPacks filled."""
    go = threading.Event()
    filled: list[object] = []
    real = flatten_module.DeferredPacks.fill

    def fill(self: Any) -> None:
        assert go.wait(30)
        real(self)
        filled.append(self)

    monkeypatch.setattr(flatten_module.DeferredPacks, "fill", fill)
    return go, filled


def test_a_lazy_save_leaves_the_packs_to_its_capture_thread(
    tmp_path: Path, held_fill: tuple[threading.Event, list[object]]
) -> None:
    go, filled = held_fill
    model, _opt, state = _trained()

    def change() -> None:
        assert filled == []  # step 0's packs were filled in save()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)

    with cryosnap.Checkpointer(tmp_path) as ckpt:
        want, pending = _second_save_held(ckpt, state, model, go, change)
        assert not pending.captured()  # returned with the copies to do
        go.set()
        pending.wait_captured()
        assert len(filled) == 1
        pending.result()
        assert_same(ckpt.restore(step=1)["model"], want)


def test_a_tensor_rebound_before_the_copies_is_saved_as_it_was(
    tmp_path: Path, held_fill: tuple[threading.Event, list[object]]
) -> None:
    go, filled = held_fill
    model, _opt, state = _trained()
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        want, pending = _second_save_held(ckpt, state, model, go)
        # The program replaces every parameter's memory before the capture copied it: the old
        # memory is freed but for what the save holds.
        for p in model.parameters():
            p.data = torch.full_like(p, 7.0)
        gc.collect()
        # Memory of the sizes just freed, written over (the allocator hands freed blocks out
        # again): a copy from a freed address would read these.
        junk = [torch.full_like(p, 3.0) for _ in range(200) for p in model.parameters()]
        go.set()
        pending.result()
        assert len(filled) == 1
        assert_same(ckpt.restore(step=1)["model"], want)
        del junk


def test_the_optimizer_step_waits_for_the_deferred_copies(
    tmp_path: Path, held_fill: tuple[threading.Event, list[object]]
) -> None:
    go, filled = held_fill
    model, opt, state = _trained()
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        want, pending = _second_save_held(ckpt, state, model, go)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        stepped = threading.Event()

        def step() -> None:
            opt.step()  # the pre-hook waits for the capture
            stepped.set()

        worker = threading.Thread(target=step)
        worker.start()
        assert not stepped.wait(0.3)  # held by the deferred copies
        go.set()
        worker.join(30)
        assert stepped.is_set() and len(filled) == 1
        pending.result()
        assert_same(ckpt.restore(step=1)["model"], want)


def test_an_eager_or_replicated_save_fills_its_packs_in_save(
    tmp_path: Path, held_fill: tuple[threading.Event, list[object]]
) -> None:
    go, filled = held_fill
    go.set()
    _model, _opt, state = _trained()
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        for step in range(3):
            ckpt.save(step, state).result()
        for step in range(3, 5):
            ckpt.save(step, {"m": state}, lazy=True, replicated=["m"]).result()
        assert ckpt._saves.flattened.reused >= 3
    assert filled == []


def _bn_state() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.BatchNorm1d(4) for _ in range(12)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, {"model": model, "opt": opt}


def test_running_statistics_are_copied_in_save(
    tmp_path: Path, held_fill: tuple[threading.Event, list[object]]
) -> None:
    """A pack holding what no optimizer mutates (a BatchNorm's running statistics, which the
    next forward pass updates) is filled before ``save()`` returns; the others may wait."""
    go, _filled = held_fill
    model, state = _bn_state()
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        want, pending = _second_save_held(ckpt, state, model, go)
        model.train()(torch.randn(8, 4))  # the next forward pass: the running stats move
        go.set()
        pending.result()
        assert_same(ckpt.restore(step=1)["model"], want)


def test_a_plain_dict_of_tensors_is_copied_in_save(
    tmp_path: Path, held_fill: tuple[threading.Event, list[object]]
) -> None:
    """No optimizer in the state guards them: copied in ``save()`` as before."""
    go, filled = held_fill
    go.set()
    model = _model()
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        for step in range(3):
            ckpt.save(step, model.state_dict(), lazy=True).result()
        assert ckpt._saves.flattened.reused == 2
    assert filled == []
