"""The training workload: an MLP with Adam trained with a checkpoint every N steps by each
saver (none, cryosnap eager and lazy, ``torch.save``, DCP ``async_save``, torch_checkpointing's
async save where it imports), the step time measured. Runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryosnap.bench import _torch_checkpointing as tc
from cryosnap.bench._clock import Clock, CtrlC
from cryosnap.bench._config import SEED, TRAIN_EVERY, BenchConfig, ProgressFn
from cryosnap.bench._peers import dcp_async_save, dcp_available
from cryosnap.bench._probes import file_sizes, fsync_path, median, settle_disk, written_between
from cryosnap.bench._result import BenchResult, TrainingFigures, new_result
from cryosnap.progress import human_bytes

if TYPE_CHECKING:
    import torch


_MLP_LAYERS = 6


# ------------------------------------------------------------------------- training workload


def mlp_width(state_bytes: int) -> int:
    """Width W of 6 Linear(W, W) layers whose parameters and two Adam moments fill the size."""
    per_width = 3 * 4 * _MLP_LAYERS  # bytes per (W^2 + W), three copies (params, exp_avg(_sq))
    return max(8, math.isqrt(state_bytes // per_width))


def _make_model(width: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(SEED)
    blocks: list[torch.nn.Module] = []
    for _ in range(_MLP_LAYERS):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _train_step(model: Any, opt: Any, x: Any, y: Any) -> None:
    import torch

    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    opt.step()


def _training_state_bytes(model: Any, opt: Any) -> int:
    import torch

    total = sum(int(p.numel()) * int(p.element_size()) for p in model.parameters())
    for st in opt.state.values():
        for value in st.values():
            if isinstance(value, torch.Tensor):
                total += int(value.numel()) * int(value.element_size())
    return total


def _tune_batch(model: Any, opt: Any, width: int, target_seconds: float) -> int:
    """A batch size for a train step of about ``target_seconds`` (between 16 and 65536)."""
    import torch

    batch = 64
    for _ in range(2):  # estimate, then correct once at the estimated size
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        _train_step(model, opt, x, y)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            _train_step(model, opt, x, y)
            times.append(time.perf_counter() - t0)
        estimate = min(65536, max(16, round(batch * target_seconds / max(median(times), 1e-6))))
        clamped = estimate in (batch, 16, 65536)  # nothing a second measurement would change
        batch = estimate
        if clamped:
            break
    return batch


class Saver:
    """A checkpoint method inside the training loop (this one: none, the baseline)."""

    key = "none"
    label = "no checkpoint (baseline)"

    def open(self, work: Path, model: Any, opt: Any) -> None:
        self.work, self.model, self.opt = work, model, opt
        self.save_seconds: list[float] = []
        self.durable_seconds: list[float] = []

    def save(self, step: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class CryosnapSaver(Saver):
    def __init__(self, *, lazy: bool) -> None:
        self.lazy = lazy
        self.key = "cryosnap_lazy" if lazy else "cryosnap_eager"
        self.label = f"cryosnap Checkpointer {'lazy' if lazy else 'eager'}"

    def open(self, work: Path, model: Any, opt: Any) -> None:
        import cryosnap

        super().open(work, model, opt)
        self.ckpt = cryosnap.Checkpointer(work / "run")  # product defaults: incremental
        self.pendings: list[Any] = []

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        state = {"model": self.model, "optim": self.opt}
        self.pendings.append(self.ckpt.save(step, state, lazy=self.lazy))
        self.save_seconds.append(time.perf_counter() - t0)

    def drain(self) -> None:
        self.ckpt.wait()
        self.durable_seconds += [p.result().seconds for p in self.pendings]
        self.pendings.clear()

    def close(self) -> None:
        self.ckpt.close()


class DcpSaver(Saver):
    key = "dcp_async"
    label = "DCP async_save"

    def open(self, work: Path, model: Any, opt: Any) -> None:
        super().open(work, model, opt)
        self.future: Future[Any] | None = None

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        if self.future is not None:
            self.future.result()  # as the DCP docs recommend: one checkpoint in flight
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        future, _staging = dcp_async_save(state, self.work / f"step-{step}")
        future.add_done_callback(lambda _f: self.durable_seconds.append(time.perf_counter() - t0))
        self.future = future
        self.save_seconds.append(time.perf_counter() - t0)

    def drain(self) -> None:
        future, self.future = self.future, None
        if future is not None:
            future.result()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.drain()


class TorchSaver(Saver):
    key = "torch"
    label = "torch.save"

    def save(self, step: int) -> None:
        import torch

        t0 = time.perf_counter()
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        with open(self.work / f"step-{step}.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.work)
        seconds = time.perf_counter() - t0
        self.save_seconds.append(seconds)
        self.durable_seconds.append(seconds)


class TorchCheckpointingSaver(Saver):
    """torch_checkpointing's ``CheckpointManager`` (async; the CPU-only configuration of
    :mod:`cryosnap.bench._torch_checkpointing`): the save call returns when staged (the next
    step may change the state); durable when its write future is done and the bench's fsync of
    the files (its writer does not fsync) returned, in the future's callback."""

    key = tc.KEY
    label = "torch_checkpointing async save"

    def open(self, work: Path, model: Any, opt: Any) -> None:
        super().open(work, model, opt)
        self.manager = tc.manager()
        self.pending: list[tuple[Future[Any], threading.Event]] = []

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        path = self.work / f"step-{step}"
        payload = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        future = tc.save(self.manager, path, payload)
        self.save_seconds.append(time.perf_counter() - t0)

        synced = threading.Event()

        def durable(done: Future[Any]) -> None:
            try:
                if done.exception() is None:
                    tc.fsync_tree(path)
                    fsync_path(self.work)
                    self.durable_seconds.append(time.perf_counter() - t0)
            finally:
                synced.set()

        future.add_done_callback(durable)
        self.pending.append((future, synced))

    def drain(self) -> None:
        pending, self.pending = self.pending, []
        for future, synced in pending:
            future.result()
            synced.wait()  # the callback's fsync runs after result() returns

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.manager.close()


