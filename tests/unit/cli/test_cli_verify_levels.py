"""``cryosnap verify PATH --scratch DIR`` and ``cryosnap.Run(path, scratch=...).verify()``:
every level of a run checked, each copy of a version on its own, and the damaged level named
(a restore that reads scratch never reads the persistent copy, so its damage goes unnoticed
there). Over real runs written by a Checkpointer: one process, striped scratch devices, and
two ranks (threads of an ``InProcessGroup``) with ``<scratch>/rank-<r>`` parts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap.cli import main
from cryosnap.dist import Coordinator
from cryosnap.run import Run

from ..distributed.test_coordinator import run_ranks

STEPS = (1, 2, 3)  # keep_scratch=2: scratch holds 2 and 3, persistent all three


def state(step: int, rank: int = 0) -> dict[str, Any]:
    """Content no other step or rank holds (data is de-duplicated within a level)."""
    return {"w": np.arange(4096, dtype=np.float64) + 10**6 * step + 10**8 * rank, "step": step}


def content(step: int, rank: int = 0) -> bytes:
    return bytes(state(step, rank)["w"][:8].tobytes())


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def flip_byte(level: Path, data: bytes) -> None:
    """Damage the first byte of ``data`` where the data files of the level at ``level`` hold
    it (each device's ``data/``)."""
    for file in sorted(level.glob("data/*.dat")):
        raw = bytearray(file.read_bytes())
        at = raw.find(data)
        if at >= 0:
            raw[at] ^= 0xFF
            file.write_bytes(bytes(raw))
            return
    raise AssertionError(f"no data file under {level} holds {data!r:.40}")


def files_of(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def single(tmp_path: Path) -> tuple[Path, Path]:
    """A world of one with a scratch level: (persistent, scratch)."""
    persistent, scratch = tmp_path / "persistent", tmp_path / "scratch"
    with cryosnap.Checkpointer(persistent, scratch=scratch, chunk_bytes=4096) as ckpt:
        for step in STEPS:
            ckpt.save(step, state(step)).result()
    return persistent, scratch


@pytest.fixture
def ranks(tmp_path: Path) -> tuple[Path, Path]:
    """Two ranks, node-local scratch under one directory: (persistent, scratch)."""
    persistent, scratch = tmp_path / "persistent", tmp_path / "scratch"

    def body(c: Coordinator) -> None:
        with cryosnap.Checkpointer(persistent, scratch=scratch, comm=c, chunk_bytes=4096) as ckpt:
            for step in STEPS:
                ckpt.save(step, state(step, c.rank)).result()

    run_ranks(2, body)
    assert sorted(os.listdir(scratch)) == ["rank-00000", "rank-00001"]
    return persistent, scratch


def rows(out: str) -> list[list[str]]:
    """The table's rows (level, step, status), header and summary lines left out."""
    found = []
    for line in out.splitlines()[1:]:
        cells = line.split()
        at = next((i for i, c in enumerate(cells) if c in ("OK", "DAMAGED")), None)
        if at is not None and cells[at - 1].isdigit() and ":" not in cells[0]:
            found.append([" ".join(cells[: at - 1]), cells[at - 1], cells[at]])
    return found


# ---------------------------------------------------------------------------------------------
# one process


def test_every_level_good_exits_0_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], single: tuple[Path, Path]
) -> None:
    persistent, scratch = single
    before = files_of(persistent.parent)
    code, out, err = cli(capsys, "verify", persistent, "--scratch", scratch)
    assert (code, err) == (0, "")
    assert rows(out) == [
        ["persistent", "1", "OK"],
        ["persistent", "2", "OK"],
        ["persistent", "3", "OK"],
        ["scratch", "2", "OK"],
        ["scratch", "3", "OK"],
    ]
    assert out.splitlines()[-2:] == ["persistent: 3 versions OK", "scratch: 2 versions OK"]
    assert files_of(persistent.parent) == before


def test_damaged_persistent_copy_is_named_while_scratch_is_good(
    capsys: pytest.CaptureFixture[str], single: tuple[Path, Path]
) -> None:
    persistent, scratch = single
    flip_byte(persistent, content(3))
    # What the restore reads (scratch, the fastest level) is good: it never sees the damage.
    assert cryosnap.load(scratch, step=3)["step"] == 3

    code, out, err = cli(capsys, "verify", persistent, "--scratch", scratch)
    assert (code, err) == (1, "")
    assert ["persistent", "3", "DAMAGED"] in rows(out)
    assert ["scratch", "3", "OK"] in rows(out)
    (damaged,) = [line for line in out.splitlines() if "DAMAGED" in line]
    assert damaged.startswith("persistent") and "leaf w" in damaged and "hash" in damaged
    assert out.splitlines()[-2:] == [
        "persistent: 1 of 3 versions damaged",
        "scratch: 2 versions OK",
    ]
    assert "Traceback" not in out + err

    code, out, _ = cli(capsys, "verify", persistent, "--scratch", scratch, "--json")
    doc = json.loads(out)
    assert (code, doc["ok"], doc["damaged_levels"]) == (1, False, ["persistent"])
    [check] = [v for v in doc["versions"] if not v["ok"]]
    assert (check["level"], check["step"]) == ("persistent", 3)
    (error,) = check["errors"]
    assert error.startswith("persistent: step 3") and "leaf w" in error
    levels = {level["level"]: level for level in doc["levels"]}
    assert levels["persistent"]["damaged"] == [3] and levels["scratch"]["ok"] is True

    # Without --scratch, the persistent level alone, as before: the same damage, no level.
    code, out, _ = cli(capsys, "verify", persistent, "--json")
    assert code == 1 and all("level" not in v for v in json.loads(out)["versions"])


