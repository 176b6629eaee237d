"""The read and write limits (engine/_limits.py): frozen values checked when made, the defaults
the constants they replace had, a block that sets them for the reads (or part writers) started
in it and ends with it, and the rule that a read takes its value once, at its entry, in the
context of the thread that starts it: its pool threads get the value, not the context."""

from __future__ import annotations

import contextvars
import dataclasses
import os
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_type_hints

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._state import flatten
from cryosnap.engine import ReadLimits, WriteLimits
from cryosnap.engine._limits import ReadChanges, WriteChanges
from cryosnap.engine.fetch import ReadPlan, _execute
from cryosnap.storage import LocalStore, open_store

CHUNK = 4096
STATE = {"w": np.arange(64 << 10, dtype=np.float32)}  # 256 KiB: 64 chunks
SMALL = {"io_batch_bytes": 16 << 10, "bounce_bytes": 8 << 10, "read_threads": 3}


def test_the_defaults_are_the_former_constants() -> None:
    limits = ReadLimits()
    assert dataclasses.asdict(limits) == {
        "io_batch_bytes": 64 << 20,
        "bounce_bytes": 8 << 20,
        "gap_bytes": 64 << 10,
        "fragmented_runs": 256,
        "read_threads": max(2, min(8, os.cpu_count() or 2)),
        "populate_min_bytes": 1 << 20,
        "direct_min_bytes": 256 << 10,
        "cold_share": 0.5,
        "staging_share": 0.5,
        "map_cold_into": True,
    }
    assert limits.cold_threads == max(4, limits.read_threads)
    assert limits.io_batch_bytes == engine.IO_BATCH_BYTES  # the capture's batch too
    assert dataclasses.asdict(WriteLimits()) == {
        "first_bytes": 8 << 20,
        "next_bytes": 32 << 20,
        "place_bytes": 4 << 20,
    }
    assert ReadLimits.current() == limits and WriteLimits.current() == WriteLimits()


