"""SIGKILL at every phase of a fork's creation and of the ancestor's retention, and an ancestor
that trains on while forks are made: nothing a fork reads is ever deleted, a killed fork is
made again or released, and every fork is its version bit for bit (docs/design/lineage.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._format.forks import Hold
from cryosnap.storage import LocalStore

CHUNK = 64 << 10


def _state(step: int) -> dict[str, object]:
    w = np.arange(300_000, dtype=np.float64)
    w[: step * 5000] += step  # each step rewrites a few chunks, keeps the rest
    return {"w": w, "step": step}


_PRELUDE = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import cryosnap
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    def state(step):
        w = np.arange(300_000, dtype=np.float64)
        w[: step * 5000] += step
        return {"w": w, "step": step}

    def killer(op_wanted, key_has, nth):
        seen = [0]
        def fault(op, key):
            if op == op_wanted and key_has in key:
                seen[0] += 1
                if seen[0] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
        return fault
    """
)

_FORK_CHILD = _PRELUDE + textwrap.dedent(
    """
    anc, dest, op, key_has = sys.argv[1:5]
    run = cryosnap.Run(FaultyStore(LocalStore(anc), fault=killer(op, key_has, 1)))
    run.fork(2, FaultyStore(LocalStore(dest), fault=killer(op, key_has, 1)))
    print("finished without crashing")
    """
)

# (operation, key fragment): the fork's record, the hold in the ancestor, the version's
# manifest, its commit record.
FORK_PHASES = [
    ("write", "FORK.json"),
    ("write", "forks/"),
    ("write", "rank-"),
    ("write", "COMMIT"),
]


def _ancestor(path: Path) -> None:
    with cryosnap.Checkpointer(path, chunk_bytes=CHUNK) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, _state(s)).result()


def _kill(code: str, *args: object) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr


def _same(path: Path, step: int) -> None:
    got = cryosnap.load(path, step=step)
    assert got["step"] == step and got["w"].tobytes() == _state(step)["w"].tobytes()


def _holds(anc: Path) -> list[Hold]:
    folder = anc / "forks"
    if not folder.exists():
        return []
    return [Hold.from_json(p.read_bytes(), str(p)) for p in sorted(folder.iterdir())]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("op", "key_has"), FORK_PHASES)
@pytest.mark.parametrize("then", ["again", "delete"])
def test_sigkill_while_a_fork_is_made(tmp_path: Path, op: str, key_has: str, then: str) -> None:
    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _ancestor(anc)
    _kill(_FORK_CHILD, anc, dest, op, key_has)
    for s in (1, 2, 3):
        _same(anc, s)  # the ancestor is untouched
    assert cryosnap.Run(anc).verify().ok
    # No version in the fork: the commit record is what makes it one.
    assert not (dest / "versions" / f"{2:012d}" / "COMMIT.json").exists()
    if then == "again":
        cryosnap.Run(anc).fork(2, dest)  # an unfinished fork is made again in place
        _same(dest, 2)
        cryosnap.Run(anc).gc(keep=1)  # releases the killed attempt's hold, keeps this one's
        assert [h.fork for h in _holds(anc)] == [os.path.realpath(dest)]
        _same(dest, 2)
        assert cryosnap.Run(dest).verify().ok
    else:
        shutil.rmtree(dest, ignore_errors=True)
        cryosnap.Run(anc).gc(keep=1)
        assert _holds(anc) == []
        needed = set(engine.read_commit(LocalStore(anc), 3).data_files)
        assert {f"data/{p.name}" for p in (anc / "data").iterdir()} == needed


_GC_CHILD = _PRELUDE + textwrap.dedent(
    """
    anc, nth = sys.argv[1], int(sys.argv[2])
    cryosnap.Run(FaultyStore(LocalStore(anc), fault=killer("delete", "", nth))).gc(keep=1)
    print("finished without crashing")
    """
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_sigkill_in_the_ancestors_retention_deletes_nothing_a_fork_reads(
    tmp_path: Path, nth: int
) -> None:
    """Killed at its 1st, 2nd, 3rd delete (commit records, then manifests, then files)."""
    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _ancestor(anc)
    cryosnap.Run(anc).fork(1, dest)
    _kill(_GC_CHILD, anc, nth)
    _same(dest, 1)
    cryosnap.Run(anc).gc(keep=1)  # finishes what the killed pass started
    assert cryosnap.Run(anc).steps() == [3]
    _same(dest, 1)
    _same(anc, 3)
    assert cryosnap.Run(dest).verify().ok


_TRAINER = _PRELUDE + textwrap.dedent(
    """
    anc, last = sys.argv[1], int(sys.argv[2])
    with cryosnap.Checkpointer(anc, chunk_bytes=64 << 10, keep=1) as ckpt:
        for s in range(1, last + 1):
            ckpt.save(s, state(s)).result()
    print("trained")
    """
)


@pytest.mark.deep
@pytest.mark.timeout(300)
def test_forks_made_while_the_ancestor_trains_on(tmp_path: Path) -> None:
    """The ancestor saves with keep=1 (each version retired at the next save) in another
    process while this one forks its newest version again and again: a fork either fails
    cleanly (its version was retired meanwhile) or is that version bit for bit, also after
    the ancestor has moved on and collected."""
    anc = tmp_path / "anc"
    with cryosnap.Checkpointer(anc, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(0, _state(0)).result()
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(anc), "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    made: dict[Path, int] = {}
    try:
        n = 0
        while trainer.poll() is None and n < 200:
            n += 1
            steps = engine.list_steps(LocalStore(anc))
            if not steps:
                continue
            dest = tmp_path / f"f{n}"
            try:
                cryosnap.Run(anc).fork(steps[-1], dest)
            except cryosnap.CheckpointNotFoundError:
                # Retired meanwhile: nothing made, nothing held (the fork took back its holds).
                assert not (dest / "versions").exists() or not any(
                    p.name.startswith("COMMIT") for p in (dest / "versions").rglob("*")
                )
                continue
            made[dest] = steps[-1]
            time.sleep(0.01)
    finally:
        out, err = trainer.communicate(timeout=240)
    assert trainer.returncode == 0, out + err
    assert len(made) >= 3
    cryosnap.Run(anc).gc(keep=1)
    assert sorted(h.fork for h in _holds(anc)) == sorted(os.path.realpath(d) for d in made)
    for dest, step in made.items():
        _same(dest, step)
        assert cryosnap.Run(dest).verify().ok
