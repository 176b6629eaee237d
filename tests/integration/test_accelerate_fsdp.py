"""Accelerate's FSDP2 under ``cryosnap.integrations.accelerate.Checkpoints``, on 2 gloo ranks.

Accelerate shards a model with FSDP2 only on accelerators; on this CPU job
:func:`cryosnap.testing.cpu_fsdp2_accelerator` gives its state the distributed type FSDP that
it would have had there, and from then on ``prepare`` (``fully_shard``), ``backward`` and the
training are Accelerate's own (accelerate_job.py ``--fsdp``). Each rank writes its own DTensor
shards of the model and optimizer (about half each, no gather) and 1/N of the replicated rest;
a later save does not write the frozen layer again; a restore puts every rank's shards back in
place, bit for bit; a version of another world size is refused naming the ways on; a run
killed with SIGKILL mid-epoch resumes bit-exact against an uninterrupted one. FSDP1 is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType

import cryosnap
from cryosnap.integrations.accelerate import Checkpoints

from . import accelerate_job as job
from . import ranks as launcher
from .test_accelerate import LAUNCH_TIMEOUT, _final, _losses, _resumed, _torchrun

JOB = Path(job.__file__)


@pytest.fixture(autouse=True)
def fresh_accelerate() -> Iterator[None]:
    """Accelerate's state is a process-wide singleton: each test starts and ends without it."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_fsdp2_ranks_write_their_own_shards_and_restore_them_in_place(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    cryosnap.save(other, {"models": {}}, step=4)  # a version a world of one saved
    got = launcher.launch(
        JOB, "fsdp", 2, tmp_path / "out", str(run), "--other", str(other), timeout=LAUNCH_TIMEOUT
    )
    full = got[0]["full"]
    assert got[1]["full"] == full and got[0]["shard"] + got[1]["shard"] == full  # no gather
    infos = [cryosnap.Run(run).info(4, rank=r) for r in (0, 1)]
    for rank, (mine, info) in enumerate(zip(got, infos, strict=True)):
        keys = info.replicated
        assert isinstance(keys, tuple) and set(keys) == {"schedulers", "scaler", "accelerator"}
        assert mine["steps"] == [3, 4]  # total_limit=2 is keep
        # The version holds this rank's local shards: about half of the model and optimizer.
        sharded = sum(
            x.nbytes for x in info.leaves if x.path.split("/")[0] in ("models", "optimizers")
        )
        assert 0 <= sharded - mine["shard"] <= 256, (rank, sharded, mine["shard"])  # Adam's steps
        assert abs(mine["shard"] - full / 2) <= job.CHUNK, (rank, mine["shard"], full)
        own = sum(x.nbytes for x in info.leaves if x.path.split("/")[0] not in keys)
        replicated = sum(x.nbytes for x in info.leaves if x.path.split("/")[0] in keys)
        written = [i["written"] for i in mine["infos"]]
        # The first save: its shards, its own state and at most a chunk of the replicated rest.
        assert own <= written[0] <= own + replicated + job.CHUNK, (rank, written[0], own)
        # The later ones: not the frozen layer's shard again.
        for later in written[1:]:
            assert later <= own - mine["frozen_shard"] + replicated + job.CHUNK, (rank, later)
        assert mine["changed"] and mine["restored_step"] == 4
        assert mine["bit_exact"] and mine["moved"] == []  # every shard back, in place
        message = mine["world_size_error"]
        assert "saved by 1 rank(s) and 2 participant(s)" in message, message
        assert "cryosnap.dcp" in message and "replicated_only" not in message


@pytest.mark.deep
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 30)
def test_fsdp2_killed_mid_epoch_resumes_bit_exact(tmp_path: Path) -> None:
    args = ("--steps", "20", "--fsdp")
    code, output = _torchrun("train", str(tmp_path / "a"), str(tmp_path / "straight"), *args)
    assert code == 0, output
    killed = str(tmp_path / "killed")
    code, output = _torchrun("train", str(tmp_path / "b"), killed, *args, "--kill-at", "14")
    assert code != 0 and not list((tmp_path / "b").glob("final-*.json")), output
    code, output = _torchrun("train", str(tmp_path / "b"), killed, *args)
    assert code == 0, output
    for rank in (0, 1):
        first, again = _resumed(tmp_path / "b", rank)
        assert first == 0 and again in (8, 12), again  # a save before the kill, mid-epoch
        assert _losses(tmp_path / "b", rank) == _losses(tmp_path / "a", rank)
        assert _final(tmp_path / "b", rank) == _final(tmp_path / "a", rank)  # shards, in place


@pytest.mark.timeout(60)
def test_fsdp1_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP1's flat parameters are no DTensors: refused before the run is opened."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType.FSDP)
    monkeypatch.setattr(
        accelerator.state,
        "fsdp_plugin",
        FullyShardedDataParallelPlugin(fsdp_version=1),
        raising=False,
    )
    with pytest.raises(NotImplementedError, match=r"FSDP1 .*fsdp_version=2"):
        Checkpoints(accelerator, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_cpu_fsdp2_accelerator_refuses_fsdp1_and_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    from cryosnap.testing import cpu_fsdp2_accelerator

    # An Accelerator given an FSDP plugin sets ACCELERATE_USE_FSDP in os.environ: undone after.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")

    with pytest.raises(ValueError, match="fsdp_version=2"):
        cpu_fsdp2_accelerator(FullyShardedDataParallelPlugin(fsdp_version=1))
    with pytest.raises(ValueError, match="CPU job of several ranks"):
        cpu_fsdp2_accelerator()
