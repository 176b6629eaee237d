"""SIGKILL at every phase of a superseding save (issue 26): the run shows either no
superseding (the old trajectory whole) or the new version and the superseding both, never a
mix, and the abandoned trajectory never comes back once superseded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cryosnap

_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import cryosnap
    from cryosnap._format.keys import parse_commit_key
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    run, phase, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
    armed = {"on": False, "seen": 0}

    def fault(op, key):
        if not armed["on"]:
            return
        name = op
        if op in ("write", "delete"):
            kind = "commit" if parse_commit_key(key) is not None else "file"
            name = f"{op}-{kind}"
        if name == phase:
            armed["seen"] += 1
            if armed["seen"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    def state(step, trajectory):
        return {"a": np.full(200_000, step + 1000.0 * trajectory), "step": step,
                "trajectory": trajectory}

    store = FaultyStore(LocalStore(run), fault=fault)
    with cryosnap.Checkpointer(store, chunk_bytes=64 << 10, keep=3) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state(step, 0)).result()
        ckpt.restore(step=2)
        armed["on"] = True
        ckpt.save(3, state(3, 1)).result()
        ckpt.save(4, state(4, 1)).result()
    print("finished without crashing")
    """
)

PHASES = [
    ("open_writer", 1),  # before the new version's data file exists
    ("writer.write", 1),  # its data half written
    ("writer.commit", 1),  # data written, not yet durable under its name
    ("write-file", 1),  # data durable, its manifest not written
    ("write-commit", 1),  # manifest durable, the superseding commit record not written
    ("list", 1),  # the run listed (before the commit or by retention after it)
    ("list", 3),
    ("delete-commit", 1),  # retention deletes the first superseded commit record
    ("delete-commit", 2),  # ... the second one
    ("delete-file", 1),  # ... the superseded files
    ("write-commit", 2),  # the next version of the new trajectory
]


def _trajectory_of(run: Path, step: int) -> int:
    out = cryosnap.load(run, step=step)
    assert out["step"] == step
    np.testing.assert_array_equal(out["a"], np.full(200_000, step + 1000.0 * out["trajectory"]))
    return int(out["trajectory"])


@pytest.mark.parametrize(("phase", "nth"), PHASES)
def test_sigkill_during_a_superseding_save(tmp_path: Path, phase: str, nth: int) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(run), phase, str(nth)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    with cryosnap.Checkpointer(run, keep=3) as ckpt:
        steps = ckpt.steps()
        trajectories = {s: _trajectory_of(run, s) for s in steps}
        if steps == [2, 3, 4] and trajectories == {2: 0, 3: 0, 4: 0}:
            superseded = False  # killed before the commit: the old trajectory, whole
        else:
            superseded = True
            assert steps in ([2, 3], [2, 3, 4]), steps  # keep=3 dropped 1 before
            assert {s: t for s, t in trajectories.items() if s > 2} == dict.fromkeys(
                [s for s in steps if s > 2], 1
            ), trajectories
        killed_before_commit = phase in ("open_writer", "writer.write", "writer.commit") or (
            phase == "write-file"
        )
        killed_before_commit = killed_before_commit or (phase == "write-commit" and nth == 1)
        if phase != "list":  # listings happen before and after the commit
            assert superseded != killed_before_commit, (phase, nth, steps, trajectories)
        # The program resumes: restores the newest and saves on, whatever the kill left.
        newest = ckpt.latest_step()
        assert newest is not None
        got = ckpt.restore()
        assert got["step"] == newest
        ckpt.save(newest + 1, {**got, "step": newest + 1}).result()
    assert cryosnap.load(run)["step"] == newest + 1
