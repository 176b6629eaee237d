"""Direct I/O data files (storage/_direct.py through LocalStore): every byte lands whatever the
alignment of the buffers, the page cache stays cold, the probe decides once, and the faults
midway (EINVAL, ENOSPC, short writes) end in a buffered fallback or a clear error."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap.storage import LocalStore, check_direct_io, open_store
from cryosnap.storage import _direct as direct_module
from cryosnap.storage._direct import BLOCK_BYTES, BOUNCE_BYTES, DIRECT_MIN_BYTES
from cryosnap.testing import FaultySyscalls

from ..support import cached_pages_of


def _aligned(nbytes: int, seed: int) -> tuple[mmap.mmap, memoryview]:
    m = mmap.mmap(-1, nbytes)
    view = memoryview(m)
    view[:] = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()
    return m, view


def _write(store: LocalStore, key: str, batches: list[list[memoryview]]) -> bytes:
    writer = store.open_writer(key)
    for views in batches:
        writer.write(views)
    writer.commit()
    return b"".join(bytes(v) for views in batches for v in views)


def _pieces(sizes: list[int], offsets: list[int], seed: int = 0) -> list[memoryview]:
    """Views of ``sizes`` bytes, each ``offsets[i]`` bytes past a page of its own memory."""
    rng = np.random.default_rng(seed)
    out = []
    for n, skip in zip(sizes, offsets, strict=True):
        m = mmap.mmap(-1, n + skip + 1)
        view = memoryview(m)[skip : skip + n]
        view[:] = rng.integers(0, 256, n, np.uint8).tobytes()
        out.append(view)
    return out


SIZES = st.lists(
    st.one_of(
        st.integers(0, 5000),
        st.integers(DIRECT_MIN_BYTES - 10, DIRECT_MIN_BYTES + 3 * BLOCK_BYTES),
        st.sampled_from([1 << 20, (1 << 20) + 17, 3 * BLOCK_BYTES]),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=SIZES, data=st.data())
def test_every_byte_lands_whatever_the_alignment(
    direct_dir: Path, sizes: list[int], data: st.DataObject
) -> None:
    offsets = data.draw(
        st.lists(st.sampled_from([0, 16, 64, 4095]), min_size=len(sizes), max_size=len(sizes))
    )
    store = LocalStore(direct_dir, direct_io=True)
    views = _pieces(sizes, offsets)
    cut = data.draw(st.integers(0, len(views)))
    want = _write(store, "data/x.dat", [views[:cut], views[cut:]])
    assert store.size("data/x.dat") == len(want)
    assert store.read("data/x.dat") == want
    store.delete("data/x.dat")


def test_more_than_the_bounce_buffer_of_small_pieces(direct_dir: Path) -> None:
    store = LocalStore(direct_dir, direct_io=True)
    views = _pieces(
        [BLOCK_BYTES - 1] * (BOUNCE_BYTES // BLOCK_BYTES + 3),
        [0] * (BOUNCE_BYTES // BLOCK_BYTES + 3),
    )
    want = _write(store, "x.dat", [views])
    assert store.read("x.dat") == want


def test_aligned_memory_goes_to_the_disk_from_where_it_lies(direct_dir: Path) -> None:
    """A page-aligned buffer is one direct write of its own bytes (no copy to the bounce
    buffer); its unaligned tail is padded in the last block, then truncated away."""
    syscalls = FaultySyscalls(lambda n, direct: None)
    store = LocalStore(direct_dir, direct_io=True, syscalls=syscalls)
    _m, view = _aligned(4 << 20, 1)
    want = _write(store, "x.dat", [[view, view[:100]]])
    assert syscalls.writes[-2:] == [(4 << 20, True), (BLOCK_BYTES, True)]
    assert store.read("x.dat") == want


def _packs(count: int, seed: int = 0) -> list[memoryview]:
    """Views like a version's packs of small tensors: sizes no multiple of a block, each in
    memory of its own at the offset its first byte has in the file (so that each body, past
    the bytes that fill the block the last one's tail began, is aligned alike)."""
    sizes = [DIRECT_MIN_BYTES * 3 + 4096 * (i % 5) + 17 * i + 5 for i in range(count)]
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at % BLOCK_BYTES)
        at += n
    return _pieces(sizes, offsets, seed)


