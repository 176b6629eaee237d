"""Verified restore against the raw read and the peers, interleaved in one process.

```bash
.venv/bin/python bench/bench_restore.py --state dense --rounds 5 --peers   # 1 GiB, 16 tensors
.venv/bin/python bench/bench_restore.py --state small --rounds 5 --peers   # ~300 MB, 20,000
# A/B of cryosnap trees: copies of src/cryosnap renamed cs_<name> in one folder
cp -r src/cryosnap /tmp/ab/cs_new && git archive HEAD~3 src/cryosnap | tar -x -C /tmp/old \
  && mv /tmp/old/src/cryosnap /tmp/ab/cs_old
.venv/bin/python bench/bench_restore.py --state dense --variants old,new --variants-dir /tmp/ab
```

Every round runs every reader once, the first one rotating, after one untimed round that warms
the page cache; the table shows medians and every sample. Readers:

- ``raw_readinto``: the file's bytes back to back, ``readinto`` preallocated, touched tensors
  (the limit of a restore into existing tensors);
- ``raw_fresh``: the same into tensors allocated by the read (the limit of a fresh load: the
  fresh pages are faulted in);
- ``<cryosnap>.load`` (every tensor touched) and ``<cryosnap>.load(into=)`` (the same
  preallocated tensors as raw_readinto), for the cryosnap on the path or each ``--variants``;
- ``--peers``: ``torch.load(weights_only=True)``, safetensors ``load_file`` (mmap: nothing is
  read until used, so every page is touched) and ``load_file(backend="pread")``.

Files are written once under ``--dir`` (reused by later runs of the same state) and left there;
the machine's load average is printed before and after: compare quiet runs only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

StateDict = dict[str, torch.Tensor]


def dense_shapes(size: int) -> list[tuple[str, tuple[int, ...]]]:
    rows = max(1, size // 16 // 4 // 4096)
    return [(f"blocks.{i}.weight", (rows, 4096)) for i in range(16)]


def small_shapes(size: int, tensors: int = 20_000) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer-like state dict of ``tensors`` tensors, ``size`` bytes (cryosnap bench's
    many-small workload)."""
    hidden, mlp, vocab = 64, 256, 65536
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(max(1, (tensors - 5) // 20)):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.input_layernorm.bias", (hidden,)),
        ]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes += [
                (f"{p}.attn.{proj}.weight", (hidden, hidden)),
                (f"{p}.attn.{proj}.bias", (hidden,)),
            ]
        shapes += [
            (f"{p}.attn.q_norm.weight", (hidden,)),
            (f"{p}.attn.k_norm.weight", (hidden,)),
            (f"{p}.attn.rotary_emb.inv_freq", (hidden // 2,)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.post_attention_layernorm.bias", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (mlp, hidden)),
            (f"{p}.mlp.up_proj.weight", (mlp, hidden)),
            (f"{p}.mlp.up_proj.bias", (mlp,)),
            (f"{p}.mlp.down_proj.weight", (hidden, mlp)),
            (f"{p}.mlp.down_proj.bias", (hidden,)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("model.norm.bias", (hidden,))]
    shapes.append(("lm_head.weight", (vocab, hidden)))
    fixed = sum(int(np.prod(s)) * 4 for _, s in shapes if len(s) < 2)
    rows = sum(s[0] for _, s in shapes if len(s) >= 2)
    row_bytes = sum(int(np.prod(s)) * 4 for _, s in shapes if len(s) >= 2) / rows
    scale = max(0.0, size - fixed) / (rows * row_bytes)
    return [(k, s if len(s) < 2 else (max(1, round(s[0] * scale)), *s[1:])) for k, s in shapes]


def byte_view(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


def touch(tree: StateDict) -> float:
    """Read one value per 4 KiB page of every tensor (lazily mapped loads read on use)."""
    return sum(float(t.reshape(-1)[::1024].sum()) for t in tree.values())


def write_files(work: Path, state: StateDict, cryosnap: Any) -> None:
    from safetensors.torch import save_file

    work.mkdir(parents=True, exist_ok=True)
    cryosnap.save(work / "cs", state, step=0)
    torch.save(state, work / "state.pt")
    save_file(state, work / "state.safetensors")
    with open(work / "raw.bin", "wb") as f:
        for t in state.values():
            f.write(byte_view(t))
    (work / "done").touch()


def _load(cryosnap: Any, path: Path, into: StateDict | None) -> object:
    if into is not None:
        return cryosnap.load(path, into=into)
    return touch(cryosnap.load(path))


def readers(
    work: Path, into: StateDict, mods: dict[str, Any], peers: bool
) -> dict[str, Callable[[], object]]:
    def raw_readinto() -> object:
        with open(work / "raw.bin", "rb", buffering=0) as f:
            for t in into.values():
                v = byte_view(t)
                while v:
                    v = v[f.readinto(v) :]
        return into

    def raw_fresh() -> object:
        out: StateDict = {}
        with open(work / "raw.bin", "rb", buffering=0) as f:
            for k, t in into.items():
                v = byte_view(out.setdefault(k, torch.empty_like(t)))
                while v:
                    v = v[f.readinto(v) :]
        return touch(out)

    found: dict[str, Callable[[], object]] = {"raw_readinto": raw_readinto, "raw_fresh": raw_fresh}
    for name, m in mods.items():
        found[f"{name}.load"] = functools.partial(_load, m, work / "cs", None)
        found[f"{name}.load(into=)"] = functools.partial(_load, m, work / "cs", into)
    if peers:
        from safetensors.torch import load_file

        found["torch.load"] = lambda: touch(torch.load(work / "state.pt", weights_only=True))
        found["safetensors(mmap)"] = lambda: touch(load_file(work / "state.safetensors"))
        found["safetensors(pread)"] = lambda: touch(
            load_file(work / "state.safetensors", backend="pread")
        )
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state", choices=["dense", "small"], default="dense")
    ap.add_argument("--size", type=int, default=None, help="bytes (dense 1 GiB, small 300 MB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/cryosnap-bench-restore"))
    ap.add_argument("--peers", action="store_true", help="also torch.load and safetensors")
    ap.add_argument("--variants", default="", help="comma list of NAME: import cs_NAME")
    ap.add_argument("--variants-dir", type=Path, default=None, help="the folder of cs_NAME")
    args = ap.parse_args()
    size = args.size or (1 << 30 if args.state == "dense" else 300_000_000)
    shapes = dense_shapes(size) if args.state == "dense" else small_shapes(size)
    if args.variants_dir is not None:
        sys.path.insert(0, str(args.variants_dir))
    names = [n for n in args.variants.split(",") if n]
    mods = {n: importlib.import_module(f"cs_{n}") for n in names}
    if not mods:
        mods = {"cryosnap": importlib.import_module("cryosnap")}
    work = args.dir / f"{args.state}-{size}"
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) for k, s in shapes}
    if not (work / "done").exists():
        write_files(work, state, next(iter(mods.values())))
    into = {k: torch.zeros_like(t) for k, t in state.items()}
    nbytes = sum(t.nbytes for t in state.values())
    del state
    found = readers(work, into, mods, args.peers)
    load_before = os.getloadavg()[0]
    for fn in found.values():  # the page cache warm for every reader
        fn()
        gc.collect()
    times: dict[str, list[float]] = {k: [] for k in found}
    order = list(found.items())
    for r in range(args.rounds):
        for name, fn in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            gc.collect()
    raw = statistics.median(times["raw_readinto"])
    print(f"{args.state}: {len(into)} tensors, {nbytes / 1e6:.0f} MB, {args.rounds} rounds")
    for name, ts in times.items():
        m = statistics.median(ts)
        samples = " ".join(f"{t:.3f}" for t in ts)
        print(
            f"  {name:24s} {m:7.3f} s {nbytes / m / 1e9:6.2f} GB/s {m / raw:6.2f}x raw  [{samples}]"
        )
    after = os.getloadavg()[0]
    print(f"load average {load_before:.2f} before, {after:.2f} after ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
