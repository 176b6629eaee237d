"""The memory level (``Checkpointer(memory=...)``) in one process and with threads as ranks:
its budget, its files' modes, restore order and report, its life cycle (removed at close,
taken over by the next open after a kill, orphans found and removed), and bad input.
tests/integration/test_memory_dist.py runs it with gloo processes, SIGKILL and lost nodes."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
import cryosnap._run.memory as _memory
import cryosnap._run.redundancy.partner as _partner
from cryosnap import engine
from cryosnap._run.options import RunOptions
from cryosnap.dist import Coordinator
from cryosnap.errors import MemoryLevelError
from cryosnap.storage import LocalStore

from ..distributed.test_coordinator import run_ranks

_NODE = threading.local()


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A memory root of the test's own (the default is /dev/shm)."""
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv(_memory.MEMORY_ROOT_ENV, str(root))
    return root


def state_of(step: int, n: int = 1 << 18) -> dict[str, Any]:
    w = np.arange(n, dtype=np.float32)
    w[: 1000 * (step + 1)] += step
    return {"w": w, "step": step}


def run_dirs(root: Path) -> list[Path]:
    user = root / f"cryosnap-{os.getuid()}"
    return sorted(user.glob("run-*")) if user.exists() else []


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def test_the_budget_is_parsed_and_bad_values_are_refused(tmp_path: Path) -> None:
    assert RunOptions(path=tmp_path, memory="4GiB").memory_bytes == 4 << 30
    assert RunOptions(path=tmp_path, memory=3 << 20).memory_bytes == 3 << 20
    assert RunOptions(path=tmp_path).memory_bytes is None
    with pytest.raises(ValueError, match="not a size"):
        RunOptions(path=tmp_path, memory="lots")
    with pytest.raises(ValueError, match="below the smallest memory level"):
        RunOptions(path=tmp_path, memory="1KiB")
    with pytest.raises(TypeError, match="memory must be"):
        RunOptions(path=tmp_path, memory=True)


def test_from_config_takes_the_memory_budget(tmp_path: Path, shm: Path) -> None:
    with cryosnap.Checkpointer.from_config({"path": str(tmp_path / "run"), "memory": "8MiB"}) as c:
        assert c.options.memory_bytes == 8 << 20


def test_a_version_is_restored_from_memory_private_to_its_owner_and_removed_at_close(
    tmp_path: Path, shm: Path
) -> None:
    with cryosnap.Checkpointer(
        tmp_path / "run", scratch=tmp_path / "scratch", memory="64MiB", chunk_bytes=1 << 16
    ) as c:
        for step in range(3):
            c.save(step, state_of(step))
        c.wait()
        (run,) = run_dirs(shm)
        # Owner only: every directory 0700, every file 0600.
        assert stat.S_IMODE((shm / f"cryosnap-{os.getuid()}").stat().st_mode) == 0o700
        for p in [run, *run.rglob("*")]:
            want = 0o700 if p.is_dir() else 0o600
            assert stat.S_IMODE(p.lstat().st_mode) == want, p
        # Only the newest version is kept in memory (with what it inherits).
        own = run / "rank-00000"
        assert engine.list_steps(LocalStore(own)) == [2]
        got = c.restore()
        assert c.restored_step == 2 and c.restored_from == "memory"
        assert np.array_equal(got["w"], state_of(2)["w"])
        got = c.restore(step=1)  # not in memory any more: the fastest level holding it
        assert c.restored_from == "scratch" and got["step"] == 1
    assert run_dirs(shm) == []


def test_an_exception_leaving_the_run_keeps_its_memory_level_for_the_restart(
    tmp_path: Path, shm: Path
) -> None:
    with (
        pytest.raises(RuntimeError, match="the training failed"),
        cryosnap.Checkpointer(tmp_path / "run", memory="64MiB") as c,
    ):
        c.save(3, state_of(3)).result()
        c.wait()
        raise RuntimeError("the training failed")
    (kept,) = run_dirs(shm)
    with cryosnap.Checkpointer(tmp_path / "run", memory="64MiB") as c:
        assert c.restore()["step"] == 3 and c.restored_from == "memory"
    assert not kept.exists()


