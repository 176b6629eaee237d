"""What a columnar skeleton saves a restore into a dict of many small tensors: the JSON of
20,000 leaf nodes written one object per leaf (as before format_version 4) against one list per
field (a sketch of the columns docs/FORMAT.md now describes), each parsed; the columns' checks
in numpy; and the floor that stays, the torch attributes a restore reads of each tensor of
``into=`` (dtype, shape, address, size, contiguity, device, inference/conj/neg flags).
Minimums of 7 runs. The measurement docs/PERFORMANCE.md ("a restore's floor per tensor")
started the columns from.

``PYTHONPATH=src:bench python bench/bench_columnar.py [--tensors 20000]``
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cryosnap.bench._workloads import build_state, many_small_shapes


def _best(fn: Callable[[], Any], rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=300_000_000)
    parser.add_argument("--tensors", type=int, default=20_000)
    args = parser.parse_args()
    into = {
        k: torch.empty_like(v)
        for k, v in build_state(many_small_shapes(args.size, args.tensors)).items()
    }
    keys = list(into)
    nodes, at, blob = [], 0, 0
    for k in keys:
        t = into[k]
        nodes.append(
            {
                "t": "torch",
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "device": "cpu",
                "b": blob,
                "at": at,
            }
        )
        at += t.nbytes
        if at > 1 << 20:  # packs of about 1 MiB, as flatten makes them
            blob, at = blob + 1, 0
    names = sorted({n["dtype"] for n in nodes})
    rows = json.dumps({"t": "dict", "k": keys, "v": nodes})
    cols = json.dumps(
        {
            "t": "dict",
            "k": keys,
            "columns": {
                "dtypes": names,
                "dtype": [names.index(n["dtype"]) for n in nodes],
                "ndim": [len(n["shape"]) for n in nodes],
                "shape": [d for n in nodes for d in n["shape"]],
                "b": [n["b"] for n in nodes],
                "at": [n["at"] for n in nodes],
            },
        }
    )
    columns = json.loads(cols)["columns"]

    def check_columns() -> None:
        ndim = np.asarray(columns["ndim"], np.int64)
        shape = np.asarray(columns["shape"], np.int64)
        blobs, offsets = np.asarray(columns["b"], np.int64), np.asarray(columns["at"], np.int64)
        dtype = np.asarray(columns["dtype"], np.int64)
        ok = (ndim >= 0).all() and int(ndim.sum()) == len(shape) and (shape >= 0).all()
        ok = ok and (blobs >= 0).all() and (offsets >= 0).all() and (dtype < len(names)).all()
        assert ok

    plain = torch.Tensor

    def attributes() -> list[tuple[Any, ...]]:
        return [
            (
                type(x) is plain,
                x.dtype,
                x.shape,
                x.data_ptr(),
                x.nbytes,
                x.is_cpu,
                x.is_contiguous(),
                x.is_inference() or x.is_conj() or x.is_neg(),
            )
            for x in (into[k] for k in keys)
        ]

    gc.disable()
    print(f"{len(keys)} tensors, minimums of 7 runs:")
    for what, text in (("one object per leaf", rows), ("one list per field", cols)):
        ms = _best(lambda text=text: json.loads(text))  # type: ignore[misc]
        print(f"  parse, {what} ({len(text) / 1e6:.2f} MB): {ms:.1f} ms")
    print(f"  the columns' checks in numpy: {_best(check_columns):.1f} ms")
    print(f"  into='s torch attributes, one pass: {_best(attributes):.1f} ms")


if __name__ == "__main__":
    main()
