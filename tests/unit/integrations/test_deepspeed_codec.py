"""What cryosnap's DeepSpeed engine stores of a file's dict besides plain data: DeepSpeed's own
objects (its loss scaler, fragment addresses, the ZeRO stage enum) and ``torch.Size`` as plain
data and back, anything else refused without pickle, and no stored class name outside
DeepSpeed ever imported. In process: no ranks, no training (test_deepspeed.py has those)."""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install -r requirements-dev.txt)",
)


@pytest.fixture(scope="module")
def ds() -> Any:
    from cryosnap.integrations import deepspeed

    return deepspeed


def test_deepspeed_objects_round_trip_as_plain_data(ds: Any) -> None:
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    weight = torch.arange(6.0).reshape(2, 3)
    state = {
        "module": OrderedDict([("w", weight)]),
        "param_shapes": [OrderedDict([("w", torch.Size([2, 3]))])],
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(4.0),
            "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [OrderedDict([("w", fragment_address(numel=6, start=0))])],
            "dtype": torch.bfloat16,
        },
        "steps": (1, 2.5, "x", None, b"y"),
    }
    stored = ds._encode(state, "tag/file.pt", allow_pickle=False)
    assert stored["module"]["w"] is weight  # tensors are not copied
    back = ds._decode(stored)
    assert back["param_shapes"][0]["w"] == torch.Size([2, 3])
    assert type(back["param_shapes"][0]["w"]) is torch.Size
    assert isinstance(back["module"], OrderedDict)
    scaler = back["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler) is LossScaler and vars(scaler) == vars(LossScaler(4.0))
    assert back["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients
    address = back["optimizer_state_dict"]["param_slice_mappings"][0]["w"]
    assert address == fragment_address(numel=6, start=0)
    assert back["optimizer_state_dict"]["dtype"] is torch.bfloat16
    assert back["steps"] == (1, 2.5, "x", None, b"y")


class _Mine:
    pass


def test_other_objects_are_refused_naming_their_path(ds: Any) -> None:
    with pytest.raises(TypeError, match=r"cannot checkpoint t/f\.pt/client/0 without pickle"):
        ds._encode({"client": [_Mine()]}, "t/f.pt", allow_pickle=False)
    kept = _Mine()
    assert ds._encode({"client": [kept]}, "t/f.pt", allow_pickle=True)["client"][0] is kept


@pytest.mark.parametrize("name", ["os:system", "builtins:eval", "deepspeed", "deepspeed:nothing"])
def test_a_stored_class_outside_deepspeed_is_refused(ds: Any, name: str) -> None:
    """A damaged or hostile version cannot make a load import or build anything else."""
    from cryosnap.errors import CheckpointFormatError

    with pytest.raises(CheckpointFormatError):
        ds._decode({ds._TYPE: "object", "class": name, "state": {}})


def test_files_every_rank_saved_are_replicated(ds: Any) -> None:
    names = [["model.pt", "optim_0.pt"], ["model.pt", "optim_1.pt"]]
    assert ds._owners(names) == {"model.pt": -1, "optim_0.pt": 0, "optim_1.pt": 1}


def test_deepspeed_folders_are_made_outside_the_run_only(ds: Any, tmp_path: Any) -> None:
    class Engine:
        pass

    engine = Engine()
    ours = ds.CryosnapCheckpointEngine(None, engine=engine, channel=None, run=str(tmp_path / "run"))
    ours.makedirs(str(tmp_path / "run" / "global_step3"), exist_ok=True)
    ours.makedirs(str(tmp_path / "run"), exist_ok=True)
    assert not (tmp_path / "run").exists()  # the run's directory is cryosnap's
    ours.makedirs(str(tmp_path / "hf" / "checkpoint-3" / "global_step3"), exist_ok=True)
    assert (tmp_path / "hf" / "checkpoint-3" / "global_step3").is_dir()
