"""The memory level with real processes: gloo ranks, each on a "node" of its own
(``$CRYOSNAP_NODE``, its scratch directory and its memory root ``$CRYOSNAP_MEMORY_ROOT``), that
save and SIGKILL themselves; then the memory of none, one, M or M+1 nodes is deleted and the
ranks start again: each part comes from the fastest level that holds it (its own memory, its
memory rebuilt from the other nodes' memory, scratch), bit for bit, and the memory is gone
once they close.

Run as a script (``python test_memory_dist.py SCENARIO OUT_DIR PARTNER``) by the tests.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.test_dist_torch import launch

HERE = Path(__file__).resolve()


def state_of(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(rank)
    w = rng.standard_normal(48 << 10).astype(np.float32)
    w[: 2048 * (step + 1)] += step
    return {"w": w, "rank": rank, "step": step}


def _run_dirs(root: Path) -> list[Path]:
    user = root / f"cryosnap-{os.getuid()}"
    return sorted(user.glob("run-*")) if user.exists() else []


def _save_kill_restore(tmp: Path, world: int, partner: str, lost: list[int]) -> list[Any]:
    """Save and SIGKILL on ``world`` ranks, delete the memory of the nodes ``lost``, restart:
    the level each rank restored from. A rank whose memory was rebuilt said so in its log,
    naming the memory level (not scratch)."""
    from cryosnap._run.memory import orphans

    launch("save", world, tmp, partner, script=HERE, killed=frozenset(range(world)))
    for rank in range(world):
        root = tmp / f"shm-{rank}"
        (left,) = _run_dirs(root)
        assert [o.path for o in orphans(root)] == [left]  # its pid is dead
    for rank in lost:
        shutil.rmtree(tmp / f"shm-{rank}")
        (tmp / f"shm-{rank}").mkdir()
    got = launch("restore", world, tmp / "restart", partner, str(tmp), script=HERE)
    for rank in range(world):
        assert got[rank]["same"] and got[rank]["step"] == 2, got[rank]
        assert _run_dirs(tmp / f"shm-{rank}") == []  # removed at close
        rebuilt = [line for line in got[rank]["log"] if "lacked versions" in line]
        if got[rank]["from"] == "partner-memory":
            assert len(rebuilt) == 1 and rebuilt[0].startswith(f"rank {rank}: memory "), got[rank]
        assert not any("scratch" in line for line in rebuilt), got[rank]
    return [g["from"] for g in got]


@pytest.mark.timeout(300)
def test_partner_memory_brings_back_a_lost_nodes_memory(tmp_path: Path) -> None:
    assert _save_kill_restore(tmp_path, 2, "partner", lost=[0]) == ["partner-memory", "memory"]


@pytest.mark.deep
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("partner", "lost", "expected"),
    [
        ("partner", [], ["memory", "memory"]),
        ("partner", [0, 1], ["scratch", "scratch"]),
        ("xor", [1], ["memory", "partner-memory", "memory"]),
        ("xor", [0, 1], ["scratch", "scratch", "memory"]),
        ("rs:2+1", [2], ["memory", "memory", "partner-memory"]),
        ("rs:2+1", [0, 2], ["scratch", "memory", "scratch"]),
    ],
)
def test_memory_of_one_m_and_m_plus_one_lost_nodes(
    tmp_path: Path, partner: str, lost: list[int], expected: list[str]
) -> None:
    if partner.startswith("rs:"):
        pytest.importorskip("zfec")
    world = len(expected)
    assert _save_kill_restore(tmp_path, world, partner, lost) == expected


# -- the ranks' side ------------------------------------------------------------------------------


def _open(rank: int, base: Path, partner: str) -> Any:
    import cryosnap

    os.environ["CRYOSNAP_NODE"] = f"node-{rank}"
    os.environ["CRYOSNAP_MEMORY_ROOT"] = str(base / f"shm-{rank}")
    (base / f"shm-{rank}").mkdir(exist_ok=True)
    return cryosnap.Checkpointer(
        base / "run",
        scratch=base / f"node-{rank}",
        partner=True if partner == "partner" else partner,
        memory="64MiB",
        chunk_bytes=4096,
    )


class _Lines(logging.Handler):
    """The cryosnap log's warnings of this rank, as lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(scenario: str, out: Path, partner: str, base: str = "") -> None:
    import datetime

    import torch.distributed as dist

    lines = _Lines()
    logging.getLogger("cryosnap").addHandler(lines)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    got: dict[str, Any] = {}
    if scenario == "save":
        ckpt = _open(rank, out, partner)
        for step in range(3):
            ckpt.save(step, state_of(rank, step))
        ckpt.wait()
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    with _open(rank, Path(base), partner) as ckpt:
        state = ckpt.restore()
        want = state_of(rank, state["step"])
        got["step"] = state["step"]
        got["from"] = ckpt.restored_from
        got["same"] = bool(np.array_equal(state["w"], want["w"])) and state["rank"] == rank
    got["log"] = lines.lines
    (out / f"rank-{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
