from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# The machines are shared and noisy: never fail a property test on its running time.
settings.register_profile(
    "cryosnap", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cryosnap"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip where no CUDA device is available (torch is imported only
    when such a test was collected)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu:
        item.add_marker(skip)
