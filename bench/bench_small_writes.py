"""How long a state of many small tensors takes to reach the disk: per version the stall,
the time to durable and its part after the stall, with the direct writes' calls counted; a
lazy save's stall for a module and its Adam state of many small tensors; a one-shot
``cryosnap.save``. Wall times (medians): compare trees only alternated, in the same minutes.

``PYTHONPATH=<tree>/src python bench/bench_small_writes.py eager|lazy-optimizer|one-shot``
(docs/PERFORMANCE.md, "Many small tensors to the disk"). Writes under
``$CRYOSNAP_BENCH_DIR`` (default: the system temp dir), which must take ``O_DIRECT`` for the
write counts to mean anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

import cryosnap
from cryosnap.bench._workloads import build_state, many_small_shapes
from cryosnap.storage import LocalStore
from cryosnap.storage._direct import Syscalls


class _Counted(Syscalls):
    """The direct writes' calls of the store, counted (pwritev where the tree has it)."""

    def __init__(self) -> None:
        self.calls = 0

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self.calls += 1
        return super().pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        self.calls += 1
        return os.pwritev(fd, buffers, offset)


def _eager(root: str, versions: int, size: int, tensors: int) -> str:
    state = build_state(many_small_shapes(size, tensors))
    counted = _Counted()
    store = LocalStore(os.path.join(root, "run"), direct_io=True, syscalls=counted)
    stalls, durable, calls = [], [], []
    with cryosnap.Checkpointer(store, incremental=False, keep=1) as ckpt:
        ckpt.save(0, state).result()  # the staging pool and the packs' memory, untimed
        for step in range(1, versions + 1):
            time.sleep(0.2)
            before = counted.calls
            t0 = time.perf_counter()
            pending = ckpt.save(step, state)
            t1 = time.perf_counter()
            pending.result()
            t2 = time.perf_counter()
            stalls.append(t1 - t0)
            durable.append(t2 - t0)
            calls.append(counted.calls - before)
    after = [d - s for d, s in zip(durable, stalls, strict=True)]
    return (
        f"eager, {tensors:,} tensors: stall {_ms(stalls)}, durable {_ms(durable)}, after the "
        f"stall {_ms(after)}, direct write calls per version {statistics.median(calls):.0f}"
    )


def _lazy_optimizer(root: str, versions: int, layers: int, width: int) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state: dict[str, Any] = {"model": model, "opt": opt}
    stalls, cpu, durable = [], [], []
    with cryosnap.Checkpointer(os.path.join(root, "run"), incremental=False, keep=1) as ckpt:
        ckpt.save(0, state, lazy=True).result()
        for step in range(1, versions + 1):
            time.sleep(0.2)
            c0, t0 = time.thread_time(), time.perf_counter()
            pending = ckpt.save(step, state, lazy=True)
            stalls.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            pending.result()
            durable.append(time.perf_counter() - t0)
    n = len(model.state_dict()) * 3
    q = statistics.quantiles(cpu, n=4)
    return (
        f"lazy, {layers} x Linear({width}, {width}) and Adam ({n:,} tensors): "
        f"stall {_ms(stalls)}, "
        f"save() CPU min / first quartile / median {1e3 * min(cpu):.1f} / {1e3 * q[0]:.1f} / "
        f"{1e3 * q[1]:.1f} ms, durable {_ms(durable)}"
    )


def _one_shot(root: str, versions: int, size: int, tensors: int) -> str:
    state = build_state(many_small_shapes(size, tensors))
    times = []
    for i in range(versions + 1):
        path = os.path.join(root, f"once-{i}")
        t0 = time.perf_counter()
        cryosnap.save(path, state, step=0)
        times.append(time.perf_counter() - t0)
        shutil.rmtree(path)
    return f"cryosnap.save, {tensors:,} tensors: {_ms(times[1:])} to durable"


def _ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["eager", "lazy-optimizer", "one-shot"])
    parser.add_argument("--versions", type=int, default=8)
    parser.add_argument("--size", type=int, default=300_000_000, help="bytes (default 300 MB)")
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=3000, help="lazy-optimizer's Linears")
    parser.add_argument("--width", type=int, default=64, help="lazy-optimizer's Linear width")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-writes-", dir=os.environ.get("CRYOSNAP_BENCH_DIR"))
    try:
        if args.what == "eager":
            line = _eager(root, args.versions, args.size, args.tensors)
        elif args.what == "lazy-optimizer":
            line = _lazy_optimizer(root, args.versions, args.layers, args.width)
        else:
            line = _one_shot(root, args.versions, args.size, args.tensors)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{line} (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
