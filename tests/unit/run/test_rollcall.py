"""The roll call at open (#52's bad input): participants that disagree on their ranks, the
world size, the run id or the format versions they write get a ParticipantMismatchError on
every rank, and nothing is written; a group that agrees opens and saves. Ranks are threads
(cryosnap.dist.InProcessGroup); tests/integration/test_dist_failures.py runs gloo ranks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
import cryosnap._run.rollcall as _rollcall
from cryosnap.dist import Coordinator, InProcessGroup
from cryosnap.errors import CoordinationError, ParticipantMismatchError

WORLD = 3
_FORMATS = threading.local()


class _Claims:
    """A rank's coordinator that claims another rank or world size (a misconfigured job: the
    rank and size a launcher's environment gave one process disagree with the group's)."""

    def __init__(self, inner: Coordinator, *, rank: int | None, world_size: int | None) -> None:
        self._inner = inner
        self._rank = inner.rank if rank is None else rank
        self._world = inner.world_size if world_size is None else world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def each_rank(body: Callable[[Coordinator], Any]) -> list[str]:
    """``body`` on WORLD threads; what each raised (``type: message``) or ``"ok"``."""
    group = InProcessGroup(WORLD, timeout=20)
    out = [""] * WORLD

    def main(rank: int) -> None:
        try:
            body(group.coordinator(rank))
            out[rank] = "ok"
        except cryosnap.CheckpointError as exc:
            out[rank] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def opens(run: Path, **per_rank: Callable[[int], Any]) -> Callable[[Coordinator], None]:
    def body(c: Coordinator) -> None:
        rank = c.rank
        coord: Any = c
        if "claims" in per_rank:
            coord = _Claims(c, **per_rank["claims"](rank))
        run_id = per_rank["run_id"](rank) if "run_id" in per_rank else None
        with cryosnap.Checkpointer(run, comm=coord, run_id=run_id, chunk_bytes=4096) as ckpt:
            ckpt.save(1, {"x": np.full(8, rank)}).result(timeout=20)

    return body


def nothing_written(run: Path) -> bool:
    return not run.exists() or not any(run.rglob("*"))


@pytest.mark.parametrize(
    ("claims", "said"),
    [
        (
            lambda r: {"rank": 0, "world_size": None},
            "ranks: the participant at position 1 says "
            "rank 0, the participant at position 2 says rank 0",
        ),
        (
            lambda r: {"rank": None, "world_size": 4 if r == 2 else None},
            "world size: 3 (ranks 0, 1) vs 4 (ranks 2) (the group has 3)",
        ),
    ],
)
def test_ranks_or_world_sizes_that_disagree(
    tmp_path: Path, claims: Callable[[int], Any], said: str
) -> None:
    run = tmp_path / "run"
    for got in each_rank(opens(run, claims=claims)):
        assert got.startswith("ParticipantMismatchError: rank "), got
        assert f"disagree: {said}; nothing was written" in got
    assert nothing_written(run)


def test_a_rank_with_another_run_id(tmp_path: Path) -> None:
    run = tmp_path / "run"
    got = each_rank(opens(run, run_id=lambda r: "other" if r == 1 else "mine"))
    for rank, text in enumerate(got):
        assert text == (
            f"ParticipantMismatchError: rank {rank}: the participants opening this run disagree:"
            " run id: 'mine' (ranks 0, 2) vs 'other' (ranks 1) (the group has 3); nothing was "
            "written (start every rank with the same launcher settings, run_id and cryosnap "
            "release)"
        )
    assert nothing_written(run)
    assert each_rank(opens(run, run_id=lambda r: "mine")) == ["ok"] * WORLD  # agreed: it opens


def test_a_rank_of_another_cryosnap_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 2 writes an older manifest format (its thread's formats, as another release's)."""
    newest = _rollcall.written_formats()
    monkeypatch.setattr(_rollcall, "written_formats", lambda: getattr(_FORMATS, "formats", newest))

    def body(c: Coordinator) -> None:
        if c.rank == 2:
            _FORMATS.formats = [newest[0] - 1, newest[1]]
        opens(tmp_path / "run")(c)

    for got in each_rank(body):
        assert f"format versions: {newest!r} (ranks 0, 1) vs [{newest[0] - 1}, {newest[1]}]" in got
        assert got.startswith("ParticipantMismatchError")
    assert nothing_written(tmp_path / "run")


def test_a_mismatch_is_a_coordination_error() -> None:
    assert issubclass(ParticipantMismatchError, CoordinationError)
    assert _rollcall.disagreement([[0, 2, None, [8, 2]], [1, 2, None, [8, 2]]]) == ""
