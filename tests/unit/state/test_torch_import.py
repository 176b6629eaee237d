"""torch is imported lazily, only for a state that holds a tensor, and through one lock
(cryosnap._state.torch_import): each case runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cryosnap

# The sources under test first, whatever the installed copy is.
_SRC = str(Path(cryosnap.__file__).resolve().parent.parent)


def _run(code: str, tmp_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_numpy_state_restores_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np, cryosnap\n"
        "run = sys.argv[1] + '/run'\n"
        "state = {'a': np.arange(10.0), 'n': 3, 'f': 2.5, 'c': {'x': np.float32(2)}}\n"
        "cryosnap.save(run, state, step=1)\n"
        "assert cryosnap.load(run)['n'] == 3\n"
        "into = {'a': np.zeros(10), 'n': 0, 'f': 0.0, 'c': {'x': np.float32(0)}}\n"
        "cryosnap.load(run, into=into)\n"
        "assert into['a'][9] == 9.0 and into['n'] == 3\n"
        "with cryosnap.Checkpointer(run) as ckpt:\n"
        "    ckpt.restore(into=into)\n"
        "    ckpt.restore()\n"
        "print('torch' in sys.modules)\n"
    )
    assert _run(code, tmp_path).strip() == "False"


def test_two_threads_restoring_torch_states_at_once(tmp_path: Path) -> None:
    # Saved by this process (torch imported here); restored by a fresh interpreter whose first
    # tensors come from two threads at once: both start the lazy import of torch
    # (the second, a moment later, through map_location=, which asks torch for the device
    # first).
    import torch

    for name in ("r0", "r1"):
        cryosnap.save(tmp_path / name, {"w": torch.arange(4.0), "b": torch.ones(2)}, step=1)
    code = (
        "import sys, threading, time, cryosnap\n"
        "errors, out = [], {}\n"
        "def restore(name):\n"
        "    try:\n"
        "        where = 'cpu' if name == 'r1' else None\n"
        "        if where:\n"
        "            time.sleep(0.3)  # while the other thread is inside import torch\n"
        "        out[name] = cryosnap.load(sys.argv[1] + '/' + name, map_location=where)\n"
        "    except BaseException as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=restore, args=(n,)) for n in ('r0', 'r1')]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "assert not errors, errors\n"
        "print(sorted(out), float(out['r1']['w'].sum()))\n"
    )
    assert _run(code, tmp_path).strip() == "['r0', 'r1'] 6.0"