def test_a_damaged_memory_copy_falls_back_to_scratch(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with cryosnap.Checkpointer(tmp_path / "run", scratch=tmp_path / "scratch", memory="64MiB") as c:
        c.save(1, state_of(1)).result()
        c.wait()
        (data,) = (run_dirs(shm)[0] / "rank-00000" / "data").iterdir()
        with open(data, "r+b") as f:
            f.seek(100)
            f.write(b"\xff" * 8)
        got = c.restore()
        assert c.restored_from == "scratch"
        assert "does not match its hash; reading the next tier" in caplog.text
        assert np.array_equal(got["w"], state_of(1)["w"])


def test_a_budget_smaller_than_one_part_skips_the_level_with_a_warning(
    tmp_path: Path, shm: Path
) -> None:
    with cryosnap.Checkpointer(tmp_path / "run", scratch=tmp_path / "scratch", memory="1MiB") as c:
        with pytest.warns(
            RuntimeWarning, match=r"step 0 is not kept in the memory level.*1\.0 MiB"
        ):
            c.save(0, state_of(0)).result()
            c.wait()
        c.restore()
        assert c.restored_from == "scratch"
        assert files_under(run_dirs(shm)[0] / "rank-00000") == [
            run_dirs(shm)[0] / "rank-00000" / "writer.lock"
        ]


def test_too_little_available_memory_skips_the_level(
    tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The system's MemAvailable (read from /proc/meminfo) is what stops a copy from ever
    causing an OOM kill: here it is made to say 100 MiB."""
    monkeypatch.setattr(_memory, "_mem_available", lambda: 100 << 20)
    with cryosnap.Checkpointer(tmp_path / "run", memory="1GiB") as c:
        with pytest.warns(RuntimeWarning, match="memory available"):
            c.save(0, state_of(0)).result()
            c.wait()
        c.restore()
        assert c.restored_from == "persistent"


def test_a_missing_root_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_memory.MEMORY_ROOT_ENV, str(tmp_path / "nope"))
    with pytest.raises(MemoryLevelError, match=r"nope is missing.*CRYOSNAP_MEMORY_ROOT"):
        cryosnap.Checkpointer(tmp_path / "run", memory="8MiB")
    # Nothing held: the run opens without the memory level.
    cryosnap.Checkpointer(tmp_path / "run").close()


def test_a_user_directory_others_can_enter_is_refused(tmp_path: Path, shm: Path) -> None:
    (shm / f"cryosnap-{os.getuid()}").mkdir(mode=0o755)
    os.chmod(shm / f"cryosnap-{os.getuid()}", 0o755)
    with pytest.raises(MemoryLevelError, match="mode 0700"):
        cryosnap.Checkpointer(tmp_path / "run", memory="8MiB")


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user needs root to setuid")
def test_another_user_cannot_read_a_version_in_memory(tmp_path: Path, shm: Path) -> None:
    """A child process turned into user nobody tries to list and read the memory level's
    files (the parent directories are opened up for the test: the files' own modes are
    what is checked, and the per-user directory's)."""
    os.chmod(tmp_path, 0o755)
    os.chmod(shm, 0o755)
    with cryosnap.Checkpointer(tmp_path / "run", memory="64MiB") as c:
        c.save(0, state_of(0)).result()
        c.wait()
        run = run_dirs(shm)[0]
        data = next((run / "rank-00000" / "data").iterdir())
        targets = [shm / f"cryosnap-{os.getuid()}", data]
        results = []
        for target in targets:
            # The file itself, reached with root's rights to the directories above it.
            fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY if target.is_dir() else os.O_RDONLY)
            os.close(fd)
            pid = os.fork()
            if pid == 0:  # the child: user nobody
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    try:
                        if target.is_dir():
                            os.listdir(target)
                        else:
                            with open(target, "rb") as f:
                                f.read(1)
                        os._exit(0)
                    except PermissionError:
                        os._exit(13)
                finally:
                    os._exit(99)
            _, status = os.waitpid(pid, 0)
            results.append(os.waitstatus_to_exitcode(status))
        assert results == [13, 13]
        # And the file's mode alone denies it, whatever the directories say.
        assert stat.S_IMODE(data.stat().st_mode) == 0o600


def _save_and_die(run: Path, scratch: Path) -> None:
    """In a forked child: save one version with a memory level, then SIGKILL itself."""
    try:
        c = cryosnap.Checkpointer(run, scratch=scratch, memory="64MiB")
        c.save(5, state_of(5)).result()
        c.wait()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _killed_child(run: Path, scratch: Path) -> None:
    """A new interpreter, not a fork of this (threaded) worker: a forked copy of the worker's
    threads' locks can hang the child (it did, under load). The memory root is inherited
    through the environment (the ``shm`` fixture)."""
    code = (
        "import sys; from pathlib import Path; "
        "from tests.unit.run.test_memory import _save_and_die; "
        "_save_and_die(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run), str(scratch)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_a_killed_run_is_taken_over_by_its_next_open(tmp_path: Path, shm: Path) -> None:
    _killed_child(tmp_path / "run", tmp_path / "scratch")
    (left,) = run_dirs(shm)
    assert [o.path for o in _memory.orphans(shm)] == [left]
    with cryosnap.Checkpointer(tmp_path / "run", scratch=tmp_path / "scratch", memory="64MiB") as c:
        assert _memory.orphans(shm) == []  # held again
        got = c.restore()
        assert c.restored_from == "memory" and got["step"] == 5
    assert run_dirs(shm) == []


@pytest.mark.timeout(120)
def test_orphans_of_a_run_never_reopened_are_removed_by_the_cli(
    tmp_path: Path, shm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cryosnap.cli._main import main

    _killed_child(tmp_path / "run", tmp_path / "scratch")
    with cryosnap.Checkpointer(tmp_path / "other", memory="64MiB") as live:
        live.save(1, state_of(1)).result()
        live.wait()
        assert main(["memory"]) == 0
        listed = capsys.readouterr().out
        assert "orphan" in listed and str(tmp_path / "run") in listed
        assert main(["memory", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert sorted((lv["run"], lv["orphan"]) for lv in doc["levels"]) == [
            (str(tmp_path / "other"), False),
            (str(tmp_path / "run"), True),
        ]
        assert main(["memory", "--clean"]) == 0
        capsys.readouterr()
        # The live run's level stays; the orphan is gone.
        assert [r.run for r in _memory.memory_runs(shm)] == [str(tmp_path / "other")]
    assert run_dirs(shm) == []


# -- threads as ranks, each on a node of its own -----------------------------------------------


@pytest.fixture
def nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each thread-rank's node name and memory root are its own."""
    monkeypatch.setattr(_partner, "node_name", lambda: _NODE.name)
    monkeypatch.setattr(_memory, "memory_root", lambda environ=None: _NODE.shm)


def _node(tmp: Path, rank: int) -> None:
    _NODE.name = f"n{rank}"
    _NODE.shm = tmp / f"shm-{rank}"
    _NODE.shm.mkdir(exist_ok=True)


def test_with_partner_copies_a_lost_nodes_memory_comes_back_from_its_partner(
    tmp_path: Path, nodes: None
) -> None:
    def save(c: Coordinator) -> None:
        _node(tmp_path, c.rank)
        ckpt = cryosnap.Checkpointer(
            tmp_path / "run",
            scratch=tmp_path / f"node-{c.rank}",
            comm=c,
            partner=True,
            memory="64MiB",
        )
        for step in range(2):
            ckpt.save(step, {**state_of(step), "rank": c.rank})
        ckpt.wait()
        ckpt._writer.stop()  # as a kill would: the memory level is left behind
        ckpt._levels.close_handoffs()
        ckpt._levels.release_locks()
        assert ckpt._run.memory is not None
        ckpt._run.memory.release()

    def restore(c: Coordinator) -> tuple[str | None, int]:
        _node(tmp_path, c.rank)
        with cryosnap.Checkpointer(
            tmp_path / "run",
            scratch=tmp_path / f"node-{c.rank}",
            comm=c,
            partner=True,
            memory="64MiB",
        ) as ckpt:
            got = ckpt.restore()
            assert np.array_equal(got["w"], state_of(1)["w"]) and got["rank"] == c.rank
            return ckpt.restored_from, got["step"]

    run_ranks(2, save)
    import shutil

    shutil.rmtree(tmp_path / "shm-0")
    (tmp_path / "shm-0").mkdir()
    assert run_ranks(2, restore) == [("partner-memory", 1), ("memory", 1)]
    assert run_dirs(tmp_path / "shm-0") == [] and run_dirs(tmp_path / "shm-1") == []


def test_memory_with_several_participants_needs_scratch(tmp_path: Path, nodes: None) -> None:
    def body(c: Coordinator) -> None:
        _node(tmp_path, c.rank)
        cryosnap.Checkpointer(tmp_path / "run", comm=c, memory="64MiB")

    with pytest.raises(ValueError, match="needs scratch="), warnings.catch_warnings():
        run_ranks(2, body)


def test_the_default_root_is_dev_shm_and_nothing_stays_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    monkeypatch.delenv(_memory.MEMORY_ROOT_ENV, raising=False)
    before = set(run_dirs(Path("/dev/shm")))
    with cryosnap.Checkpointer(tmp_path / "run", memory="16MiB") as c:
        c.save(0, state_of(0)).result()
        c.wait()
        (mine,) = set(run_dirs(Path("/dev/shm"))) - before
        assert [r.run for r in cryosnap.run.memory_levels() if r.path == mine] == [
            str(tmp_path / "run")
        ]
        c.restore()
        assert c.restored_from == "memory"
    assert not mine.exists()


@pytest.fixture
def small_tmpfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real tmpfs of 8 MiB as the memory root (root only: skipped elsewhere, or where the
    mount is refused, as in a container without CAP_SYS_ADMIN); unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = tmp_path / "tmpfs"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(root)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {mounted.stderr.strip()}")
    try:
        monkeypatch.setenv(_memory.MEMORY_ROOT_ENV, str(root))
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=True, timeout=30)


def _fill(root: Path) -> Path:
    """Write a file in ``root`` until the file system is full (ENOSPC); the file."""
    filler = root / "filler"
    block = b"\xa5" * (64 << 10)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_full_tmpfs_skips_versions_and_loses_nothing(
    tmp_path: Path, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real 8 MiB tmpfs: a version larger than its free space is skipped by the check
    before the copy; one whose copy meets a real ENOSPC (another process filled the tmpfs
    between the check and the copy) is skipped too, its partial file removed. Each with a
    warning; the persistent level holds every version, and the memory level takes the next
    version once there is room again."""
    copy = _memory._copy
    fill: list[Path] = []

    def crowded(src: Any, dst: Any, keys: list[str]) -> None:
        if not fill:  # armed: the tmpfs fills up just before this copy
            fill.append(_fill(small_tmpfs))
        copy(src, dst, keys)

    user = small_tmpfs / f"cryosnap-{os.getuid()}"
    with (
        pytest.warns(RuntimeWarning, match=r"memory=64\.0 MiB is more than .* holds \(8\.0 MiB"),
        cryosnap.Checkpointer(tmp_path / "run", memory="64MiB", incremental=False) as c,
    ):
        c.save(1, state_of(1)).result()  # 1 MiB: fits
        c.wait()
        assert c.restore()["step"] == 1 and c.restored_from == "memory"
        with pytest.warns(RuntimeWarning, match=r"step 2 is not kept .* free, 1[12]\.\d MiB"):
            c.save(2, state_of(2, 3 << 20)).result()  # 12 MiB: more than the tmpfs
            c.wait()
        assert c.restore()["step"] == 2 and c.restored_from == "persistent"
        monkeypatch.setattr(_memory, "_copy", crowded)
        with pytest.warns(RuntimeWarning, match=r"step 3 is not kept .*disk full"):
            c.save(3, state_of(3, 5 << 18)).result()  # 5 MiB: fits, until the tmpfs fills
            c.wait()
        assert fill and not [p for p in user.rglob("*") if p.name.endswith(".partial")]
        own = LocalStore(run_dirs(small_tmpfs)[0] / "rank-00000")
        assert engine.list_steps(own) == []  # version 1 made room for 3; 3 never committed
        got = c.restore()
        assert got["step"] == 3 and c.restored_from == "persistent"
        assert np.array_equal(got["w"], state_of(3, 5 << 18)["w"])
        fill[0].unlink()
        c.save(4, state_of(4, 5 << 18)).result()
        c.wait()
        assert c.restore()["step"] == 4 and c.restored_from == "memory"
    for step, n in ((1, 1 << 18), (2, 3 << 20), (3, 5 << 18), (4, 5 << 18)):
        got = cryosnap.load(tmp_path / "run", step=step)
        assert np.array_equal(got["w"], state_of(step, n)["w"])
    assert run_dirs(small_tmpfs) == []
