"""The demo's summary: the table of saves against ``torch.save`` + fsync of the same state, the
figures under it and ``summary.png`` (matplotlib, the ``demo`` extra). Runs in the parent
process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from cryosnap.demo._training import build, final_state, need_torch, train
from cryosnap.demo._workdir import TORCH_SAVES
from cryosnap.progress import human_bytes


def torch_save_seconds(work: Path) -> float:
    """torch.save + fsync of the same state as the demo checkpoints, median of 3."""
    torch = need_torch()
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


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def median_of(events: list[dict[str, Any]], key: str) -> float:
    values = sorted(e[key] for e in events)
    return float(values[len(values) // 2])


def print_saves(
    saves: list[dict[str, Any]], restores: list[dict[str, Any]], kill_at: int, torch_save: float
) -> None:
    """The table of every save: its stall against torch.save, the bytes written, when it was
    durable on each tier, and where the run was killed and resumed."""
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


def print_figures(
    saves: list[dict[str, Any]], restores: list[dict[str, Any]], kill_at: int, torch_save: float
) -> tuple[int, float]:
    """The summary lines under the table; returns the state's size and the median stall."""
    tiers = sorted({"+".join(e["tiers"]) for e in saves})
    inc = [e for e in saves if e["incremental"]]
    logical = saves[-1]["logical_bytes"]
    print()
    print(f"state: {human_bytes(logical)}; torch.save + fsync of it: {ms(torch_save)}")
    stalls = sorted(e["stall_seconds"] for e in saves)
    median = stalls[len(stalls) // 2]
    print(
        f"median stall per checkpoint: {median * 1e3:.1f} ms ({median / torch_save:.1%} of "
        f"torch.save); durable on scratch after {median_of(saves, 'scratch_seconds'):.3f} s, "
        f"on persistent after {median_of(saves, 'seconds'):.3f} s (medians)"
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
            f"(restore from {r['tier']}: {ms(r['seconds'])})"
        )
    return logical, median
