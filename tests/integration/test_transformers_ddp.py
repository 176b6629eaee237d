"""The Hugging Face callback under DDP: a real ``Trainer`` on 2 gloo processes (CPU), the user's
script being transformers_job.py.

Every rank holds the run: the model parameters, optimizer, LR scheduler and trainer state are
written once in total, each rank writing its share (within 1/N + one chunk, counted from the
version's manifests), and each rank's RNG states are its own. A job resumed from the run ends
with weights bit for bit those of the uninterrupted job, every logged loss equal. The unmarked
slice runs the three trainings (reference, stopped, resumed) in one job of processes started
with torchrun's environment; the deep test SIGKILLs a ``torchrun`` job (every process of it)
mid-epoch and resumes it with a new ``torchrun``. Under the Trainer's own FSDP2 path (made
to run on the CPU job by :func:`cryosnap.testing.as_cpu_fsdp2`) each rank writes its DTensor
shards and resumes them bit for bit. A DeepSpeed config, FSDP1 or DTensors outside FSDP2 are
refused with ``UnsupportedError`` (with DeepSpeed, saying how the Trainer's own saves go
through cryosnap).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("torch.distributed")

import cryosnap
from cryosnap.integrations.transformers import resume
from tests import forkserver
from tests.integration import manifests, ranks, transformers_job
from tests.integration.test_dist_torch import free_port
from tests.integration.test_example_train import _signal_tree

JOB = Path(transformers_job.__file__)
ROOT = JOB.parents[2]
WORLD = 2
CHUNK = 4096  # the smallest chunk: the bound below is tight
STEPS = [3, 6, 9, 12]  # the saves of transformers_job (every 3 optimizer steps, 12 in all)
REPLICATED = ("lr_scheduler", "model", "optimizer", "trainer_state")


# -- bytes per rank, from the version's manifests ----------------------------------------------


def _leaf_bytes(run: Path, step: int, rank: int) -> tuple[int, int]:
    """(replicated, own) bytes of rank ``rank``'s part of version ``step``: its leaves' sizes,
    a tensor shared with another leaf (tied weights) counted once."""
    info = cryosnap.Run(run).info(step, rank=rank)
    assert info.replicated is not True and set(info.replicated or ()) == set(REPLICATED)
    replicated = own = 0
    for leaf in info.leaves:
        if leaf.shared_with is not None:
            continue
        if leaf.path.strip("/").split("/")[0] in REPLICATED:
            replicated += leaf.nbytes
        else:
            own += leaf.nbytes
    return replicated, own


def _assert_split(run: Path) -> None:
    """Each rank wrote 1/N of the replicated state (+ at most one chunk) and its own keys."""
    for step in STEPS:
        for rank in range(WORLD):
            replicated, own = _leaf_bytes(run, step, rank)
            written = manifests.written(run, step, rank)
            assert written <= replicated / WORLD + CHUNK + own, (step, rank, written, replicated)
            if step == STEPS[0]:  # a full version: every rank writes its share of it
                assert written >= replicated / WORLD - CHUNK + own, (rank, written, replicated)
    # Written once in total: rank 0 alone would have written all of it.
    replicated, own = _leaf_bytes(run, STEPS[0], 0)
    total = sum(manifests.written(run, STEPS[0], r) for r in range(WORLD))
    assert replicated + own <= total <= replicated + WORLD * own


def _losses(path: Path) -> list[tuple[int, float]]:
    return transformers_job.losses(path)


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_ddp_saves_one_nth_per_rank_and_resumes_bit_exact(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    got = ranks.launch(
        JOB,
        str(run),
        WORLD,
        out,
        "--resume-in-process",
        "6",
        "--chunk-bytes",
        str(CHUNK),
        elastic=True,
    )
    for rank in range(WORLD):
        assert got[rank]["step"] == 12
        assert got[rank]["final"] == got[rank]["reference"], rank
    assert got[0]["final"] == got[1]["final"]  # replicas
    reference = _losses(out / "reference.txt")
    assert [s for s, _ in reference] == list(range(1, 13))
    assert _losses(out / "losses.txt") == reference[:6]
    assert _losses(out / "resumed.txt") == reference[6:]
    assert cryosnap.Run(run).steps() == STEPS
    assert cryosnap.Run(run).info().world_size == WORLD
    _assert_split(run)
    # Each rank's part: the same replicated state, its own generators.
    parts = [cryosnap.load(run, rank=r) for r in range(WORLD)]
    assert parts[0]["trainer_state"] == parts[1]["trainer_state"]
    assert json.loads(parts[0]["trainer_state"])["global_step"] == 12
    for name, weight in parts[0]["model"].items():
        assert weight.equal(parts[1]["model"][name]), name
    assert not parts[0]["rng"]["torch"].equal(parts[1]["rng"]["torch"])


@pytest.mark.timeout(240)
def test_fsdp2_saves_each_ranks_shards_and_resumes_bit_exact(tmp_path: Path) -> None:
    """The Trainer's own FSDP2 path (transformers_job.py --fsdp): each rank writes its DTensor
    shards of the model and optimizer and a share of the rest; a Trainer resumed from the
    run ends with every rank's shards bit for bit those of the uninterrupted one."""
    run, out = tmp_path / "run", tmp_path / "out"
    args = ("--resume-in-process", "6", "--chunk-bytes", str(CHUNK), "--fsdp")
    got = ranks.launch(JOB, str(run), WORLD, out, *args, elastic=True)
    for rank in range(WORLD):
        assert got[rank]["step"] == 12
        assert got[rank]["final"] == got[rank]["reference"], rank
    assert got[0]["final"] != got[1]["final"]  # shards, not replicas
    reference = _losses(out / "reference.txt")
    assert _losses(out / "resumed.txt") == reference[6:]
    assert cryosnap.Run(run).steps() == STEPS
    sharded = ("model", "optimizer")
    parts = []
    for rank in range(WORLD):
        info = cryosnap.Run(run).info(STEPS[0], rank=rank)
        assert info.replicated == ("lr_scheduler", "trainer_state")
        size = {"shards": 0, "replicated": 0, "own": 0}
        for leaf in info.leaves:
            key = leaf.path.strip("/").split("/")[0]
            if leaf.shared_with is None:
                kind = "shards" if key in sharded else "replicated"
                size[kind if key in (*sharded, *info.replicated) else "own"] += leaf.nbytes
        # A full version: its shards, its own keys, and its share of the replicated rest.
        written = manifests.written(run, STEPS[0], rank)
        low = size["shards"] + size["own"]
        assert low <= written <= low + size["replicated"] / WORLD + CHUNK, (rank, written, size)
        parts.append(size["shards"])
    # Each rank's local shards: half of the model and optimizer (FSDP2 shards dim 0, which
    # the small tensors do not split evenly: rows of a 1-row tensor lie on rank 0).
    assert abs(parts[0] - parts[1]) <= CHUNK, parts
    loaded = [cryosnap.load(run, rank=r, keys=["model"])["model"] for r in range(WORLD)]
    for shard in loaded:
        assert tuple(shard["transformer.wte.weight"].shape) == (32, 16)  # rows of 64 x 16
    # One process cannot resume 2 ranks' shards: refused before anything is trained.
    alone = transformers_job.trainer(tmp_path / "alone", tmp_path / "alone-out")
    with pytest.raises(cryosnap.WorldSizeError, match="saved by 2 ranks under FSDP2"):
        resume(alone, run)
    assert alone.state.global_step == 0


