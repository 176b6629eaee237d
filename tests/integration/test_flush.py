"""``cryosnap flush``: a program SIGKILLed between its scratch commit and the flush, then the
job epilogue's flush as a user types it (``python -m cryosnap flush``), then a bit-exact load
from the persistent tier. Also: a live writer refused, idempotence, a damaged scratch chunk,
superseded versions, several scratch tiers, and a distributed run under real ``mpiexec -n 2``
and under ``torchrun``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import Tier
from cryosnap.engine import list_steps
from cryosnap.errors import RunLockedError
from cryosnap.storage import LocalStore
from tests import forkserver

from .levels_support import KillBeforeFlush, check, state

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).resolve().parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``cryosnap ARGS`` as a user types it, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return forkserver.run(["-m", "cryosnap", *map(str, args)], env, timeout=120)


def test_flush_after_the_program_died_then_load_bit_exact(
    killed_before_flush: KillBeforeFlush,
) -> None:
    run = killed_before_flush()
    persistent, (scratch,) = run.persistent, run.scratch
    # The dead writer's lock is taken over.
    done = cli("flush", persistent, "--scratch", scratch)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    (line,) = done.stdout.splitlines()
    assert line.startswith("step 2: flushed ") and line.endswith(" s"), line
    assert list_steps(LocalStore(persistent)) == [1, 2]
    for s in (1, 2):
        check(cryosnap.load(persistent, step=s), s)
    # Idempotent: a second run flushes nothing and says so.
    again = cli("flush", persistent, "--scratch", scratch)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("nothing to flush: 2 versions on scratch (steps 1, 2)")
    as_json = json.loads(cli("flush", persistent, "--scratch", scratch, "--json").stdout)
    assert as_json["ok"] and as_json["flushed"] == []
    assert as_json["already_persistent"] == [1, 2]
    # The persistent tier alone is a complete run.
    check(cryosnap.load(persistent), 2)


def test_flush_json_and_several_scratch_tiers(killed_before_flush: KillBeforeFlush) -> None:
    run = killed_before_flush(last=3, scratch=("nvme0", "nvme1"))
    persistent, tiers = run.persistent, run.scratch
    done = cli("flush", persistent, "--scratch", tiers[0], "--scratch", tiers[1], "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [v["step"] for v in doc["flushed"]] == [3]
    assert doc["flushed"][0]["bytes"] > 0 and doc["flushed"][0]["seconds"] >= 0
    assert doc["already_persistent"] == [2]  # keep_scratch=2: step 1 left scratch
    assert doc["scratch"] == [str(t) for t in tiers]
    check(cryosnap.load(persistent, step=3), 3)


def test_the_python_entry_point(killed_before_flush: KillBeforeFlush) -> None:
    run = killed_before_flush()
    persistent, (scratch,) = run.persistent, run.scratch
    report = cryosnap.flush(persistent, scratch=[Tier(scratch)])
    assert report.ok and [v.step for v in report.flushed] == [2]
    assert report.flushed[0].nbytes > 0 and report.already == (1,)
    assert cryosnap.flush(persistent, scratch=scratch).flushed == ()
    check(cryosnap.load(persistent), 2)


def test_a_live_writer_is_refused(tmp_path: Path, killed_before_flush: KillBeforeFlush) -> None:
    run = killed_before_flush()
    persistent, (scratch,) = run.persistent, run.scratch
    with cryosnap.Checkpointer(persistent, scratch=tmp_path / "other-scratch"):
        refused = cli("flush", persistent, "--scratch", scratch)
        assert refused.returncode == 2
        assert refused.stdout == ""
        (line,) = refused.stderr.splitlines()
        assert line.startswith("cryosnap: error: ") and "already open for writing" in line
        with pytest.raises(RunLockedError):
            cryosnap.flush(persistent, scratch=scratch)
        assert list_steps(LocalStore(persistent)) == [1]


def test_a_damaged_scratch_chunk_names_the_leaf_and_commits_nothing(
    killed_before_flush: KillBeforeFlush,
) -> None:
    run = killed_before_flush()
    persistent, (scratch,) = run.persistent, run.scratch
    (data,) = (scratch / "data").glob("000000000002-*")
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    failed = cli("flush", persistent, "--scratch", scratch)
    assert failed.returncode == 1, failed.stderr
    (line,) = failed.stderr.splitlines()
    assert line.startswith("cryosnap: error: step 2 on scratch is damaged, not flushed")
    assert "leaf a" in line and "Traceback" not in failed.stderr
    assert list_steps(LocalStore(persistent)) == [1]
    doc = json.loads(cli("flush", persistent, "--scratch", scratch, "--json").stdout)
    assert not doc["ok"] and [(f["step"], f["damaged"]) for f in doc["failed"]] == [(2, True)]
    assert list_steps(LocalStore(persistent)) == [1]


def test_superseded_versions_are_not_flushed(killed_before_flush: KillBeforeFlush) -> None:
    run = killed_before_flush(last=3)  # scratch: 2, 3; persistent: 1, 2
    persistent, (scratch,) = run.persistent, run.scratch
    # Another job (its own scratch) rewinds to step 1 and saves step 2 again: the old 2 and 3
    # are no versions of the run any more.
    with cryosnap.Checkpointer(persistent) as ckpt:
        check(ckpt.restore(step=1), 1)
        ckpt.save(2, {**state(2), "name": "rewound"}).result()
    report = cryosnap.flush(persistent, scratch=scratch)
    assert report.ok and report.flushed == () and report.superseded == (2, 3)
    assert list_steps(LocalStore(persistent)) == [1, 2]
    assert cryosnap.load(persistent)["name"] == "rewound"
    line = cli("flush", persistent, "--scratch", scratch).stdout.splitlines()
    assert line[:2] == [
        "step 2: superseded by a rewind saved later, not flushed",
        "step 3: superseded by a rewind saved later, not flushed",
    ]


def test_retry_seconds_bounds_the_retries_of_a_failing_persistent_tier(
    killed_before_flush: KillBeforeFlush,
) -> None:
    """A persistent tier that fails every write (its data folder a file): ``--retry-seconds 0``
    tries each version once, a longer one retries (one warning line), and either way the version
    stays on scratch, exit 1, one error line; the tier repaired, the flush goes through."""
    run = killed_before_flush()
    persistent, (scratch,) = run.persistent, run.scratch
    data = persistent / "data"
    data.rename(persistent / "data.kept")
    data.write_bytes(b"not a folder")
    once = cli("flush", persistent, "--scratch", scratch, "--retry-seconds", "0")
    assert once.returncode == 1, once.stderr
    (line,) = once.stderr.splitlines()
    assert line.startswith("cryosnap: error: ") and "step 2" in line and "after 1 attempt:" in line
    again = cli("flush", persistent, "--scratch", scratch, "--retry-seconds", "1.5")
    assert again.returncode == 1, again.stderr
    warning, error = again.stderr.splitlines()
    assert warning.startswith("cryosnap: warning: flushing step 2") and "retrying" in warning
    attempts = int(error.split(" after ")[1].split(" attempt")[0])
    assert attempts > 1
    assert list_steps(LocalStore(persistent)) == [1]
    bad = cli("flush", persistent, "--scratch", scratch, "--retry-seconds", "-1")
    assert bad.returncode == 2 and "--retry-seconds must be a number >= 0" in bad.stderr
    data.unlink()
    (persistent / "data.kept").rename(data)
    done = cli("flush", persistent, "--scratch", scratch, "--retry-seconds", "0")
    assert done.returncode == 0, done.stderr
    check(cryosnap.load(persistent), 2)
    report = cryosnap.flush(persistent, scratch=scratch, retry_seconds=0)
    assert report.ok and report.already == (1, 2)
    with pytest.raises(ValueError, match=r"^retry_seconds=-1 is invalid"):
        cryosnap.flush(persistent, scratch=scratch, retry_seconds=-1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["flush", "{tmp}/persistent"], "Missing option '--scratch'"),
        (["flush", "{tmp}/persistent", "--scratch", "{tmp}/nope"], "no scratch run at"),
        (["flush", "{tmp}/nope", "--scratch", "{tmp}/scratch"], "no run at"),
    ],
)
def test_usage_errors_and_missing_runs_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "persistent").mkdir()
    (tmp_path / "scratch").mkdir()
    done = cli(*(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("cryosnap: error: ") and message in line


def test_a_distributed_run_under_mpiexec(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (requirements-dev.txt)")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}: the mpich wheel is not installed")
    sys.path.insert(0, str(HERE))
    from flush_job import state_of

    run, base = tmp_path / "run", tmp_path / "scratch"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    job = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(HERE / "flush_job.py"), str(run), str(base)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert job.returncode != 0 and "finished without crashing" not in job.stdout
    assert list_steps(LocalStore(run)) == [1]
    # The epilogue: one process per rank, each given its node's scratch (MPMD, as each node's
    # $TMPDIR would be), rank 0 prints.
    flush = [sys.executable, "-m", "cryosnap", "flush", str(run), "--scratch"]
    mpmd = [str(MPIEXEC), "-n", "1", *flush, str(base / "node-0"), ":",
            "-n", "1", *flush, str(base / "node-1")]  # fmt: skip
    done = subprocess.run(mpmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith("step 2: flushed "), line
    assert list_steps(LocalStore(run)) == [1, 2]
    for rank in (0, 1):
        part, expected = cryosnap.load(run, step=2, rank=rank), state_of(rank, 2)
        assert part["rank"] == rank and part["step"] == 2
        for key in ("w", "shared"):
            np.testing.assert_array_equal(part[key], expected[key])
    again = subprocess.run(mpmd, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.startswith("nothing to flush: 2 versions on scratch (steps 1, 2)")
    # One process for the parts of two ranks: refused, naming the layout to use.
    alone = cli("flush", run, "--scratch", base / "node-0")
    assert alone.returncode == 2 and "one process per rank" in alone.stderr


def test_a_distributed_run_flushed_under_torchrun(tmp_path: Path) -> None:
    """The same job (one node: both ranks' parts under one scratch), flushed by torchrun's
    processes (gloo, found from torchrun's environment)."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (requirements-dev.txt)")
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    torchrun = Path(sys.executable).parent / "torchrun"
    if not MPIEXEC.exists() or not torchrun.exists():
        pytest.skip("needs the mpich wheel's mpiexec and torch's torchrun")
    sys.path.insert(0, str(HERE))
    from flush_job import state_of

    run, scratch = tmp_path / "run", tmp_path / "scratch"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    job = [str(MPIEXEC), "-n", "2", sys.executable, str(HERE / "flush_job.py"), str(run),
           str(scratch), "shared"]  # fmt: skip
    assert subprocess.run(job, capture_output=True, timeout=120, env=env).returncode != 0
    assert list_steps(LocalStore(run)) == [1]
    flush = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "cryosnap", "flush",
             str(run), "--scratch", str(scratch)]  # fmt: skip
    done = subprocess.run(flush, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith("step 2: flushed "), line
    for rank in (0, 1):
        part, expected = cryosnap.load(run, step=2, rank=rank), state_of(rank, 2)
        for key in ("w", "shared"):
            np.testing.assert_array_equal(part[key], expected[key])


def test_a_damaged_part_of_one_rank_fails_the_version_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (requirements-dev.txt)")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}: the mpich wheel is not installed")
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    job = [str(MPIEXEC), "-n", "2", sys.executable, str(HERE / "flush_job.py"), str(run),
           str(scratch), "shared"]  # fmt: skip
    assert subprocess.run(job, capture_output=True, timeout=120, env=env).returncode != 0
    (data,) = (scratch / "rank-00001" / "data").glob("000000000002-*")
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    flush = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "cryosnap", "flush", str(run),
             "--scratch", str(scratch)]  # fmt: skip
    done = subprocess.run(flush, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("cryosnap: error: step 2 on scratch is damaged, not flushed")
    assert "rank-00001" in line and "leaf w" in line
    assert list_steps(LocalStore(run)) == [1]
