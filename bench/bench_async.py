"""Asynchronous two-phase checkpoints: how long does a save block the program, and what does
checkpointing cost a training loop? cryosnap's Checkpointer against its peers, in one run.

Part 1, stall on one state (default: 1 GiB of fp32 in 16 tensors of 64 MiB), every peer on the
same tensors:

- memcpy: torch ``copy_`` of every tensor into preallocated, already touched tensors ("one
  memcpy", the floor of any capture); numpy ``copyto`` of the same bytes for reference.
- cryosnap eager: ``Checkpointer(dir, staging_bytes=None, incremental=False).save(step, state)``;
  the stall is the time until ``save`` returns (``SaveInfo.stall_seconds`` is shown next to it).
  One untimed warm-up save allocates the staging pool, which every later version reuses: the
  steady state a training loop sees. ``incremental=False`` makes every version full, so every
  version writes every byte in the background.
- cryosnap lazy: ``save(..., lazy=True)``; the stall is the time until the call returns; the
  capture (the copy, on a background thread) completes later, shown separately.
- ``torch.distributed.checkpoint.async_save`` (one process, no process group; its default stager
  allocates a fresh staging copy per call): the time until it returns its Future. For reference,
  the same with one ``DefaultStager`` reused across calls (it caches its staging buffers), the
  synchronous ``torch.distributed.checkpoint.save`` and ``torch.save`` + fsync.

After a warm-up round, repetitions go round-robin over the peers (the first peer rotates); before
each timed operation every earlier save is durable and the file systems are synced (untimed).
Tables show medians. Peak memory of a save with ``staging_bytes`` smaller than the state is
measured in a fresh child process (VmHWM, reset through /proc/self/clear_refs, and VmRSS sampled
every 5 ms by a thread).

Part 2, a training loop: an MLP whose parameters plus Adam moments exceed 256 MB, a batch tuned
for about one second per step, two torch threads. N timed steps (default 20) without checkpoints
(the baseline) and with a checkpoint every step and every 10 steps by each of: cryosnap eager,
cryosnap lazy (the optimizer's step pre-hook waits for the capture), DCP ``async_save`` (waiting
for the previous Future before the next save, as the DCP docs recommend) and ``torch.save`` +
fsync. cryosnap runs with its product default, ``incremental=True``. The N steps run as
``--rounds`` segments in round-robin rounds (order reversed every other round), each interval
group with its own baseline beside it in time: on a shared machine the load drifts by 2x within
minutes, and a single baseline run would carry all of that drift into every overhead.

Checks from the issue are printed as PASS / FAIL / SKIP, never asserted.

Run: ``.venv/bin/python bench/bench_async.py`` (about 12 minutes; ``--quick``: about 2).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

import _harness as h

StateDict = dict[str, torch.Tensor]

_SEED = 20240611
_MIB = 1 << 20
_MB = 10**6
_POLL_SECONDS = 0.0002


# ----------------------------------------------------------------------------------- cryosnap


def quiet_dcp_warnings() -> None:
    # DCP warns on every call that it runs without a process group, which is what we mean.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")


# ------------------------------------------------------------------------------------ results


@dataclass(slots=True)
class Report:
    """Everything measured, written to --json after each part (results as we go)."""

    environment: dict[str, Any]
    args: dict[str, Any]
    stall: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)

    def add_checks(self, checks: Sequence[h.Check]) -> None:
        for check in checks:
            print(check.line(), flush=True)
            self.checks.append(asdict(check))

    def write(self, path: Path | None) -> None:
        if path is None:
            return
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, default=str) + "\n")
        tmp.replace(path)


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1e3:.1f} ms"


def _s(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds:.3f} s"


def _x(value: float, reference: float) -> str:
    if value != value or reference != reference or reference <= 0:
        return "-"
    return f"{value / reference:.2f}x"


def _ratio_check(name: str, value: float, limit: float, reference: float, what: str) -> h.Check:
    """PASS when value <= limit * reference (seconds)."""
    if value != value or reference != reference or reference <= 0:
        return h.Check(name, None, "not measured")
    ratio = value / reference
    detail = f"{_ms(value)} = {ratio:.2f}x {what} ({_ms(reference)}); limit {limit}x"
    return h.Check(name, ratio <= limit, detail)


# --------------------------------------------------------------------------- part 1: the state


def build_state(size_scale: float, tensors: int = 16) -> StateDict:
    """16 fp32 tensors of 4096 x 4096 (64 MiB each), rows scaled by ``size_scale``."""
    gen = torch.Generator().manual_seed(_SEED)
    rows = max(1, round(4096 * size_scale))
    return {f"blocks.{i}.weight": torch.randn(rows, 4096, generator=gen) for i in range(tensors)}


def state_bytes(state: StateDict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def nudge(state: StateDict) -> None:
    """Change one element of every tensor so that each version differs from the last."""
    for t in state.values():
        t.view(-1)[0] += 1.0


def wait_captured(pending: Any) -> None:
    """Poll until a lazy capture completes, without ``wait_captured`` (which counts as stall)."""
    while not pending.captured():
        time.sleep(_POLL_SECONDS)


class StallPeer:
    """One way to take a checkpoint of the state; ``run`` times one save and waits it out."""

    key = ""
    label = ""

    def setup(self, root: Path, state: StateDict) -> None:
        pass

    def run(self, state: StateDict) -> dict[str, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TorchCopyPeer(StallPeer):
    key = "memcpy"
    label = "memcpy: torch copy_ into preallocated"

    def setup(self, root: Path, state: StateDict) -> None:
        self.dst = {k: torch.empty_like(v) for k, v in state.items()}
        for k, v in state.items():
            self.dst[k].copy_(v)  # touch every page before the clock starts

    def run(self, state: StateDict) -> dict[str, float]:
        os.sync()
        t0 = time.perf_counter()
        for k, v in state.items():
            self.dst[k].copy_(v)
        return {"stall": time.perf_counter() - t0}

    def close(self) -> None:
        self.dst = {}


class NumpyCopyPeer(TorchCopyPeer):
    key = "memcpy_numpy"
    label = "memcpy: numpy copyto (reference)"

    def run(self, state: StateDict) -> dict[str, float]:
        pairs = [(self.dst[k].numpy(), v.numpy()) for k, v in state.items()]
        os.sync()
        t0 = time.perf_counter()
        for dst, src in pairs:
            np.copyto(dst, src)
        return {"stall": time.perf_counter() - t0}


class CryosnapPeer(StallPeer):
    """Eager or lazy saves; eager and lazy share one Checkpointer (one staging pool)."""

    def __init__(self, cryosnap: ModuleType, shared: dict[str, Any], *, lazy: bool) -> None:
        self.cryosnap = cryosnap
        self.shared = shared
        self.lazy = lazy
        self.key = "cryosnap_lazy" if lazy else "cryosnap_eager"
        self.label = "cryosnap save(lazy=True)" if lazy else "cryosnap save (eager)"

    def setup(self, root: Path, state: StateDict) -> None:
        if "ckpt" not in self.shared:
            # incremental=False: every version is full; keep=1 bounds the disk used.
            self.shared["ckpt"] = self.cryosnap.Checkpointer(
                root / "cryosnap", staging_bytes=None, incremental=False, keep=1
            )
            self.shared["step"] = 0

    def run(self, state: StateDict) -> dict[str, float]:
        ckpt = self.shared["ckpt"]
        ckpt.wait()
        self.shared["step"] += 1
        nudge(state)
        gc.collect()
        os.sync()
        t0 = time.perf_counter()
        pending = ckpt.save(self.shared["step"], state, lazy=self.lazy)
        stall = time.perf_counter() - t0
        wait_captured(pending)
        captured = time.perf_counter() - t0
        info = pending.result()
        durable = time.perf_counter() - t0
        return {
            "stall": stall,
            "captured": captured,
            "durable": durable,
            "info_stall": info.stall_seconds,
            "written_bytes": float(info.written_bytes),
        }

    def close(self) -> None:
        ckpt = self.shared.pop("ckpt", None)
        if ckpt is not None:
            ckpt.close()


def dcp_async_save(
    state: dict[str, Any], path: Path, stager: Any = None
) -> tuple[Future[Any], Future[Any] | None]:
    """``torch.distributed.checkpoint.async_save``: (upload future, staging future or None)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    kwargs: dict[str, Any] = {} if stager is None else {"async_stager": stager}
    result = async_save(state, checkpoint_id=path, **kwargs)
    if isinstance(result, AsyncSaveResponse):
        return result.upload_completion, result.staging_completion
    return result, None


