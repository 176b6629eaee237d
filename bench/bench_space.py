"""Space under retention: the bytes a run holds with ``keep=K`` in dense training, against K
versions of the state.

A CPU AdamW job (an MLP of two Linear(W, W) layers; the model, AdamW's two moments and the RNG
state are saved, ~28.6 MB at W = 1100), one save per training step, ``Checkpointer(dir,
keep=K, full_every=16)``. After the last save (and retention's deletes) it prints the bytes of
the run's data files and of every file against ``K x`` the version's logical bytes, and the
median bytes each incremental version wrote against the bytes that changed (the model and the
moments: every value changes each step). What a version writes beyond them is the remnant it
copied forward (the RNG state and the step counters). Prints figures only; asserts nothing.

    .venv/bin/python bench/bench_space.py                  # keep=3, 12 versions
    .venv/bin/python bench/bench_space.py --keep 2 --versions 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

import cryosnap


def _bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--versions", type=int, default=12)
    parser.add_argument("--width", type=int, default=1100)
    args = parser.parse_args()
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dense = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        written: list[int] = []
        with cryosnap.Checkpointer(run, keep=args.keep, full_every=16) as ckpt:
            for step in range(args.versions):
                loss = model(torch.randn(64, w)).square().mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                state = {"model": model, "optim": optim, "rng": cryosnap.RNGState()}
                info = ckpt.save(step, state).result()
                written.append(info.written_bytes)
            ckpt.wait()  # retention's deletes run after a version is reported
            space = getattr(ckpt.status(), "space", {}).get("persistent", ())
        version = info.logical_bytes
        k = args.keep
        data, total = _bytes(run / "data"), _bytes(run)
        print(f"keep={k}, {args.versions} versions of {version:,} B")
        print(f"data files : {data:,} B = {data / (k * version):.3f} x {k} versions")
        print(f"all files  : {total:,} B = {total / (k * version):.3f} x {k} versions")
        extra = statistics.median(written[1:]) - dense
        print(f"written per incremental version (median): {statistics.median(written[1:]):,} B")
        print(f"  of which beyond the changed model and moments: {extra:,.0f} B")
        for v in space:
            print(
                f"  step {v.step}: owns {v.owned_bytes:,} B, reads {v.referenced_bytes:,} B "
                f"of other versions' files, pins {v.pinned_bytes:,} B of dropped ones"
            )


if __name__ == "__main__":
    main()
