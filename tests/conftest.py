from __future__ import annotations

import os
import time
from pathlib import Path
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


def _heavy_first(items: list[pytest.Item]) -> None:
    """The multi-process tests (tests/integration) and those marked ``slow`` start first, each
    part still in pytest-randomly's order (a stable sort, after its shuffle): xdist hands the
    tests out in this order as workers free up, so a 30-second test no longer starts last and
    leaves the other workers idle while it finishes."""
    integration = Path(__file__).resolve().parent / "integration"

    def light(item: pytest.Item) -> bool:
        heavy = item.path.is_relative_to(integration) or item.get_closest_marker("slow")
        return not heavy

    items.sort(key=light)


# A full-length campaign (``deep``) may take minutes beside others on a busy 2-core machine;
# the suite-wide timeout (pyproject.toml) is for hangs in ordinary tests.
DEEP_TIMEOUT = 1500


def _deep_timeouts(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("deep") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(DEEP_TIMEOUT))


# tryfirst: the group marks are in place before xdist reads them (its own hook of this name);
# pytest-randomly's shuffle (a hook wrapper) runs before it.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share a module-scoped fixture go to one xdist worker; the heavy tests start
    first; tests marked ``gpu`` skip where no CUDA device is available (torch is imported only
    when such a test was collected)."""
    _share_module_fixtures(items)
    _heavy_first(items)
    _deep_timeouts(items)
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu:
        item.add_marker(skip)


def _takes_direct_io(directory: str) -> str | None:
    """None if ``directory`` takes an aligned O_DIRECT write (the probe's), else why not."""
    from cryosnap.storage import LocalStore

    try:
        store = LocalStore(directory, direct_io=None)
        return None if store.check_direct_io() else f"{directory} writes buffered (probed)"
    except OSError as exc:
        return f"{directory}: {exc}"


@pytest.fixture
def direct_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A fresh directory whose file system takes O_DIRECT (ext4, xfs...): pytest's tmp_path
    where it does, else one under /var/tmp or the working directory; skips, saying why, where
    none does (tmp_path on tmpfs and nothing else writable)."""
    import shutil
    import tempfile

    base = tmp_path_factory.mktemp("direct")
    why = _takes_direct_io(str(base))
    if why is None:
        yield base
        return
    reasons = [why]
    for root in ("/var/tmp", os.getcwd()):
        try:
            candidate = tempfile.mkdtemp(prefix="cryosnap-direct-", dir=root)
        except OSError as exc:
            reasons.append(f"{root}: {exc}")
            continue
        why = _takes_direct_io(candidate)
        if why is None:
            try:
                yield Path(candidate)
            finally:
                shutil.rmtree(candidate, ignore_errors=True)
            return
        shutil.rmtree(candidate, ignore_errors=True)
        reasons.append(why)
    pytest.skip("no directory here takes O_DIRECT: " + "; ".join(reasons))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The random order's seed, last (``-q`` hides pytest-randomly's header that names it)."""
    if config.pluginmanager.hasplugin("randomly"):
        seed = config.getoption("randomly_seed", None)
        terminalreporter.write_line(f"random order: -p randomly --randomly-seed={seed} reruns it")


@pytest.fixture(scope="session", autouse=True)
def no_memory_level_left() -> Any:
    """The suite leaves no memory level in shared memory (``Checkpointer(memory=...)``: a
    clean close removes it; a killed run's is taken over by its next open): at the end of the
    session, an orphan (no live holder) that was not there at its start fails it. Levels
    other sessions hold are not ours to judge."""
    from cryosnap._run.memory import memory_root, orphans

    roots = {Path("/dev/shm"), memory_root()}
    before = {run.path for root in roots for run in orphans(root)}
    yield
    left = [run for root in roots for run in orphans(root) if run.path not in before]
    assert not left, "the tests left memory levels in shared memory: " + ", ".join(
        f"{run.path} ({run.run})" for run in left
    )


# MPICH keeps each job's intranode channel in a file /dev/shm/mpich_shm_*, unlinked by the
# job's own exit; a job the tests SIGKILL (on purpose) leaves it, 65 MiB each.
_SHM = Path("/dev/shm")


def _mapped_in_shm() -> set[str]:
    """The /dev/shm files some live process maps."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0:
                names.add(line[at:].removesuffix(" (deleted)"))
    return names


def _unmapped_segments(start: float) -> list[tuple[Path, float]]:
    """MPICH segments of this user created since ``start`` that no live process maps, with
    their last change."""
    mapped = _mapped_in_shm()
    out = []
    for path in _SHM.glob("mpich_shm_*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid == os.getuid() and st.st_ctime >= start and str(path) not in mapped:
            out.append((path, max(st.st_mtime, st.st_ctime)))
    return out


@pytest.fixture(scope="session", autouse=True)
def no_mpi_segments_left() -> Any:
    """At the end of the session, unlink the MPICH segments its killed jobs left: created since
    it started, by this user, mapped by no live process five seconds after their last change
    (a starting job maps its own at once). As a cluster's job epilogue cleans /dev/shm after
    a killed job."""
    start = time.time()
    yield
    if not _SHM.is_dir():
        return
    found = _unmapped_segments(start)
    if not found:
        return
    time.sleep(max(0.0, max(changed for _, changed in found) + 5.0 - time.time()))
    for path, _ in _unmapped_segments(start):
        path.unlink(missing_ok=True)