class DcpAsyncPeer(StallPeer):
    def __init__(self, *, reuse_stager: bool) -> None:
        self.reuse_stager = reuse_stager
        self.key = "dcp_async_cached" if reuse_stager else "dcp_async"
        self.label = (
            "DCP async_save, one DefaultStager reused (ref.)"
            if reuse_stager
            else "DCP async_save (default)"
        )
        self.stager: Any = None
        self.count = 0

    def setup(self, root: Path, state: StateDict) -> None:
        self.root = root
        if self.reuse_stager and self.stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # What async_save makes per call (no pinning, no shared memory, synchronous
            # staging), but kept, so its cached staging buffers are reused across versions.
            self.stager = DefaultStager(StagingOptions(False, False, False, False))

    def run(self, state: StateDict) -> dict[str, float]:
        self.count += 1
        path = self.root / f"{self.key}-{self.count}"
        nudge(state)
        gc.collect()
        os.sync()
        t0 = time.perf_counter()
        upload, staging = dcp_async_save(state, path, self.stager)
        stall = time.perf_counter() - t0
        if staging is not None:
            staging.result()
        captured = time.perf_counter() - t0
        upload.result()
        durable = time.perf_counter() - t0
        h.rmtree(path)
        return {"stall": stall, "captured": captured, "durable": durable}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class DcpSyncPeer(StallPeer):
    key = "dcp_save"
    label = "DCP save, synchronous (ref.)"

    def setup(self, root: Path, state: StateDict) -> None:
        self.root = root
        self.count = 0

    def run(self, state: StateDict) -> dict[str, float]:
        from torch.distributed.checkpoint.state_dict_saver import save

        self.count += 1
        path = self.root / f"{self.key}-{self.count}"
        nudge(state)
        gc.collect()
        os.sync()
        t0 = time.perf_counter()
        save(state, checkpoint_id=path)
        seconds = time.perf_counter() - t0
        h.rmtree(path)
        return {"stall": seconds, "durable": seconds}


