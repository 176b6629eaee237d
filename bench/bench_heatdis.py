"""The overhead of checkpoints in examples/heatdis.py (docs/HPC.md): the same run under
``mpiexec -n 4`` (two simulated nodes of two ranks, partner copies, scratch and persistent in a
temporary directory) with a checkpoint every K iterations and with none, alternated round by
round; the medians of the loop's seconds as each run prints them, and the ratios to none.

    python bench/bench_heatdis.py --rows 1024 --cols 1024 --iterations 200 --every 0 50 20

Prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness as h

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def one_run(tmp: Path, args: argparse.Namespace, every: int) -> float:
    """The loop seconds of one run (a fresh run directory: no restore)."""
    run = Path(tempfile.mkdtemp(dir=tmp))
    (run / "cryosnap.toml").write_text(f'path = "{run / "persistent"}"\npartner = true\n')
    program = [sys.executable, str(ROOT / "examples" / "heatdis.py"),
               "--config", str(run / "cryosnap.toml"), "--rows", str(args.rows),
               "--cols", str(args.cols), "--iterations", str(args.iterations),
               "--every", str(every)]  # fmt: skip
    cmd = [str(MPIEXEC)]
    for i, node in enumerate(("a", "b")):
        env = ["-env", "CRYOSNAP_NODE", node, "-env", "CRYOSNAP_SCRATCH", str(run / node)]
        cmd += [*([":"] if i else []), "-n", "2", *env, *program]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("done: ")]
    return float(line.split()[-2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="grid rows (1024)")
    parser.add_argument("--cols", type=int, default=1024, help="grid columns (1024)")
    parser.add_argument("--iterations", type=int, default=200, help="loop iterations (200)")
    parser.add_argument(
        "--every", type=int, nargs="+", default=[0, 50, 20], help="K values; 0: no checkpoint"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of each K, alternated (3)")
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary folder goes")
    args = parser.parse_args()
    seconds: dict[int, list[float]] = {k: [] for k in args.every}
    load_before = h.load_average()
    with h.scratch_dir("bench-heatdis-", args.dir) as tmp:
        for _ in range(args.rounds):
            for every in args.every:
                seconds[every].append(one_run(tmp, args, every))
    state = args.rows * args.cols * 8
    print(f"heatdis {args.rows}x{args.cols} float64 ({state / 2**20:.1f} MiB over 4 ranks), "
          f"{args.iterations} iterations, {args.rounds} rounds, medians")  # fmt: skip
    none = h.median(seconds[0]) if 0 in seconds else None
    for every, samples in seconds.items():
        med = h.median(samples)
        what = "no checkpoint" if every == 0 else f"every {every} iterations"
        ratio = f"  x{med / none:.3f}" if none else ""
        runs = " ".join(f"{s:.2f}" for s in samples)
        print(f"{what:>24}: {med:7.3f} s{ratio}   (runs: {runs})")
    h.print_load(load_before)


if __name__ == "__main__":
    main()
