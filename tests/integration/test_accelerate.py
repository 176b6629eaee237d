"""Accelerate integration: ``cryosnap.integrations.accelerate.Checkpoints`` with the real
``Accelerator`` on CPU, in this process (a world of one) and on 2 gloo ranks under torchrun
(accelerate_job.py).

A training stopped, or killed with SIGKILL, mid-epoch resumes bit for bit where an
uninterrupted one ends (every loss of every rank, final weights, a registered object); under
DDP each rank writes about half of the replicated model and optimizer state, a second save
writes what changed (not the frozen layer), and ``ProjectConfiguration(total_limit=...)`` is
the run's ``keep``. Bad input is refused with an error that says what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, ProjectConfiguration

import cryosnap
from cryosnap.errors import InexactResumeError
from cryosnap.integrations.accelerate import Checkpoints

from . import accelerate_job as job
from . import ranks as launcher

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(job.__file__)
LAUNCH_TIMEOUT = 180


@pytest.fixture(autouse=True)
def fresh_accelerate() -> Iterator[None]:
    """Accelerate's state is a process-wide singleton: each test starts and ends without it."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _losses(out: Path, rank: int = 0) -> dict[int, str]:
    """Step -> loss (as float.hex) of each step ``rank`` trained; a step trained again after
    a resume counts as trained then."""
    found = {}
    for line in (out / f"losses-{rank}.txt").read_text().splitlines():
        if not line.startswith("resumed"):
            step, loss = line.split()
            found[int(step)] = loss
    return found


def _resumed(out: Path, rank: int = 0) -> list[int]:
    lines = (out / f"losses-{rank}.txt").read_text().splitlines()
    return [int(line.split()[1]) for line in lines if line.startswith("resumed")]


def _final(out: Path, rank: int = 0) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((out / f"final-{rank}.json").read_text())
    return result


# -- one process ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_one_process_stopped_mid_epoch_resumes_bit_exact(tmp_path: Path) -> None:
    job.train(tmp_path / "straight", tmp_path / "a", steps=20, every=4, kill_at=None)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run = tmp_path / "stopped"
    job.train(run, tmp_path / "b", steps=16, every=4, kill_at=None)  # 11 batches an epoch
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    job.train(run, tmp_path / "b", steps=20, every=4, kill_at=None)
    assert _resumed(tmp_path / "b") == [0, 16]  # epoch 1, 5 batches in
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")
    assert _final(tmp_path / "b") == _final(tmp_path / "a")
    assert cryosnap.Run(run).steps() == [4, 8, 12, 16, 20]


