"""Superseding (issue 26): a save after a restore of an older version than the run's newest
supersedes the later versions, as part of its own commit; the run never gets stuck on a
damaged version, and never restores an abandoned trajectory.

docs/FORMAT.md ("Superseding") states the rule; ``_format.keys.visible_versions`` is
its pure form, tested first, then through a Checkpointer on real files: a fallback past
damage, an explicit rewind, a restore with no save, retention, scratch tiers, a failed
superseding commit, and a state machine against a model of the visible versions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cryosnap
from cryosnap import engine
from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import (
    Lineage,
    commit_key,
    manifest_key,
    parse_commit_key,
    parse_manifest_key,
    visible_versions,
)
from cryosnap.errors import CheckpointNotFoundError, StorageError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore


def state(step: int, trajectory: int = 0) -> dict[str, Any]:
    """The state at ``step`` of a trajectory (a rewound run computes another one)."""
    x = np.arange(4096, dtype=np.float32)
    x[: 64 * (step % 7 + 1)] += step + 1000 * trajectory
    return {"x": x, "step": step, "trajectory": trajectory}


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return bool(
        np.array_equal(got["x"], want["x"])
        and got["step"] == want["step"]
        and got["trajectory"] == want["trajectory"]
    )


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def files(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if name != "writer.lock":
                out[path.relative_to(root).as_posix()] = path.read_bytes()
    return out


def damage_newest_data(root: Path, step: int) -> None:
    """Flip a byte of the data that only ``step`` wrote (its own data file)."""
    [own] = sorted((root / "data").glob(f"{step:012d}-*.dat"))
    flip_byte(own, 8)


# -- the rule -----------------------------------------------------------------------------------


def test_keys_of_a_lineage_round_trip_and_stay_plain_without_one() -> None:
    assert commit_key(7) == "versions/000000000007/COMMIT.json"
    assert manifest_key(7, 3) == "versions/000000000007/rank-00003.json"
    lin = Lineage(2, 5)
    key = commit_key(7, lin)
    assert key == "versions/000000000007/COMMIT-g2-f000000000005.json"
    assert parse_commit_key(key) == (7, lin)
    assert parse_commit_key(commit_key(7)) == (7, None)
    assert parse_manifest_key(manifest_key(7, 3, 2)) == (3, 2)
    assert parse_manifest_key(manifest_key(7, 3)) == (3, 0)
    for other in (
        "versions/000000000007/COMMIT-g0-f000000000005.json",  # generation 0 has no lineage
        "versions/000000000007/COMMIT-g2-f5.json",
        "versions/000000000007/COMMIT-g2.json",
        "versions/7/COMMIT.json",
        "versions/000000000007/rank-00000.json",
    ):
        assert parse_commit_key(other) is None, other


def test_visible_versions_follow_the_newest_generation() -> None:
    g1, g2 = Lineage(1, 20), Lineage(2, 10)
    records = [(10, None), (20, None), (30, None), (40, None)]
    assert list(visible_versions(records)) == [10, 20, 30, 40]
    # Restored 20, saved 30 again: the old 30 and 40 are superseded.
    after = [*records, (30, g1)]
    assert visible_versions(after) == {10: None, 20: None, 30: g1}
    # Saved on in generation 1; then restored 10 and saved 20: generation 2 wins over both.
    more = [*after, (40, g1), (50, g1), (20, g2)]
    assert visible_versions(more) == {10: None, 20: g2}
    # Order of the listing does not matter; a record listed twice (two tiers) counts once.
    assert visible_versions(reversed(more + more)) == {10: None, 20: g2}


def test_a_lineage_in_the_record_must_match_its_key(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, state(s)).result()
        ckpt.restore(step=1)
        ckpt.save(2, state(2, 1)).result()
    store = LocalStore(run)
    record = engine.read_commit(store, 2)
    assert record.lineage == Lineage(1, 1)
    assert CommitRecord.from_json(record.to_json(), "x").lineage == Lineage(1, 1)
    # A record moved to another lineage's key is refused as malformed, never taken as that.
    os.rename(run / record.key, run / commit_key(2, Lineage(1, 0)))
    with pytest.raises(cryosnap.CheckpointFormatError, match="lineage"):
        engine.read_commit(store, 2)


# -- through a Checkpointer ---------------------------------------------------------------------


def test_a_fallback_past_damage_lets_the_program_save_that_step_again(tmp_path: Path) -> None:
    """The heat-diffusion case of issue 26: the newest version is damaged, restore falls back,
    the program recomputes the iteration and saves it under the same step."""
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, chunk_bytes=4096) as ckpt:
        for s in (100, 200, 300):
            ckpt.save(s, state(s)).result()
    damage_newest_data(run, 300)
    [damaged] = (run / "data").glob("000000000300-*.dat")
    with cryosnap.Checkpointer(run, chunk_bytes=4096) as ckpt:
        with pytest.warns(RuntimeWarning, match="step 300"):
            got = ckpt.restore()
        assert same(got, state(200)) and ckpt.restored_step == 200
        assert ckpt.steps() == [100, 200, 300]  # nothing changed yet
        info = ckpt.save(300, state(300, 1)).result()
        assert info.incremental  # built on the version it restored
        assert ckpt.steps() == [100, 200, 300]
        assert same(ckpt.restore(), state(300, 1))
        ckpt.save(400, state(400, 1)).result()
    assert same(cryosnap.load(run, step=300), state(300, 1))
    assert same(cryosnap.load(run), state(400, 1))
    # The damaged version's files are reclaimed (keep=None reclaims superseded versions).
    assert not damaged.exists()
    assert sorted(os.listdir(run / "versions" / "000000000300")) == [
        "COMMIT-g1-f000000000200.json",
        "rank-00000-g1.json",
    ]


def test_an_explicit_rewind_abandons_the_later_trajectory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, chunk_bytes=4096) as ckpt:
        for s in (1, 2, 3, 4, 5):
            ckpt.save(s, state(s)).result()
    with cryosnap.Checkpointer(run, chunk_bytes=4096) as ckpt:
        assert same(ckpt.restore(step=2), state(2))
        ckpt.save(3, state(3, 1)).result()
        # 4 and 5 are no longer versions: not listed, never restored, their steps free.
        assert ckpt.steps() == [1, 2, 3] and ckpt.latest_step() == 3
        with pytest.raises(CheckpointNotFoundError, match="step 5"):
            ckpt.restore(step=5)
        ckpt.save(4, state(4, 1)).result()
    assert engine.list_steps(LocalStore(run)) == [1, 2, 3, 4]
    with pytest.raises(CheckpointNotFoundError):
        cryosnap.load(run, step=5)
    assert same(cryosnap.load(run), state(4, 1))
    # Nothing of the abandoned trajectory is left: its data files were reclaimed.
    assert not list((run / "data").glob("000000000005-*"))
    assert not (run / "versions" / "000000000005").exists() or not os.listdir(
        run / "versions" / "000000000005"
    )


def test_a_restore_followed_by_no_save_changes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, state(s)).result()
    before = files(run)
    with cryosnap.Checkpointer(run) as ckpt:
        ckpt.restore(step=1)
    assert files(run) == before
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.steps() == [1, 2, 3]
        assert same(ckpt.restore(), state(3))


def test_restoring_the_newest_version_starts_no_new_lineage(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, state(s)).result()
        ckpt.restore(step=1)  # would rewind...
        ckpt.restore()  # ...but the program went back to the newest one
        ckpt.save(4, state(4)).result()
        assert ckpt.steps() == [1, 2, 3, 4]
    assert all(parse_commit_key(k) == (s, None) for s, k in _commit_keys(run))


def _commit_keys(run: Path) -> list[tuple[int, str]]:
    out = []
    for key in LocalStore(run).list("versions"):
        parsed = parse_commit_key(key)
        if parsed is not None:
            out.append((parsed[0], key))
    return out


def test_saving_a_step_at_or_below_the_fork_that_exists_is_still_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, state(s)).result()
        ckpt.restore(step=2)
        for s in (1, 2):
            with pytest.raises(cryosnap.CheckpointExistsError, match=f"step {s}"):
                ckpt.save(s, state(s, 1))
        ckpt.save(3, state(3, 1)).result()
        with pytest.raises(cryosnap.CheckpointExistsError, match="step 3"):
            ckpt.save(3, state(3, 2))


def test_rewinds_stack_across_generations_and_reopens(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, keep=3) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, state(s)).result()
        ckpt.restore(step=4)
        ckpt.save(5, state(5, 1)).result()
        ckpt.save(6, state(6, 1)).result()
    with cryosnap.Checkpointer(run, keep=3) as ckpt:
        assert ckpt.steps() == [4, 5, 6]
        assert same(ckpt.restore(), state(6, 1))
        ckpt.save(7, state(7, 1)).result()  # the reopened run goes on in generation 1
        ckpt.restore(step=5)
        ckpt.save(6, state(6, 2)).result()
        assert ckpt.steps() == [5, 6]  # 4 went with keep=3 at step 7; 7 is superseded
    assert same(cryosnap.load(run, step=5), state(5, 1))
    assert same(cryosnap.load(run), state(6, 2))
    lineages = {s: engine.read_commit(LocalStore(run), s).lineage for s in (5, 6)}
    assert lineages == {5: Lineage(1, 4), 6: Lineage(2, 5)}


def test_a_superseding_save_that_fails_to_commit_supersedes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, state(s)).result()

    def fail_commit(op: str, key: str) -> None:
        if op == "write" and parse_commit_key(key) is not None:
            raise StorageError(f"injected: {key}")

    store = FaultyStore(LocalStore(run), fault=fail_commit)
    with cryosnap.Checkpointer(store) as ckpt:
        ckpt.restore(step=1)
        with pytest.raises(StorageError, match="injected"):
            ckpt.save(2, state(2, 1)).result()
        assert ckpt.steps() == [1, 2, 3]
        ckpt.wait()  # the failure was received from result(): not raised again
    assert engine.list_steps(LocalStore(run)) == [1, 2, 3]
    assert same(cryosnap.load(run), state(3))
    # The next writer supersedes for real, in the generation the failed one would have used.
    with cryosnap.Checkpointer(run) as ckpt:
        ckpt.restore(step=1)
        ckpt.save(2, state(2, 1)).result()
        assert ckpt.steps() == [1, 2]
    assert engine.read_commit(LocalStore(run), 2).lineage == Lineage(1, 1)


def test_superseded_versions_never_come_back_through_scratch(tmp_path: Path) -> None:
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    opts: dict[str, Any] = {"scratch": scratch, "keep_scratch": 3, "chunk_bytes": 4096}
    with cryosnap.Checkpointer(run, **opts) as ckpt:
        for s in (1, 2, 3, 4):
            ckpt.save(s, state(s)).result()
    with cryosnap.Checkpointer(run, **opts) as ckpt:
        ckpt.restore(step=2)
        info = ckpt.save(3, state(3, 1)).result()
        assert info.tiers == ("scratch", "persistent")
        assert ckpt.steps() == [1, 2, 3]
    assert engine.list_steps(LocalStore(run)) == [1, 2, 3]
    assert engine.list_steps(LocalStore(scratch)) == [2, 3]  # keep_scratch=3 held 2-4
    for root in (run, scratch):
        assert same(cryosnap.load(root, step=3), state(3, 1))
    # The node's scratch is wiped: the persistent level alone knows the new trajectory.
    shutil.rmtree(scratch)
    with cryosnap.Checkpointer(run, **opts) as ckpt:
        assert ckpt.steps() == [1, 2, 3]
        assert same(ckpt.restore(), state(3, 1))


def test_across_tiers_a_rewind_not_yet_flushed_hides_what_persistent_holds(
    tmp_path: Path,
) -> None:
    """The superseding version is on scratch only (its flush fails): persistent still holds
    the abandoned versions, and the run's listing and restore must not pick them."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    opts: dict[str, Any] = {"keep_scratch": 5, "chunk_bytes": 4096}
    with cryosnap.Checkpointer(run, scratch=scratch, **opts) as ckpt:
        for s in (1, 2, 3, 4):
            ckpt.save(s, state(s)).result()

    def refuse_commits(op: str, key: str) -> None:
        if op == "write" and parse_commit_key(key) is not None:
            raise StorageError(f"injected: {key}")

    persistent = FaultyStore(LocalStore(run), fault=refuse_commits)
    with (
        warnings.catch_warnings(),
        cryosnap.Checkpointer(persistent, scratch=scratch, flush_retry_seconds=0, **opts) as ckpt,
    ):
        ckpt.restore(step=2)
        pending = ckpt.save(3, state(3, 1))
        pending.result(tier="scratch")
        with pytest.raises(StorageError):
            pending.result()
        assert engine.list_steps(LocalStore(run)) == [1, 2, 3, 4]  # persistent alone
        assert ckpt.steps() == [1, 2, 3]
        assert same(ckpt.restore(), state(3, 1))
        with pytest.raises(CheckpointNotFoundError):
            ckpt.restore(step=4)
    # Reopened with a working persistent tier: the version is flushed, and persistent
    # reclaims the versions it supersedes.
    with cryosnap.Checkpointer(run, scratch=scratch, **opts) as ckpt:
        ckpt.wait()
        assert ckpt.steps() == [1, 2, 3]
    assert engine.list_steps(LocalStore(run)) == [1, 2, 3]
    assert same(cryosnap.load(run), state(3, 1))


