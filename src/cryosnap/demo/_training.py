"""The demo's training: a recommendation-style model (a sparse embedding table with SparseAdam,
an MLP head with Adam) on a synthetic, skewed data set through a ResumableLoader; the child
process that trains with a two-tier Checkpointer (killed or resumed), the uninterrupted
reference run and the restore from the persistent tier alone. Runs in the child processes
(``--child``) and, for the reference, in the parent.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROWS, DIM, HIDDEN, BATCH = 200_000, 64, 1024, 4096
SAMPLES = 64 * BATCH  # one epoch: 64 batches
MODEL_SEED, DATA_SEED = 0, 0
CHUNK_BYTES, FULL_EVERY, KEEP, KEEP_SCRATCH = 4 << 10, 8, 4, 2


def need_torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - the demo needs the torch extra
        sys.exit("cryosnap demo: needs torch (pip install 'cryosnap[torch]')")
    return torch


class Clicks:
    """A synthetic, in-memory data set of (item id, target) pairs.

    Ids follow a skewed popularity over the 5% of items that are in fashion, as in
    recommendation data: most embedding rows stay untouched between checkpoints. Map-style:
    the DataLoader needs ``__len__`` and ``__getitem__``, and fetches a whole batch at once
    through ``__getitems__``.
    """

    def __init__(self, n: int, seed: int) -> None:
        torch = need_torch()
        g = torch.Generator().manual_seed(seed)
        self.ids = (torch.rand(n, generator=g) ** 3 * (ROWS // 20)).long()
        self.target = torch.sin(self.ids.float() / 977.0).unsqueeze(1)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.ids[index], self.target[index]

    def __getitems__(self, indices: list[int]) -> tuple[Any, Any]:
        idx = need_torch().as_tensor(indices)
        return self.ids[idx], self.target[idx]


def _whole_batch(batch: tuple[Any, Any]) -> tuple[Any, Any]:
    return batch  # __getitems__ returns the batch already collated


def build() -> dict[str, Any]:
    """Model, optimizers and data loader, as every run (killed, resumed, reference) makes them."""
    torch = need_torch()
    from cryosnap.integrations.torch import ResumableLoader, ResumableSampler

    torch.manual_seed(MODEL_SEED)
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(ROWS, DIM, sparse=True),
            "head": torch.nn.Sequential(
                torch.nn.Linear(DIM, HIDDEN),
                torch.nn.ReLU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(HIDDEN, 1),
            ),
        }
    )
    dataset: Any = Clicks(SAMPLES, seed=DATA_SEED)
    loader = ResumableLoader(
        dataset,
        batch_size=BATCH,
        sampler=ResumableSampler(dataset, shuffle=True, seed=DATA_SEED),
        collate_fn=_whole_batch,
    )
    return {
        "model": model,
        "sparse": torch.optim.SparseAdam(list(model["emb"].parameters()), lr=1e-2),
        "dense": torch.optim.Adam(model["head"].parameters(), lr=1e-3),
        "loader": loader,
    }


def train(parts: dict[str, Any], start: int, steps: int, after: Callable[[int], None]) -> None:
    """Train from step ``start`` to ``steps``, calling ``after(step)`` after each step. The
    loader moves to the next epoch by itself; dropout draws from torch's global generator."""
    model, sparse, dense, loader = parts["model"], parts["sparse"], parts["dense"], parts["loader"]
    step = start
    while step < steps:
        for ids, target in loader:
            sparse.zero_grad()
            dense.zero_grad()
            loss = (model["head"](model["emb"](ids)) - target).pow(2).mean()
            loss.backward()
            sparse.step()
            dense.step()
            step += 1
            after(step)
            if step >= steps:
                break


def final_state(parts: dict[str, Any]) -> dict[str, Any]:
    """What must match bit for bit: weights, optimizer state, data position, torch's RNG."""
    state = {k: parts[k].state_dict() for k in ("model", "sparse", "dense", "loader")}
    return {**state, "rng": need_torch().get_rng_state()}


def child(work: Path, steps: int, every: int, kill_at: int | None) -> None:
    """Train (resuming if a checkpoint exists), checkpointing every ``every`` steps."""
    import cryosnap
    from cryosnap.policy import EveryNSteps

    torch = need_torch()
    torch.set_num_threads(1)
    parts = build()
    state: dict[str, Any] = {**parts, "rng": cryosnap.RNGState(), "step": 0}
    events = (work / "events.jsonl").open("a")

    def event(kind: str, **fields: Any) -> None:
        events.write(json.dumps({"event": kind, **fields}) + "\n")
        events.flush()

    with cryosnap.Checkpointer(
        work / "persistent",
        scratch=work / "scratch",
        keep=KEEP,
        keep_scratch=KEEP_SCRATCH,
        policy=EveryNSteps(every),
        chunk_bytes=CHUNK_BYTES,
        full_every=FULL_EVERY,
    ) as ckpt:
        latest = ckpt.latest_step()
        if latest is not None:
            status = ckpt.status()
            on_scratch = status.steps.get("scratch", ())
            t0 = time.perf_counter()
            ckpt.restore(into=state)
            event(
                "restore",
                step=state["step"],
                seconds=time.perf_counter() - t0,
                tier="scratch" if latest in on_scratch else "persistent",
                scratch=list(on_scratch),
                persistent=list(status.steps["persistent"]),
                not_persistent=list(status.not_persistent),
            )
        pending: list[Any] = []

        def report(block: bool) -> None:
            for p in [p for p in pending if block or p.done()]:
                pending.remove(p)
                first = p.result(tier="scratch")  # at once: the scratch commit came first
                info = p.result()
                event(
                    "save",
                    step=info.step,
                    stall_seconds=info.stall_seconds,
                    scratch_seconds=first.seconds,
                    seconds=info.seconds,
                    tiers=list(info.tiers),
                    written_bytes=info.written_bytes,
                    logical_bytes=info.logical_bytes,
                    incremental=info.incremental,
                )

        def after(step: int) -> None:
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt.should_save(step) or step == steps:
                state["step"] = step
                pending.append(ckpt.save(step, state, lazy=True))
            report(block=False)

        train(parts, state["step"], steps, after)
        report(block=True)
    torch.save(final_state(parts), work / "final.pt")
    events.close()


def reference(steps: int) -> dict[str, Any]:
    """The same training, never interrupted and never checkpointed."""
    torch = need_torch()
    torch.set_num_threads(1)
    parts = build()
    train(parts, 0, steps, lambda step: None)
    return final_state(parts)


def restore_persistent(work: Path) -> tuple[int, float, dict[str, Any]]:
    """A replacement node: scratch is empty; restore the newest version from persistent."""
    import cryosnap

    shutil.rmtree(work / "scratch")
    parts = build()
    state: dict[str, Any] = {**parts, "rng": cryosnap.RNGState(), "step": -1}
    with cryosnap.Checkpointer(
        work / "persistent", scratch=work / "scratch", chunk_bytes=CHUNK_BYTES
    ) as ckpt:
        t0 = time.perf_counter()
        ckpt.restore(into=state)
        seconds = time.perf_counter() - t0
    return state["step"], seconds, final_state(parts)


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two trees of tensors and plain values."""
    torch = need_torch()
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
