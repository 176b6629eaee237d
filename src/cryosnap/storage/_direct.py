"""Direct I/O for data files: ``O_DIRECT`` writes that bypass the page cache, the probe that
decides once per directory whether its file system takes them, the reads of a cold restore
(:class:`DirectReader`) and the injectable syscalls.

:class:`DirectFile` runs on the data file's I/O thread (the appender's), :class:`DirectReader`
on a read pool's thread; :func:`probe_direct` on the thread that opens the level.
docs/design/storage.md ("Direct I/O") has the why.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from contextlib import suppress
from typing import Final

from cryosnap import _native
from cryosnap._native import IOV_MAX
from cryosnap.errors import TruncatedError

__all__ = [
    "BLOCK_BYTES",
    "DirectFile",
    "DirectReader",
    "IOV_MAX",
    "Syscalls",
    "advance",
    "probe_direct",
    "takes_direct_reads",
]

log = logging.getLogger("cryosnap")

# The alignment of every direct write's offset, length and memory: the page size, a multiple
# of every block device's logical block (512 or 4096 bytes).
BLOCK_BYTES: Final = 4096
# The aligned bounce buffer that gathers what cannot go to the disk from where it lies (small
# blobs, the unaligned head and tail of a large one): one direct write per this many bytes.
BOUNCE_BYTES: Final = 8 << 20
# Aligned runs shorter than this are copied to the bounce buffer: a syscall each costs more.
DIRECT_MIN_BYTES: Final = 64 << 10
O_DIRECT: Final = getattr(os, "O_DIRECT", 0)
# File systems that are the page cache: a direct write there is a copy into it all the same.
_MEMORY_FS: Final = frozenset({"tmpfs", "ramfs"})


class Syscalls:
    """The calls a direct write makes; tests pass a subclass that fails some of them
    (:class:`cryosnap.testing.FaultySyscalls`)."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def ftruncate(self, fd: int, nbytes: int) -> None:
        os.ftruncate(fd, nbytes)

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)