# -- a state machine against a model of the visible versions -----------------------------------


class SupersedeMachine(RuleBasedStateMachine):
    """Save / failing commit / damage / restore / restart, checked against a model: the
    versions the run lists, and the trajectory each one restores. A restarted program
    restores before it saves, as a resuming job does."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self._tmp = tempfile.TemporaryDirectory()
        self.run = Path(self._tmp.name) / "run"
        self.fail = False
        self.store = FaultyStore(LocalStore(self.run), fault=self._fault)
        self.ckpt = self._open()
        self.model: dict[int, int] = {}  # step -> trajectory
        self.damaged: set[int] = set()
        self.trajectory = 0
        self.next_step = 1
        self.must_restore = False

    def _open(self) -> cryosnap.Checkpointer:
        return cryosnap.Checkpointer(self.store, chunk_bytes=4096, keep=4)

    def _fault(self, op: str, key: str) -> None:
        if self.fail and op == "write" and parse_commit_key(key) is not None:
            raise StorageError(f"injected: {key}")

    def teardown(self) -> None:
        self.fail = False
        with contextlib.suppress(cryosnap.CheckpointError):
            self.ckpt.close()
        self._tmp.cleanup()

    @precondition(lambda self: not self.must_restore)
    @rule(commit_fails=st.booleans())
    def save(self, commit_fails: bool) -> None:
        step = self.next_step
        self.fail = commit_fails
        try:
            self.ckpt.save(step, state(step, self.trajectory)).result()
        except StorageError:
            assert commit_fails
            return
        finally:
            self.fail = False
        assert not commit_fails
        # Committed: every version after the fork is superseded; keep=4 keeps 3 more.
        older = sorted((s, t) for s, t in self.model.items() if s < step)
        self.model = {**dict(older[-3:]), step: self.trajectory}
        # The step saved again is a new version: the damage was the superseded one's.
        self.damaged = (self.damaged & set(self.model)) - {step}
        self.next_step = step + 1

    @precondition(lambda self: bool(self.model))
    @rule()
    def crash_with_damage(self) -> None:
        """The job dies and the newest version's data is damaged on the way."""
        self.ckpt.close()
        newest = max(self.model)
        own = sorted((self.run / "data").glob(f"{newest:012d}-*.dat"))
        if newest not in self.damaged and own and own[0].stat().st_size:
            flip_byte(own[0], 0)
            self.damaged.add(newest)
        self.ckpt = self._open()
        self.must_restore = True

    @rule()
    def restart(self) -> None:
        self.ckpt.close()
        self.ckpt = self._open()
        self.must_restore = bool(self.model)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        good = [s for s in self.model if s not in self.damaged]
        if not good:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                with pytest.raises(cryosnap.CheckpointError):
                    self.ckpt.restore()
            return
        if data.draw(st.booleans()):
            step = data.draw(st.sampled_from(good))
            got = self.ckpt.restore(step=step)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                got = self.ckpt.restore()
            step = max(good)
        assert same(got, state(step, self.model[step]))
        # The program goes on from there: on a new trajectory if it rewound.
        if any(s > step for s in self.model):
            self.trajectory += 1
        self.next_step = step + 1
        self.must_restore = False

    @invariant()
    def lists_the_model(self) -> None:
        assert self.ckpt.steps() == sorted(self.model)


