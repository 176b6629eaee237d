"""A state machine over an ancestor run and its forks: save, fork, remove, gc, delete a fork,
and a fork whose creation dies midway (its residue left as a crash leaves it). After every
step each version of each run loads bit for bit (nothing referenced was deleted); at the end,
with every fork deleted, the ancestor's collection leaves exactly what its version reads
(everything unreferenced eventually goes)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import cryosnap
from cryosnap import engine
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

CHUNK = 16 << 10
N = 48 << 10  # float32 elements: 12 chunks


class Crash(Exception):
    """Raised by the store at the chosen write, and at every delete after: the fork's
    creation stops there and takes nothing back, as a killed process would."""


class Forks(RuleBasedStateMachine):
    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="cryosnap-forks-"))
        self.versions: dict[Path, dict[int, np.ndarray]] = {}
        self.unfinished: set[Path] = set()
        self.made = 0

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    @initialize(target=runs)
    def ancestor(self) -> Path:
        path = self._new()
        self._save(path, 1, np.arange(N, dtype=np.float32))
        return path

    def _new(self) -> Path:
        self.made += 1
        return self.root / f"run{self.made}"

    def _save(self, path: Path, step: int, value: np.ndarray) -> None:
        with cryosnap.Checkpointer(path, chunk_bytes=CHUNK) as ckpt:
            ckpt.save(step, {"w": value}).result()
        self.versions.setdefault(path, {})[step] = value.copy()

    @precondition(lambda self: bool(self.versions))
    @rule(run=runs, lo=st.integers(0, N - 1), size=st.integers(1, 3 * CHUNK // 4))
    def save(self, run: Path, lo: int, size: int) -> None:
        if run not in self.versions or not self.versions[run]:
            return
        last = max(self.versions[run])
        value = self.versions[run][last].copy()
        value[lo : lo + size] += 1.0
        self._save(run, last + 1, value)

    @precondition(lambda self: bool(self.versions))
    @rule(target=runs, run=runs, pick=st.integers(0, 100))
    def fork(self, run: Path, pick: int) -> Path:
        dest = self._new()
        steps = sorted(self.versions.get(run, {}))
        if not steps:
            return dest  # a run deleted since: a name that never becomes one
        step = steps[pick % len(steps)]
        cryosnap.Run(run).fork(step, dest)
        self.versions[dest] = {step: self.versions[run][step]}
        return dest

    @precondition(lambda self: bool(self.versions))
    @rule(target=runs, run=runs, pick=st.integers(0, 100), at=st.integers(1, 4))
    def crashed_fork(self, run: Path, pick: int, at: int) -> Path:
        dest = self._new()
        steps = sorted(self.versions.get(run, {}))
        if not steps:
            return dest
        writes = [0]

        def fault(op: str, key: str) -> None:
            if op == "delete" and writes[0] >= at:
                raise Crash(key)
            if op == "write":
                writes[0] += 1
                if writes[0] == at:
                    raise Crash(key)

        source = cryosnap.Run(FaultyStore(LocalStore(run), fault=fault))
        try:
            source.fork(steps[pick % len(steps)], FaultyStore(LocalStore(dest), fault=fault))
        except Crash:
            self.unfinished.add(dest)
            return dest
        step = steps[pick % len(steps)]
        self.versions[dest] = {step: self.versions[run][step]}
        return dest

    @precondition(lambda self: bool(self.versions))
    @rule(run=runs, pick=st.integers(0, 100))
    def remove(self, run: Path, pick: int) -> None:
        steps = sorted(self.versions.get(run, {}))
        if len(steps) < 2:
            return
        step = steps[pick % len(steps)]
        cryosnap.Run(run).remove(step)
        del self.versions[run][step]

    @precondition(lambda self: bool(self.versions))
    @rule(run=runs, keep=st.integers(1, 3))
    def gc(self, run: Path, keep: int) -> None:
        if run not in self.versions:
            return
        cryosnap.Run(run).gc(keep=keep)
        for step in sorted(self.versions[run])[:-keep]:
            del self.versions[run][step]

    @rule(run=runs)
    def delete(self, run: Path) -> None:
        if run == self.root / "run1":
            return  # the ancestor stays (its forks are what is deleted)
        shutil.rmtree(run, ignore_errors=True)
        self.versions.pop(run, None)
        self.unfinished.discard(run)

    @invariant()
    def every_version_loads_bit_for_bit(self) -> None:
        for path, versions in self.versions.items():
            assert cryosnap.Run(path).steps() == sorted(versions)
            for step, value in versions.items():
                got = cryosnap.load(path, step=step)["w"]
                assert got.tobytes() == value.tobytes(), (path, step)

    def check_nothing_leaks(self) -> None:
        ancestor = self.root / "run1"
        if ancestor not in self.versions:
            return
        for path in list(self.versions) + list(self.unfinished):
            if path != ancestor:
                shutil.rmtree(path, ignore_errors=True)
        cryosnap.Run(ancestor).gc(keep=1)
        newest = max(self.versions[ancestor])
        needed = set(engine.read_commit(LocalStore(ancestor), newest).data_files)
        assert {f"data/{p.name}" for p in (ancestor / "data").iterdir()} == needed
        assert not (ancestor / "forks").exists() or not list((ancestor / "forks").iterdir())


class _Checked(Forks):
    def teardown(self) -> None:
        try:
            self.check_nothing_leaks()
        finally:
            super().teardown()


TestForks = _Checked.TestCase
TestForks.settings = settings(
    max_examples=20,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
