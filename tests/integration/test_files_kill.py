"""A restore of ``cryosnap.File`` leaves SIGKILLed after its files were staged and before they
replaced their targets: every target is left as it was.

The restoring process is a real child, killed while a stateful object's ``load_state_dict``
(the step between staging and renaming) waits on its stdin; it says so on its stdout first.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import cryosnap

CHILD = """
import sys
import cryosnap

class Blocks:
    def state_dict(self):
        return {"a": 1}

    def load_state_dict(self, state):
        print("staged", flush=True)
        sys.stdin.read()  # until killed

cryosnap.load(sys.argv[1], into={"f": cryosnap.File(sys.argv[2]), "obj": Blocks()})
"""


class _Stateful:
    def state_dict(self) -> dict[str, int]:
        return {"a": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise AssertionError("not loaded in this process")


def test_a_restore_killed_between_staging_and_renaming_changes_no_target(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src.h5"
    src.write_bytes(b"saved" * 3000)
    cryosnap.save(tmp_path / "run", {"f": cryosnap.File(src), "obj": _Stateful()})
    targets = tmp_path / "targets"
    targets.mkdir()
    target = targets / "grid.h5"
    target.write_bytes(b"the program's current file")
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "run"), str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "staged"
            child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=60) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
    assert target.read_bytes() == b"the program's current file"
    (staged,) = (p for p in targets.iterdir() if p != target)
    assert staged.name.startswith(".grid.h5.") and staged.name.endswith(".cryosnap-tmp")
    assert staged.read_bytes() == b"saved" * 3000  # whole and fsynced, never renamed