def _buffered(fd: int) -> None:
    """Clear ``O_DIRECT`` on ``fd``: its later writes go through the page cache."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)


class DirectFile:
    """The writes of one data file opened with ``O_DIRECT``, in order.

    A buffer whose memory and file offset are aligned alike goes to the disk from where it
    lies (the staging slabs and the data file's layout make it so for large blobs); the rest
    is gathered in a page-aligned bounce buffer, written in whole blocks. The aligned pieces of
    one :meth:`write` (the buffers' bodies and the bounce buffer's blocks between them) are
    written together, up to IOV_MAX at a time, in one ``pwritev``: a version of many packs of
    small tensors is a few large writes, not two synchronous ones per pack (a body, then the
    block its tail shares with the next pack's head), which a network file system pays a
    round trip each for. ``finish`` writes the last partial block padded with zeros and
    truncates the file to its bytes. A write the file system refuses midway (EINVAL) or a
    short one that leaves the offset unaligned switches this file to buffered writes, from the
    same offset on: nothing written is lost, and the file is fsynced once by its writer as
    every file is."""

    def __init__(self, fd: int, key: str, syscalls: Syscalls) -> None:
        self.key = key
        self._fd = fd
        self._sys = syscalls
        self._bounce: mmap.mmap | None = None
        self._view = memoryview(b"")
        self._base = 0  # the file offset of the first byte not written yet (aligned, direct)
        self._queued: list[memoryview] = []  # pieces to write back to back from _base
        self._queued_bytes = 0
        # The bounce buffer's bytes not queued yet, [_start, _fill), lie in the file right
        # after the queued pieces; _start is on a block of the buffer.
        self._start = 0
        self._fill = 0
        self.direct = True

    @property
    def size(self) -> int:
        return self._base + self._queued_bytes + self._fill - self._start

    def _room(self) -> memoryview:
        if self._bounce is None:
            self._bounce = mmap.mmap(-1, BOUNCE_BYTES)  # anonymous: page-aligned, zeroed
            self._view = memoryview(self._bounce)
        return self._view

    def write(self, buffers: Sequence[memoryview]) -> int:
        """Append ``buffers`` (flat byte views); the bytes taken. Every byte of them is written
        (or copied to the bounce buffer) when this returns: the caller may reuse them."""
        total = 0
        for v in buffers:
            total += v.nbytes
            if self.direct:
                self._put(v)
            else:
                self._flush(pad=False)
                self._queue(v)
        self._submit()
        return total

    def _queue(self, piece: memoryview) -> None:
        self._queued.append(piece)
        self._queued_bytes += piece.nbytes
        if len(self._queued) >= IOV_MAX:
            self._submit()

    def _queue_blocks(self) -> None:
        """Queue the whole blocks the bounce buffer holds."""
        whole = (self._fill - self._start) // BLOCK_BYTES * BLOCK_BYTES
        if whole:
            self._queue(self._view[self._start : self._start + whole])
            self._start += whole

    def _put(self, v: memoryview) -> None:
        n, i = v.nbytes, 0
        address = _native.address_of(v) if n >= DIRECT_MIN_BYTES else 1
        while i < n and self.direct:
            k = -(self._fill - self._start) % BLOCK_BYTES  # bytes to the file's next block
            body = (n - i - k) // BLOCK_BYTES * BLOCK_BYTES
            aligned = body >= DIRECT_MIN_BYTES and (address + i + k) % BLOCK_BYTES == 0
            if aligned and k == 0:
                self._queue_blocks()
                self._queue(v[i : i + body])
                i += body
                continue
            room = self._room()
            if self._fill == BOUNCE_BYTES:  # full: every byte of it is in whole blocks
                self._queue_blocks()
                self._submit()
                self._start = self._fill = 0
                continue
            take = k if aligned else min(n - i, BOUNCE_BYTES - self._fill)
            room[self._fill : self._fill + take] = v[i : i + take]
            self._fill += take
            i += take
        if i < n:  # switched to buffered writes meanwhile
            self._flush(pad=False)
            self._queue(v[i:])

    def _flush(self, *, pad: bool) -> None:
        """Queue and write what the bounce buffer holds: its whole blocks (``pad``: every
        byte, the last block padded with zeros; buffered: every byte); what is left of a
        partial block stays."""
        start, fill = self._start, self._fill
        if fill > start and (pad or not self.direct):
            end = (
                fill if not self.direct else start + -(-(fill - start) // BLOCK_BYTES) * BLOCK_BYTES
            )
            self._view[fill:end] = bytes(end - fill)
            self._queue(self._view[start:end])
            self._start = end
        else:
            self._queue_blocks()
        self._submit()
        if self._start >= self._fill:  # nothing left: the buffer starts over
            self._start = self._fill = 0

    def _submit(self) -> None:
        """Write the queued pieces at ``_base``, back to back."""
        views, offset = self._queued, self._base
        if not views:
            return
        self._queued = []
        self._base += self._queued_bytes
        self._queued_bytes = 0
        i = 0
        while i < len(views):
            batch = views[i : i + IOV_MAX]
            want = sum(v.nbytes for v in batch)
            try:
                n = self._sys.pwritev(self._fd, batch, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._fall_back(f"the file system refused a direct write ({exc.strerror})")
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"a write of {want} bytes wrote none")
            offset += n
            i = i + len(batch) if n == want else advance(views, i, n)
            if i < len(views) and self.direct and n % BLOCK_BYTES:
                self._fall_back(f"a short direct write ({n} bytes) left an unaligned offset")

    def _fall_back(self, why: str) -> None:
        log.warning("cryosnap: %s: %s; the rest of the file is written buffered", self.key, why)
        _buffered(self._fd)
        self.direct = False

    def finish(self) -> None:
        """Write what the bounce buffer holds; the file ends at the last byte given."""
        size = self.size
        padded = self.direct and size % BLOCK_BYTES
        self._flush(pad=True)
        if padded:
            self._sys.ftruncate(self._fd, size)  # the zeros after the last byte go
        self.close()

    def close(self) -> None:
        """Free the bounce buffer (the descriptor is the writer's). A failed write's traceback
        may still hold views of it (the pieces of the call that failed): then it is unmapped
        when the last of them goes, and closing here must not raise over that failure."""
        self._queued = []
        self._view.release()
        self._view = memoryview(b"")
        bounce, self._bounce = self._bounce, None
        if bounce is not None:
            with suppress(BufferError):
                bounce.close()


def advance(views: list[memoryview], i: int, nbytes: int) -> int:
    """After a vectored call from ``views[i]`` on moved ``nbytes`` (fewer than its views
    hold): the index of the first view it did not finish, that view cut to its tail in
    place."""
    for j in range(i, len(views)):
        v = views[j]
        if nbytes < v.nbytes:
            views[j] = v[nbytes:]
            return j
        nbytes -= v.nbytes
    return len(views)


def probe_direct(root_fd: int, syscalls: Syscalls, fs_type: str, *, memory: bool) -> str | None:
    """Whether the directory ``root_fd`` takes direct writes: None if an aligned direct write
    of one block to a scratch file in it succeeds, else why not (the file is removed). Unless
    ``memory``, a memory file system (``fs_type`` tmpfs, ramfs) is not probed: it is the page
    cache itself, where a direct write is a copy into it all the same."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    if fs_type in _MEMORY_FS and not memory:
        return f"{fs_type} keeps files in memory"
    name = f".direct-probe-{secrets.token_hex(4)}.tmp"  # a name remove_incomplete reclaims
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | O_DIRECT
    try:
        fd = os.open(name, flags, 0o600, dir_fd=root_fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return f"its file system ({fs_type or 'unknown'}) refuses O_DIRECT"
    block = mmap.mmap(-1, BLOCK_BYTES)
    try:
        syscalls.pwrite(fd, memoryview(block), 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return f"its file system ({fs_type or 'unknown'}) refuses direct writes"
    finally:
        block.close()
        os.close(fd)
        with suppress(OSError):
            os.unlink(name, dir_fd=root_fd)
    return None


# -- the reads of a cold restore

# The most bytes one direct read asks for: a few MiB in flight per reader keeps the device busy
# without pinning much memory at once.
DIRECT_READ_BYTES: Final = 8 << 20
# The aligned bounce buffer of a read thread (what cannot be read into where it goes: small
# blobs, the heads and tails of large ones, gaps): one direct read per this many bytes. Kept by
# the thread (its fresh pages cost a fault each), also by a storage thread that lives long.
READ_BOUNCE_BYTES: Final = 1 << 20
_bounces = threading.local()  # each read thread's aligned bounce buffer, reused


def _bounce(nbytes: int) -> memoryview:
    """This thread's page-aligned bounce buffer, at least ``nbytes`` (at most
    READ_BOUNCE_BYTES)."""
    view: memoryview | None = getattr(_bounces, "view", None)
    if view is None or view.nbytes < nbytes:
        size = max(nbytes, 64 << 10)
        _bounces.view = view = memoryview(mmap.mmap(-1, -(-size // BLOCK_BYTES) * BLOCK_BYTES))
    return view


def _copy(dest: memoryview, source: memoryview) -> None:
    if dest.nbytes >= DIRECT_MIN_BYTES:
        _native.memmove(_native.address_of(dest), _native.address_of(source), dest.nbytes)
    else:
        dest[:] = source


# (file offset, the view its bytes land in, whether it is read straight into that view)
_Op = tuple[int, memoryview, bool]


def takes_direct_reads(fd: int) -> bool:
    """Whether the file system of ``fd`` takes ``O_DIRECT`` on it (set on ``fd`` if so)."""
    if not O_DIRECT:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


class DirectReader:
    """The reads of one data file of a cold restore (out of the page cache), in large reads.

    With ``direct`` the file is read with ``O_DIRECT`` (set on ``fd`` here): a buffer whose
    memory and file offset are aligned alike is read into from where it lies, in reads of up to
    ``DIRECT_READ_BYTES``; the rest (small buffers, the unaligned head and tail of a large one,
    gaps) through an aligned bounce buffer, its blocks read once. A file system that refuses
    ``O_DIRECT``, or refuses a read midway (EINVAL), or a short read that leaves an unaligned
    offset, switches the file to buffered reads from the same offset on: nothing read is lost
    (``refused`` says why, for the store to stop asking). Buffered reads are advised
    (``POSIX_FADV_SEQUENTIAL`` for the file, ``WILLNEED`` per range) so the kernel reads ahead
    in large requests. The end of the file before the bytes asked is a TruncatedError."""

    def __init__(self, fd: int, key: str, syscalls: Syscalls, *, direct: bool) -> None:
        self.key = key
        self.refused = ""
        self._fd = fd
        self._sys = syscalls
        self.direct = direct and takes_direct_reads(fd)
        if direct and not self.direct:
            self.refused = "its file system refuses O_DIRECT"
        if not self.direct:
            self._advise(0, 0, "POSIX_FADV_SEQUENTIAL")

    def _advise(self, offset: int, nbytes: int, name: str) -> None:
        advice = getattr(os, name, None)
        if advice is not None:
            with suppress(OSError):  # advice only
                os.posix_fadvise(self._fd, offset, nbytes, advice)

    def read(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (flat byte views) with the bytes of the file from ``offset`` on,
        back to back."""
        views = [v for v in buffers if v.nbytes]
        if not self.direct:
            self._advise(offset, sum(v.nbytes for v in views), "POSIX_FADV_WILLNEED")
            self._fill_all(views, offset)
            return
        ops = _ops(offset, views)
        i = 0
        while i < len(ops):
            if ops[i][2] and self.direct:
                self._fill(ops[i][1], ops[i][0], ops[i][1].nbytes)
                i += 1
                continue
            j = i + 1
            while j < len(ops) and not (ops[j][2] and self.direct):
                j += 1
            self._bounced(ops[i:j])
            i = j

    def _bounced(self, ops: list[_Op]) -> None:
        """Ops that follow each other in the file, read through the bounce buffer in aligned
        windows (buffered: straight into their views)."""
        if not self.direct:
            self._fill_all([v for _o, v, _d in ops], ops[0][0])
            return
        lo, end = ops[0][0], ops[-1][0] + ops[-1][1].nbytes
        at = lo // BLOCK_BYTES * BLOCK_BYTES
        k = 0
        while at < end:
            want = min(-(-(end - at) // BLOCK_BYTES) * BLOCK_BYTES, READ_BOUNCE_BYTES)
            bounce = _bounce(want)[:want]
            got = self._fill(bounce, at, min(want, end - at))
            stop = at + got
            while k < len(ops):
                o, v, _d = ops[k]
                a, z = max(o, at), min(o + v.nbytes, stop)
                if a < z:
                    _copy(v[a - o : z - o], bounce[a - at : z - at])
                if o + v.nbytes > stop:
                    break
                k += 1
            at = stop

    def _fill(self, view: memoryview, offset: int, need: int) -> int:
        """Read into ``view`` from ``offset`` until at least ``need`` bytes came (more, up to
        its size, where the file has them); the bytes read."""
        done = 0
        while done < need:
            try:
                n = self._sys.preadv(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._fall_back(f"the file system refused a direct read ({exc.strerror})")
                continue
            if n <= 0:
                raise TruncatedError(
                    f"{self.key} ends at byte {offset + done}, before the data it should hold"
                )
            done += n
            if done < need and self.direct and n % BLOCK_BYTES:
                self._fall_back(f"a short direct read ({n} bytes) left an unaligned offset")
        return done

    def _fill_all(self, views: list[memoryview], offset: int) -> None:
        """Buffered reads of ``views`` back to back from ``offset``, many buffers a call."""
        i = 0
        while i < len(views):
            batch = views[i : i + IOV_MAX]
            n = self._sys.preadv(self._fd, batch, offset)
            if n <= 0:
                raise TruncatedError(
                    f"{self.key} ends at byte {offset}, before the data it should hold"
                )
            offset += n
            i = advance(views, i, n)

    def _fall_back(self, why: str) -> None:
        _buffered(self._fd)  # the store that opened the file warns, once
        self.direct = False
        self.refused = why
        self._advise(0, 0, "POSIX_FADV_SEQUENTIAL")


def _ops(offset: int, views: list[memoryview]) -> list[_Op]:
    """The reads of ``views`` back to back from ``offset``: the aligned body of a large view
    whose memory is aligned as its file offset is goes straight into it (cut in reads of
    ``DIRECT_READ_BYTES``), the rest through the bounce buffer."""
    ops: list[_Op] = []
    pos = offset
    for v in views:
        n = v.nbytes
        lo = -(-pos // BLOCK_BYTES) * BLOCK_BYTES
        hi = (pos + n) // BLOCK_BYTES * BLOCK_BYTES
        if hi - lo < DIRECT_MIN_BYTES or v.readonly or (_native.address_of(v) - pos) % BLOCK_BYTES:
            ops.append((pos, v, False))
            pos += n
            continue
        if lo > pos:
            ops.append((pos, v[: lo - pos], False))
        for a in range(lo, hi, DIRECT_READ_BYTES):
            z = min(a + DIRECT_READ_BYTES, hi)
            ops.append((a, v[a - pos : z - pos], True))
        if pos + n > hi:
            ops.append((hi, v[hi - pos :], False))
        pos += n
    return ops