# A child process: a Trainer with a DeepSpeed config changes the process for good (its
# environment and accelerate's shared state make every later Trainer a DeepSpeed one).
_REFUSED = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import Replicate, distribute_tensor
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers import TrainerControl, TrainerState
import cryosnap
from cryosnap.integrations.transformers import CryosnapCallback

out = {}
def refused(fn):
    try:
        fn()
    except cryosnap.UnsupportedError as exc:
        return str(exc)
    return None

def model():
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config)

dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
callback = CryosnapCallback(sys.argv[2], save_steps=1)
args = TrainingArguments(output_dir=sys.argv[3], use_cpu=True, report_to="none")
def begin(sharded):
    return lambda: callback.on_train_begin(args, TrainerState(), TrainerControl(), model=sharded)
out["fsdp"] = refused(begin(FullyShardedDataParallel(model(), device_id=torch.device("cpu"))))
replicated = model()  # a DTensor weight outside FSDP2 (tensor parallelism's kind)
wte = replicated.transformer.wte
mesh = init_device_mesh("cpu", (1,))
wte.weight = torch.nn.Parameter(distribute_tensor(wte.weight.detach(), mesh, [Replicate()]))
out["dtensor"] = refused(begin(replicated))
dist.destroy_process_group()
ds = TrainingArguments(
    output_dir=sys.argv[3], use_cpu=True, report_to="none",
    deepspeed={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}},
)
out["deepspeed"] = refused(
    lambda: Trainer(model=model(), args=ds, callbacks=[CryosnapCallback(sys.argv[2], save_steps=1)])
)
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_deepspeed_and_sharded_models_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    store = f"file://{tmp_path / 'store'}"
    done = forkserver.run(
        ["-c", _REFUSED, store, str(tmp_path / "run"), str(tmp_path / "out")],
        {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    refused = json.loads(done.stdout.strip().splitlines()[-1])
    assert "does not support a model sharded by FSDP1" in refused["fsdp"]
    assert "DTensors beyond FSDP2's" in refused["dtensor"]
    assert "fsdp_config={'version': 2}" in refused["fsdp"]  # what it does save
    # What to do instead, as test_deepspeed_routes.py does it.
    for advice in ("deepspeed.register()", '"cryosnap": {"path"', 'save_strategy="steps"'):
        assert advice in refused["deepspeed"], refused["deepspeed"]
    assert not (tmp_path / "run").exists()  # refused before anything was written


# -- a torchrun job killed with SIGKILL mid-training ----------------------------------------------


def _torchrun(run: Path, out: Path, *args: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
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
        str(JOB),
        str(run),
        str(out),
        "--chunk-bytes",
        str(CHUNK),
        *args,
    ]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }


def _job(run: Path, out: Path) -> list[dict[str, Any]]:
    """A whole torchrun job to its end; what each rank reported."""
    proc = subprocess.run(
        _torchrun(run, out), capture_output=True, text=True, timeout=200, env=_env()
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def _killed(run: Path, out: Path, pause_at: int, durable: int) -> None:
    """A torchrun job that every rank pauses at the start of step ``pause_at``; once step
    ``durable`` is committed, SIGKILL to torchrun and each of its processes."""
    command = _torchrun(run, out, "--pause-at", str(pause_at))
    log = (out / "killed.log").open("w")
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_env(),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 200
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
        log.close()


def _steps(run: Path) -> list[int]:
    try:
        return cryosnap.Run(run).steps()
    except cryosnap.CheckpointNotFoundError:
        return []


@pytest.mark.deep
@pytest.mark.timeout(600)
def test_a_torchrun_job_sigkilled_mid_epoch_resumes_bit_exact(tmp_path: Path) -> None:
    ref = _job(tmp_path / "ref-run", tmp_path / "ref")
    run, killed, resumed = tmp_path / "run", tmp_path / "killed", tmp_path / "resumed"
    _killed(run, killed, pause_at=8, durable=6)  # 4 steps an epoch: step 8 is mid-epoch 2
    assert _steps(run) == [3, 6]
    reference = _losses(tmp_path / "ref" / "losses.txt")
    assert _losses(killed / "losses.txt") == reference[:7]
    got = _job(run, resumed)
    assert _losses(resumed / "losses.txt") == reference[6:]
    for rank in range(WORLD):
        assert got[rank]["step"] == 12
        assert got[rank]["final"] == ref[rank]["final"], rank
    assert _steps(run) == STEPS
    _assert_split(run)
