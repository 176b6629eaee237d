"""A version's first batch reaches the disk in steps (PartWriter.add): its first
``WriteLimits.first_bytes`` hashed and queued alone, so the data file's first write does not
wait for the whole batch's hashing, then the rest in groups of ``next_bytes``, each written
while the next is hashed; the part is the same, byte for byte, and the batch is released
once."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cryosnap import engine
from cryosnap._run.capture.staging import direct_batches
from cryosnap._state import flatten
from cryosnap.engine import WriteLimits
from cryosnap.engine.items import Batch
from cryosnap.engine.write import _appender
from cryosnap.storage import LocalStore
from cryosnap.storage._direct import BLOCK_BYTES

CHUNK = 4096
NEVER_SPLIT = WriteLimits(first_bytes=1 << 30)


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "a": rng.integers(0, 255, 5 * CHUNK + 17, np.uint8),
        "b": rng.integers(0, 255, 9 * CHUNK, np.uint8),
        "c": rng.integers(0, 255, 100, np.uint8),
    }


def _write(
    root: Path, batch_bytes: int, released: list[int], limits: WriteLimits | None = None
) -> Any:
    flat = flatten(_state())
    writer = engine.PartWriter(LocalStore(root), 1, flat, chunk_bytes=CHUNK, limits=limits)
    batches: list[Batch] = list(direct_batches(flat, batch_bytes=batch_bytes, chunk_bytes=CHUNK))
    for i, batch in enumerate(batches):
        writer.add(batch.pieces, functools.partial(released.append, i))
    return writer.finish(), len(batches)


@pytest.fixture
def appends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real = _appender.Appender.append

    def spy(self: Any, views: Any, release: Any, nbytes: int) -> None:
        seen.append(nbytes)
        real(self, views, release, nbytes)

    monkeypatch.setattr(_appender.Appender, "append", spy)
    return seen


def test_the_first_batch_is_queued_in_two_and_the_part_is_the_same(
    tmp_path: Path, appends: list[int]
) -> None:
    released: list[int] = []
    limits = WriteLimits(first_bytes=3 * CHUNK)
    split, batches = _write(tmp_path / "split", 1 << 20, released, limits)
    assert batches == 1  # one batch of the whole state
    (data,) = split.manifest.data_files
    assert appends[0] == 3 * CHUNK and len(appends) == 2
    assert sum(appends) == (tmp_path / "split" / data).stat().st_size
    assert released == [0]  # once, after both writes

    appends.clear()
    released.clear()
    whole, _ = _write(tmp_path / "whole", 1 << 20, released, NEVER_SPLIT)
    assert len(appends) == 1 and released == [0]
    assert split.manifest.blobs == whole.manifest.blobs
    assert split.root == whole.root
    files = split.manifest.data_files
    assert [(tmp_path / "split" / f).read_bytes() for f in files] == [
        (tmp_path / "whole" / f).read_bytes() for f in whole.manifest.data_files
    ]


def test_the_rest_of_the_first_batch_is_queued_in_groups(
    tmp_path: Path, appends: list[int]
) -> None:
    released: list[int] = []
    limits = WriteLimits(first_bytes=3 * CHUNK, next_bytes=4 * CHUNK)
    groups, batches = _write(tmp_path / "groups", 1 << 20, released, limits)
    assert batches == 1
    # 14 chunks and 117 bytes: 3 chunks, then groups of 4 (with the alignment padding before a
    # blob's first chunk), the last holding what is left.
    assert appends[0] == 3 * CHUNK and len(appends) == 4
    assert all(4 * CHUNK <= n < 4 * CHUNK + BLOCK_BYTES for n in appends[1:3])
    assert released == [0]  # once, after every group's write
    appends.clear()
    released.clear()
    whole, _ = _write(tmp_path / "whole", 1 << 20, released, NEVER_SPLIT)
    assert len(appends) == 1
    assert groups.manifest.blobs == whole.manifest.blobs and groups.root == whole.root
    assert [(tmp_path / "groups" / f).read_bytes() for f in groups.manifest.data_files] == [
        (tmp_path / "whole" / f).read_bytes() for f in whole.manifest.data_files
    ]


def test_only_the_first_batch_is_split(tmp_path: Path, appends: list[int]) -> None:
    released: list[int] = []
    part, batches = _write(tmp_path, 4 * CHUNK, released, WriteLimits(first_bytes=2 * CHUNK))
    assert batches >= 3
    assert len(appends) == batches + 1  # the first in two, the others whole
    assert sorted(released) == list(range(batches))
    (data,) = part.manifest.data_files
    assert sum(appends) == (tmp_path / data).stat().st_size


def test_a_failure_in_the_rest_of_the_first_batch_releases_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flat = flatten(_state())
    limits = WriteLimits(first_bytes=3 * CHUNK)
    writer = engine.PartWriter(LocalStore(tmp_path), 1, flat, chunk_bytes=CHUNK, limits=limits)
    real = writer._diff
    calls = []

    def failing(pieces: Any) -> Any:
        calls.append(len(pieces))
        if len(calls) == 2:
            raise MemoryError("hashing the rest")
        return real(pieces)

    monkeypatch.setattr(writer, "_diff", failing)
    released: list[int] = []
    (batch,) = direct_batches(flat, batch_bytes=1 << 20, chunk_bytes=CHUNK)
    with pytest.raises(MemoryError, match="hashing the rest"):
        writer.add(batch.pieces, lambda: released.append(1))
    writer.abort()
    assert released == [1]
    assert not list(tmp_path.rglob("*.dat"))  # nothing committed
