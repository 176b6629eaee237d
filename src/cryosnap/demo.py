"""The main job, ``make demo`` (``python -m cryosnap.demo``): train, get killed, resume exactly.

A small recommendation-style model (a sparse embedding table trained with SparseAdam, a dense
MLP head with dropout trained with Adam) trains on a synthetic, skewed, in-memory data set read
through a shuffled :class:`~cryosnap.integrations.torch.ResumableLoader`. It checkpoints with a
:class:`cryosnap.Checkpointer` on two tiers under the work directory (``./demo-run``): every
version lands on ``scratch`` first and is flushed to ``persistent`` in the background. Saves are
asynchronous (lazy capture: only the optimizer steps wait), incremental (only the chunks whose
content changed are written: the embedding rows that were hot) and kept by retention. The
:class:`cryosnap.RNGState` and the loader's position are part of the checkpoint.

The training process is SIGKILLed at a random step, restarted, resumes from the newest
checkpoint and finishes; its final state must equal, bit for bit, that of an uninterrupted run
of the same code. Then scratch is wiped and the newest version is restored from the persistent
tier alone, as on a replacement node. A summary compares the stall per checkpoint with
``torch.save`` + fsync of the same state, shows the bytes each version wrote, when it was
durable on each tier, and the restore times; ``summary.png`` plots it (needs matplotlib: the
``demo`` extra).

Runs as three processes: the parent (this module's ``main``), the killed child and the resumed
child (``--child``), so the kill is a real SIGKILL of a real process.

The demo deletes only what it created: it takes a missing or empty directory and marks it
(``.cryosnap-demo``); a rerun into a marked directory replaces the previous run's entries; any
other non-empty directory is refused with exit code 2 (``--dir .`` in a project is safe).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .progress import human_bytes

__all__ = ["main"]

ROWS, DIM, HIDDEN, BATCH = 200_000, 64, 1024, 4096
SAMPLES = 64 * BATCH  # one epoch: 64 batches
MODEL_SEED, DATA_SEED = 0, 0
CHUNK_BYTES, FULL_EVERY, KEEP, KEEP_SCRATCH = 4 << 10, 8, 4, 2

# The work directory's marker: written when the demo takes a directory, required to reuse one.
MARKER = ".cryosnap-demo"
MARKER_TEXT = "A cryosnap demo run: the next `cryosnap demo` here replaces what it created.\n"
TORCH_SAVES = 3  # torch.save runs timed for the comparison, each to work / torch-{i}.pt
# Everything a run creates in the work directory; a rerun removes these and nothing else.
OWN = (
    "scratch",
    "persistent",
    "events.jsonl",
    "final.pt",
    "summary.png",
    *(f"torch-{i}.pt" for i in range(TORCH_SAVES)),
)


def _torch() -> Any:
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
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        self.ids = (torch.rand(n, generator=g) ** 3 * (ROWS // 20)).long()
        self.target = torch.sin(self.ids.float() / 977.0).unsqueeze(1)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.ids[index], self.target[index]

    def __getitems__(self, indices: list[int]) -> tuple[Any, Any]:
        idx = _torch().as_tensor(indices)
        return self.ids[idx], self.target[idx]


def _whole_batch(batch: tuple[Any, Any]) -> tuple[Any, Any]:
    return batch  # __getitems__ returns the batch already collated


def build() -> dict[str, Any]:
    """Model, optimizers and data loader, as every run (killed, resumed, reference) makes them."""
    torch = _torch()
    from .integrations.torch import ResumableLoader, ResumableSampler

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
    return {**state, "rng": _torch().get_rng_state()}


def child(work: Path, steps: int, every: int, kill_at: int | None) -> None:
    """Train (resuming if a checkpoint exists), checkpointing every ``every`` steps."""
    import cryosnap

    from .policy import EveryNSteps

    torch = _torch()
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
    torch = _torch()
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
    torch = _torch()
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


def _torch_save_seconds(work: Path) -> float:
    """torch.save + fsync of the same state as the demo checkpoints, median of 3."""
    torch = _torch()
    parts = build()
    train(parts, 0, 3, lambda step: None)  # the optimizers' state exists
    state = final_state(parts)
    times = []
    for i in range(TORCH_SAVES):
        path = work / f"torch-{i}.pt"
        t0 = time.perf_counter()
        with path.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
        path.unlink()
    return sorted(times)[len(times) // 2]


def plot(
    path: Path, saves: list[dict[str, Any]], torch_save: float, kill_at: int, every: int
) -> str | None:
    """Write the summary plot; return why it was skipped, or None."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install 'cryosnap[demo]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    steps = [e["step"] for e in saves]
    colors = ["tab:blue" if e["incremental"] else "tab:orange" for e in saves]
    width = every * 0.6
    fig, (stall, written) = plt.subplots(1, 2, figsize=(12, 4.5))
    stall.bar(steps, [e["stall_seconds"] * 1e3 for e in saves], width=width, color=colors)
    stall.axhline(torch_save * 1e3, color="tab:red", linestyle="--", label="torch.save + fsync")
    stall.set_yscale("log")
    stall.set_ylim(top=torch_save * 1e3 * 3)
    stall.set_title("stall per checkpoint (training blocked)")
    stall.set_xlabel("step")
    stall.set_ylabel("ms (log scale)")
    logical = saves[-1]["logical_bytes"]
    mib = 1 << 20
    written.bar(steps, [e["written_bytes"] / mib for e in saves], width=width, color=colors)
    written.axhline(logical / mib, color="tab:gray", linestyle="--", label="whole state")
    written.set_yscale("log")
    written.set_title("bytes written per version")
    written.set_xlabel("step")
    written.set_ylabel("MiB (log scale)")
    smallest = min(e["written_bytes"] for e in saves) / mib
    written.set_ylim(bottom=max(smallest / 4, 1e-3), top=logical / mib * 3)
    kinds = [
        Patch(color="tab:orange", label="full version"),
        Patch(color="tab:blue", label="incremental version"),
    ]
    for ax in (stall, written):
        ax.axvline(kill_at, color="black", linestyle=":", label=f"SIGKILL (step {kill_at})")
        handles, _ = ax.get_legend_handles_labels()
        ax.legend(handles=[*handles, *kinds], fontsize="small", loc="upper right")
    fig.suptitle("cryosnap demo: async incremental checkpoints, scratch + persistent tiers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def prepare(work: Path) -> str | None:
    """Make ``work`` ready for a new run; return why it cannot be, or None.

    The demo deletes only what it created. A missing or empty directory becomes a demo directory
    (:data:`MARKER` says so); in a demo directory the previous run's entries (:data:`OWN`) are
    removed and nothing else; any other non-empty directory is refused, untouched.
    """
    marker = work / MARKER
    try:
        if work.exists() and not work.is_dir():
            return f"--dir {work} exists and is not a directory"
        if work.is_dir() and any(work.iterdir()) and not marker.is_file():
            return (
                f"--dir {work} is not empty and is not a demo directory (no {MARKER} file): "
                "the demo deletes only what it created; choose a new or empty directory"
            )
        work.mkdir(parents=True, exist_ok=True)
        for name in OWN:
            _remove(work / name)
        marker.write_text(MARKER_TEXT)
    except OSError as exc:
        return f"cannot prepare --dir {work}: {exc}"
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _spawn(args: list[str], *, quiet_stdout: bool = False) -> int:
    """Run a training child; with ``quiet_stdout`` (``--json``) its output goes to stderr, so
    stdout carries the summary document only."""
    cmd = [sys.executable, "-m", "cryosnap.demo", "--child", *args]
    out = 2 if quiet_stdout else None  # fd 2: the parent's stderr
    return subprocess.run(cmd, check=False, stdout=out).returncode


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cryosnap demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir",
        default="demo-run",
        help="work directory (default ./demo-run): new, empty or an earlier demo run's",
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N (default 20)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random kill step")
    parser.add_argument(
        "--json",
        action="store_true",
        help="progress on stderr, the summary as one JSON object on stdout",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Path(args.dir).absolute()
    if args.child:
        child(work, args.steps, args.every, args.kill_at)
        return 0
    if args.every < 1 or args.steps < 2 * args.every + 2:
        # The kill falls after the first checkpoint and before the last one.
        print("cryosnap demo: error: needs --every >= 1, --steps >= 2 * every + 2", file=sys.stderr)
        return 2

    if not args.json:
        return _run_demo(args, work, None)
    summary: dict[str, Any] = {}
    with contextlib.redirect_stdout(sys.stderr):
        code = _run_demo(args, work, summary)
    summary["exit_code"] = code
    print(json.dumps(summary))
    return code


def _run_demo(args: argparse.Namespace, work: Path, summary: dict[str, Any] | None) -> int:
    """The demo's parent: kill, resume, compare, print the table; with ``summary`` also fill
    it with the figures (``--json``)."""
    t_start = time.perf_counter()
    refused = prepare(work)
    if refused is not None:
        print(f"cryosnap demo: error: {refused}", file=sys.stderr)
        return 2
    kill_at = random.Random(args.seed).randrange(args.every + 1, args.steps - args.every)
    common = ["--dir", str(work), "--steps", str(args.steps), "--every", str(args.every)]
    print(
        f"cryosnap demo: training {args.steps} steps, checkpoint every {args.every} "
        f"(async, lazy capture, incremental)\n"
        f"  scratch tier {work / 'scratch'} (keep {KEEP_SCRATCH}), "
        f"flushed in the background to persistent tier {work / 'persistent'} (keep {KEEP})",
        flush=True,
    )
    print(f"  1. training process, SIGKILLed at step {kill_at} ...", flush=True)
    t0 = time.perf_counter()
    quiet = summary is not None
    code = _spawn([*common, "--kill-at", str(kill_at)], quiet_stdout=quiet)
    how = "killed by SIGKILL" if code == -9 else "unexpected"
    print(f"     exited with {code} ({how}) after {time.perf_counter() - t0:.0f} s")
    if code != -9:
        return 1
    print("  2. restarted: resumes from the newest checkpoint and finishes ...", flush=True)
    t0 = time.perf_counter()
    if _spawn(common, quiet_stdout=quiet) != 0:
        return 1
    print(f"     done after {time.perf_counter() - t0:.0f} s")
    torch = _torch()
    resumed = torch.load(work / "final.pt", weights_only=True)
    print("  3. reference run, never interrupted ...", flush=True)
    t0 = time.perf_counter()
    exact = same(resumed, reference(args.steps))
    print(f"     done after {time.perf_counter() - t0:.0f} s")
    print("  4. scratch wiped: restart from the persistent tier alone ...", flush=True)
    restored_step, persistent_s, restored = restore_persistent(work)
    from_persistent = restored_step == args.steps and same(restored, resumed)

    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    saves = sorted((e for e in events if e["event"] == "save"), key=lambda e: e["step"])
    restores = [e for e in events if e["event"] == "restore"]
    torch_save = _torch_save_seconds(work)
    print()
    print(
        f"{'step':>5} {'kind':>11} {'stall ms':>9} {'vs torch.save':>13} {'written':>10} "
        f"{'of state':>9} {'scratch s':>9} {'persist s':>9}"
    )
    resumed_from = restores[0]["step"] if restores else None
    for e in saves:
        if resumed_from is not None and e["step"] > resumed_from:
            print(f"{'':>5} --- SIGKILL at step {kill_at}; resumed from step {resumed_from} ---")
            resumed_from = None
        kind = "incremental" if e["incremental"] else "full"
        print(
            f"{e['step']:>5} {kind:>11} {e['stall_seconds'] * 1e3:>9.1f} "
            f"{e['stall_seconds'] / torch_save:>13.1%} {human_bytes(e['written_bytes']):>10} "
            f"{e['written_bytes'] / e['logical_bytes']:>9.1%} {e['scratch_seconds']:>9.3f} "
            f"{e['seconds']:>9.3f}"
        )
    tiers = sorted({"+".join(e["tiers"]) for e in saves})
    inc = [e for e in saves if e["incremental"]]
    logical = saves[-1]["logical_bytes"]
    print()
    print(f"state: {human_bytes(logical)}; torch.save + fsync of it: {_ms(torch_save)}")
    stalls = sorted(e["stall_seconds"] for e in saves)
    median = stalls[len(stalls) // 2]
    print(
        f"median stall per checkpoint: {median * 1e3:.1f} ms ({median / torch_save:.1%} of "
        f"torch.save); durable on scratch after {_median(saves, 'scratch_seconds'):.3f} s, "
        f"on persistent after {_median(saves, 'seconds'):.3f} s (medians)"
    )
    print(f"tiers each version reached (SaveInfo.tiers): {', '.join(tiers)}")
    if inc:
        mean_inc = sum(e["written_bytes"] for e in inc) / len(inc)
        print(
            f"incremental versions wrote {human_bytes(mean_inc)} on average "
            f"({mean_inc / logical:.1%} of the state)"
        )
    for r in restores:
        print(
            f"killed at step {kill_at}: scratch held steps {r['scratch']}, persistent "
            f"{r['persistent']}; resumed from step {r['step']} "
            f"(restore from {r['tier']}: {_ms(r['seconds'])})"
        )
    print(
        f"restart from persistent only (scratch wiped): step {restored_step} restored in "
        f"{_ms(persistent_s)}, equal to the final state: {'YES' if from_persistent else 'NO'}"
    )
    print(f"final state equals an uninterrupted run, bit for bit: {'YES' if exact else 'NO'}")
    skipped = plot(work / "summary.png", saves, torch_save, kill_at, args.every)
    if skipped is None:
        print(f"plot: {work / 'summary.png'}")
    else:
        print(f"plot skipped: {skipped}")
    print(f"demo wall time: {time.perf_counter() - t_start:.0f} s")
    if summary is not None:
        summary.update(
            dir=str(work),
            steps=args.steps,
            every=args.every,
            killed_at=kill_at,
            resumed_from=restores[0]["step"] if restores else None,
            state_bytes=logical,
            torch_save_seconds=torch_save,
            median_stall_seconds=median,
            saves=saves,
            restored_from_persistent_step=restored_step,
            equal_to_uninterrupted=exact,
            persistent_alone_restores=from_persistent,
            plot=None if skipped is not None else str(work / "summary.png"),
            wall_seconds=time.perf_counter() - t_start,
        )
    return 0 if exact and from_persistent else 1


def _median(events: list[dict[str, Any]], key: str) -> float:
    values = sorted(e[key] for e in events)
    return float(values[len(values) // 2])


if __name__ == "__main__":
    raise SystemExit(main())
