"""The demo's parent process: parse the options, spawn the training child that is SIGKILLed, the
one that resumes, compare bit for bit with an uninterrupted run and print the summary (JSON
with ``--json``). Runs as the parent; the children are ``python -m cryosnap.demo --child``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cryosnap.demo._report import ms, plot, print_figures, print_saves, torch_save_seconds
from cryosnap.demo._training import (
    KEEP,
    KEEP_SCRATCH,
    child,
    need_torch,
    reference,
    restore_persistent,
    same,
)
from cryosnap.demo._workdir import prepare

DESCRIPTION = (
    "The main job, ``make demo`` (``python -m cryosnap.demo``): train, get killed, resume exactly."
)


def _spawn(args: list[str], *, quiet_stdout: bool = False) -> int:
    """Run a training child; with ``quiet_stdout`` (``--json``) its output goes to stderr, so
    stdout carries the summary document only."""
    cmd = [sys.executable, "-m", "cryosnap.demo", "--child", *args]
    out = 2 if quiet_stdout else None  # fd 2: the parent's stderr
    return subprocess.run(cmd, check=False, stdout=out).returncode


def main(argv: list[str] | None = None) -> int:
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
    parser = argparse.ArgumentParser(prog="cryosnap demo", description=DESCRIPTION)
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
    torch = need_torch()
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
    torch_save = torch_save_seconds(work)
    print_saves(saves, restores, kill_at, torch_save)
    logical, median = print_figures(saves, restores, kill_at, torch_save)
    print(
        f"restart from persistent only (scratch wiped): step {restored_step} restored in "
        f"{ms(persistent_s)}, equal to the final state: {'YES' if from_persistent else 'NO'}"
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