def _small(tmp_path: Path, **options: Any) -> tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(cpu=True, **options)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(12, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=3, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    return accelerator, model, opt, loader


def _train_step(model: Any, opt: Any, batch: Any) -> None:
    model(batch[0]).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.timeout(60)
def test_lazy_save_holds_the_weights_of_its_step(tmp_path: Path) -> None:
    """The optimizer step right after a lazy save waits for the copy: the version holds the
    weights as they were at save(), and restore() puts them back in place."""
    accelerator, model, opt, loader = _small(tmp_path)
    with Checkpoints(accelerator, tmp_path / "run") as ckpts:
        assert ckpts.restore() is None  # an empty run: nothing to resume, nothing changed
        batches = iter(loader)
        _train_step(model, opt, next(batches))
        at_save = {k: v.clone() for k, v in model.state_dict().items()}
        pending = ckpts.save(1)
        # The hook that makes it wait is on the torch optimizer that Accelerate's wraps.
        assert opt.optimizer._optimizer_step_pre_hooks
        _train_step(model, opt, next(batches))  # at once: the step waits for the capture
        assert pending.result().step == 1
        assert not torch.equal(model.weight, at_save["weight"])
        assert ckpts.restore() == 1
        for name, value in model.state_dict().items():
            assert torch.equal(value, at_save[name]), name


@pytest.mark.timeout(60)
def test_grad_scaler_state_comes_back(tmp_path: Path) -> None:
    """Accelerate makes no GradScaler on a CPU; one given to the accelerator is saved
    (replicated under DDP) and restored like its own."""
    accelerator = _small(tmp_path)[0]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale tensor exists from the first use
    accelerator.scaler = scaler
    with Checkpoints(accelerator, tmp_path / "run") as ckpts:
        ckpts.save(1, lazy=False)
        scaler.update(new_scale=8.0)
        assert ckpts.restore() == 1
    assert scaler.get_scale() == 1024.0
    assert cryosnap.load(tmp_path / "run")["scaler"][0]["scale"] == 1024.0


@pytest.mark.timeout(60)
def test_total_limit_is_keep(tmp_path: Path) -> None:
    config = ProjectConfiguration(total_limit=2)
    accelerator, model, opt, loader = _small(tmp_path, project_config=config)
    with Checkpoints(accelerator, tmp_path / "run") as ckpts:
        for step in range(1, 5):
            _train_step(model, opt, next(iter(loader)))
            ckpts.save(step)
    assert cryosnap.Run(tmp_path / "run").steps() == [3, 4]
    with pytest.raises(TypeError, match="give one of them"):
        Checkpoints(accelerator, tmp_path / "other", keep=3)


class _Opaque:
    """A registered object whose state is no plain value."""

    def state_dict(self) -> dict[str, Any]:
        return {"when": complex(1, 2).__class__}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


@pytest.mark.timeout(60)
def test_no_pickle_unless_allowed(tmp_path: Path) -> None:
    accelerator = _small(tmp_path)[0]
    accelerator.register_for_checkpointing(_Opaque())
    with (
        Checkpoints(accelerator, tmp_path / "run") as ckpts,
        pytest.raises(TypeError, match="registered/0/when"),
    ):
        ckpts.save(1)
    with Checkpoints(accelerator, tmp_path / "pickled", allow_pickle=True) as ckpts:
        ckpts.save(1).result()
        assert ckpts.restore() == 1
    assert accelerator._custom_objects[0].loaded == {"when": complex}


class _Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.randn(6, 8))


