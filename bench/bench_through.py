"""Write-through capture on and off, side by side: the stall and the durable time of eager
``Checkpointer(keep=2, direct_io=True)`` versions against a raw ``O_DIRECT`` write+fsync of
the same bytes, in one process, the three writers alternating every version (a shared machine
drifts; medians of many alternated rounds are what can be compared).

512 MiB of float32 in 8 tensors (``--mib``, ``--tensors``), every byte changed between
versions; one warm-up version, then medians of ``--versions``. "off" is the same Checkpointer
with the hand-over disabled (every byte copied into staging first, as before #28 item 2).
Usage: ``python bench/bench_through.py [--dir D] [--mib 512] [--tensors 8] [--versions 15]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import cryosnap


def _raw(root: Path, step: int, buf: mmap.mmap) -> float:
    t0 = time.perf_counter()
    fd = os.open(root / f"{step}.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.pwrite(fd, memoryview(buf), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(root, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    seconds = time.perf_counter() - t0
    (root / f"{step - 2}.bin").unlink(missing_ok=True)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--versions", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    n = args.tensors
    state = {f"w{i}": torch.rand((args.mib << 18) // n) for i in range(n)}
    nbytes = sum(t.nbytes for t in state.values())
    buf = mmap.mmap(-1, -(-nbytes // 4096) * 4096)
    work = Path(tempfile.mkdtemp(prefix="bench-through-", dir=args.dir))
    (work / "raw").mkdir()
    ckpts = {
        side: cryosnap.Checkpointer(work / side, keep=2, incremental=False, direct_io=True)
        for side in ("on", "off")
    }
    ckpts["off"]._capturer.through = False  # every byte through the staging copy
    stall: dict[str, list[float]] = {"on": [], "off": []}
    durable: dict[str, list[float]] = {"raw": [], "on": [], "off": []}
    loads = []
    try:
        for step in range(args.versions + 1):
            for t in state.values():
                t.add_(1.0)  # every byte changes
            at = 0
            for t in state.values():
                buf[at : at + t.nbytes] = t.numpy().data.cast("B")
                at += t.nbytes
            order = ["raw", "on", "off"]
            for side in order[step % 3 :] + order[: step % 3]:
                os.sync()
                if side == "raw":
                    seconds = _raw(work / "raw", step, buf)
                else:
                    t0 = time.perf_counter()
                    pending = ckpts[side].save(step, state)
                    returned = time.perf_counter() - t0
                    pending.result()
                    seconds = time.perf_counter() - t0
                    ckpts[side].wait()
                    if step:
                        stall[side].append(returned)
                if step:
                    durable[side].append(seconds)
            loads.append(os.getloadavg()[0])
        limit = statistics.median(durable["raw"])
        print(f"{nbytes / 2**20:.0f} MiB in {n} tensors, keep=2, medians of {args.versions}")
        print(f"1-min load {min(loads):.1f}-{max(loads):.1f}")
        print(f"{'writer':34} {'durable s':>10} {'x raw direct':>13} {'stall s':>8}")
        print(f"{'raw O_DIRECT write+fsync':34} {limit:10.3f} {1:12.2f}x")
        for side, name in (("on", "write-through"), ("off", "copy first (before)")):
            med = statistics.median(durable[side])
            print(f"{'Checkpointer ' + name:34} {med:10.3f} {med / limit:12.2f}x "
                  f"{statistics.median(stall[side]):8.3f}")  # fmt: skip
        got = ckpts["on"].restore()
        assert all(torch.equal(got[k], v) for k, v in state.items())
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
        buf.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
