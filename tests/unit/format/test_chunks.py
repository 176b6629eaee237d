"""cryosnap._format.chunks: chunk spans, chunk hashes and Merkle roots (pure functions)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import xxhash
from hypothesis import assume, given
from hypothesis import strategies as st

from cryosnap._format.chunks import (
    HASH_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    chunk_count,
    chunk_spans,
    hash_bytes,
    hash_chunks,
    hash_chunks_released,
    hash_each_released,
    merkle_levels,
    merkle_root,
    validate_chunk_bytes,
    value_runs,
)

# Small chunk sizes keep the properties fast; the functions take any positive size.
_chunk_bytes = st.sampled_from([1, 3, 16, 100, MIN_CHUNK_BYTES])
_hashes = st.lists(st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES), min_size=1, max_size=40)


@given(st.integers(0, 10**6), st.integers(1, 10**5))
def test_spans_tile_the_blob(nbytes: int, chunk_bytes: int) -> None:
    spans = chunk_spans(nbytes, chunk_bytes)
    assert len(spans) == chunk_count(nbytes, chunk_bytes)
    assert [s for s, _ in spans] == list(range(0, nbytes, chunk_bytes))
    assert all(0 < e - s <= chunk_bytes for s, e in spans)
    assert all(e - s == chunk_bytes for s, e in spans[:-1])
    assert (spans[-1][1] if spans else 0) == nbytes


@given(st.binary(max_size=2000), _chunk_bytes)
def test_hash_chunks_equals_hashing_each_span(data: bytes, chunk_bytes: int) -> None:
    expected = b"".join(hash_bytes(data[s:e]) for s, e in chunk_spans(len(data), chunk_bytes))
    assert hash_chunks(memoryview(data), chunk_bytes) == expected
    assert len(expected) == chunk_count(len(data), chunk_bytes) * HASH_BYTES


def test_hash_is_xxh3_128() -> None:
    assert hash_bytes(b"abc") == xxhash.xxh3_128_digest(b"abc")
    assert len(hash_bytes(b"")) == HASH_BYTES
    assert hash_chunks(memoryview(b""), MIN_CHUNK_BYTES) == b""


@given(_hashes)
def test_merkle_root_is_deterministic_and_accepts_both_forms(hashes: list[bytes]) -> None:
    root = merkle_root(hashes)
    assert len(root) == HASH_BYTES
    assert merkle_root(list(hashes)) == root
    assert merkle_root(b"".join(hashes)) == root


@given(_hashes, st.data())
def test_merkle_root_changes_when_any_chunk_changes(
    hashes: list[bytes], data: st.DataObject
) -> None:
    i = data.draw(st.integers(0, len(hashes) - 1), label="chunk")
    new = data.draw(st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES), label="hash")
    assume(new != hashes[i])
    changed = [*hashes[:i], new, *hashes[i + 1 :]]
    assert merkle_root(changed) != merkle_root(hashes)


@given(_hashes, st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES))
def test_merkle_root_changes_when_a_chunk_is_appended_or_dropped(
    hashes: list[bytes], extra: bytes
) -> None:
    # An odd node is carried up unchanged, so appending to a one-chunk list is the case that
    # needs the inner-node hash.
    assert merkle_root([*hashes, extra]) != merkle_root(hashes)
    if len(hashes) > 1:
        assert merkle_root(hashes[:-1]) != merkle_root(hashes)


@given(st.lists(st.binary(min_size=1, max_size=64), min_size=2, max_size=2))
def test_inner_nodes_cannot_pose_as_chunks(chunks: list[bytes]) -> None:
    hashes = [hash_bytes(c) for c in chunks]
    # A blob whose single chunk is the concatenation of two chunk hashes has another root.
    assert merkle_root(hashes) != merkle_root([hash_bytes(b"".join(hashes))])


@given(_hashes)
def test_merkle_levels_shape(hashes: list[bytes]) -> None:
    levels = merkle_levels(hashes)
    assert levels[0] == hashes
    assert len(levels[-1]) == 1
    for below, above in itertools.pairwise(levels):
        assert len(above) == (len(below) + 1) // 2
        if len(below) % 2:
            assert above[-1] == below[-1]  # odd node carried up


def test_merkle_root_edge_cases() -> None:
    h = hash_bytes(b"x")
    assert merkle_root([h]) == h
    assert merkle_root([]) == merkle_root(b"") == hash_bytes(b"")
    with pytest.raises(ValueError, match="multiple of 16"):
        merkle_root(b"\x00" * 17)


@pytest.mark.parametrize("value", [MIN_CHUNK_BYTES, MIN_CHUNK_BYTES + 1, 1 << 20, MAX_CHUNK_BYTES])
def test_validate_chunk_bytes_accepts(value: int) -> None:
    assert validate_chunk_bytes(value) == value


@pytest.mark.parametrize("value", [0, -4096, MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1, 1 << 40])
def test_validate_chunk_bytes_range(value: int) -> None:
    with pytest.raises(ValueError, match=rf"chunk_bytes={value} .*4096.*67108864"):
        validate_chunk_bytes(value)


@pytest.mark.parametrize("value", [4096.0, "4096", True, None])
def test_validate_chunk_bytes_type(value: object) -> None:
    with pytest.raises(TypeError, match="chunk_bytes must be an int"):
        validate_chunk_bytes(value)


@given(st.lists(st.integers(0, 2), max_size=40))
def test_value_runs_cover_the_array_in_runs_of_equal_values(values: list[int]) -> None:
    arr = np.array(values, dtype=np.int8)
    runs = value_runs(arr)
    assert [i for a, b in runs for i in range(a, b)] == list(range(len(values)))
    assert all(len(set(values[a:b])) == 1 for a, b in runs)
    assert all(values[b - 1] != values[b] for _a, b in runs[:-1])


@pytest.mark.parametrize("readonly", [False, True])
def test_hash_each_released_is_hash_bytes_of_each(readonly: bool) -> None:
    """Views on both sides of the size from which the GIL is released while hashing."""
    rng = np.random.default_rng(0)
    sizes = [0, 1, 4096, (128 << 10) - 1, 128 << 10, (1 << 20) + 3]
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    views = [memoryview(a.tobytes()) if readonly else memoryview(a) for a in arrays]
    assert hash_each_released(views) == [hash_bytes(a.tobytes()) for a in arrays]
    assert hash_each_released(views[3:5]) == [hash_chunks_released(v, 1 << 20) for v in views[3:5]]