def _savers(missing: dict[str, str]) -> list[Saver]:
    savers: list[Saver] = [Saver(), CryosnapSaver(lazy=False), CryosnapSaver(lazy=True)]
    savers.append(TorchSaver())
    if dcp_available():
        savers.append(DcpSaver())
    else:
        missing["dcp_async"] = "torch.distributed is not available in this torch build"
    why = tc.unavailable()
    if why is None:
        savers.append(TorchCheckpointingSaver())
    else:
        missing[tc.KEY] = why
    return savers


def run_training(
    config: BenchConfig,
    root: Path,
    command: str,
    progress: ProgressFn | None,
    ctrl_c: CtrlC,
) -> BenchResult:
    import torch

    width = mlp_width(config.state_bytes)
    model, opt = _make_model(width)
    batch = _tune_batch(model, opt, width, config.step_seconds)  # also creates Adam's moments
    generator = torch.Generator().manual_seed(SEED)
    data = (
        torch.randn(batch, width, generator=generator),
        torch.randn(batch, width, generator=generator),
    )
    nbytes = _training_state_bytes(model, opt)
    params = sum(int(p.numel()) for p in model.parameters())
    title = (
        f"MLP {_MLP_LAYERS} x Linear({width}, {width}) with Adam, {params / 1e6:.1f} M "
        f"parameters, {human_bytes(nbytes)} of parameters and moments"
    )
    leaves = len(list(model.parameters())) + sum(
        isinstance(v, torch.Tensor) for st in opt.state.values() for v in st.values()
    )
    result = new_result(config, command, nbytes, leaves, title)
    result.memory_method = "not measured in the training workload"
    result.cold = "not measured in the training workload"
    savers = _savers(result.missing)
    if tc.unavailable() is None:
        result.notes.append(f"{tc.KEY}: {tc.NOTE}")
    result.training_setup = {
        "width": width,
        "layers": _MLP_LAYERS,
        "params": params,
        "batch": batch,
        "steps": config.steps,
        "every": list(TRAIN_EVERY),
        "torch_threads": torch.get_num_threads(),
    }
    figures = {
        (s.key, every): TrainingFigures(s.key, s.label, every)
        for every in TRAIN_EVERY
        for s in savers
    }
    result.training = list(figures.values())
    clock = Clock(config.repeat * len(TRAIN_EVERY) * len(savers), progress)
    for r in range(config.repeat):
        for every in TRAIN_EVERY:
            # Each interval's group has its own baseline runs beside it in time, and the order
            # is reversed every other round: the load of a shared machine drifts within minutes.
            group = savers if r % 2 == 0 else savers[::-1]
            for saver in group:
                fig = figures[(saver.key, every)]
                if fig.error is None:
                    work = root / f"{saver.key}-{every}-{r}"
                    try:
                        _train_run(model, opt, data, work, saver, every, config.steps, fig)
                    except Exception as exc:
                        fig.error = ctrl_c.failure(exc)
                        result.notes.append(f"{saver.label}, every {every}: failed: {fig.error}")
                clock.tick(f"round {r + 1}/{config.repeat}: {saver.label}, every {every}")
    result.notes.append(
        "save call: mean time in the save call (DCP: including the wait for the previous "
        "Future; cryosnap: including the wait for a previous version still in flight); "
        "durable: save call until on disk (median); written/save: bytes of new files per save "
        "(median over rounds); cryosnap runs with its defaults (incremental)"
    )
    result.notes += [f"{key}: not measured ({why})" for key, why in result.missing.items()]
    result.elapsed_seconds = clock.elapsed
    return result


def _train_run(
    model: Any,
    opt: Any,
    data: tuple[Any, Any],
    work: Path,
    saver: Saver,
    every: int,
    steps: int,
    fig: TrainingFigures,
) -> None:
    """``steps`` timed train steps with a checkpoint after steps 1, 1 + every, ..."""
    x, y = data
    work.mkdir()
    saver.open(work, model, opt)
    try:
        _train_step(model, opt, x, y)  # one untimed step: caches warm after the previous run
        if saver.key != "none":
            saver.save(0)  # one untimed, drained save: staging allocated, imports warm
            saver.drain()
            saver.save_seconds.clear()
            saver.durable_seconds.clear()
        gc.collect()
        settle_disk()
        before = file_sizes(work)
        times, saves = [], 0
        cpu0 = time.process_time()
        for k in range(1, steps + 1):
            t0 = time.perf_counter()
            _train_step(model, opt, x, y)
            if saver.key != "none" and (k - 1) % every == 0:
                saver.save(k)
                saves += 1
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        t0 = time.perf_counter()
        saver.drain()
        drain = time.perf_counter() - t0
        fig.step_seconds += times
        fig.save_call_seconds += saver.save_seconds
        fig.durable_seconds += saver.durable_seconds
        fig.drain_seconds.append(drain)
        fig.cpu_seconds_per_step.append(cpu / steps)
        fig.saves += saves
        if saves:
            fig.written_bytes.append(written_between(before, file_sizes(work)) / saves)
    finally:
        saver.close()
        shutil.rmtree(work, ignore_errors=True)
        settle_disk()
