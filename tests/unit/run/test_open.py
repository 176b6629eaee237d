"""_run/open.py: the channels a run's rooms use are the ones CHANNELS names, made first."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import cryosnap
import cryosnap.policy
from cryosnap._run.open import CHANNELS
from cryosnap.dist import LocalCoordinator


class _Recording(LocalCoordinator):
    """A world of one that records the channels asked of it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def channel(self, name: str) -> LocalCoordinator:
        self.names.append(name)
        return self


def test_a_run_makes_the_channels_of_channels_first_and_uses_no_other(tmp_path: Path) -> None:
    coord = _Recording()
    every = cryosnap.policy.EveryNSteps(2)
    with cryosnap.Checkpointer(tmp_path / "run", comm=coord, keep=1, policy=every) as ckpt:
        ckpt.save(1, {"w": np.zeros(4)}).result()
        ckpt.save(2, {"w": np.ones(4)}).result()  # retention runs
        assert ckpt.should_save(3) is False
        ckpt.restore()
    assert coord.names[: len(CHANNELS)] == list(CHANNELS)
    assert set(coord.names) == set(CHANNELS)  # a room's channel missing there fails here
