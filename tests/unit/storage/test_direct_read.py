"""The reads of a cold restore (storage/_direct.py's DirectReader through
LocalStore.read_ranges_cold) on a file system that takes O_DIRECT: every byte lands whatever
the alignment of the buffers and offsets, aligned memory is read into straight from the disk,
the page cache stays cold, and the faults midway (EINVAL, short reads, the end of the file)
end in a buffered fallback with nothing lost or the truncation error."""

from __future__ import annotations

import errno
import logging
import mmap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cryosnap import _native
from cryosnap.errors import TruncatedError
from cryosnap.storage import LocalStore, TimeoutStore
from cryosnap.storage._direct import BLOCK_BYTES, DIRECT_READ_BYTES
from cryosnap.testing import FaultySyscalls

from ..support import evict

FILE_BYTES = 3 * DIRECT_READ_BYTES // 2 + 12_345  # a last partial block


def _file(root: Path, nbytes: int = FILE_BYTES) -> bytes:
    data = np.random.default_rng(7).integers(0, 256, nbytes, np.uint8).tobytes()
    (root / "x.dat").write_bytes(data)
    evict(root / "x.dat")
    return data


def _buffer(nbytes: int, skip: int) -> memoryview:
    """``nbytes`` of memory ``skip`` bytes past a page boundary."""
    return memoryview(mmap.mmap(-1, nbytes + skip + 1))[skip : skip + nbytes]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_every_byte_lands_whatever_the_alignment(direct_dir: Path, data: st.DataObject) -> None:
    path = direct_dir / "x.dat"
    want = path.read_bytes() if path.exists() else _file(direct_dir)
    offset = data.draw(st.sampled_from([0, 1, 4095, BLOCK_BYTES, 3 * BLOCK_BYTES + 17, 70_001]))
    sizes = data.draw(
        st.lists(
            st.sampled_from([0, 1, 100, BLOCK_BYTES, 70_000, 1 << 20, (1 << 20) + 5]),
            min_size=1,
            max_size=4,
        )
    )
    skips = data.draw(st.lists(st.sampled_from([0, 16, 4095, offset % BLOCK_BYTES]), min_size=4))
    bufs = [_buffer(n, skip) for n, skip in zip(sizes, skips, strict=False)]
    second = data.draw(st.integers(0, 2 << 20))
    more = [_buffer(1 << 20, 0)]
    LocalStore(direct_dir).read_ranges_cold("x.dat", [(offset, bufs), (second, more)])
    got = b"".join(bytes(b) for b in bufs)
    assert got == want[offset : offset + len(got)]
    assert bytes(more[0]) == want[second : second + (1 << 20)]


def test_aligned_memory_is_read_into_straight_from_the_disk(direct_dir: Path) -> None:
    """A page-aligned buffer at a block-aligned offset is read with O_DIRECT into itself, in
    reads of DIRECT_READ_BYTES; the file's last partial block comes through the bounce
    buffer. The page cache stays cold."""
    want = _file(direct_dir)
    syscalls = FaultySyscalls()
    store = LocalStore(direct_dir, syscalls=syscalls)
    view = _buffer(len(want), 0)
    store.read_ranges_cold("x.dat", [(0, [view])])
    assert bytes(view) == want
    body = len(want) // BLOCK_BYTES * BLOCK_BYTES
    assert syscalls.reads[:2] == [(DIRECT_READ_BYTES, True), (body - DIRECT_READ_BYTES, True)]
    assert syscalls.reads[2] == (len(want) - body, True)  # the tail's block, to the file's end
    share = store.cached_share("x.dat")
    if share is None:
        pytest.skip("mincore is not available here")
    assert share <= 0.1


def test_the_cache_share_tells_an_evicted_file_from_a_read_one(direct_dir: Path) -> None:
    _file(direct_dir)
    store = LocalStore(direct_dir)
    share = store.cached_share("x.dat")
    if share is None:
        pytest.skip("mincore is not available here")
    assert share <= 0.1
    store.read("x.dat")
    assert store.cached_share("x.dat") == 1.0
    assert TimeoutStore(store, 30).cached_share("x.dat") == 1.0


