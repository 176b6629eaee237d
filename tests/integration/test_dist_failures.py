"""A rank SIGKILLed during a save of 4 gloo ranks (#52): every other rank's save of that version
raises CoordinationError, nothing is half-committed, and the restarted job saves on.

Phases: in the capture (the victim's ``save()`` call), in its data writes, while the others
gather the parts for the commit (the victim's part is written), the leader before its commit
record, and the leader after it (the version is committed: the survivors fail to hear so, the
restart finds it). Each launch runs this file as the ranks' script (``python
test_dist_failures.py SCENARIO OUT_DIR PHASE``) with test_dist_torch's launcher; the kills go
through FaultyStore (test_dist_phases.py kills 2 ranks at every store step, this file 4 ranks at
each step of the protocol). With MPI, MPICH's launcher ends the whole job when one rank dies,
so no survivor is left to observe: these are gloo ranks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve()
WORLD = 4
TIMEOUT = 20.0  # the coordination timeout: a short one (a dead peer fails a collective at once)

# victim, the store operation it dies at (or "capture"), which version is the newest after
PHASES: dict[str, tuple[int, str, int]] = {
    "capture": (1, "capture", 1),
    "mid-data-write": (2, "writer.write", 1),
    "commit-gather": (3, "written manifest", 1),
    "leader-before-commit-record": (0, "write commit", 1),
    "leader-after-commit-record": (0, "written commit", 2),
}


def state_of(rank: int, step: int) -> dict[str, Any]:
    model = np.random.default_rng(0).standard_normal(1 << 16) + step
    own = np.random.default_rng(100 + rank).standard_normal(1 << 16) + step
    return {"model": model, "own": own, "step": step}


def launch(scenario: str, out: Path, phase: str, killed: frozenset[int]) -> list[dict[str, Any]]:
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    from tests.integration import test_dist_torch

    return test_dist_torch.launch(
        scenario, WORLD, out, phase, killed=killed, script=HERE, timeout=200
    )


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.timeout(480)
def test_a_rank_killed_in_each_phase_aborts_the_version_on_every_other_rank(
    tmp_path: Path, phase: str
) -> None:
    import cryosnap
    from cryosnap import engine
    from cryosnap.storage import LocalStore

    victim, _, newest = PHASES[phase]
    run = tmp_path / "run"
    results = launch("killed", tmp_path / "killed", phase, frozenset({victim}))
    for rank, got in enumerate(results):
        if rank == victim:
            continue
        assert got["error"].startswith(f"CoordinationError: rank {rank}/{WORLD}: "), (rank, got)
    # Committed whole or not at all: the commit record names every rank's part, each loads.
    assert engine.list_steps(LocalStore(run)) == list(range(1, newest + 1))
    for rank in range(WORLD):
        np.testing.assert_array_equal(
            cryosnap.load(run, rank=rank)["own"], state_of(rank, newest)["own"]
        )

    for rank, got in enumerate(launch("restart", tmp_path / "restart", phase, frozenset())):
        assert got["latest"] == newest and got["restored_step"] == newest, rank
        assert got["saved"] == newest + 1, rank
    assert engine.list_steps(LocalStore(run))[-1] == newest + 1
    for rank in range(WORLD):
        part = cryosnap.load(run, rank=rank)
        np.testing.assert_array_equal(part["own"], state_of(rank, newest + 1)["own"])


@pytest.mark.timeout(240)
def test_gloo_ranks_that_disagree_on_the_run_id_or_format_open_nothing(tmp_path: Path) -> None:
    """Rank 1 opens with another run id, then as another cryosnap release (an older manifest
    format): every rank's open raises ParticipantMismatchError and nothing is written; the
    same ranks agreeing then open and save."""
    from cryosnap import engine
    from cryosnap.storage import LocalStore

    for rank, got in enumerate(launch("mismatch", tmp_path / "mismatch", "-", frozenset())):
        assert got["run_id"].startswith(f"ParticipantMismatchError: rank {rank}: "), got
        assert "run id: 'mine' (ranks 0, 2, 3) vs 'other' (ranks 1)" in got["run_id"]
        assert "format versions: " in got["format"] and "(ranks 1)" in got["format"], got
        assert got["written_after_refusals"] is False and got["saved"] == 1
    assert engine.list_steps(LocalStore(tmp_path / "run")) == [1]


# -- the ranks' side ------------------------------------------------------------------------------


class _KillOnCapture:
    """A stateful leaf: its ``state_dict()`` (read by the capture, on the caller's thread)
    SIGKILLs this process once armed."""

    def __init__(self) -> None:
        self.armed = False

    def state_dict(self) -> dict[str, Any]:
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"armed": self.armed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.armed = bool(state["armed"])


def _store(run: Path, rank: int, phase: str) -> tuple[Any, threading.Event]:
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    victim, wanted, _ = PHASES[phase]
    armed = threading.Event()

    class AfterWrites(FaultyStore):
        def write(self, key: str, data: Any) -> None:
            super().write(key, data)
            self.fault("written", key)

    def fault(op: str, key: str) -> None:
        if not armed.is_set() or rank != victim:
            return
        if op in ("write", "written"):
            op += " commit" if key.endswith("COMMIT.json") else " manifest"
        if op == wanted:
            os.kill(os.getpid(), signal.SIGKILL)

    return AfterWrites(LocalStore(run), fault=fault), armed


def _init() -> int:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    return int(dist.get_rank())


def _killed(out: Path, phase: str) -> dict[str, Any]:
    import cryosnap
    from cryosnap.dist import TorchCoordinator

    rank = _init()
    store, armed = _store(out.parent / "run", rank, phase)
    hook = _KillOnCapture()
    got: dict[str, Any] = {}
    comm = TorchCoordinator(timeout=TIMEOUT)
    # Small staging slabs and chunks: the data goes out in several writes.
    opts = {"comm": comm, "chunk_bytes": 64 << 10, "staging_bytes": 256 << 10}
    with cryosnap.Checkpointer(store, **opts) as ckpt:  # type: ignore[arg-type]
        ckpt.save(1, {**state_of(rank, 1), "hook": hook}, replicated=["model"]).result()
        armed.set()
        hook.armed = rank == PHASES[phase][0] and phase == "capture"
        try:
            ckpt.save(2, {**state_of(rank, 2), "hook": hook}, replicated=["model"]).result()
        except cryosnap.CheckpointError as exc:
            got["error"] = f"{type(exc).__name__}: {exc}"
    return got


def _restart(out: Path) -> dict[str, Any]:
    import cryosnap
    from cryosnap.dist import TorchCoordinator

    rank = _init()
    comm = TorchCoordinator(timeout=TIMEOUT)
    with cryosnap.Checkpointer(out.parent / "run", comm=comm, chunk_bytes=64 << 10) as ckpt:
        latest = ckpt.latest_step()
        restored = ckpt.restore()
        assert latest is not None
        np.testing.assert_array_equal(restored["own"], state_of(rank, latest)["own"])
        step = latest + 1
        saved = ckpt.save(
            step, {**state_of(rank, step), "hook": _KillOnCapture()}, replicated=["model"]
        )
        got = {
            "latest": latest,
            "restored_step": int(restored["step"]),
            "saved": saved.result().step,
        }
    return got


def _mismatch(out: Path) -> dict[str, Any]:
    import cryosnap
    import cryosnap._run.rollcall as rollcall
    from cryosnap.dist import TorchCoordinator

    rank = _init()
    run = out.parent / "run"
    comm = TorchCoordinator(timeout=TIMEOUT)
    got: dict[str, Any] = {}
    try:
        cryosnap.Checkpointer(run, comm=comm, run_id="other" if rank == 1 else "mine")
    except cryosnap.CheckpointError as exc:
        got["run_id"] = f"{type(exc).__name__}: {exc}"
    newest = rollcall.written_formats()
    if rank == 1:  # as a process of an older release would
        rollcall.written_formats = lambda: [newest[0] - 1, newest[1]]
    try:
        cryosnap.Checkpointer(run, comm=comm)
    except cryosnap.CheckpointError as exc:
        got["format"] = f"{type(exc).__name__}: {exc}"
    rollcall.written_formats = lambda: newest
    got["written_after_refusals"] = run.exists()
    with cryosnap.Checkpointer(run, comm=comm) as ckpt:
        got["saved"] = ckpt.save(1, state_of(rank, 1)).result().step
    return got


def main(scenario: str, out: Path, phase: str) -> None:
    import torch.distributed as dist

    if scenario == "mismatch":
        got = _mismatch(out)
    else:
        got = _killed(out, phase) if scenario == "killed" else _restart(out)
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(got))
    if scenario == "killed":
        # A peer vanished: gloo's groups are broken, and torch may abort at interpreter exit
        # (test_dist_phases.py does the same). What is tested is reported above.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
