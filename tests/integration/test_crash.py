"""SIGKILL at every phase of a save: earlier versions stay restorable, nothing partial shows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap.storage import LocalStore

_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import cryosnap
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    run, phase, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
    armed = {"on": False, "seen": 0}

    def fault(op, key):
        if not armed["on"]:
            return
        name = op
        if op == "write":
            name = "commit" if key.endswith("COMMIT.json") else "manifest"
        if name == phase:
            armed["seen"] += 1
            if armed["seen"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    store = FaultyStore(LocalStore(run), fault=fault)
    with cryosnap.Checkpointer(store, chunk_bytes=64 << 10, staging_bytes=1 << 20) as ckpt:
        ckpt.save(1, {"a": np.full(300_000, 1.0), "step": 1}).result()
        armed["on"] = True
        ckpt.save(2, {"a": np.full(300_000, 2.0), "step": 2}).result()
    print("finished without crashing")
    """
)

PHASES = [
    ("open_writer", 1),  # before the data file exists
    ("writer.write", 1),  # first batch of data
    ("writer.write", 2),  # in the middle of the data
    ("writer.commit", 1),  # data written, not yet fsynced and renamed
    ("manifest", 1),  # data durable, manifest not written
    ("commit", 1),  # manifest durable, commit record not written
]


def _killed_at(run: Path, phase: str, nth: int) -> None:
    """Run the child that saves step 1, then SIGKILLs itself at ``phase`` (its ``nth`` time)
    during the save of step 2."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(run), phase, str(nth)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr


@pytest.mark.parametrize(("phase", "nth"), PHASES)
def test_sigkill_during_save_leaves_previous_version(tmp_path: Path, phase: str, nth: int) -> None:
    run = tmp_path / "run"
    _killed_at(run, phase, nth)
    out = cryosnap.load(run)
    assert out["step"] == 1
    np.testing.assert_array_equal(out["a"], np.full(300_000, 1.0))
    # The killed writer's lock is recovered and the same step can be saved again.
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.steps() == [1]
        ckpt.save(2, {"a": np.full(300_000, 2.0), "step": 2}).result()
    assert cryosnap.load(run)["step"] == 2


def _files(run: Path) -> dict[str, int]:
    """The run's files under data/ and versions/ and their sizes."""
    return {
        str(p.relative_to(run)): p.stat().st_size
        for sub in ("data", "versions")
        for p in (run / sub).rglob("*")
        if p.is_file()
    }


def _keys_of(run: Path, step: int) -> set[str]:
    record = engine.read_commit(LocalStore(run), step)
    return {record.key, *(m.key for m in record.manifests), *record.data_files}


@pytest.mark.parametrize("by", ["open", "gc"])
@pytest.mark.parametrize(
    ("phase", "nth"),
    [("writer.write", 2), ("commit", 1)],  # a .partial data file; data and manifest durable
)
def test_what_a_killed_save_left_is_counted_and_removed(
    tmp_path: Path, phase: str, nth: int, by: str
) -> None:
    """keep=None (retention never runs): the next writer's open, or gc, removes what the
    killed save left; gc (and its dry run) counts those bytes."""
    run = tmp_path / "run"
    _killed_at(run, phase, nth)
    left = {k: n for k, n in _files(run).items() if k not in _keys_of(run, 1)}
    assert left and sum(left.values()) > 0
    dry = cryosnap.Run(run).gc(keep=5, dry_run=True)
    assert (dry.removed, dry.freed_bytes) == ((), sum(left.values()))
    if by == "gc":
        assert cryosnap.Run(run).gc(keep=5).freed_bytes == sum(left.values())
    else:
        with cryosnap.Checkpointer(run) as ckpt:
            assert ckpt.steps() == [1]
    assert set(_files(run)) == _keys_of(run, 1)
    assert cryosnap.load(run)["step"] == 1


def test_sigkill_after_commit_keeps_the_version(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = (
        "import os, signal, cryosnap\n"
        f"c = cryosnap.Checkpointer({str(run)!r})\n"
        "c.save(7, {'x': 7}).result()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == -9
    assert cryosnap.load(run) == {"x": 7}


_COMPACTING_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import cryosnap
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    run, phase = sys.argv[1], sys.argv[2]
    armed = {"on": False}
    rng = np.arange(5000, dtype=np.uint8)  # never changes: a remnant copied forward

    def fault(op, key):
        if not armed["on"]:
            return
        name = op
        if op == "write":
            name = "commit" if key.endswith("COMMIT.json") else "manifest"
        if name == phase and (op != "read_into" or key.startswith("data/")):
            os.kill(os.getpid(), signal.SIGKILL)

    store = FaultyStore(LocalStore(run), fault=fault)
    with cryosnap.Checkpointer(store, keep=2, chunk_bytes=64 << 10) as ckpt:
        for step in range(5):
            armed["on"] = step == 4
            ckpt.save(step, {"a": np.arange(100_000.0) + step, "rng": rng}).result()
    print("finished without crashing")
    """
)


@pytest.mark.parametrize("phase", ["read_into", "writer.commit", "commit"])
def test_sigkill_while_compacting_keeps_the_old_references(tmp_path: Path, phase: str) -> None:
    """Killed while a version copies a remnant forward (reading it, the copy not durable, the
    version not committed): the kept versions still read the remnant where it was."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _COMPACTING_CHILD, str(run), phase],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    rng = np.arange(5000, dtype=np.uint8)
    assert cryosnap.Run(run).steps() == [2, 3]
    for step in (2, 3):
        out = cryosnap.load(run, step=step)
        np.testing.assert_array_equal(out["a"], np.arange(100_000.0) + step)
        np.testing.assert_array_equal(out["rng"], rng)
    with cryosnap.Checkpointer(run, keep=2, chunk_bytes=64 << 10) as ckpt:
        for step in (4, 5, 6):
            ckpt.save(step, {"a": np.arange(100_000.0) + step, "rng": rng}).result()
        ckpt.wait()
    assert cryosnap.Run(run).steps() == [5, 6]
    np.testing.assert_array_equal(cryosnap.load(run, step=5)["rng"], rng)
    # The files of the dropped versions went: two versions' data, no more.
    data = sum(f.stat().st_size for f in (run / "data").iterdir())
    assert data <= 2 * (800_000 + 5000) + 2 * 64