def test_what_a_block_may_change_is_every_field() -> None:
    assert get_type_hints(ReadChanges) == get_type_hints(ReadLimits)
    assert get_type_hints(WriteChanges) == get_type_hints(WriteLimits)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"io_batch_bytes": 0}, ValueError, "io_batch_bytes=0 is invalid: allowed is a positive"),
        ({"read_threads": 2.0}, TypeError, "read_threads must be a positive int"),
        ({"gap_bytes": -1}, ValueError, "gap_bytes=-1 is invalid: allowed is an int >= 0"),
        ({"cold_share": 1.5}, ValueError, "cold_share=1.5 is invalid: allowed is a number from"),
        ({"staging_share": "half"}, TypeError, "staging_share must be a number from 0 to 1"),
        ({"map_cold_into": 1}, TypeError, "map_cold_into must be a bool"),
    ],
)
def test_bad_read_limits_name_the_field(
    changes: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ReadLimits(**changes)
    with pytest.raises(error, match=match), engine.read_limits(**changes):
        pass
    assert ReadLimits.current() == ReadLimits()
    with pytest.raises(ValueError, match="next_bytes=0 is invalid"):
        WriteLimits(next_bytes=0)


def test_blocks_nest_and_end_with_their_block_even_on_failure() -> None:
    with engine.read_limits(io_batch_bytes=1 << 20) as outer:
        assert ReadLimits.current() is outer
        with engine.read_limits(bounce_bytes=1 << 16) as inner:
            assert inner == ReadLimits(io_batch_bytes=1 << 20, bounce_bytes=1 << 16)
            assert ReadLimits.current() is inner
        assert ReadLimits.current() is outer
        with pytest.raises(RuntimeError), engine.read_limits(gap_bytes=0):
            raise RuntimeError("in the block")
        assert ReadLimits.current() is outer
        with engine.write_limits(first_bytes=CHUNK) as written:
            assert WriteLimits.current() is written == WriteLimits(first_bytes=CHUNK)
        assert WriteLimits.current() == WriteLimits()
    assert ReadLimits.current() == ReadLimits()


class _Seen:
    """What each read cut: its plan, the limits it was planned with, the pool's threads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plans: list[tuple[ReadPlan, ReadLimits]] = []
        self.threads: list[int] = []
        plan_reads, run = _execute.plan_reads, _execute._run

        def planned(*args: Any, **kwargs: Any) -> ReadPlan:
            plan = plan_reads(*args, **kwargs)
            self.plans.append((plan, kwargs["limits"]))
            return plan

        def pooled(work: Sequence[Callable[[], object]], threads: int) -> None:
            self.threads.append(threads)
            run(work, threads)

        monkeypatch.setattr(_execute, "plan_reads", planned)
        monkeypatch.setattr(_execute, "_run", pooled)

    def last(self) -> tuple[int, int, ReadLimits]:
        """The last read's pieces and tasks (first pass), and its limits."""
        plan, limits = self.plans[-1]
        return len(plan.pieces.blob), len(plan.first.task_starts), limits


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> _Seen:
    return _Seen(monkeypatch)


@pytest.fixture
def location() -> str:
    """A store without mapped or cold files: every piece is read in tasks."""
    loc = f"memory://{uuid.uuid4()}"
    cryosnap.save(loc, STATE, step=1, chunk_bytes=CHUNK)
    return loc


def _load(location: str) -> None:
    assert np.array_equal(cryosnap.load(location, step=1)["w"], STATE["w"])


def test_a_block_cuts_the_plan_and_the_pool_of_the_reads_in_it(seen: _Seen, location: str) -> None:
    _load(location)
    assert seen.last() == (1, 1, ReadLimits())  # one piece, one task
    with engine.read_limits(**SMALL) as small:
        _load(location)
    assert seen.last() == (32, 16, small)  # pieces of 8 KiB, tasks of 16 KiB
    assert seen.threads[-1] == 3
    _load(location)  # the block ended: the defaults again
    assert seen.last() == (1, 1, ReadLimits())
    assert seen.threads[-1] == ReadLimits().read_threads


def test_limits_passed_to_a_read_win_over_the_block(seen: _Seen, location: str) -> None:
    store = open_store(location)
    given = ReadLimits(io_batch_bytes=64 << 10, bounce_bytes=16 << 10)
    with engine.read_limits(**SMALL) as small:
        engine.read_part(store, 1, limits=given)
        assert seen.last() == (16, 4, given)
        engine.verify_part(store, 1)
        assert seen.last() == (32, 16, small)


def test_a_read_takes_the_limits_of_the_context_it_starts_in(seen: _Seen, location: str) -> None:
    """A thread started in the block reads with its own context's limits: an empty context's
    are the defaults, a copy of the block's are the block's. A plain thread starts with an
    empty context on CPython (a copy where threads inherit the context:
    ``sys.flags.thread_inherit_context``, the free-threaded builds' default)."""
    found: dict[str, ReadLimits] = {}

    def read(name: str) -> None:
        _load(location)
        found[name] = seen.last()[2]

    with engine.read_limits(**SMALL) as small:
        threads = [
            threading.Thread(target=contextvars.Context().run, args=(read, "empty")),
            threading.Thread(target=contextvars.copy_context().run, args=(read, "copied")),
            threading.Thread(target=read, args=("plain",)),
        ]
        for t in threads:
            t.start()
            t.join()
    inherits = bool(getattr(sys.flags, "thread_inherit_context", False))
    assert found == {
        "empty": ReadLimits(),
        "copied": small,
        "plain": small if inherits else ReadLimits(),
    }


def test_a_part_writer_takes_the_limits_of_the_block_it_is_made_in(tmp_path: Path) -> None:
    flat = flatten(STATE)
    with engine.write_limits(first_bytes=3 * CHUNK) as limits:
        inside = engine.PartWriter(LocalStore(tmp_path), 1, flat, chunk_bytes=CHUNK)
        given = engine.PartWriter(
            LocalStore(tmp_path), 2, flat, chunk_bytes=CHUNK, limits=WriteLimits()
        )
    after = engine.PartWriter(LocalStore(tmp_path), 3, flat, chunk_bytes=CHUNK)
    assert inside.limits is limits and given.limits == after.limits == WriteLimits()
    for writer in (inside, given, after):
        writer.abort()