def test_damaged_scratch_copy_is_named_while_persistent_is_good(
    capsys: pytest.CaptureFixture[str], single: tuple[Path, Path]
) -> None:
    persistent, scratch = single
    flip_byte(scratch, content(2))
    code, out, err = cli(capsys, "verify", persistent, "--scratch", scratch)
    assert (code, err) == (1, "")
    assert ["scratch", "2", "DAMAGED"] in rows(out)
    assert ["persistent", "2", "OK"] in rows(out)
    assert out.splitlines()[-2:] == [
        "persistent: 3 versions OK",
        "scratch: 1 of 2 versions damaged",
    ]

    report = Run(persistent, scratch=scratch).verify()
    assert not report.ok and report.damaged_levels == ("scratch",)
    (check,) = report.damaged
    assert (check.level, check.step) == ("scratch", 2)
    assert check.errors[0].startswith("scratch: step 2")


def test_step_is_checked_on_the_levels_that_hold_it(
    capsys: pytest.CaptureFixture[str], single: tuple[Path, Path]
) -> None:
    persistent, scratch = single
    code, out, _ = cli(capsys, "verify", persistent, "--scratch", scratch, "--step", "1")
    assert code == 0 and rows(out) == [["persistent", "1", "OK"]]
    assert out.splitlines()[-1] == f"scratch: no version ({scratch})"
    code, out, _ = cli(capsys, "verify", persistent, "--scratch", scratch, "--step", "3")
    assert code == 0 and [r[0] for r in rows(out)] == ["persistent", "scratch"]

    code, out, err = cli(capsys, "verify", persistent, "--scratch", scratch, "--step", "9")
    assert (code, out) == (2, "")
    assert err.startswith("cryosnap: error: step 9 not found") and len(err.splitlines()) == 1


def test_a_scratch_that_is_missing_or_not_one_is_exit_2_an_empty_one_no_version(
    capsys: pytest.CaptureFixture[str], single: tuple[Path, Path], tmp_path: Path
) -> None:
    persistent, _scratch = single
    for wrong, says in ((tmp_path / "nowhere", "no scratch at"), (tmp_path, "not a run's")):
        code, out, err = cli(capsys, "verify", persistent, "--scratch", wrong)
        assert (code, out) == (2, "")
        assert err.startswith("cryosnap: error: ") and says in err and len(err.splitlines()) == 1
    code, _, err = cli(capsys, "verify", persistent, "--scratch", "")
    assert code == 2 and "--scratch" in err

    (tmp_path / "wiped").mkdir()  # a node-local disk emptied after the job: not damage
    code, out, err = cli(capsys, "verify", persistent, "--scratch", tmp_path / "wiped")
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"scratch: no version ({tmp_path / 'wiped'})"


def test_striped_scratch_devices_found_from_the_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    persistent, devices = tmp_path / "persistent", [tmp_path / "s0", tmp_path / "s1"]
    with cryosnap.Checkpointer(persistent, scratch=devices, chunk_bytes=4096) as ckpt:
        for step in STEPS:
            ckpt.save(step, state(step)).result()
    for given in (devices, devices[:1]):  # every device, or the first (its layout names all)
        args = [a for d in given for a in ("--scratch", d)]
        code, out, err = cli(capsys, "verify", persistent, *args)
        assert (code, err) == (0, "")
        assert [r[0] for r in rows(out)].count("scratch") == 2
    report = Run(persistent, scratch=devices[0]).verify()
    assert [level.name for level in report.levels] == ["persistent", "scratch"]

    code, _, err = cli(capsys, "verify", persistent, "--scratch", devices[0], "--scratch", tmp_path)
    assert code == 2 and "devices" in err and len(err.splitlines()) == 1


def test_run_scratch_is_checked_as_the_checkpointer_checks_it(single: tuple[Path, Path]) -> None:
    persistent, _ = single
    with pytest.raises(ValueError, match=r"scratch=\[\]"):
        Run(persistent, scratch=[])
    assert Run(persistent).verify().levels == ()  # no scratch: one store, as before


# ---------------------------------------------------------------------------------------------
# two ranks


def test_ranks_scratch_parts_each_verified_and_named(
    capsys: pytest.CaptureFixture[str], ranks: tuple[Path, Path]
) -> None:
    persistent, scratch = ranks
    code, out, err = cli(capsys, "verify", persistent, "--scratch", scratch)
    assert (code, err) == (0, "")
    assert out.splitlines()[-3:] == [
        "persistent: 3 versions OK",
        "scratch rank-00000: 2 versions OK",
        "scratch rank-00001: 2 versions OK",
    ]

    flip_byte(scratch / "rank-00001", content(3, rank=1))
    flip_byte(persistent, content(2, rank=0))
    code, out, err = cli(capsys, "verify", persistent, "--scratch", scratch)
    assert (code, err) == (1, "")
    damaged = [r for r in rows(out) if r[2] == "DAMAGED"]
    assert damaged == [["persistent", "2", "DAMAGED"], ["scratch rank-00001", "3", "DAMAGED"]]
    assert "rank 0: step 2" in out  # which rank's part of the persistent version

    report = Run(persistent, scratch=scratch).verify()
    assert report.damaged_levels == ("persistent", "scratch rank-00001")
    by_level = {(c.level, c.step): c for c in report.damaged}
    assert by_level["scratch rank-00001", 3].damage[0].rank == 1  # that rank's part
    assert by_level["persistent", 2].damage[0].rank == 0
    assert by_level["scratch rank-00001", 3].errors[0].startswith("scratch rank-00001: step 3")