def test_the_pieces_of_one_write_go_to_the_disk_in_one_call(direct_dir: Path) -> None:
    """Forty packs: their bodies from where they lie and the blocks their tails share with
    the next heads from the bounce buffer, in one pwritev, not two writes per pack."""
    syscalls = FaultySyscalls()
    store = LocalStore(direct_dir, direct_io=True, syscalls=syscalls)
    store.check_direct_io()
    views = _packs(40)
    before = len(syscalls.writes)
    want = _write(store, "x.dat", [views])
    calls = syscalls.writes[before:]
    assert len(calls) == 2 and all(direct for _n, direct in calls)  # the write, the last block
    # Only the tails and heads went through the bounce buffer: a block per pack at most.
    assert calls[0][0] >= len(want) - 41 * BLOCK_BYTES
    assert store.read("x.dat") == want


def test_more_pieces_than_one_call_takes(direct_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_module, "IOV_MAX", 4)
    syscalls = FaultySyscalls()
    store = LocalStore(direct_dir, direct_io=True, syscalls=syscalls)
    store.check_direct_io()
    before = len(syscalls.writes)
    want = _write(store, "x.dat", [_packs(12, 1), _packs(3, 2)])
    assert len(syscalls.writes) - before >= 12 * 2 // 4
    assert store.read("x.dat") == want


@pytest.mark.parametrize("short", [BLOCK_BYTES * 50, BLOCK_BYTES * 50 + 123, 1])
@pytest.mark.parametrize("nth", [2, 3])
def test_a_short_write_of_many_pieces_loses_nothing(direct_dir: Path, short: int, nth: int) -> None:
    """A short pwritev ending inside one of its pieces (on a block: the rest goes on directly;
    off one: buffered from there)."""
    syscalls = FaultySyscalls(_After(nth, short=short))
    store = LocalStore(direct_dir, direct_io=True, syscalls=syscalls)
    store.check_direct_io()
    want = _write(store, "x.dat", [_packs(30, 3), _packs(5, 4)])
    assert store.read("x.dat") == want
    assert store.size("x.dat") == len(want)


@pytest.mark.parametrize("nth", [2, 3])
def test_a_refusal_midway_through_many_pieces_loses_nothing(
    direct_dir: Path, nth: int, caplog: pytest.LogCaptureFixture
) -> None:
    """EINVAL on a pwritev of many pieces: none of its bytes landed; they and the rest are
    written buffered from that offset."""
    syscalls = FaultySyscalls(_After(nth, errno.EINVAL, every=True))
    store = LocalStore(direct_dir, direct_io=True, syscalls=syscalls)
    store.check_direct_io()
    with caplog.at_level(logging.WARNING, logger="cryosnap"):
        want = _write(store, "x.dat", [_packs(30, 5), _packs(7, 6), _packs(2, 7)])
    assert store.read("x.dat") == want
    assert "refused a direct write" in caplog.text
    assert not syscalls.writes[-1][1]


def test_a_direct_checkpoint_leaves_the_page_cache_cold(direct_dir: Path) -> None:
    state = {"w": np.random.default_rng(0).random(4 << 20)}  # 32 MiB
    with cryosnap.Checkpointer(direct_dir / "run", direct_io=True, keep=2) as ckpt:
        for step in range(2):
            state["w"] += 1
            ckpt.save(step, state).result()
    files = sorted((direct_dir / "run" / "data").iterdir())
    counts = cached_pages_of(files)
    if counts is None:
        pytest.skip("mincore is not available here")
    cached, total = counts
    assert total >= (32 << 20) // BLOCK_BYTES
    assert cached <= 0.1 * total, f"{cached} of {total} pages of the data files are cached"
    assert np.array_equal(cryosnap.load(direct_dir / "run")["w"], state["w"])


# -- the probe --------------------------------------------------------------------------------


def _refusing_probe(nbytes: int, direct: bool) -> None:
    if direct:
        raise OSError(errno.EINVAL, "Invalid argument")


def test_a_file_system_that_refuses_writes_buffered_by_default(direct_dir: Path) -> None:
    syscalls = FaultySyscalls(_refusing_probe)
    store = LocalStore(direct_dir, syscalls=syscalls)
    assert store.check_direct_io() is False
    want = _write(store, "x.dat", [_pieces([1 << 20], [0])])
    assert store.read("x.dat") == want
    assert [d for _n, d in syscalls.writes] == []  # buffered writes go by writev
    assert not [p for p in direct_dir.iterdir() if p.name.startswith(".direct-probe")]