@pytest.mark.timeout(60)
def test_loader_without_position_is_refused_or_restarts_its_epoch(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(torch.utils.data.DataLoader(_Stream(), batch_size=2))
    with pytest.raises(InexactResumeError, match="IterableDataset") as caught:
        Checkpoints(accelerator, tmp_path / "run")
    assert caught.value.path == os.fspath(tmp_path / "run")
    with pytest.warns(UserWarning, match="resumes at the start of its epoch"):
        ckpts = Checkpoints(accelerator, tmp_path / "run", exact=False)
    with ckpts:
        for _ in loader:
            pass
        ckpts.save(1).result()
    loaded = cryosnap.load(tmp_path / "run")
    assert loaded["dataloaders"] == {0: {"epoch": 1, "consumed": 0}}


@pytest.mark.timeout(60)
def test_deepspeed_without_one_engine_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a DeepSpeed plugin Checkpoints saves through the one prepared DeepSpeed engine
    (test_deepspeed_routes.py); none prepared yet is refused before the run is opened."""
    pytest.importorskip("deepspeed")
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    with pytest.raises(NotImplementedError, match="one prepared model, a DeepSpeed engine"):
        Checkpoints(accelerator, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_one_open_checkpoints_per_accelerator(tmp_path: Path) -> None:
    accelerator = _small(tmp_path)[0]
    with (
        Checkpoints(accelerator, tmp_path / "run"),
        pytest.raises(ValueError, match="another open Checkpoints"),
    ):
        Checkpoints(accelerator, tmp_path / "other")
    Checkpoints(accelerator, tmp_path / "other").close()  # the first one released the loader


@pytest.mark.timeout(60)
def test_a_loader_prepared_later_is_named(tmp_path: Path) -> None:
    accelerator = _small(tmp_path)[0]
    data = torch.utils.data.TensorDataset(torch.zeros(4))
    with Checkpoints(accelerator, tmp_path / "run") as ckpts:
        accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2))
        with pytest.raises(ValueError, match=r"after the last accelerator\.prepare"):
            ckpts.save(1)


# -- two ranks under torchrun --------------------------------------------------------------------


def _kill_tree(pid: int) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for p in reversed(procs):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)


def _torchrun(*args: str, ranks: int = 2) -> tuple[int, str]:
    """``accelerate_job.py *args`` on ``ranks`` CPU processes (torchrun; one process: python);
    its exit status and output. A job that outlives LAUNCH_TIMEOUT is killed, tree and all."""
    from tests.integration.test_dist_torch import free_port

    if ranks == 1:
        command = [sys.executable, str(JOB), *args]
    else:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)),
            *("--master-addr", "127.0.0.1", "--master-port", str(free_port())),
            *(str(JOB), *args),
        ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # a SIGKILL of the tree reaches torchrun's ranks too
    )
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait()
    return proc.returncode, out


def _data_bytes(run: Path, step: int, rank: int) -> int:
    """The bytes of the data files ``rank`` wrote for version ``step``."""
    return sum(f.stat().st_size for f in (run / "data").glob(f"{step:012d}-r{rank:05d}-*.dat"))


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_two_ranks_write_half_each_then_only_changes(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    saved = launcher.launch(JOB, "bytes", 2, out, str(run), elastic=True, timeout=LAUNCH_TIMEOUT)
    assert [s["steps"] for s in saved] == [[3, 4], [3, 4]]  # total_limit=2 is keep
    assert cryosnap.Run(run).steps() == [3, 4]
    info = [cryosnap.Run(run).info(4, rank=r) for r in (0, 1)]
    assert isinstance(info[0].replicated, tuple)
    replicated = set(info[0].replicated)
    assert replicated >= {"models", "optimizers"}
    shared = sum(leaf.nbytes for leaf in info[0].leaves if leaf.path.split("/")[0] in replicated)
    own = [sum(x.nbytes for x in i.leaves if x.path.split("/")[0] not in replicated) for i in info]
    frozen = sum(x.nbytes for x in info[0].leaves if x.path.startswith("models/0/embed."))
    assert frozen > 1 << 20 and shared > frozen
    written = [[i["written"] for i in s["infos"]] for s in saved]
    for rank in (0, 1):
        # The first save: half of the replicated state each (whole chunks), and its own.
        mine = written[rank][0] - own[rank]
        assert abs(mine - shared / 2) <= job.CHUNK, (rank, mine, shared)
        # The same counted on disk (data files carry a little framing).
        on_disk = _data_bytes(run, 1, rank) - own[rank]
        assert abs(on_disk - shared / 2) <= job.CHUNK + 8192, (rank, on_disk, shared)
    # Later saves: the trained head, its optimizer state and each rank's own, in total; the
    # frozen layer is not written again. Not 1/N each: the replicated chunks are split by
    # their position in the state (docs/design/distributed.md), and the changed ones lie
    # together, in the head.
    changed = shared - frozen + sum(own)
    for step in (2, 3, 4):
        total = written[0][step - 1] + written[1][step - 1]
        assert total <= changed + 2 * job.CHUNK, (step, total, changed)
    assert sum(_data_bytes(run, 4, r) for r in (0, 1)) < frozen


def _killed_resumes_bit_exact(tmp_path: Path, ranks: int) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    code, output = _torchrun(
        "train", str(tmp_path / "a"), str(straight), "--steps", "20", ranks=ranks
    )
    assert code == 0, output
    code, output = _torchrun(
        "train", str(tmp_path / "b"), str(killed), "--steps", "20", "--kill-at", "14", ranks=ranks
    )
    assert code != 0 and not list((tmp_path / "b").glob("final-*.json")), output
    code, output = _torchrun(
        "train", str(tmp_path / "b"), str(killed), "--steps", "20", ranks=ranks
    )
    assert code == 0, output
    for rank in range(ranks):
        first, again = _resumed(tmp_path / "b", rank)
        assert first == 0 and again in (8, 12), again  # a save before the kill, mid-epoch
        assert _losses(tmp_path / "b", rank) == _losses(tmp_path / "a", rank)
        assert _final(tmp_path / "b", rank) == _final(tmp_path / "a", rank)


@pytest.mark.deep
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 30)
def test_two_ranks_killed_mid_epoch_resume_bit_exact(tmp_path: Path) -> None:
    _killed_resumes_bit_exact(tmp_path, 2)


@pytest.mark.deep
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 30)
def test_one_process_killed_mid_epoch_resumes_bit_exact(tmp_path: Path) -> None:
    _killed_resumes_bit_exact(tmp_path, 1)
