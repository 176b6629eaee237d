"""PendingSave alone: a result, a timeout and a failure, each delivered as the caller asks."""

from __future__ import annotations

import time

import pytest

from cryosnap._run.results import CaptureTracker, PendingSave, SaveInfo
from cryosnap.errors import CheckpointError, CheckpointTimeoutError

LEVELS = ("scratch", "persistent")


def _pending(levels: tuple[str, ...] = LEVELS) -> PendingSave:
    tracker = CaptureTracker(0)
    tracker.finish()
    return PendingSave(1, tracker, time.perf_counter(), levels, LEVELS)


def _info(*tiers: str) -> SaveInfo:
    return SaveInfo(1, 10, 10, 1, 1, 0.0, 0.1, False, tiers)


def test_the_result_comes_once_the_last_level_is_reached() -> None:
    p = _pending()
    with pytest.raises(CheckpointTimeoutError):
        p.result(0.01)
    p.reached("scratch", _info("scratch"))
    assert p.result(0.01, tier="scratch").tiers == ("scratch",)
    assert not p.done()
    p.reached("persistent", _info("scratch", "persistent"))
    assert p.done() and p.result(0.01).tiers == ("scratch", "persistent")
    assert p.undelivered_error() is None


def test_a_failure_is_raised_by_result_every_time_and_handed_on_once() -> None:
    p = _pending()
    error = CheckpointError("boom")
    p.fail(error)
    assert p.failed() and p.failed_undelivered()
    assert p.undelivered_error() is error
    assert p.undelivered_error() is None
    for _ in range(2):
        with pytest.raises(CheckpointError, match="boom"):
            p.result(0.01)


def test_a_failure_the_caller_received_is_not_handed_on() -> None:
    p = _pending()
    p.fail(CheckpointError("boom"))
    with pytest.raises(CheckpointError):
        p.result(0.01)
    assert p.undelivered_error() is None


def test_a_version_kept_below_the_last_level_refuses_that_tier() -> None:
    p = _pending(("scratch",))
    with pytest.raises(ValueError, match="does not go to that tier"):
        p.result(0.01, tier="persistent")
    with pytest.raises(ValueError, match="is invalid"):
        p.result(0.01, tier="tape")
    p.reached("scratch", _info("scratch"))
    assert p.done() and p.result(0.01).tiers == ("scratch",)
