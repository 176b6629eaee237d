from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import cryosnap


def test_save_load_round_trip(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "a": np.ones(3), "n": 4}
    info = cryosnap.save(tmp_path / "run", state, step=3)
    assert info.step == 3
    assert info.written_bytes == 6 * 4 + 3 * 8
    out = cryosnap.load(tmp_path / "run")
    assert torch.equal(out["w"], state["w"])
    np.testing.assert_array_equal(out["a"], state["a"])
    assert out["n"] == 4
