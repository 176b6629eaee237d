"""Launching a test script on N gloo ranks: one helper for the files that run themselves as
the ranks' script (test_dcp_dist.py, test_dtensor_dist.py, test_lightning_ddp.py).

``launch(script, scenario, world, out, *args)`` runs ``script scenario out *args`` on
``world`` processes with torchrun's environment (test_dist_torch's launcher) and returns what
each rank wrote to ``out/rank-N.json``; skipped where torch.distributed is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def launch(
    script: Path, scenario: str, world: int, out: Path, *args: str, **options: Any
) -> list[dict[str, Any]]:
    """What each rank of ``script scenario out *args`` on ``world`` processes reported;
    ``options`` go to test_dist_torch's launcher (``timeout`` 240 s unless given, ``killed``,
    ``elastic``)."""
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    from tests.integration import test_dist_torch

    options.setdefault("timeout", 240)
    return test_dist_torch.launch(scenario, world, out, *args, script=script, **options)
