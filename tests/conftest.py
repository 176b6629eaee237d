from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# The machines are shared and noisy: never fail a property test on its running time.
settings.register_profile(
    "cryosnap", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cryosnap"))


def _share_module_fixtures(items: list[pytest.Item]) -> None:
    """The tests of a module that use one of its module-scoped fixtures (a trained reference,
    a template run) form one xdist group: under ``--dist loadgroup`` one worker runs them and
    builds the fixture once, instead of every worker that got one of them building it."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        module = item.getparent(pytest.Module)
        if info is None or module is None:
            continue
        for name in item.fixturenames:
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope == "module":
                item.add_marker(pytest.mark.xdist_group(module.nodeid))
                break


# tryfirst: the group marks are in place before xdist reads them (its own hook of this name).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share a module-scoped fixture go to one xdist worker; tests marked ``gpu``
    skip where no CUDA device is available (torch is imported only when such a test was
    collected)."""
    _share_module_fixtures(items)
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu:
        item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The random order's seed, last (``-q`` hides pytest-randomly's header that names it)."""
    if config.pluginmanager.hasplugin("randomly"):
        seed = config.getoption("randomly_seed", None)
        terminalreporter.write_line(f"random order: -p randomly --randomly-seed={seed} reruns it")
