"""Verification of read pieces against the part's chunk hashes, and the record of what failed
(read errors by task number, mismatched chunks) with the one error a restore raises for them.
Runs on the read pool's threads (recording under a lock) and the caller's (raising).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cryosnap import _native
from cryosnap._format.chunks import HASH_BYTES, hash_bytes, hash_chunks_released
from cryosnap.engine._resolved import ResolvedPart
from cryosnap.engine.fetch._plan import PieceLists
from cryosnap.errors import IntegrityError

__all__ = ["Outcome", "Verifier"]

# Pieces of one chunk of at most this many bytes are hashed by one xxhash call each, holding
# the GIL (below the native call's threshold, which releases it).
_INLINE_HASH_BYTES = 64 << 10


class Outcome:
    """What went wrong in a pass. Errors are deterministic: every task runs to its end; a
    failed read (the first in task order) wins over a mismatch, and of the mismatches the
    first chunk in blob order is named, as a sequential reader would."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failures: list[tuple[int, BaseException]] = []  # (task number, what it raised)
        self.bad: list[tuple[int, int]] = []  # (blob, chunk) that did not match its hash
        self.failed: set[int] = set()  # the task numbers of failures
        self.bad_blobs: set[int] = set()  # the blobs of bad

    def fail(self, number: int, exc: BaseException) -> None:
        with self._lock:
            self.failures.append((number, exc))
            self.failed.add(number)

    def mismatch(self, blob: int, chunk: int) -> None:
        with self._lock:
            self.bad.append((blob, chunk))
            self.bad_blobs.add(blob)

    def raise_first(self, part: ResolvedPart, url: str) -> None:
        if self.failures:
            _n, exc = min(self.failures, key=lambda f: f[0])
            raise exc
        if self.bad:
            blob, chunk = min(self.bad)
            b = part.blobs[blob]
            cb = part.manifest.chunk_bytes
            lo = chunk * cb
            hi = min(lo + cb, b.nbytes)
            raise IntegrityError(
                f"step {part.step}, tier {url}: leaf {b.path}: chunk {chunk} "
                f"(bytes {lo}-{hi}) does not match its hash"
            )


class Verifier:
    """Hashes pieces where they lie, compares them with the expected hashes all at once and,
    in a second pass, copies those that match into place (by address, the GIL released)."""

    def __init__(
        self, part: ResolvedPart, pieces: PieceLists, address: Sequence[int], outcome: Outcome
    ) -> None:
        self.cb = part.manifest.chunk_bytes
        # Every chunk's expected hash, blob after blob: one bytes object, sliced per piece.
        self.expected = part.chunks().hashes.tobytes()
        self.pieces = pieces
        self.address = address  # of each leaf's first byte
        self.outcome = outcome

    def verify(
        self, pids: list[int], dests: Sequence[memoryview], sources: list[int] | None
    ) -> int:
        """Hash every piece ``pids`` where it is (``dests``) and compare the lot; with
        ``sources`` (the address of each piece's verified bytes, all of them direct) copy each
        that matches into place. Returns the bytes of the pieces."""
        # A piece of one chunk too small for the native call is one xxhash call (what
        # hash_chunks_released would do, without its checks).
        cb, small = self.cb, min(self.cb, _INLINE_HASH_BYTES)
        got = [hash_bytes(d) if d.nbytes <= small else hash_chunks_released(d, cb) for d in dests]
        bad = self._compare(pids, got)
        if sources is not None:
            address, p_blob, p_start = self.address, self.pieces.blob, self.pieces.start
            memmove = _native.memmove
            for i, (p, src, d) in enumerate(zip(pids, sources, dests, strict=True)):
                if i not in bad:
                    memmove(address[p_blob[p]] + p_start[p], src, d.nbytes)
        return sum(d.nbytes for d in dests)

    def _compare(self, pids: list[int], got: list[bytes]) -> set[int]:
        """Compare the hashes ``got`` of pieces ``pids`` with the expected ones, all at once;
        record and return (as positions in ``pids``) those that differ."""
        expected, hlo, hhi = self.expected, self.pieces.hash_lo, self.pieces.hash_hi
        bad: set[int] = set()
        if b"".join(got) != b"".join([expected[hlo[p] : hhi[p]] for p in pids]):
            for i, p in enumerate(pids):
                want = expected[hlo[p] : hhi[p]]
                if got[i] != want:
                    self._mismatch(p, got[i], want)
                    bad.add(i)
        return bad

    def _mismatch(self, pid: int, got: bytes, want: bytes) -> None:
        """Record the first chunk of piece ``pid`` that does not match."""
        c = 0
        while got[c : c + HASH_BYTES] == want[c : c + HASH_BYTES]:
            c += HASH_BYTES
        chunk = self.pieces.start[pid] // self.cb + c // HASH_BYTES
        self.outcome.mismatch(self.pieces.blob[pid], chunk)
