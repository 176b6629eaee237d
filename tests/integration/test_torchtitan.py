"""cryosnap's torchtitan checkpoint manager with the real torchtitan (0.3.0) on CPU: built from
its ``Config`` as torchtitan builds it, driven as torchtitan's ``Trainer`` drives it.

In this process (a world of one): the configuration refused (``keep_latest_k=1``,
``last_save_in_hf``, ``create_seed_checkpoint``), a resume into a different model, a missing
``load_step``, and ``initial_load_path`` from a DCP checkpoint written by torchtitan's own
manager. On 2 gloo ranks (torchtitan_job.py beside this file): FSDP2 on a CPU mesh and
torchtitan's DDP (FSDP2 over ``dp_replicate``), the bytes each rank writes (replicated state
1/N, the second save only what changed), a resume on another mesh refused (``deep``), and
SIGKILL mid-training then resume, bit-exact against an uninterrupted run (``deep``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from cryosnap.engine.write._shares import STRIPES_PER_RANK, stripe_bytes
from tests.integration import ranks

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="torchtitan is not installed (pip install -r requirements-dev.txt)",
    ),
    pytest.mark.timeout(400),
]

JOB = Path(__file__).resolve().parent / "torchtitan_job.py"
CHUNK = 4096


def _launch(
    tmp_path: Path, name: str, *args: str, world: int = 2, **options: Any
) -> list[dict[str, Any]]:
    return ranks.launch(JOB, "train", world, tmp_path / name, *args, **options)


def _train(run: Path, mode: str, steps: int, kill_at: int = -1) -> tuple[str, ...]:
    return (str(run), mode, str(steps), "2", str(kill_at), str(CHUNK))


# -- in this process: a world of one --------------------------------------------------------------


def _digests(built: tuple[Any, ...], state: Any) -> dict[str, str]:
    from tests.integration import torchtitan_job as job

    return job.digests(built[0], built[1], built[2], state)


def _trained(run: Path, steps: int, **fields: Any) -> tuple[Any, ...]:
    """A training of ``steps`` steps saved every 2 into ``run``: its parts and train state."""
    from tests.integration import torchtitan_job as job

    built, state = job.parts("single"), job.TrainState()
    ckpt = job.manager(str(run), built, state, interval=2, chunk_bytes=CHUNK, **fields)
    assert ckpt.load() is False  # a fresh start
    job.loop(built, state, ckpt, steps)
    ckpt.close()
    return built, state


def test_config_refuses_what_the_manager_cannot_honour(tmp_path: Path) -> None:
    import cryosnap
    from cryosnap.integrations.torchtitan import CryosnapCheckpointManager
    from tests.integration import torchtitan_job as job

    Config = CryosnapCheckpointManager.Config
    with pytest.raises(cryosnap.ConfigError, match=r"keep_latest_k=1: torchtitan refuses it"):
        Config(enable=True, keep_latest_k=1)
    with pytest.raises(cryosnap.UnsupportedError, match=r"last_save_in_hf.*cryosnap export"):
        Config(enable=True, last_save_in_hf=True)
    with pytest.raises(cryosnap.UnsupportedError, match=r"create_seed_checkpoint.*initial_load"):
        Config(enable=True, create_seed_checkpoint=True)
    with pytest.raises(ValueError, match="interval needs to be at least 1"):
        Config(enable=True, interval=0)  # torchtitan's own checks still run
    built, state = job.parts("single"), job.TrainState()
    with pytest.raises(cryosnap.ConfigError, match=r"exclude_from_loading names 'optimiser'"):
        job.manager(str(tmp_path / "run"), built, state, exclude_from_loading=["optimiser"])
    assert not (tmp_path / "run").exists()  # refused before the run was opened
    disabled = Config(enable=False, folder=str(tmp_path / "off")).build(
        dataloader=None,
        model_parts=[built[0]],
        optimizers=built[1],
        lr_schedulers=built[2],
        states={},
        sd_adapter=None,
    )
    assert disabled.save(2) is False and disabled.load() is False
    assert not (tmp_path / "off").exists()


def test_torchtitans_config_manager_parses_the_managers_fields() -> None:
    from torchtitan.config.manager import ConfigManager

    from cryosnap.integrations.torchtitan import CryosnapCheckpointManager

    args = ["--module", "tests.integration.torchtitan_job", "--config", "cli_config"]
    args += ["--dump_folder", "/tmp/x", "--checkpoint.interval", "7"]
    args += ["--checkpoint.chunk_bytes", "4096", "--checkpoint.partner", "xor"]
    config = ConfigManager().parse_args(args)
    checkpoint = config.checkpoint
    assert type(checkpoint) is CryosnapCheckpointManager.Config
    assert (checkpoint.enable, checkpoint.interval) == (True, 7)
    assert (checkpoint.chunk_bytes, checkpoint.partner) == (4096, "xor")
    assert checkpoint._owner is CryosnapCheckpointManager  # what config.build() constructs


def test_the_schedule_fields_decide_which_steps_are_saved(tmp_path: Path) -> None:
    import cryosnap

    _trained(tmp_path / "first", 5, enable_first_step_checkpoint=True)
    assert cryosnap.Run(tmp_path / "first").steps() == [1, 2, 4, 5]  # 5: the last step
    _trained(tmp_path / "none", 5, load_only=True)
    assert not cryosnap.Run(tmp_path / "none").steps()


def test_resume_into_a_different_model_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    import cryosnap
    from tests.integration import torchtitan_job as job

    run = tmp_path / "run"
    _trained(run, 2, keep_latest_k=0)
    other, state = job.parts("single", hidden=32), job.TrainState()
    ckpt = job.manager(str(run), other, state, interval=2)
    before = _digests(other, state)
    with pytest.raises(cryosnap.StateMismatchError, match=r"step 2 of .* does not fit") as exc:
        ckpt.load()
    assert "initial_load_path" in str(exc.value)  # the way to another model or mesh
    assert _digests(other, state) == before  # nothing half-restored
    with pytest.raises(cryosnap.CheckpointNotFoundError, match=r"load_step=7: .* holds steps 2"):
        ckpt.load(step=7)
    ckpt.close()


def test_resume_is_bit_exact_and_honours_exclude_and_last_model_only(tmp_path: Path) -> None:
    from tests.integration import torchtitan_job as job

    run = tmp_path / "run"
    whole, whole_state = _trained(tmp_path / "whole", 6, last_save_model_only=False)
    _trained(run, 3, last_save_model_only=False)  # versions 2 and 3 (the last step)
    built, state = job.parts("single"), job.TrainState()
    ckpt = job.manager(str(run), built, state, interval=2, last_save_model_only=False)
    assert ckpt.load() is True and state.step == 3
    job.loop(built, state, ckpt, 6)
    ckpt.close()
    assert _digests(built, state) == _digests(whole, whole_state)
    # exclude_from_loading: the dataloader's position stays where it is.
    built, state = job.parts("single"), job.TrainState()
    ckpt = job.manager(str(run), built, state, interval=2, exclude_from_loading=["dataloader"])
    assert ckpt.load(step=4) is True and state.step == 4
    assert built[3].state_dict() == job.parts("single")[3].state_dict()
    ckpt.close()
    # last_save_model_only (torchtitan's default): the last version holds the model alone,
    # and loading it loads the model alone.
    model_only = tmp_path / "model-only"
    trained, _ = _trained(model_only, 3)
    built, state = job.parts("single"), job.TrainState()
    ckpt = job.manager(str(model_only), built, state, interval=2)
    assert ckpt.load() is True and state.step == 0  # the train state was not in it
    got = _digests(built, state)
    want = _digests(trained, state)
    assert {k: v for k, v in got.items() if k.startswith("model/")} == {
        k: v for k, v in want.items() if k.startswith("model/")
    }
    assert got != want  # the optimizer is the fresh one
    ckpt.close()


def test_initial_load_path_from_torchtitans_own_dcp_checkpoint(tmp_path: Path) -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from tests.integration import torchtitan_job as job

    trained, trained_state = _trained(tmp_path / "first", 2)
    dcp_manager = CheckpointManager.Config(
        enable=True, folder=str(tmp_path / "dcp"), interval=2, keep_latest_k=0
    ).build(
        dataloader=trained[3],
        model_parts=[trained[0]],
        optimizers=trained[1],
        lr_schedulers=trained[2],
        states={"train_state": trained_state},
        sd_adapter=None,
    )
    assert dcp_manager.save(2)
    dcp_manager.close()
    built, state = job.parts("single"), job.TrainState()
    ckpt = job.manager(
        str(tmp_path / "second"),
        built,
        state,
        initial_load_path=str(tmp_path / "dcp" / "step-2"),
        initial_load_model_only=False,
    )
    assert ckpt.load() is True
    assert _digests(built, state) == _digests(trained, trained_state)
    ckpt.close()


def test_initial_load_path_from_a_run_written_through_cryosnap_dcp(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save

    import cryosnap.dcp
    from tests.integration import torchtitan_job as job

    trained, trained_state = _trained(tmp_path / "first", 2)
    save(trained[0].state_dict(), storage_writer=cryosnap.dcp.StorageWriter(tmp_path / "dcp"))
    built, state = job.parts("single"), job.TrainState()
    ckpt = job.manager(
        str(tmp_path / "second"), built, state, initial_load_path=str(tmp_path / "dcp")
    )
    assert ckpt.load() is True  # the model alone (initial_load_model_only's default)
    got, want = _digests(built, state), _digests(trained, trained_state)
    assert {k: v for k, v in got.items() if k.startswith("model/")} == {
        k: v for k, v in want.items() if k.startswith("model/")
    }
    assert got["train_state/step"] == "0"
    ckpt.close()


# -- on 2 gloo ranks ------------------------------------------------------------------------------


def test_ddp_ranks_write_half_of_the_replicated_state_and_then_only_what_changed(
    tmp_path: Path,
) -> None:
    results = _launch(tmp_path, "out", *_train(tmp_path / "run", "ddp", 4))
    frozen = 512 * 64 * 4  # the embedding's bytes: in the first version only
    for got in results:
        assert got["resumed_at"] == 0 and got["steps"] == [2, 4]
    first = [got["saves"]["2"]["written"] for got in results]
    second = [got["saves"]["4"]["written"] for got in results]
    replicated = sum(results[0]["local_param_bytes"].values())  # the whole model, every rank
    trainable = replicated - frozen
    # Replicated: the model (and AdamW's two moments of its trainable part), 1/2 each.
    whole = replicated + 2 * trainable
    for written in first:
        assert whole // 2 - 2 * CHUNK <= written <= whole // 2 + 2 * CHUNK, (first, whole)
    # The second save: the trainable parameters and moments changed, the embedding did not.
    changed = 3 * trainable
    assert sum(second) <= changed + 4 * CHUNK, (second, changed)
    assert sum(second) >= changed - 4 * CHUNK
    # What changed is one contiguous part of the replicated layout (the layers after the
    # frozen ones, their moments): the stripes spread it, each rank half within one stripe.
    stripe = stripe_bytes(whole, 2, CHUNK) + 2 * STRIPES_PER_RANK * CHUNK
    assert all(w <= changed / 2 + stripe for w in second), (second, changed, stripe)
    assert results[0]["final"] == results[1]["final"]  # replicated: the same everywhere


@pytest.mark.deep
def test_four_ddp_ranks_write_a_quarter_each(tmp_path: Path) -> None:
    results = _launch(tmp_path, "out", *_train(tmp_path / "run", "ddp", 2), world=4)
    replicated = sum(results[0]["local_param_bytes"].values())
    whole = replicated + 2 * (replicated - 512 * 64 * 4)  # the model and AdamW's moments
    written = [got["saves"]["2"]["written"] for got in results]
    for w in written:
        assert whole // 4 - 2 * CHUNK <= w <= whole // 4 + 2 * CHUNK, (written, whole)
    assert sum(written) >= whole


def test_fsdp_ranks_write_their_own_shards(tmp_path: Path) -> None:
    results = _launch(tmp_path, "out", *_train(tmp_path / "run", "fsdp", 4))
    for got in results:
        local = sum(got["local_param_bytes"].values())  # this rank's shards
        frozen = 512 * 64 * 4 // 2
        trainable = local - frozen
        assert got["saves"]["2"]["written"] >= local + 2 * trainable - CHUNK
        assert got["saves"]["2"]["written"] <= local + 2 * trainable + 4 * CHUNK
        assert got["saves"]["4"]["written"] <= 3 * trainable + 4 * CHUNK
    assert results[0]["final"] != results[1]["final"]  # each rank's own shards


@pytest.mark.deep
def test_resume_on_another_mesh_is_refused_naming_the_way(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _launch(tmp_path, "saved", *_train(run, "fsdp", 2))
    results = ranks.launch(JOB, "mismatch", 2, tmp_path / "other", str(run), "ddp")
    for got in results:
        assert got["type"] == "StateMismatchError", got
        assert "does not fit this trainer's state" in got["error"]
        # FSDP2's shards are each rank's own, DDP's parameters replicated: other keys
        assert "at model: keys missing from into=: ['tok.weight'" in got["error"]
        assert "the model, optimizers and mesh the run was saved with" in got["error"]
        assert "initial_load_path" in got["error"]
        assert got["unchanged"]


@pytest.mark.deep
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_sigkill_mid_training_then_resume_is_bit_exact(tmp_path: Path, mode: str) -> None:
    whole = _launch(tmp_path, "whole", *_train(tmp_path / "whole-run", mode, 8))
    run = tmp_path / "run"
    _launch(tmp_path, "killed", *_train(run, mode, 8, kill_at=5), killed=frozenset({0, 1}))
    resumed = _launch(tmp_path, "resumed", *_train(run, mode, 8))
    for got, ref in zip(resumed, whole, strict=True):
        assert got["resumed_at"] in (2, 4)  # the newest version committed before the kill
        assert got["final"] == ref["final"]
        assert got["steps"] == [2, 4, 6, 8]
