"""A Hypothesis state machine over a run with scratch and persistent levels: save, a save while
the persistent level is down, flush (it comes back), retire (retention), crash (every storage
call fails, the Checkpointer is abandoned without close, the run reopened) and restore, against
a model of which versions each level lists. Rewinds are test_supersede.py's."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cryosnap
from cryosnap.errors import CheckpointError, StorageError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from .rooms import CHUNK, state

KEEP, KEEP_SCRATCH = 3, 2


class _Switch:
    """A fault: ``down`` fails every write; ``dead`` fails every call."""

    def __init__(self) -> None:
        self.down = False
        self.dead = False

    def __call__(self, op: str, key: str) -> None:
        if self.dead or (self.down and op in ("write", "open_writer")):
            raise StorageError(f"{op} {key}: injected")


def _last(steps: set[int], n: int) -> set[int]:
    return set(sorted(steps)[-n:])


class RunMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="cryosnap-stateful-"))
        self.scratch: set[int] = set()
        self.persistent: set[int] = set()
        self.unflushed: set[int] = set()
        self.next_step = 0
        self.ckpt = self._open()

    def _open(self) -> cryosnap.Checkpointer:
        self.faults = (_Switch(), _Switch())
        return cryosnap.Checkpointer(
            FaultyStore(LocalStore(self.root / "persistent"), fault=self.faults[1]),
            scratch=FaultyStore(LocalStore(self.root / "scratch"), fault=self.faults[0]),
            keep=KEEP,
            keep_scratch=KEEP_SCRATCH,
            chunk_bytes=CHUNK,
            flush_retry_seconds=60.0,
        )

    def _committed_on_scratch(self, step: int) -> None:
        # Scratch retention at each commit: its newest versions and what is not persistent.
        self.scratch = _last(self.scratch | {step}, KEEP_SCRATCH) | self.unflushed

    def _flushed(self, step: int) -> None:
        self.unflushed.discard(step)
        self.persistent = _last(self.persistent | {step}, KEEP)

    @rule()
    def save(self) -> None:
        self.flush()  # the persistent level is up: what waited for it goes first
        step = self.next_step
        self.next_step += 1
        info = self.ckpt.save(step, state(step)).result(60)
        assert info.tiers == ("scratch", "persistent")
        self._committed_on_scratch(step)
        self._flushed(step)

    @precondition(lambda self: len(self.unflushed) < 2)
    @rule()
    def save_while_persistent_is_down(self) -> None:
        self.faults[1].down = True
        step = self.next_step
        self.next_step += 1
        self.unflushed.add(step)
        self.ckpt.save(step, state(step)).result(60, tier="scratch")
        self._committed_on_scratch(step)

    @rule()
    def flush(self) -> None:
        self.faults[1].down = False
        self.ckpt.wait()
        for step in sorted(self.unflushed):
            self._flushed(step)

    @precondition(lambda self: not self.unflushed)
    @rule()
    def retire_on_close(self) -> None:
        """A clean close applies scratch retention to what reached persistent; reopen."""
        self.ckpt.close()
        self.scratch = _last(self.scratch, KEEP_SCRATCH)
        self.ckpt = self._open()

    @rule(in_flight=st.booleans())
    def crash(self, in_flight: bool) -> None:
        """Every storage call fails from now on (a save in flight too); the Checkpointer is
        abandoned as a killed process leaves it, then the run is opened again: versions left
        unflushed are handed off then."""
        for fault in self.faults:
            fault.dead = True
        if in_flight:
            step = self.next_step
            self.next_step += 1
            try:
                self.ckpt.save(step, state(step)).result(60)
            except CheckpointError:
                pass
            else:
                raise AssertionError("a save to dead storage succeeded")
        _abandon(self.ckpt)
        self.ckpt = self._open()
        self.ckpt.wait()
        for step in sorted(self.unflushed):
            self._flushed(step)

    @precondition(lambda self: bool(self.scratch | self.persistent))
    @rule()
    def restore(self) -> None:
        got = self.ckpt.restore()
        newest = max(self.scratch | self.persistent)
        assert self.ckpt.restored_step == newest
        assert np.array_equal(got["big"], state(newest)["big"])

    @precondition(lambda self: bool(self.persistent))
    @rule(data=st.data())
    def load_from_persistent(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.persistent)))
        got = cryosnap.load(self.root / "persistent", step=step)
        assert np.array_equal(got["step"], state(step)["step"])

    @invariant()
    def levels_list_the_model(self) -> None:
        if not self.faults[1].down:
            self.ckpt.wait()
        steps = self.ckpt.status().steps
        assert set(steps["scratch"]) == self.scratch, (steps, self.scratch)
        assert set(steps["persistent"]) == self.persistent, (steps, self.persistent)
        assert set(self.ckpt.steps()) == self.scratch | self.persistent

    def teardown(self) -> None:
        for fault in self.faults:
            fault.down = fault.dead = False
        with contextlib.suppress(CheckpointError):
            self.ckpt.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _abandon(ckpt: cryosnap.Checkpointer) -> None:
    """What a killed process leaves: its threads stop with nothing more reaching storage
    (every call fails), and the kernel drops its locks. Nothing of close() runs."""
    levels = ckpt._levels
    levels.abandon()
    ckpt._writer.stop()
    levels.close_handoffs()
    levels.release_locks()


_FULL = settings(max_examples=40, stateful_step_count=20, deadline=None)


@pytest.mark.slow
class TestRun(RunMachine.TestCase):
    """make test's slice: 10 of the 40 runs of 20 steps (the same rules)."""

    settings = settings(_FULL, max_examples=10)


@pytest.mark.deep
class TestRunFull(RunMachine.TestCase):
    """make test-deep: all 40 runs."""

    settings = _FULL
