"""The two-level run that test_flush.py and test_tiers.py share: the state of each step, the
check of a restore, and a program SIGKILLed between its scratch commit and the flush (the
``killed_before_flush`` fixture in conftest.py runs it). Runs on the test's thread; the
program is a child process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cryosnap.engine import list_steps
from cryosnap.storage import LocalStore

# Saves steps 1..LAST on scratch + persistent; SIGKILLs itself as the flush of LAST starts
# writing to persistent, before any byte of it lands there.
_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import cryosnap
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    persistent, scratch, last = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])

    def fault(op, key):
        if key.startswith(f"data/{last:012d}") and op == "open_writer":
            os.kill(os.getpid(), signal.SIGKILL)

    def state(step):
        a = np.arange(200_000, dtype=np.float64)
        a[(step * 997) % 200_000 :: 50_000] = step
        return {"a": a, "step": step, "name": f"v{step}"}

    p = FaultyStore(LocalStore(persistent), fault=fault)
    with cryosnap.Checkpointer(p, scratch=scratch, chunk_bytes=64 << 10) as ckpt:
        for step in range(1, last + 1):
            ckpt.save(step, state(step)).result()
    print("finished without crashing")
    """
)


@dataclass(frozen=True)
class KilledRun:
    """A run whose program was SIGKILLed between its scratch commit and the flush."""

    persistent: Path
    scratch: list[Path]


class KillBeforeFlush(Protocol):
    """The ``killed_before_flush`` fixture: makes a :class:`KilledRun` under ``tmp_path``."""

    def __call__(self, *, last: int = 2, scratch: Sequence[str] = ("scratch",)) -> KilledRun: ...


def state(step: int) -> dict[str, Any]:
    """Step ``step``'s state, the child's: 1.6 MB, a few changed regions per step."""
    a = np.arange(200_000, dtype=np.float64)
    a[(step * 997) % 200_000 :: 50_000] = step
    return {"a": a, "step": step, "name": f"v{step}"}


def check(out: Any, step: int) -> None:
    """``out`` is step ``step``'s state, bit-exact."""
    assert out["step"] == step and out["name"] == f"v{step}"
    np.testing.assert_array_equal(out["a"], state(step)["a"])


def killed_run(persistent: Path, scratch: list[Path], last: int) -> None:
    """A run whose program died after committing ``last`` on scratch, before its flush:
    steps 1..last-1 are on persistent, the last ``keep_scratch`` (2) steps on scratch."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(persistent),
            json.dumps([str(s) for s in scratch]),
            str(last),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    assert list_steps(LocalStore(persistent)) == list(range(1, last))
