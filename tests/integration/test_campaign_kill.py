"""Kill campaign (issue #10): SIGKILL a saving process at random instants and at every storage
operation of a save, then check that the run holds up.

A child process runs a Checkpointer (keep=2, keep_scratch=1, incremental, 4 KiB chunks, with and
without a scratch tier) and prints each step whose ``result()`` returned. The parent kills it at
a seeded random instant, or the child kills itself from a FaultyStore fault at the n-th
occurrence of one operation. After each kill the parent reopens the run (recovering the dead
writer's lock), checks that every version it can see loads bit-exact and that every reported
step is there unless retention legitimately dropped it, saves one more version, closes, and
counts the garbage left: bytes in files that no committed version references.

``make test`` runs ``test_kill_campaign_fast`` (a kill at each kind of phase, and random kills);
``make test-deep`` the full campaign, whose number of kills ``CRYOSNAP_CAMPAIGN_KILLS`` (default
100) sets; the counts are printed (``-s``) and written to ``campaign_kill.json`` under the
test's tmp_path.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from .campaign_support import (
    KillAt,
    check_versions,
    garbage,
    open_checkpointer,
    run_child,
    state_at,
    visible_steps,
)

KILLS = int(os.environ.get("CRYOSNAP_CAMPAIGN_KILLS", "100"))
SEED = int(os.environ.get("CRYOSNAP_CAMPAIGN_SEED", "20240610"))
CHILD_STEPS = 8  # versions a child saves before it closes (when no kill came)
RANDOM_STEPS = 2000  # a child killed at a random instant is still saving then
RANDOM_WINDOW = 1.0  # seconds after the child opened the run

# Every storage operation of a save: data file, manifest, commit record, retention (list and
# deletes of commit records, manifests, data files), crash-garbage removal.
_SAVE_OPS = [
    ("open_writer", "data"),
    ("writer.write", "data"),
    ("writer.commit", "data"),
    ("write", "manifest"),
    ("write", "commit"),
    ("list", "any"),
    ("delete", "commit"),
    ("delete", "manifest"),
    ("delete", "data"),
]
# With a scratch tier: the save's operations on scratch, the flush's on persistent (copies of
# data files, manifests, the commit record; persistent retention) and its reads of scratch.
_SCRATCH_PHASES = [("scratch", op, pat) for op, pat in _SAVE_OPS] + [
    ("scratch", "read_into", "data"),
    ("persistent", "open_writer", "data"),
    ("persistent", "writer.write", "data"),
    ("persistent", "writer.commit", "data"),
    ("persistent", "write", "manifest"),
    ("persistent", "write", "commit"),
    ("persistent", "delete", "commit"),
    ("persistent", "delete", "data"),
]
_PLAIN_PHASES = [("persistent", op, pat) for op, pat in _SAVE_OPS]
# Reached only once the library calls them (remove_incomplete: crash-garbage reclaim).
_OPTIONAL = {("remove_incomplete", "any")}
if hasattr(FaultyStore, "remove_incomplete"):
    _PLAIN_PHASES.append(("persistent", "remove_incomplete", "any"))
    _SCRATCH_PHASES.append(("scratch", "remove_incomplete", "any"))


@dataclass
class Campaign:
    """One run directory killed over and over; the counts of what was checked."""

    root: Path
    scratch: bool
    wrap: bool
    name: str
    known: set[int] = field(default_factory=set)  # reported durable (child) or saved (parent)
    kills: int = 0
    survived_without_kill: list[str] = field(default_factory=list)
    verified: int = 0
    garbage_after: list[int] = field(default_factory=list)
    garbage_files_after: list[int] = field(default_factory=list)
    garbage_files: dict[str, int] = field(default_factory=dict)

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def scratch_dir(self) -> Path | None:
        return self.root / "scratch" if self.scratch else None

    def cfg(self, kill: KillAt | None, steps: int) -> dict[str, Any]:
        return {
            "run": str(self.run),
            "scratch": self.scratch_dir and str(self.scratch_dir),
            "wrap": self.wrap,
            "kill": kill and vars(kill),
            "steps": steps,
        }

    def round(self, label: str, kill: KillAt | None, delay: float | None) -> None:
        where = f"{self.name} seed={SEED} round {label}"
        try:
            result = run_child(
                self.cfg(kill, CHILD_STEPS if delay is None else RANDOM_STEPS), delay
            )
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        if not result.killed:
            self.survived_without_kill.append(label)
        self.kills += result.killed
        self.known.update(result.reported)
        self.after_kill(where, result.output)

    def after_kill(self, where: str, output: str) -> None:
        context = f"{where}\nchild output:\n{output[-3000:]}"
        try:
            steps = check_versions(self.run, self.known, keep=2, where=where)
            self.verified += len(steps)
            if self.scratch_dir is not None:
                self.verified += len(check_versions(self.scratch_dir, set(), None, where))
            # Reopen: the dead writer's lock is recovered; save one more version.
            with open_checkpointer(self.run, self.scratch_dir, self.wrap) as ckpt:
                # Opening resumes the flush of versions left on scratch, and persistent
                # retention may then retire an older one: compare once that is over.
                ckpt.wait()
                on_disk = set(visible_steps(self.run))
                if self.scratch_dir is not None:
                    on_disk |= set(visible_steps(self.scratch_dir))
                seen = sorted(on_disk)
                assert ckpt.steps() == seen, f"{where}: steps() {ckpt.steps()} != {seen}"
                assert not steps or max(steps) in seen, f"{where}: newest {max(steps)} gone"
                step = (ckpt.latest_step() or 0) + 1 if seen else 0
                ckpt.save(step, state_at(step)).result()
            self.known.add(step)
            check_versions(self.run, self.known, keep=2, where=where + " (after one more)")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{context}") from None
        except Exception as exc:
            raise AssertionError(f"{where}: {type(exc).__name__}: {exc}\n{context}") from exc
        left = garbage(self.run)
        if self.scratch_dir is not None:
            left.update({f"scratch/{k}": v for k, v in garbage(self.scratch_dir).items()})
        self.garbage_after.append(sum(left.values()))
        self.garbage_files_after.append(len(left))
        self.garbage_files = left

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": SEED,
            "kills": self.kills,
            "rounds_without_kill": self.survived_without_kill,
            "versions_verified": self.verified,
            "garbage_bytes_after_each_round": self.garbage_after,
            "garbage_files_after_each_round": self.garbage_files_after,
            "garbage_bytes_final": self.garbage_after[-1] if self.garbage_after else 0,
            "garbage_files_final": self.garbage_files,
        }


def _phase_rounds(c: Campaign, phases: list[tuple[str, str, str]], nths: list[int]) -> None:
    for role, op, pattern in phases:
        for nth in nths:
            kill = KillAt(role, op, pattern, nth)
            c.round(kill.label(), kill, None)


def _random_rounds(c: Campaign, n: int, rng: random.Random) -> None:
    for i in range(n):
        delay = rng.uniform(0.0, RANDOM_WINDOW)
        c.round(f"random#{i} delay={delay:.3f}s", None, delay)


def _report(tmp_path: Path, campaigns: list[Campaign]) -> dict[str, Any]:
    doc = {
        "seed": SEED,
        "kills": sum(c.kills for c in campaigns),
        "versions_verified": sum(c.verified for c in campaigns),
        "garbage_bytes_final": sum(c.summary()["garbage_bytes_final"] for c in campaigns),
        "garbage_files_final": sum(len(c.garbage_files) for c in campaigns),
        "campaigns": [c.summary() for c in campaigns],
    }
    out = tmp_path / "campaign_kill.json"
    out.write_text(json.dumps(doc, indent=1))
    head = {k: v for k, v in doc.items() if k != "campaigns"}
    lines = [json.dumps(c) for c in doc["campaigns"]]
    print(f"\nkill campaign ({out}): {json.dumps(head)}\n" + "\n".join(lines))
    return doc


def _check_phases_reached(campaigns: list[Campaign]) -> None:
    # A phase that never came means the campaign does not test what it claims.
    missed = [
        f"{c.name}: {label}"
        for c in campaigns
        for label in c.survived_without_kill
        if tuple(label.split(":")[1:3]) not in _OPTIONAL
    ]
    assert not missed, f"rounds that ended without a kill: {missed}"


def _check_garbage(doc: dict[str, Any]) -> None:
    left, files = doc["garbage_bytes_final"], doc["garbage_files_final"]
    where = [c["garbage_files_final"] for c in doc["campaigns"]]
    if files and not hasattr(LocalStore, "remove_incomplete"):
        pytest.xfail(f"crash garbage not reclaimed yet: {files} files, {left} bytes: {where}")
    assert files == 0, f"garbage after the next committed version: {left} bytes in {where}"


def _campaigns(tmp_path: Path) -> dict[str, Campaign]:
    return {
        "plain": Campaign(tmp_path / "plain", scratch=False, wrap=False, name="plain"),
        "scratch": Campaign(tmp_path / "scratch", scratch=True, wrap=False, name="scratch"),
        "plain-phases": Campaign(tmp_path / "pp", scratch=False, wrap=True, name="plain-phases"),
        "scratch-phases": Campaign(tmp_path / "sp", scratch=True, wrap=True, name="scratch-phases"),
    }


@pytest.mark.timeout(240)
def test_kill_campaign_fast(tmp_path: Path) -> None:
    """A few kills of each kind: at the first data write, manifest, commit and retention
    delete, and at random instants, with and without scratch."""
    rng = random.Random(SEED)
    cs = _campaigns(tmp_path)
    fast = [("persistent", "writer.write", "data"), ("persistent", "write", "commit")]
    fast += [("persistent", "delete", "data")]
    _phase_rounds(cs["plain-phases"], fast, [1])
    _phase_rounds(cs["scratch-phases"], [("persistent", "write", "commit")], [1])
    _random_rounds(cs["plain"], 3, rng)
    _random_rounds(cs["scratch"], 2, rng)
    doc = _report(tmp_path, list(cs.values()))
    _check_phases_reached(list(cs.values()))
    assert doc["kills"] >= 7, doc  # 4 phase kills, and random ones that came before the end
    _check_garbage(doc)


@pytest.mark.slow
@pytest.mark.deep
@pytest.mark.timeout(1800)
def test_kill_campaign(tmp_path: Path) -> None:
    """``CRYOSNAP_CAMPAIGN_KILLS`` kills: about two thirds at every phase of a save (the n-th
    occurrence of each operation, with and without scratch), the rest at random instants."""
    rng = random.Random(SEED)
    cs = _campaigns(tmp_path)
    n_phases = len(_PLAIN_PHASES) + len(_SCRATCH_PHASES)
    nths = list(range(1, max(1, (KILLS * 2 // 3) // n_phases) + 1))
    _phase_rounds(cs["plain-phases"], _PLAIN_PHASES, nths)
    _phase_rounds(cs["scratch-phases"], _SCRATCH_PHASES, nths)
    left = max(KILLS - n_phases * len(nths), 4)
    _random_rounds(cs["plain"], left - left // 2, rng)
    _random_rounds(cs["scratch"], left // 2, rng)
    doc = _report(tmp_path, list(cs.values()))
    _check_phases_reached(list(cs.values()))
    _check_garbage(doc)
