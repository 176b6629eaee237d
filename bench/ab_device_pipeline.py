"""A restore to a device, pipelined or not, on this machine's CPU (#28 item 8's structure; the
GPU figure is bench_gpu.py's): the state is read and verified, and its torch leaves copied
into fresh tensors through the device copier (pinned slabs on a GPU, plain memory here).

- ``pipelined``: ``cryosnap.load(map_location="cpu")`` with the engine's ``_pipelined`` made
  to answer True for the CPU: each blob's leaves are copied by the feed's thread as soon as
  the blob verified, while the others are still read.
- ``serial``: ``cryosnap.load()`` then the same copier over every leaf
  (``cryosnap._state.device.to_device``): the copies after every read, as a restore to a
  device ran before.
- ``load``: ``cryosnap.load()`` alone (no copies), the floor.

Warm page cache; the cases alternate; medians (and minimums) of ``--rounds`` after a warm-up
round, wall seconds. On a 2-core machine the copy competes with the hashing threads for the
cores; on a GPU host the host-to-device DMA does not.
Usage: ``PYTHONPATH=src python bench/ab_device_pipeline.py [--dir D] [--mib 512]
[--tensors 8] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cryosnap
from cryosnap._state.device import to_device
from cryosnap.engine import _read


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="cryosnap-pipe-"))
    try:
        per = args.mib * (1 << 20) // 4 // args.tensors
        torch.manual_seed(0)
        state = {f"t{i}": torch.randn(per) for i in range(args.tensors)}
        cryosnap.save(root / "run", state, step=1)
        real = _read._pipelined

        def pipelined() -> None:
            _read._pipelined = lambda device: True
            try:
                cryosnap.load(root / "run", map_location="cpu")
            finally:
                _read._pipelined = real

        def serial() -> None:
            to_device(_leaves(cryosnap.load(root / "run")), torch.device("cpu"))

        def load() -> None:
            cryosnap.load(root / "run")

        cases: dict[str, Callable[[], None]] = {
            "pipelined": pipelined,
            "serial": serial,
            "load": load,
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(args.rounds + 1):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if r:
                    times[name].append(dt)
        print(
            f"{args.mib} MiB in {args.tensors} tensors, {os.cpu_count()} CPUs, load "
            f"{os.getloadavg()[0]:.1f}; wall seconds, median (min) of {args.rounds}:"
        )
        base = statistics.median(times["serial"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:10s} {med:.3f} ({min(ts):.3f})  {med / base:.2f}x serial")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
