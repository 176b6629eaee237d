"""docs/HPC.md's worked example, examples/heatdis.py, under real ``mpiexec -n 4``: two "nodes"
of two ranks (``$CRYOSNAP_NODE`` and a scratch directory each, set per node as a job script
would), partner copies, a persistent tier. The job is SIGKILLed mid-run and restarted; or
killed, its scratch flushed by the epilogue (``cryosnap flush``), wiped, and restarted. Either
way the final grid is bit-exact against an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from cryosnap._format.keys import commit_key
from cryosnap.engine import list_steps
from cryosnap.storage import LocalStore

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
HEATDIS = ROOT / "examples" / "heatdis.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
ROWS, COLS, ITERATIONS, EVERY = 96, 64, 240, 20
NODES = ("node-a", "node-b")  # two ranks each

CONFIG = """\
path = "{persistent}"
partner = true
keep = 3
keep_scratch = 2
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (requirements-dev.txt)")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}: the mpich wheel is not installed")
    (tmp_path / "cryosnap.toml").write_text(CONFIG.format(persistent=tmp_path / "persistent"))
    return tmp_path


def per_node(tmp: Path, command: list[str], nodes: Sequence[str] = NODES) -> list[str]:
    """``mpiexec`` running ``command`` as 4 ranks spread evenly over ``nodes`` (two nodes:
    ranks 0-1 on the first, 2-3 on the second), each node with its own scratch
    (``CRYOSNAP_SCRATCH``, as a job script sets it from the node's ``$TMPDIR``)."""
    cmd = [str(MPIEXEC)]
    for i, node in enumerate(nodes):
        scratch = tmp / node / "scratch"
        env = ["-env", "CRYOSNAP_NODE", node, "-env", "CRYOSNAP_SCRATCH", str(scratch)]
        cmd += [*([":"] if i else []), "-n", str(4 // len(nodes)), *env, *command]
    return cmd


def heatdis(
    tmp: Path, out: str, *, nodes: Sequence[str] = NODES, extra: Sequence[str] = ()
) -> list[str]:
    return per_node(
        tmp,
        [sys.executable, str(HEATDIS), "--config", str(tmp / "cryosnap.toml"),
         "--rows", str(ROWS), "--cols", str(COLS), "--iterations", str(ITERATIONS),
         "--every", str(EVERY), "--out", str(tmp / out), *extra],
        nodes,
    )  # fmt: skip


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(sys.path)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def run_to_end(cmd: list[str], **extra: str) -> str:
    """Run the job to its end; its stdout (``**extra``: more environment, set on every rank)."""
    done = run_job(cmd, **extra)
    return done.stdout


def run_job(cmd: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env(**extra))
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def kill_mid_run(cmd: list[str], *, after: int = 2, **extra: str) -> None:
    """Start the job and SIGKILL every process of it once ``after`` checkpoints were taken."""
    seen, lines = 0, []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(**extra),
        start_new_session=True,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lines.append(line)
                assert not line.startswith("done"), "the job ended before it was killed"
                seen += line.startswith("checkpoint at iteration")
                if seen == after:
                    break
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert seen == after, "".join(lines)


def serial_reference(iterations: int = ITERATIONS) -> np.ndarray:
    """The same Jacobi iterations on the whole grid in one process."""
    grid = np.zeros((ROWS + 2, COLS))
    grid[0, :] = 100.0
    new = grid.copy()
    for _ in range(iterations):
        new[1:-1, 1:-1] = 0.25 * (
            grid[:-2, 1:-1] + grid[2:, 1:-1] + grid[1:-1, :-2] + grid[1:-1, 2:]
        )
        grid, new = new, grid
    return grid[1:-1]


def resumed_iterations(stdout: str) -> int:
    (line,) = [x for x in stdout.splitlines() if x.startswith("done: ")]
    return int(line.split()[1])


def test_killed_mid_run_and_restarted_is_bit_exact(job: Path) -> None:
    reference = serial_reference()
    uninterrupted = job / "uninterrupted"
    uninterrupted.mkdir()
    (uninterrupted / "cryosnap.toml").write_text(
        CONFIG.format(persistent=uninterrupted / "persistent")
    )
    assert resumed_iterations(run_to_end(heatdis(uninterrupted, "final.npy"))) == ITERATIONS
    np.testing.assert_array_equal(np.load(uninterrupted / "final.npy"), reference)

    kill_mid_run(heatdis(job, "final.npy"))
    assert not (job / "final.npy").exists()
    again = run_to_end(heatdis(job, "final.npy"))
    assert resumed_iterations(again) < ITERATIONS  # from a checkpoint, not from the start
    np.testing.assert_array_equal(np.load(job / "final.npy"), reference)


@pytest.mark.deep
def test_killed_then_flushed_by_the_epilogue_scratch_wiped_and_restarted(job: Path) -> None:
    kill_mid_run(heatdis(job, "final.npy"), after=3)
    scratch = [job / node / "scratch" / f"rank-{r:05d}" for node in NODES for r in range(4)]
    newest = max(s for part in scratch if part.exists() for s in list_steps(LocalStore(part)))
    # The job script's epilogue: the same layout, one process per rank.
    flush = [sys.executable, "-m", "cryosnap", "flush", str(job / "persistent")]
    cmd = per_node(job, flush)
    for i, node in enumerate(NODES):  # each node's processes get that node's scratch
        at = cmd.index(":") if i == 0 else len(cmd)
        cmd[at:at] = ["--scratch", str(job / node / "scratch")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert list_steps(LocalStore(job / "persistent"))[-1] == newest
    for node in NODES:  # the job ended: node-local disks are wiped
        shutil.rmtree(job / node)
    again = run_to_end(heatdis(job, "final.npy"))
    assert resumed_iterations(again) == ITERATIONS - newest
    np.testing.assert_array_equal(np.load(job / "final.npy"), serial_reference())


XOR_NODES = ("node-0", "node-1", "node-2", "node-3")  # one rank each: one XOR set of 4


@pytest.mark.deep
def test_xor_one_wiped_node_rebuilt_from_parity_two_read_from_the_persistent_level(
    job: Path,
) -> None:
    # The configuration file asks for partner copies; the job script overrides it.
    xor = {"CRYOSNAP_PARTNER": "xor", "CRYOSNAP_XOR_SET_SIZE": "4"}
    kill_mid_run(heatdis(job, "final.npy", nodes=XOR_NODES), after=3, **xor)
    stores = [LocalStore(job / n / "scratch" / f"rank-{r:05d}") for r, n in enumerate(XOR_NODES)]
    # Parity on every node (no partner copies: the variable overrode the file).
    for node in XOR_NODES:
        assert not (job / node / "scratch" / "partner").exists()
        assert len(list((job / node / "scratch" / "xor").iterdir())) == 1
    # What the survivors hold together: what node 1 gets back.
    common = set.intersection(*(set(list_steps(s)) for i, s in enumerate(stores) if i != 1))
    newest = max(common)
    shutil.rmtree(job / "node-1" / "scratch")  # node 1 lost its local disk
    persistent = LocalStore(job / "persistent")  # and the flush of `newest` had not got there:
    if newest in list_steps(persistent):  # only a rebuilt part 1 can give it back
        persistent.delete(commit_key(newest, None))
    again = run_job(heatdis(job, "final.npy", nodes=XOR_NODES), **xor)
    # At open, before the restore reads any level: node 1's versions rebuilt from the others'
    # parts and parity, each verified against its manifest's hashes, then committed there.
    (rebuilt,) = [x for x in again.stderr.splitlines() if "rebuilt from XOR parity" in x]
    assert rebuilt.startswith("rank 1: scratch ") and f"{newest}]" in rebuilt, again.stderr
    assert resumed_iterations(again.stdout) == ITERATIONS - newest
    np.testing.assert_array_equal(np.load(job / "final.npy"), serial_reference())

    # Two nodes of the set lost: parity cannot rebuild them, the persistent level serves.
    (job / "final.npy").unlink()
    for node in ("node-1", "node-2"):
        shutil.rmtree(job / node / "scratch")
    last = list_steps(persistent)[-1]  # the job ended: close() flushed every version
    again = run_job(heatdis(job, "final.npy", nodes=XOR_NODES), **xor)
    assert "rebuilt from XOR parity" not in again.stderr
    assert "ranks [1, 2] lost versions on scratch" in again.stderr, again.stderr
    assert resumed_iterations(again.stdout) == ITERATIONS - last
    np.testing.assert_array_equal(np.load(job / "final.npy"), serial_reference())


@pytest.mark.deep
def test_file_variant_killed_mid_run_and_restarted_is_bit_exact(job: Path) -> None:
    """``--state file``: each rank np.saves its rows to its own file and checkpoints that
    file; a restart rewrites the file (restore(into=)) and the program reads it back."""
    reference = serial_reference()
    files = ["--state", "file", "--files", str(job / "files")]
    uninterrupted = job / "uninterrupted"
    uninterrupted.mkdir()
    (uninterrupted / "cryosnap.toml").write_text(
        CONFIG.format(persistent=uninterrupted / "persistent")
    )
    u_files = ["--state", "file", "--files", str(uninterrupted / "files")]
    assert resumed_iterations(run_to_end(heatdis(uninterrupted, "final.npy", extra=u_files))) == (
        ITERATIONS
    )
    np.testing.assert_array_equal(np.load(uninterrupted / "final.npy"), reference)

    kill_mid_run(heatdis(job, "final.npy", extra=files))
    own = [job / "files" / f"rank-{r:05d}" / "grid.npy" for r in range(4)]
    for path in own:  # the program's files now: lost, or written after the checkpoint
        path.write_bytes(b"not the checkpoint")
    again = run_to_end(heatdis(job, "final.npy", extra=files))
    assert resumed_iterations(again) < ITERATIONS  # from a checkpoint: the file read back
    np.testing.assert_array_equal(np.load(job / "final.npy"), reference)
    last = (ITERATIONS - 1) // EVERY * EVERY  # the program's files: its last checkpoint's rows
    written = np.concatenate([np.load(path) for path in own])
    np.testing.assert_array_equal(written, serial_reference(last))