def torch_save_fsync(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    h.fsync_path(path.parent)


class TorchSavePeer(StallPeer):
    key = "torch_save"
    label = "torch.save + fsync (ref.)"

    def setup(self, root: Path, state: StateDict) -> None:
        self.root = root

    def run(self, state: StateDict) -> dict[str, float]:
        path = self.root / "torch_save.pt"
        nudge(state)
        gc.collect()
        os.sync()
        t0 = time.perf_counter()
        torch_save_fsync(state, path)
        seconds = time.perf_counter() - t0
        path.unlink()
        return {"stall": seconds, "durable": seconds}


def measure_stall(
    cryosnap: ModuleType, root: Path, args: argparse.Namespace, report: Report
) -> dict[str, dict[str, list[float]]]:
    state = build_state(args.size_scale)
    nbytes = state_bytes(state)
    print(
        f"\n== part 1: stall on {h.format_bytes(nbytes)} of fp32 in {len(state)} tensors "
        f"({args.repeat} repetitions round-robin after 1 warm-up round; medians) ==",
        flush=True,
    )
    shared: dict[str, Any] = {}
    peers: list[StallPeer] = [
        TorchCopyPeer(),
        NumpyCopyPeer(),
        CryosnapPeer(cryosnap, shared, lazy=False),
        CryosnapPeer(cryosnap, shared, lazy=True),
        DcpAsyncPeer(reuse_stager=False),
        DcpAsyncPeer(reuse_stager=True),
        DcpSyncPeer(),
        TorchSavePeer(),
    ]
    # The numpy peer copies into the torch peer's buffers: one destination, allocated once.
    copy_peer = peers[0]
    assert isinstance(copy_peer, TorchCopyPeer)
    samples: dict[str, dict[str, list[float]]] = {p.key: {} for p in peers}
    errors: dict[str, str] = {}
    part_root = root / "stall"
    part_root.mkdir()
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    try:
        for peer in peers:
            if isinstance(peer, NumpyCopyPeer):
                peer.dst = copy_peer.dst
            else:
                peer.setup(part_root, state)
        for rep in range(-1, args.repeat):  # rep -1: the untimed warm-up round
            shift = max(rep, 0) % len(peers)
            for peer in peers[shift:] + peers[:shift]:
                if peer.key in errors:
                    continue
                try:
                    metrics = peer.run(state)
                except Exception as exc:
                    errors[peer.key] = f"{type(exc).__name__}: {exc}"
                    print(f"  {peer.key} failed: {errors[peer.key]}", flush=True)
                    continue
                if rep >= 0:
                    for name, value in metrics.items():
                        samples[peer.key].setdefault(name, []).append(value)
            label = "warm-up" if rep < 0 else f"repetition {rep + 1}/{args.repeat}"
            print(f"  {label} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    finally:
        for peer in peers:
            with contextlib.suppress(Exception):
                peer.close()
        h.rmtree(part_root)
        os.sync()
    load_after = os.getloadavg()[0]

    def med(key: str, metric: str) -> float:
        return h.median(samples[key].get(metric, []))

    memcpy = med("memcpy", "stall")
    rows = []
    for peer in peers:
        if peer.key in errors:
            rows.append([peer.label, "error", "", "", "", "", ""])
            continue
        stall = med(peer.key, "stall")
        rows.append(
            [
                peer.label,
                _ms(stall),
                _x(stall, memcpy),
                _ms(med(peer.key, "captured")),
                _s(med(peer.key, "durable")),
                _ms(med(peer.key, "info_stall")),
                f"{nbytes / stall / 1e9:.2f}" if stall > 0 else "-",
            ]
        )
    headers = [
        "peer",
        "stall",
        "x memcpy",
        "captured",
        "durable",
        "SaveInfo.stall",
        "GB/s (stall)",
    ]
    print()
    print(h.format_table(headers, rows))
    print(
        "stall: until the call returns; captured: until the state may change again (lazy "
        "capture done / DCP staging done); durable: until the version is on disk (fsync'd)"
    )
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    h.warn_if_busy(load_before, load_after)
    for key, why in errors.items():
        print(f"  {key}: {why}")

    eager = med("cryosnap_eager", "stall")
    lazy = med("cryosnap_lazy", "stall")
    dcp_async = med("dcp_async", "stall")
    report.stall = {
        "state_bytes": nbytes,
        "samples": samples,
        "errors": errors,
        "load_average": [load_before, load_after],
    }
    checks = [
        _ratio_check("eager stall <= 1.5x memcpy", eager, 1.5, memcpy, "memcpy"),
        _ratio_check(
            "eager stall <= 0.5x DCP async_save stall", eager, 0.5, dcp_async, "DCP async_save"
        ),
        _ratio_check("lazy stall <= 0.1x memcpy", lazy, 0.1, memcpy, "memcpy"),
    ]
    cached = med("dcp_async_cached", "stall")
    if cached == cached:
        print(
            f"(info, not a check: eager stall = {_x(eager, cached)} the stall of DCP async_save "
            "with a reused DefaultStager)"
        )
    if args.size_scale != 1.0:
        print(f"size scale {args.size_scale}: a smoke run; the checks are meant for scale 1")
    report.add_checks(checks)
    del state, shared
    gc.collect()
    return samples


# ------------------------------------------------------------------- part 1b: peak memory child


def _rss_sampler(stop: threading.Event, out: list[int]) -> None:
    peak = 0
    while not stop.is_set():
        peak = max(peak, h.current_rss_bytes())
        stop.wait(0.005)
    out.append(max(peak, h.current_rss_bytes()))


def child_peak_memory(directory: Path, size_scale: float, staging_bytes: int, saves: int) -> None:
    """In a fresh process: peak RSS over ``saves`` saves (eager, lazy, ...) of the state."""
    cryosnap = h.import_cryosnap()
    state = build_state(size_scale)
    gc.collect()
    before = h.current_rss_bytes()
    reset = h.reset_peak_rss()
    stop = threading.Event()
    sampled: list[int] = []
    sampler = threading.Thread(target=_rss_sampler, args=(stop, sampled), daemon=True)
    sampler.start()
    stalls = []
    with cryosnap.Checkpointer(
        directory, staging_bytes=staging_bytes, incremental=False, keep=1
    ) as ckpt:
        for i in range(saves):
            nudge(state)
            t0 = time.perf_counter()
            pending = ckpt.save(i + 1, state, lazy=bool(i % 2))
            stalls.append(time.perf_counter() - t0)
            pending.result()
    stop.set()
    sampler.join()
    result = {
        "rss_before_bytes": before,
        "peak_rss_bytes": h.peak_rss_bytes(),
        "sampled_peak_rss_bytes": sampled[0],
        "hwm_reset": reset,
        "state_bytes": state_bytes(state),
        "staging_bytes": staging_bytes,
        "saves": saves,
        "stalls": stalls,
    }
    print(json.dumps(result))


def measure_memory(root: Path, args: argparse.Namespace, report: Report) -> None:
    staging = args.staging_mib * _MIB
    print(
        f"\n== part 1b: peak memory of saves with staging_bytes={h.format_bytes(staging)} "
        "(fresh child process) ==",
        flush=True,
    )
    directory = root / "memory"
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child-peak-memory",
        str(directory),
        "--size-scale",
        str(args.size_scale),
        "--staging-mib",
        str(args.staging_mib),
    ]
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        report.add_checks([h.Check("peak extra memory", False, "child timed out after 600 s")])
        return
    finally:
        h.rmtree(directory)
        os.sync()
    if completed.returncode != 0:
        print(completed.stderr)
        report.add_checks(
            [h.Check("peak extra memory", False, f"child exited {completed.returncode}")]
        )
        return
    fields = json.loads(completed.stdout.strip().splitlines()[-1])
    report.memory = fields
    hwm_delta = fields["peak_rss_bytes"] - fields["rss_before_bytes"]
    sampled_delta = fields["sampled_peak_rss_bytes"] - fields["rss_before_bytes"]
    stalls = ", ".join(_ms(s) for s in fields["stalls"])
    print(
        f"state {h.format_bytes(fields['state_bytes'])}, {fields['saves']} saves (eager, lazy, "
        f"...; incremental=False), stall of each: {stalls}"
    )
    print(
        f"RSS before {h.format_bytes(fields['rss_before_bytes'])}; peak extra: "
        f"{h.format_bytes(hwm_delta)} (VmHWM{'' if fields['hwm_reset'] else ', NOT reset'}), "
        f"{h.format_bytes(sampled_delta)} (VmRSS sampled every 5 ms)"
    )
    limit = 1.1 * staging
    peak = max(hwm_delta, sampled_delta) if fields["hwm_reset"] else sampled_delta
    report.add_checks(
        [
            h.Check(
                "peak extra memory <= staging_bytes + 10%",
                peak <= limit,
                f"{h.format_bytes(peak)} vs limit {h.format_bytes(limit)} "
                f"(staging_bytes {h.format_bytes(staging)})",
            )
        ]
    )


# --------------------------------------------------------------------- part 2: training loop


def make_model(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(_SEED)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    opt.step()


def training_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


class Saver:
    """A checkpoint method inside the training loop."""

    key = "none"
    label = "no checkpoint (baseline)"

    def open(self, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.root, self.model, self.opt = root, model, opt
        self.save_seconds: list[float] = []  # time of the save-related calls in the loop

    def save(self, step: int) -> None:
        pass

    def warm_up(self) -> None:
        """One untimed save (step 0) before the loop, drained: the steady state of a long run,
        where staging buffers exist and files, imports and threads are warm."""
        if self.key == "none":
            return
        self.save(0)
        self.drain()
        self.save_seconds.clear()

    def drain(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class CryosnapSaver(Saver):
    def __init__(self, cryosnap: ModuleType, *, lazy: bool) -> None:
        self.cryosnap = cryosnap
        self.lazy = lazy
        self.key = "cryosnap_lazy" if lazy else "cryosnap_eager"
        self.label = "cryosnap lazy" if lazy else "cryosnap eager"

    def open(self, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().open(root, model, opt)
        self.ckpt = self.cryosnap.Checkpointer(root / "run")  # product defaults: incremental
        self.pendings: list[Any] = []

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        self.pendings.append(
            self.ckpt.save(step, {"model": self.model, "optim": self.opt}, lazy=self.lazy)
        )
        self.save_seconds.append(time.perf_counter() - t0)

    def drain(self) -> None:
        self.ckpt.wait()

    def warm_up(self) -> None:
        super().warm_up()
        self.pendings.clear()

    def stats(self) -> dict[str, float]:
        infos = [p.result() for p in self.pendings]
        if not infos:
            return {}
        return {
            "info_stall_mean": sum(i.stall_seconds for i in infos) / len(infos),
            "durable_mean": sum(i.seconds for i in infos) / len(infos),
            "written_fraction": sum(i.written_bytes for i in infos)
            / max(1, sum(i.logical_bytes for i in infos)),
        }

    def close(self) -> None:
        self.ckpt.close()


class DcpSaver(Saver):
    key = "dcp_async"
    label = "DCP async_save"

    def open(self, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().open(root, model, opt)
        self.future: Future[Any] | None = None

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        if self.future is not None:
            self.future.result()  # as the DCP docs recommend: one checkpoint in flight
        state = {"model": self.model, "optim": self.opt}
        self.future, _staging = dcp_async_save(state, self.root / f"step-{step}")
        self.save_seconds.append(time.perf_counter() - t0)

    def drain(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None


class TorchSaver(Saver):
    key = "torch_save"
    label = "torch.save + fsync"

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        torch_save_fsync(state, self.root / f"step-{step}.pt")
        self.save_seconds.append(time.perf_counter() - t0)


@dataclass(slots=True)
class RunResult:
    method: str
    every: int
    round: int
    iteration_seconds: list[float]
    saves: int
    save_seconds: list[float]
    drain_seconds: float
    stats: dict[str, float]

    @property
    def mean(self) -> float:
        return sum(self.iteration_seconds) / len(self.iteration_seconds)


def tune_batch(
    model: torch.nn.Module, opt: torch.optim.Optimizer, width: int, target: float
) -> int:
    """A batch size (multiple of 16) for a train step of about ``target`` seconds."""
    batch = 256
    train_step(model, opt, torch.randn(batch, width), torch.randn(batch, width))  # Adam state
    for _ in range(2):  # estimate, then correct once at the estimated size
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        train_step(model, opt, x, y)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            train_step(model, opt, x, y)
            times.append(time.perf_counter() - t0)
        # At least 64: below that, Adam's pass over the state dominates the step.
        batch = max(64, round(batch * target / h.median(times) / 16) * 16)
    return batch


def run_training(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: tuple[torch.Tensor, torch.Tensor],
    root: Path,
    saver: Saver,
    every: int,
    steps: int,
    round_index: int,
) -> RunResult:
    directory = root / f"{saver.key}-{every}-{round_index}"
    directory.mkdir()
    x, y = data
    saver.open(directory, model, opt)
    times = []
    saves = 0
    try:
        train_step(model, opt, x, y)  # one untimed step: caches warm after the previous run
        saver.warm_up()
        gc.collect()
        os.sync()
        for k in range(1, steps + 1):
            t0 = time.perf_counter()
            train_step(model, opt, x, y)
            # A checkpoint after iterations 1, 1 + every, ...: every save but the last of an
            # every-step run has later iterations in the loop to overlap its background work.
            if saver.key != "none" and (k - 1) % every == 0:
                saver.save(k)
                saves += 1
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        saver.drain()
        drain = time.perf_counter() - t0
        stats = saver.stats()
    finally:
        saver.close()
        h.rmtree(directory)
        os.sync()
    return RunResult(saver.key, every, round_index, times, saves, saver.save_seconds, drain, stats)


def split_steps(steps: int, rounds: int) -> list[int]:
    """``steps`` timed steps spread as evenly as possible over ``rounds`` segments."""
    return [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]


def measure_training(
    cryosnap: ModuleType, root: Path, args: argparse.Namespace, report: Report
) -> None:
    torch.set_num_threads(2)
    model, opt = make_model(args.width, args.layers)
    batch = args.batch or tune_batch(model, opt, args.width, args.step_seconds)
    gen = torch.Generator().manual_seed(_SEED)
    data = (
        torch.randn(batch, args.width, generator=gen),
        torch.randn(batch, args.width, generator=gen),
    )
    nbytes = training_state_bytes(model, opt)
    params = sum(p.numel() for p in model.parameters())
    segments = [n for n in split_steps(args.steps, args.rounds) if n > 0]
    print(
        f"\n== part 2: training loop: MLP {args.layers} x Linear({args.width}, {args.width}), "
        f"{params / 1e6:.1f} M parameters, Adam; state (params + moments) "
        f"{nbytes / _MB:.0f} MB; batch {batch} (tuned for ~{args.step_seconds} s/step); torch "
        f"threads {torch.get_num_threads()} ==",
        flush=True,
    )
    if nbytes < 256 * _MB:
        print(f"note: state is {nbytes / _MB:.0f} MB, below the 256 MB of the issue")
    print(
        f"{args.steps} timed steps per method and interval, run as {len(segments)} segment(s) of "
        f"{'+'.join(map(str, segments))} steps in round-robin rounds (order reversed every other "
        "round); each interval group has its own baseline runs (no checkpoint) beside it in "
        f"time, and overheads are against that group's baseline. A checkpoint after iterations "
        f"1, 1+N, 1+2N, ... of each segment for N in {args.every}. cryosnap runs with its "
        "product default incremental=True (Checkpointer(dir); eager save / save(lazy=True)); DCP "
        "async_save waits for the previous Future before the next save; torch.save fsyncs each "
        "file. Each segment starts with one untimed train step and one untimed, drained save "
        "(step 0): the timed loop sees the steady state (staging buffers allocated, imports "
        "warm).",
        flush=True,
    )
    savers: list[Saver] = [
        CryosnapSaver(cryosnap, lazy=False),
        CryosnapSaver(cryosnap, lazy=True),
        DcpSaver(),
        TorchSaver(),
    ]
    part_root = root / "train"
    part_root.mkdir()
    results: list[RunResult] = []
    errors: dict[str, str] = {}
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    try:
        for r, steps in enumerate(segments):
            for every in args.every:
                group: list[Saver] = [Saver(), *savers]
                if r % 2:
                    group.reverse()
                for saver in group:
                    name = f"{saver.key}/{every}"
                    if name in errors:
                        continue
                    try:
                        res = run_training(model, opt, data, part_root, saver, every, steps, r)
                    except Exception as exc:
                        errors[name] = f"{type(exc).__name__}: {exc}"
                        print(f"  {name} failed: {errors[name]}", flush=True)
                        continue
                    results.append(res)
                    print(
                        f"  round {r + 1}: {saver.label:<26} group every {every:>2}: mean "
                        f"{res.mean:.3f} s/iter over {steps}, {res.saves} saves, drain "
                        f"{res.drain_seconds:.2f} s ({time.perf_counter() - t_start:.0f} s)",
                        flush=True,
                    )
                    report.training.setdefault("runs", []).append(asdict(res))
    finally:
        h.rmtree(part_root)
    load_after = os.getloadavg()[0]

    def iterations(key: str, every: int) -> list[float]:
        return [
            t for r in results if r.method == key and r.every == every for t in r.iteration_seconds
        ]

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    print()
    headers = [
        "method",
        "every",
        "iter mean",
        "iter median",
        "overhead",
        "save call",
        "SaveInfo.stall",
        "durable",
        "drain",
        "written",
    ]
    rows = []
    overhead: dict[tuple[str, int], float] = {}
    baselines: dict[int, float] = {}
    for every in args.every:
        base = iterations("none", every)
        baselines[every] = mean(base)
        base_runs = ", ".join(
            f"{r.mean:.3f}" for r in results if r.method == "none" and r.every == every
        )
        rows.append(
            [
                f"no checkpoint (baseline; runs: {base_runs})",
                str(every),
                _s(baselines[every]),
                _s(h.median(base)),
                *[""] * 6,
            ]
        )
        for saver in savers:
            rs = [r for r in results if r.method == saver.key and r.every == every]
            name = f"{saver.key}/{every}"
            if not rs:
                rows.append([saver.label, str(every), errors.get(name, "error"), *[""] * 7])
                continue
            its = iterations(saver.key, every)
            overhead[(saver.key, every)] = (mean(its) / baselines[every] - 1.0) * 100
            save_calls = [s for r in rs for s in r.save_seconds]

            def stat(name: str, rs: list[RunResult] = rs) -> float:
                return h.median([r.stats[name] for r in rs if name in r.stats])

            written = stat("written_fraction")
            rows.append(
                [
                    saver.label,
                    str(every),
                    _s(mean(its)),
                    _s(h.median(its)),
                    f"{overhead[(saver.key, every)]:+.1f}%",
                    _ms(mean(save_calls)),
                    _ms(stat("info_stall_mean")),
                    _s(stat("durable_mean")),
                    _s(h.median([r.drain_seconds for r in rs])),
                    "-" if written != written else f"{written * 100:.0f}%",
                ]
            )
    print(h.format_table(headers, rows))
    print(
        "iter mean / median: over every timed iteration (train step + checkpoint calls) of all "
        "segments; overhead: iter mean vs the group's baseline iter mean; save call: mean time "
        "in the save call (for DCP including the wait for the previous Future; for cryosnap "
        "including the wait for the previous version when one is still in flight); "
        "SaveInfo.stall: the save call plus any optimizer step that waited for a lazy capture; "
        "durable: save call to on disk (median of segment means); drain: waiting for the last "
        "checkpoint after a segment (median; not in iter mean); written: bytes written / "
        "logical bytes (incremental de-duplication)"
    )
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    h.warn_if_busy(load_before, load_after)
    report.training.update(
        {
            "batch": batch,
            "state_bytes": nbytes,
            "params": params,
            "segments": segments,
            "baseline_mean": {str(k): v for k, v in baselines.items()},
            "overhead_percent": {f"{k}/{e}": v for (k, e), v in overhead.items()},
            "errors": errors,
            "load_average": [load_before, load_after],
        }
    )
    checks = []
    for every in args.every:
        ours = [overhead.get(("cryosnap_eager", every)), overhead.get(("cryosnap_lazy", every))]
        theirs = {k: overhead.get((k, every)) for k in ("dcp_async", "torch_save")}
        ours_ok = [v for v in ours if v is not None]
        theirs_ok = {k: v for k, v in theirs.items() if v is not None}
        name = f"cryosnap overhead (best of eager/lazy) is the lowest, every {every}"
        if not ours_ok or not theirs_ok:
            checks.append(h.Check(name, None, "not measured"))
            continue
        best = min(ours_ok)
        peer_key = min(theirs_ok, key=lambda k: theirs_ok[k])
        checks.append(
            h.Check(
                name,
                best <= theirs_ok[peer_key],
                f"cryosnap {best:+.1f}% vs best peer {peer_key} {theirs_ok[peer_key]:+.1f}%",
            )
        )
    report.add_checks(checks)


# ----------------------------------------------------------------------------------------- main


def environment(cryosnap: ModuleType) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "cryosnap": str(Path(cryosnap.__file__ or "?").parent),
        "load_average": os.getloadavg()[0],
    }


def _every_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas: {text!r}")
    return values


def _scale(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--size-scale must be in (0, 1], got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Asynchronous checkpoints: stall of cryosnap's Checkpointer against memcpy "
        "and torch.distributed.checkpoint.async_save, peak staging memory, and checkpoint "
        "overhead in a CPU training loop.",
    )
    parser.add_argument(
        "--part", choices=["stall", "memory", "train", "all"], default="all", help="what to run"
    )
    parser.add_argument("--quick", action="store_true", help="a ~2 minute version of everything")
    parser.add_argument(
        "--size-scale", type=_scale, default=None, help="shrink the part-1 state (default 1)"
    )
    parser.add_argument("--repeat", type=int, default=None, help="part-1 repetitions (default 5)")
    parser.add_argument(
        "--staging-mib", type=int, default=None, help="staging_bytes of the memory check (256)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per method and interval (20)"
    )
    parser.add_argument(
        "--every", type=_every_list, default=None, help="checkpoint intervals (default 1,10)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="segments per run, round-robin (default 2)"
    )
    parser.add_argument(
        "--step-seconds", type=float, default=None, help="target train step time (1.0 s)"
    )
    parser.add_argument("--batch", type=int, default=0, help="batch size (default: tuned)")
    parser.add_argument("--width", type=int, default=2048, help="MLP width (2048)")
    parser.add_argument("--layers", type=int, default=6, help="MLP Linear layers (6)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    parser.add_argument("--child-peak-memory", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults: dict[str, Any] = {
        "size_scale": 0.25 if quick else 1.0,
        "repeat": 3 if quick else 5,
        "staging_mib": 64 if quick else 256,
        "steps": 6 if quick else 20,
        "every": [1, 3] if quick else [1, 10],
        "rounds": 1 if quick else 2,
        "step_seconds": 0.4 if quick else 1.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeat < 1 or args.steps < 1 or args.rounds < 1 or args.staging_mib < 1:
        parser.error("--repeat, --steps, --rounds and --staging-mib must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_dcp_warnings()
    if args.child_peak_memory is not None:
        child_peak_memory(args.child_peak_memory, args.size_scale, args.staging_mib * _MIB, saves=4)
        return 0
    cryosnap = h.import_cryosnap()
    env = environment(cryosnap)
    report = Report(env, {k: str(v) for k, v in vars(args).items()})
    print(f"environment: {json.dumps(env)}")
    print(f"command: {' '.join([sys.executable, *sys.argv])}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="cryosnap-bench-async-", dir=args.dir))
    print(f"writing under {root}")
    t0 = time.perf_counter()
    try:
        if args.part in ("stall", "all"):
            measure_stall(cryosnap, root, args, report)
            report.write(args.json)
        if args.part in ("memory", "all"):
            measure_memory(root, args, report)
            report.write(args.json)
        if args.part in ("train", "all"):
            measure_training(cryosnap, root, args, report)
            report.write(args.json)
    finally:
        h.rmtree(root)
    print("\n== summary of checks ==")
    for check in report.checks:
        print(h.Check(**check).line())
    print(f"total time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