SupersedeMachine.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=16,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_supersede_state_machine = SupersedeMachine.TestCase


def test_a_planted_or_damaged_superseding_record_never_gets_the_run_stuck(tmp_path: Path) -> None:
    """An attacker's (or bit rot's) file under a lineage key hides the versions above its
    fork; the restore falls back past it as damage, and the next save supersedes it."""
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, state(s)).result()
    (run / commit_key(2, Lineage(1, 1))).write_bytes(b"not a commit record")
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.steps() == [1, 2]  # 3 is above the planted fork; 2 is the planted one
        with pytest.warns(RuntimeWarning, match="step 2"):
            assert same(ckpt.restore(), state(1))
        ckpt.save(2, state(2, 1)).result()
        assert ckpt.steps() == [1, 2]
        assert same(ckpt.restore(), state(2, 1))
    assert engine.read_commit(LocalStore(run), 2).lineage == Lineage(2, 1)


def test_saving_an_older_step_without_a_restore_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run) as ckpt:
        ckpt.save(5, state(5)).result()
        with pytest.raises(cryosnap.StepOrderError, match=r"step 3 .*step 5") as info:
            ckpt.save(3, state(3))
        assert info.value.step == 3 and info.value.path == str(run)
        assert isinstance(info.value, ValueError)
        assert ckpt.steps() == [5]
        ckpt.save(6, state(6)).result()  # on in order
        ckpt.restore(step=5)  # a rewind: the next save may go back to any step above 5
        ckpt.save(6, state(6, 1)).result()
        with pytest.raises(cryosnap.StepOrderError, match=r"step 5 .*step 6"):
            ckpt.save(5, state(5, 1))
        assert ckpt.steps() == [5, 6]
    assert same(cryosnap.load(run), state(6, 1))
