"""cryosnap._format.keys: the keys of a run are safe, sort by step and invert."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cryosnap._format.keys import (
    commit_key,
    data_key,
    manifest_key,
    step_of_commit_key,
    version_prefix,
)
from cryosnap._format.limits import MAX_STEP
from cryosnap.storage import validate_key

from .documents import ranks, steps


@given(steps, ranks, st.text(alphabet="0123456789abcdef", min_size=1, max_size=8))
def test_keys_are_valid_and_commit_keys_invert(step: int, rank: int, token: str) -> None:
    for key in (commit_key(step), manifest_key(step, rank), data_key(step, rank, token)):
        assert validate_key(key) == key
    assert commit_key(step).startswith(version_prefix(step) + "/")
    assert manifest_key(step, rank).startswith(version_prefix(step) + "/")
    assert step_of_commit_key(commit_key(step)) == step
    assert step_of_commit_key(manifest_key(step, rank)) is None
    assert step_of_commit_key(data_key(step, rank, token)) is None


def test_keys_sort_by_step() -> None:
    steps = [0, 9, 10, 100, MAX_STEP]
    assert sorted(commit_key(s) for s in reversed(steps)) == [commit_key(s) for s in steps]


@pytest.mark.parametrize(
    "key",
    [
        "versions/12/COMMIT.json",
        "versions/00000000000a/COMMIT.json",
        "versions/000000000001/commit.json",
        "x/versions/000000000001/COMMIT.json",
        "versions/000000000001/COMMIT.json/x",
        "versions/+00000000001/COMMIT.json",
    ],
)
def test_step_of_commit_key_rejects_other_keys(key: str) -> None:
    assert step_of_commit_key(key) is None
