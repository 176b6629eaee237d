"""The other routes to cryosnap's DeepSpeed engine, with the real frameworks on CPU
(``DS_ACCELERATOR=cpu``) on 2 gloo ranks under ``torchrun``: a Hugging Face ``Trainer`` with a
DeepSpeed config whose own saves go through it (deepspeed_trainer_job.py: ``register()`` and a
``"cryosnap"`` config section), and Accelerate's ``Checkpoints`` with a DeepSpeed plugin
(accelerate_deepspeed_job.py). Each is killed with SIGKILL mid-training and resumed, bit for
bit the uninterrupted training (every loss, the final weights): ``deep``, several minutes on a
busy machine. The unmarked test is the tied weights' names (GPT-2's), which DeepSpeed lists on
rank 0 only, saved alike by every rank.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.integration.test_deepspeed import (
    LAUNCH_TIMEOUT,
    _env,
    _signal_tree,
    built_op,  # noqa: F401  (the fixture: DeepSpeed's CPU op, built once)
)
from tests.integration.test_dist_torch import free_port

pytestmark = pytest.mark.skipif(
    any(
        importlib.util.find_spec(name) is None
        for name in ("deepspeed", "torch", "transformers", "accelerate")
    ),
    reason="deepspeed, transformers or accelerate is not installed",
)

HERE = Path(__file__).resolve().parent
TRAINER_JOB = HERE / "deepspeed_trainer_job.py"
ACCELERATE_JOB = HERE / "accelerate_deepspeed_job.py"
WORLD = 2


def _torchrun(script: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(WORLD),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]


def _run(script: Path, *args: str, ok: bool = True) -> str:
    """A torchrun job to its end (``ok``: it must succeed); its output."""
    proc = subprocess.run(
        _torchrun(script, *args),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
        env=_env(),
    )
    if ok:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout + proc.stderr


def _steps(run: Path) -> list[int]:
    import cryosnap

    try:
        return cryosnap.Run(run).steps()
    except cryosnap.CheckpointNotFoundError:
        return []


# -- the tied weights' names ---------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_tied_weights_are_named_on_every_rank() -> None:
    """The model states file is saved alike by every data-parallel rank (1/N each): its
    ``shared_params`` are listed on every rank, in DeepSpeed's order, not on rank 0 alone."""
    import torch

    from cryosnap.integrations.deepspeed import _shared_params

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(8, 4)
            self.blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.wte.weight
            self.blocks[1].bias = self.blocks[0].bias

    engine = SimpleNamespace(module=Tied(), zero_optimization_partition_weights=lambda: False)
    assert _shared_params(engine) == {  # type: ignore[arg-type]
        "blocks.1.bias": "blocks.0.bias",
        "lm_head.weight": "wte.weight",
    }


# -- the HF Trainer with a DeepSpeed config --------------------------------------------------------


def _trainer_losses(path: Path) -> list[tuple[int, float]]:
    from tests.integration.transformers_job import losses

    return losses(path)


def _trainer_reports(out: Path) -> list[dict[str, object]]:
    import json

    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def _trainer_killed(run: Path, output_dir: Path, out: Path, pause_at: int, durable: int) -> None:
    """A Trainer job every rank pauses at the start of step ``pause_at``; once cryosnap's
    version ``durable`` is committed, SIGKILL to torchrun and each of its processes."""
    out.mkdir(parents=True, exist_ok=True)
    command = _torchrun(
        TRAINER_JOB, str(run), str(output_dir), str(out), "--pause-at", str(pause_at)
    )
    with (out / "killed.log").open("w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
        )
        try:
            deadline = time.monotonic() + LAUNCH_TIMEOUT
            paused = [out / f"paused-{r}" for r in range(WORLD)]
            while not (all(p.exists() for p in paused) and durable in _steps(run)):
                assert proc.poll() is None, (out / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, (out / "killed.log").read_text()[-4000:]
                time.sleep(0.2)
            _signal_tree(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                _signal_tree(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.deep
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT)
def test_trainer_with_a_deepspeed_config_killed_and_resumed_bit_exact(
    built_op: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The Trainer's own save_strategy="steps" saves through cryosnap (every 3 steps, 12 in
    all); killed at step 8, ``train(resume_from_checkpoint=True)`` loads checkpoint-6 from
    cryosnap and ends as the uninterrupted training."""
    ref = tmp_path / "ref"
    _run(TRAINER_JOB, str(tmp_path / "ref-run"), str(tmp_path / "ref-trainer"), str(ref))
    reference = _trainer_losses(ref / "losses.txt")
    assert [s for s, _ in reference] == list(range(1, 13))
    run, output_dir = tmp_path / "run", tmp_path / "trainer"
    _trainer_killed(run, output_dir, tmp_path / "killed", pause_at=8, durable=6)
    assert _steps(run) == [3, 6]
    assert _trainer_losses(tmp_path / "killed" / "losses.txt") == reference[:7]
    # The Trainer's folders hold its own small files; DeepSpeed's went to cryosnap.
    assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint-3", "checkpoint-6"]
    assert not list((output_dir / "checkpoint-6" / "global_step6").iterdir())
    resumed = tmp_path / "resumed"
    _run(TRAINER_JOB, str(run), str(output_dir), str(resumed))
    assert _trainer_losses(resumed / "losses.txt") == reference[6:]
    want, got = _trainer_reports(ref), _trainer_reports(resumed)
    for rank in range(WORLD):
        assert got[rank]["step"] == 12
        assert got[rank]["final"] == want[rank]["final"], rank
    assert _steps(run) == [3, 6, 9, 12]


# -- Accelerate with a DeepSpeed plugin ------------------------------------------------------------


def _accelerate_losses(out: Path, rank: int) -> dict[int, str]:
    text = (out / f"losses-{rank}.txt").read_text()
    return {int(s): v for s, v in re.findall(r"^(\d+) (\S+)$", text, re.M)}


@pytest.mark.deep
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT)
def test_accelerate_with_a_deepspeed_plugin_killed_and_resumed_bit_exact(
    built_op: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Checkpoints saves through the DeepSpeed engine every 4 steps; rank 0 SIGKILLs itself
    after step 10; the job started again resumes from the newest durable version (RNG, loader
    position, registered object and LR scheduler beside the engine's files) and ends as the
    uninterrupted one."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _run(ACCELERATE_JOB, str(straight), str(tmp_path / "a"), "--steps", "14")
    _run(
        ACCELERATE_JOB,
        str(killed),
        str(tmp_path / "b"),
        "--steps",
        "14",
        "--kill-at",
        "10",
        ok=False,
    )
    assert "final" not in " ".join(p.name for p in killed.iterdir())
    saved = _steps(tmp_path / "b")
    assert saved and saved[-1] in (4, 8), saved
    _run(ACCELERATE_JOB, str(killed), str(tmp_path / "b"), "--steps", "14")
    for rank in range(WORLD):
        [resumed] = re.findall(
            r"^resumed (\d+)$", (killed / f"losses-{rank}.txt").read_text(), re.M
        )[1:]
        assert int(resumed) in (4, 8)
        want, got = _accelerate_losses(straight, rank), _accelerate_losses(killed, rank)
        assert sorted(want) == list(range(1, 15))
        assert got == want  # before the kill and after the resume: the same losses
        assert (killed / f"final-{rank}.txt").read_text() == (
            straight / f"final-{rank}.txt"
        ).read_text()
    assert _steps(tmp_path / "b") == [4, 8, 12]
