"""Accelerate's FSDP2 as Accelerate itself sets it up on accelerators, under ``Checkpoints``:
the part that the CPU tests (tests/integration/test_accelerate_fsdp.py) cannot run, where
``cryosnap.testing.cpu_fsdp2_accelerator`` sets the distributed type that Accelerate picks
only on a device. Here ``Accelerator(fsdp_plugin=...)`` picks it (NCCL, CUDA DTensors,
captured through pinned staging): a run killed with SIGKILL mid-epoch resumes bit for bit
against an uninterrupted one, every rank's shards restored in place.

Run on a machine with a GPU: ``PYTHONPATH=src python3 -m pytest -m gpu tests/gpu`` (bash
bench/gpu.sh runs it); one torchrun process per GPU; without one it is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "integration" / "accelerate_job.py"
TIMEOUT = 240


def _torchrun(*args: str) -> tuple[int, str]:
    """``accelerate_job.py *args --fsdp --device`` under torchrun, one process per GPU."""
    from tests.integration.test_dist_torch import free_port

    command = [
        *(sys.executable, "-m", "torch.distributed.run"),
        *("--nproc-per-node", str(torch.cuda.device_count())),
        *("--master-addr", "127.0.0.1", "--master-port", str(free_port())),
        *(str(JOB), *args, "--fsdp", "--device"),
    ]
    env = {
        **os.environ,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS's deterministic reductions
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=TIMEOUT, check=False
    )
    return done.returncode, (done.stdout + done.stderr)[-4000:]


@pytest.mark.timeout(3 * TIMEOUT + 30)
def test_accelerate_fsdp2_on_devices_killed_resumes_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from tests.integration.test_accelerate import _final, _losses, _resumed

    steps = ("--steps", "20")
    code, output = _torchrun("train", str(tmp_path / "a"), str(tmp_path / "straight"), *steps)
    assert code == 0, output
    killed = str(tmp_path / "killed")
    code, output = _torchrun("train", str(tmp_path / "b"), killed, *steps, "--kill-at", "14")
    assert code != 0 and not list((tmp_path / "b").glob("final-*.json")), output
    code, output = _torchrun("train", str(tmp_path / "b"), killed, *steps)
    assert code == 0, output
    for rank in range(torch.cuda.device_count()):
        first, again = _resumed(tmp_path / "b", rank)
        assert first == 0 and again in (8, 12), again
        assert _losses(tmp_path / "b", rank) == _losses(tmp_path / "a", rank)
        assert _final(tmp_path / "b", rank) == _final(tmp_path / "a", rank)  # shards, in place