def test_a_refusal_midway_falls_back_to_buffered_reads(
    direct_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    want = _file(direct_dir)
    calls = []

    def fault(nbytes: int, direct: bool) -> int | None:
        calls.append(direct)
        if direct and len(calls) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return None

    syscalls = FaultySyscalls(read_fault=fault)
    store = LocalStore(direct_dir, syscalls=syscalls)
    view = _buffer(len(want), 0)
    with caplog.at_level(logging.WARNING, logger="cryosnap"):
        store.read_ranges_cold("x.dat", [(0, [view])])
    assert bytes(view) == want
    assert syscalls.reads[0] == (DIRECT_READ_BYTES, True)
    assert all(not direct for _n, direct in syscalls.reads[1:])
    assert "refused a direct read" in caplog.text
    # The store stops asking: the next file is read buffered from the start.
    syscalls.reads.clear()
    store.read_ranges_cold("x.dat", [(0, [view])])
    assert bytes(view) == want
    assert syscalls.reads and not any(direct for _n, direct in syscalls.reads)


@pytest.mark.parametrize("short", [BLOCK_BYTES, 100])
def test_short_reads_lose_nothing(direct_dir: Path, short: int) -> None:
    """A short read of whole blocks goes on direct; one that leaves an unaligned offset goes
    on buffered."""
    want = _file(direct_dir)
    first = [True]

    def fault(nbytes: int, direct: bool) -> int | None:
        if first[0] and direct:
            first[0] = False
            return short
        return None

    syscalls = FaultySyscalls(read_fault=fault)
    view = _buffer(len(want), 0)
    LocalStore(direct_dir, syscalls=syscalls).read_ranges_cold("x.dat", [(0, [view])])
    assert bytes(view) == want
    assert syscalls.reads[0] == (short, True)
    assert syscalls.reads[1][1] is (short % BLOCK_BYTES == 0)


def test_the_end_of_the_file_is_a_truncation(direct_dir: Path) -> None:
    want = _file(direct_dir, 3 * BLOCK_BYTES + 10)
    store = LocalStore(direct_dir)
    with pytest.raises(TruncatedError, match=r"x\.dat ends at byte"):
        store.read_ranges_cold("x.dat", [(0, [_buffer(len(want) + 1, 0)])])
    with pytest.raises(TruncatedError):
        store.read_ranges_cold("x.dat", [(len(want) + BLOCK_BYTES, [_buffer(10, 0)])])
    view = _buffer(len(want), 0)
    store.read_ranges_cold("x.dat", [(0, [view])])  # exactly to the end: fine
    assert bytes(view) == want


def test_direct_io_false_reads_buffered(direct_dir: Path) -> None:
    want = _file(direct_dir)
    syscalls = FaultySyscalls()
    view = _buffer(len(want), 0)
    LocalStore(direct_dir, direct_io=False, syscalls=syscalls).read_ranges_cold(
        "x.dat", [(0, [view])]
    )
    assert bytes(view) == want
    assert syscalls.reads and not any(direct for _n, direct in syscalls.reads)


def test_gaps_and_many_small_buffers(direct_dir: Path) -> None:
    want = _file(direct_dir)
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 9000, 300).tolist()
    bufs = [_buffer(n, int(rng.integers(0, 64))) for n in sizes]
    ranges = [(17, bufs[:150]), (17 + sum(sizes[:150]) + 5000, bufs[150:])]
    LocalStore(direct_dir).read_ranges_cold("x.dat", ranges)
    for offset, views in ranges:
        got = b"".join(bytes(v) for v in views)
        assert got == want[offset : offset + len(got)]


def test_readonly_or_unaligned_memory_goes_through_the_bounce(direct_dir: Path) -> None:
    want = _file(direct_dir)
    syscalls = FaultySyscalls()
    view = _buffer(2 << 20, 512)  # aligned to 512 bytes, not to a page
    LocalStore(direct_dir, syscalls=syscalls).read_ranges_cold("x.dat", [(0, [view])])
    assert bytes(view) == want[: 2 << 20]
    assert _native.address_of(view) % BLOCK_BYTES == 512
    assert all(direct for _n, direct in syscalls.reads)
