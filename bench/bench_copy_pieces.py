"""Many small copies, four ways: 300 MB from one buffer into 20,000 separate tensors of
`cryosnap bench --workload many-small`'s sizes (what a save's pack fills and a restore's
copies into ``into=`` do), as a Python loop of ``memmove`` (one ctypes call per piece, the way
before ``_native.copy_pieces``), the same loop copying one byte per piece (the loop's own
cost), and ``copy_pieces`` on one thread and split between ``COPY_THREADS``; medians (min)
of ``--rounds``.

``PYTHONPATH=src python bench/bench_copy_pieces.py`` (docs/PERFORMANCE.md, "Many small
tensors: the copies of packs made by the kernel").
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from cryosnap import _native
from cryosnap.bench._workloads import many_small_shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=300_000_000, help="bytes (default 300 MB)")
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shapes = many_small_shapes(args.size, args.tensors)
    sizes = np.array([math.prod(s) * 4 for _name, s in shapes], np.int64)
    source = torch.randn(int(sizes.sum()) // 4).view(torch.uint8)
    dests = [torch.empty(int(n), dtype=torch.uint8) for n in sizes.tolist()]
    to = np.array([t.data_ptr() for t in dests], np.int64)
    frm = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) + source.data_ptr()
    memmove = _native.memmove_fn()

    def loop(nbytes: list[int]) -> Callable[[], None]:
        def run() -> None:
            for d, s, n in zip(to.tolist(), frm.tolist(), nbytes, strict=True):
                memmove(d, s, n)

        return run

    cases: dict[str, Callable[[], None]] = {
        "memmove per piece": loop(sizes.tolist()),
        "memmove per piece, 1 byte each (the loop alone)": loop([1] * len(sizes)),
        "copy_pieces, 1 thread": lambda: _native.copy_pieces(to, frm, sizes, threads=1),
        f"copy_pieces, {_native.COPY_THREADS} threads": lambda: _native.copy_pieces(
            to, frm, sizes, threads=_native.COPY_THREADS
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():  # interleaved: the machine's load moves
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    flat = source.numpy()
    pieces = zip(dests, np.cumsum(sizes).tolist(), sizes.tolist(), strict=True)
    if any(not np.array_equal(t.numpy(), flat[e - n : e]) for t, e, n in pieces):
        raise SystemExit("the copies differ from the source")
    kernel = "process_vm_readv" if _native._vm_read_ready() else "none: one memmove each"
    print(f"{len(sizes):,} pieces, {sizes.sum() / 1e6:.0f} MB; the kernel's call: {kernel}")
    for name, values in times.items():
        print(f"  {name}: {1e3 * statistics.median(values):.1f} ms ({1e3 * min(values):.1f})")


if __name__ == "__main__":
    main()
