"""SIGKILL during a save (eager or lazy) whose blobs go to the writer from the live memory
(write-through, _run/capture/through.py): the earlier version stays restorable, nothing partial
shows, the run reopens."""

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
    from cryosnap._run.capture.through import Rates
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    run, phase, nth, lazy = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "lazy"
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

    def state(step):
        out = {f"w{i}": np.full(1 << 18, 10 * step + i, np.float32) for i in range(6)}
        return out | {"step": step}

    class Eager(Rates):  # the writer taken for 4x faster than the copy, whatever is measured
        ratio = 0.25

        def observe(self, attr, nbytes, seconds):
            pass

    store = FaultyStore(LocalStore(run), fault=fault)
    # A staging budget of 4 slabs of 256 KiB: the capture waits for the writer, which has
    # begun (and handed the last blobs over) by the time it gives the first slab back.
    with cryosnap.Checkpointer(store, chunk_bytes=64 << 10, keep=2, staging_bytes=1 << 20) as ckpt:
        ckpt._capturer.through = True  # as on a direct-I/O level (tmp may be a tmpfs)
        ckpt._capturer._rates = ckpt._capturer._lazy_rates = Eager()
        ckpt.save(1, state(1), lazy=lazy).result()
        armed["on"] = True
        ckpt.save(2, state(2), lazy=lazy).result()
    print("finished without crashing")
    """
)

PHASES = [
    ("writer.write", 1),  # the first blob handed over (or the first batch of data)
    ("writer.write", 3),  # in the middle of the data
    ("writer.commit", 1),  # data written, not yet fsynced and renamed
    ("manifest", 1),  # data durable, manifest not written
    ("commit", 1),  # manifest durable, commit record not written
]


def _state(step: int) -> dict[str, object]:
    out: dict[str, object] = {
        f"w{i}": np.full(1 << 18, 10 * step + i, np.float32) for i in range(6)
    }
    out["step"] = step
    return out


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize(("phase", "nth"), PHASES)
def test_sigkill_during_a_written_through_save_leaves_the_previous_version(
    tmp_path: Path, phase: str, nth: int, mode: str
) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(run), phase, str(nth), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    out = cryosnap.load(run)
    expected = _state(1)
    assert out["step"] == 1
    for key in expected:
        np.testing.assert_array_equal(out[key], expected[key])
    # The killed writer's lock is recovered and the same step can be saved again.
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.steps() == [1]
        ckpt.save(2, _state(2)).result()
    assert cryosnap.load(run)["step"] == 2