def test_direct_io_true_where_refused_is_an_error_at_open_naming_the_level(
    direct_dir: Path,
) -> None:
    store = LocalStore(direct_dir / "p", direct_io=True, syscalls=FaultySyscalls(_refusing_probe))
    with pytest.raises(cryosnap.DirectIOError, match=r"the persistent level: .*refuses direct"):
        cryosnap.Checkpointer(store)
    # The level is not left locked: another writer opens it.
    cryosnap.Checkpointer(LocalStore(direct_dir / "p", direct_io=False)).close()


def test_a_scratch_tier_forces_its_own(direct_dir: Path) -> None:
    tier = cryosnap.Tier(direct_dir / "s", direct_io=False)
    with cryosnap.Checkpointer(direct_dir / "p", scratch=tier, direct_io=True) as ckpt:
        assert ckpt.scratch is not None
        assert check_direct_io(ckpt.persistent, True, "persistent") is True
        assert check_direct_io(ckpt.scratch.devices[0], None, "scratch") is False
        ckpt.save(0, {"w": np.arange(1 << 18)}).result()
    assert np.array_equal(cryosnap.load(direct_dir / "p")["w"], np.arange(1 << 18))


def test_direct_io_true_on_an_object_store_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(cryosnap.DirectIOError, match=r"the persistent level: .*not a local"):
        cryosnap.Checkpointer("memory://direct-io-test/run", direct_io=True)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_tmpfs_is_buffered_by_default() -> None:
    with open("/proc/self/mounts", encoding="utf-8") as f:
        if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in f):
            pytest.skip("/dev/shm is not tmpfs here")
    probe = Path(tempfile.mkdtemp(prefix="cryosnap-probe-", dir="/dev/shm"))
    try:
        assert LocalStore(str(probe)).check_direct_io() is False
    finally:
        shutil.rmtree(probe)


