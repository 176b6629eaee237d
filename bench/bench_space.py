"""Space under retention: the bytes a run holds with ``keep=K`` in dense training, against K
versions of the state.

A CPU AdamW job (an MLP of two Linear(W, W) layers; the model, AdamW's two moments and the RNG
state are saved, ~28.6 MB at W = 1100), one save per training step, ``Checkpointer(dir,
keep=K, full_every=16)``. After the last save (and retention's deletes) it prints the bytes of
the run's data files and of every file against ``K x`` the version's logical bytes, and the
median bytes each incremental version wrote against the bytes that changed (the model and the
moments: every value changes each step). What a version writes beyond them is the remnant it
copied forward (the RNG state and the step counters). Prints figures only; asserts nothing.

With ``--ranks N`` the same job runs as N torch.distributed (gloo) processes training one
DistributedDataParallel model, each rank saving its own copy of the state (``--replicated``:
the model and optimizer saved as replicated, written once in total, each rank's RNG state its
own); the bytes are then compared with K versions of every rank's part.

    .venv/bin/python bench/bench_space.py                  # keep=3, 12 versions
    .venv/bin/python bench/bench_space.py --keep 2 --versions 20
    .venv/bin/python bench/bench_space.py --ranks 2 [--replicated]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cryosnap


def _bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _train_and_save(rank: int, args: argparse.Namespace, run: Path, port: int) -> None:
    """One rank (or the one process) of the job: train, save each step, report on rank 0."""
    if args.ranks > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w))
    trained = torch.nn.parallel.DistributedDataParallel(model) if args.ranks > 1 else model
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(rank)  # each rank its own batches and RNG state
    dense = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    replicated = ["model", "optim"] if args.replicated else None
    written: list[int] = []
    with cryosnap.Checkpointer(run, keep=args.keep, full_every=16) as ckpt:
        for step in range(args.versions):
            loss = trained(torch.randn(64, w)).square().mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            state = {"model": model, "optim": optim, "rng": cryosnap.RNGState()}
            info = ckpt.save(step, state, replicated=replicated).result()
            written.append(info.written_bytes)
        ckpt.wait()  # retention's deletes run after a version is reported
        space = getattr(ckpt.status(), "space", {}).get("persistent", ())
    if args.ranks > 1:
        dist.destroy_process_group()
    if rank == 0:
        parts = 1 if args.replicated else args.ranks
        _report(args, run, parts * info.logical_bytes, written, dense, space)


def _report(
    args: argparse.Namespace,
    run: Path,
    version: int,
    written: list[int],
    dense: int,
    space: tuple[object, ...],
) -> None:
    k = args.keep
    data, total = _bytes(run / "data"), _bytes(run)
    print(f"keep={k}, {args.versions} versions of {version:,} B, {args.ranks} rank(s)")
    print(f"data files : {data:,} B = {data / (k * version):.3f} x {k} versions")
    print(f"all files  : {total:,} B = {total / (k * version):.3f} x {k} versions")
    median = statistics.median(written[1:])
    print(f"written per incremental version (median, rank 0): {median:,} B")
    if not args.replicated:
        print(f"  of which beyond the changed model and moments: {median - dense:,.0f} B")
    for v in space:
        print(
            f"  step {v.step}: owns {v.owned_bytes:,} B, reads {v.referenced_bytes:,} B "  # type: ignore[attr-defined]
            f"of other versions' files, pins {v.pinned_bytes:,} B of dropped ones"  # type: ignore[attr-defined]
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--versions", type=int, default=12)
    parser.add_argument("--width", type=int, default=1100)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--replicated", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        if args.ranks == 1:
            _train_and_save(0, args, run, 0)
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_train_and_save, args=(args, run, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