def test_direct_io_must_be_a_bool_or_none(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="direct_io must be None, True or False, got 'yes'"):
        LocalStore(tmp_path, direct_io="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="direct_io must be None, True or False, got 1"):
        cryosnap.Tier(tmp_path, direct_io=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="direct_io must be None, True or False, got 0"):
        cryosnap.Checkpointer(tmp_path, direct_io=0)  # type: ignore[arg-type]
    assert check_direct_io(open_store(tmp_path, direct_io=False), None, "persistent") is False


# -- faults midway ------------------------------------------------------------------------------


class _After:
    """Fails the ``at``-th direct write (counting from 1) and, with ``every``, all after it."""

    def __init__(
        self, at: int, error: int | None = None, short: int | None = None, every: bool = False
    ) -> None:
        self.at, self.error, self.short, self.every = at, error, short, every
        self.seen = 0

    def __call__(self, nbytes: int, direct: bool) -> int | None:
        if not direct:
            return None
        self.seen += 1
        if self.seen == self.at or (self.every and self.seen > self.at):
            if self.error is not None:
                raise OSError(self.error, os.strerror(self.error))
            return self.short
        return None


def _big_views() -> list[memoryview]:
    return _pieces([3 << 20, 5000, (2 << 20) + 123, 9 << 20], [0, 7, 64, 0])


def test_einval_midway_falls_back_to_buffered_and_loses_nothing(
    direct_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    syscalls = FaultySyscalls(_After(3, errno.EINVAL, every=True))
    store = LocalStore(direct_dir, direct_io=True, syscalls=syscalls)
    store.check_direct_io()  # the probe's write is the first direct one
    with caplog.at_level(logging.WARNING, logger="cryosnap"):
        want = _write(store, "x.dat", [_big_views()[:2], _big_views()[2:]])
    assert store.read("x.dat") == want
    assert "refused a direct write" in caplog.text and "x.dat" in caplog.text
    assert any(d for _n, d in syscalls.writes) and not syscalls.writes[-1][1]


@pytest.mark.parametrize("short", [BLOCK_BYTES, 1000, 1])
def test_a_short_direct_write_loses_nothing(direct_dir: Path, short: int) -> None:
    syscalls = FaultySyscalls(_After(2, short=short))
    store = LocalStore(direct_dir, direct_io=True, syscalls=syscalls)
    store.check_direct_io()
    want = _write(store, "x.dat", [_big_views()])
    assert store.read("x.dat") == want


def test_a_full_disk_during_a_direct_write_is_a_storage_error(direct_dir: Path) -> None:
    # The probe's write is the first direct one, the write below the second.
    store = LocalStore(direct_dir, direct_io=True, syscalls=FaultySyscalls(_After(2, errno.ENOSPC)))
    store.check_direct_io()
    writer = store.open_writer("x.dat")
    with pytest.raises(cryosnap.StorageError, match=r"writing x\.dat in .* failed: disk full"):
        writer.write(_big_views())
        writer.commit()
    writer.abort()
    assert store.list() == [] and not list(direct_dir.iterdir())


def test_a_full_disk_in_a_write_of_many_pieces_is_a_storage_error(direct_dir: Path) -> None:
    """The failed pwritev held views of the bounce buffer (its blocks between the bodies): the
    writer still aborts cleanly, the error is the full disk, nothing is left behind."""
    store = LocalStore(direct_dir, direct_io=True, syscalls=FaultySyscalls(_After(2, errno.ENOSPC)))
    store.check_direct_io()
    writer = store.open_writer("x.dat")
    with pytest.raises(cryosnap.StorageError, match=r"writing x\.dat in .* failed: disk full"):
        try:
            writer.write(_packs(40, 8))
        except cryosnap.StorageError:
            # As a save does: aborted while the failure is handled, its traceback (and the
            # views of the bounce buffer in it) alive; the abort must not raise over it.
            writer.abort()
            raise
    assert store.list() == [] and not list(direct_dir.iterdir())


# -- faults midway, through a Checkpointer: never a torn version ----------------------------------


def _ten_mib(step: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(step).random(10 << 17), "step": np.int64(step)}


def test_a_checkpoint_whose_device_refuses_midway_commits_whole(direct_dir: Path) -> None:
    fault = _After(4, errno.EINVAL, every=True)
    store = LocalStore(direct_dir, direct_io=True, syscalls=FaultySyscalls(fault))
    with cryosnap.Checkpointer(store, keep=2) as ckpt:
        for step in range(3):
            ckpt.save(step, _ten_mib(step)).result()
        assert ckpt.steps() == [1, 2]
    assert fault.seen >= 4  # the refusal came, after some direct writes
    for step in (1, 2):
        got = cryosnap.load(direct_dir, step=step)
        assert np.array_equal(got["w"], _ten_mib(step)["w"])
    assert cryosnap.Run(direct_dir).verify().ok


def test_a_full_disk_fails_a_version_of_many_small_tensors_only(direct_dir: Path) -> None:
    """Packs of small tensors: each write mixes their bodies with bounce blocks."""
    fault = _After(10**9, errno.ENOSPC)
    store = LocalStore(direct_dir, direct_io=True, syscalls=FaultySyscalls(fault))
    gen = torch.Generator().manual_seed(0)
    # ~7 MiB in 300 tensors of 12-20 KiB: packed, no size a multiple of a block.
    state = {f"t{i}": torch.randn(3000 + 7 * i, generator=gen) for i in range(300)}
    with cryosnap.Checkpointer(store) as ckpt:
        ckpt.save(0, state).result()
        fault.at = fault.seen + 1
        for t in state.values():
            t.add_(1.0)  # every chunk new: the version writes
        with pytest.raises(cryosnap.StorageError, match="disk full"):
            ckpt.save(1, state).result()
        ckpt.save(2, state).result()
        assert ckpt.steps() == [0, 2]
    assert not [p for p in direct_dir.rglob("*") if p.name.endswith(".partial")]
    assert cryosnap.Run(direct_dir).verify().ok


def test_a_full_disk_during_a_direct_write_fails_that_version_only(direct_dir: Path) -> None:
    fault = _After(10**9, errno.ENOSPC)
    store = LocalStore(direct_dir, direct_io=True, syscalls=FaultySyscalls(fault))
    with cryosnap.Checkpointer(store) as ckpt:
        ckpt.save(0, _ten_mib(0)).result()
        fault.at = fault.seen + 1  # the next version's first direct write
        with pytest.raises(cryosnap.StorageError, match="disk full"):
            ckpt.save(1, _ten_mib(1)).result()
        assert ckpt.steps() == [0]
        ckpt.save(2, _ten_mib(2)).result()  # the disk has room again
        assert ckpt.steps() == [0, 2]
    assert not [p for p in direct_dir.rglob("*") if p.name.endswith(".partial")]
    assert cryosnap.Run(direct_dir).verify().ok
    assert np.array_equal(cryosnap.load(direct_dir, step=0)["w"], _ten_mib(0)["w"])
