"""The mapped path: a part's data files mapped copy-on-write where the store maps them, the
blobs whose leaves are built over that memory, and the pool's work that hashes (and, for
into='s leaves, copies) pieces where they lie. :class:`Mapped` runs on the caller's thread,
:class:`MappedWork` on the read pool's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable

import numpy as np

from cryosnap import _native
from cryosnap.engine._resolved import ResolvedPart
from cryosnap.engine.fetch._plan import PieceLists, overlapping
from cryosnap.engine.fetch._verify import Outcome, Verifier
from cryosnap.errors import CheckpointError
from cryosnap.storage import Store

__all__ = ["Mapped", "MappedWork"]


class Mapped:
    """The data files a part uses, mapped copy-on-write where the store maps them
    (``map_file``: a LocalStore on a local file system, possibly in a TimeoutStore; a wrapper
    that injects faults has none, so its reads stay reads), and where each blob lies in them.

    :meth:`place` hands out the memory of a blob whose chunks lie back to back in one mapped
    file: :class:`cryosnap._state.Restorer` builds the leaf over it (no allocation, no copy) and
    the reader verifies it there. A file that cannot be mapped is read as before (its errors,
    a missing file for one, come from the read). The files ``skip`` names (cold ones, read
    with direct I/O instead) are not mapped, until :meth:`add` maps some of them (those
    into='s own leaves lie in: no leaf is built over them)."""

    def __init__(self, store: Store, part: ResolvedPart, skip: Collection[int] = ()) -> None:
        self._map_file: Callable[[str], memoryview | None] | None = getattr(store, "map_file", None)
        self._part = part
        self.views: dict[int, memoryview] = {}
        self.address: dict[int, int] = {}
        chunks = part.chunks()
        n = len(part.blobs)
        self._file: list[int] = [-1] * n
        self._offset: list[int] = [0] * n
        self._nbytes: list[int] = chunks.nbytes.tolist()
        if self._map_file is None or not len(chunks.files):
            return
        self.add(f for f in np.unique(chunks.files).tolist() if f not in skip)

    def add(self, files: Iterable[int]) -> None:
        """Map ``files`` (indices into the part's files) too, where the store maps them (a
        file that cannot be mapped is left out: ``views`` says which are). Where the blobs
        lie is found again (:meth:`alone`); blobs already given memory by :meth:`place` keep
        it."""
        added = False
        if self._map_file is not None:
            for f in files:
                if f in self.views:
                    continue
                with contextlib.suppress(CheckpointError):
                    view = self._map_file(self._part.files[f])
                    if view is not None:
                        self.views[f] = view
                        self.address[f] = _native.address_of(view)
                        added = True
        if added:
            self._locate()

    def _locate(self) -> None:
        # A blob lies in one piece of memory when its chunks follow each other in one file.
        chunks = self._part.chunks()
        files = chunks.files
        cb = self._part.manifest.chunk_bytes
        offs = chunks.offsets
        new = np.ones(len(files), bool)
        new[1:] = (files[1:] != files[:-1]) | (offs[1:] != offs[:-1] + cb)
        runs = np.cumsum(new)
        starts = chunks.starts
        lo = np.minimum(starts[:-1], len(files) - 1)
        whole = (starts[1:] > starts[:-1]) & (runs[np.maximum(starts[1:] - 1, 0)] == runs[lo])
        whole &= np.isin(files[lo], np.fromiter(self.views, np.int64, len(self.views)))
        whole[whole] &= ~overlapping(files[lo][whole], offs[lo][whole], chunks.nbytes[whole])
        self._file = np.where(whole, files[lo], -1).tolist()
        self._offset = offs[lo].tolist()

    def alone(self, blob: int) -> bool:
        """Whether ``blob`` lies in one piece of a mapped file that no other blob's bytes
        overlap."""
        return self._file[blob] >= 0

    def place(self, blob: int, alignment: int) -> memoryview | None:
        """The mapped memory holding ``blob``'s bytes, if they lie in one piece of a mapped
        file, inside it, at an address that is a multiple of ``alignment``; else None."""
        f = self._file[blob]
        if f < 0:
            return None
        lo = self._offset[blob]
        hi = lo + self._nbytes[blob]
        view = self.views[f]
        if hi > view.nbytes or (self.address[f] + lo) % alignment:
            return None
        return view[lo:hi]


class MappedWork:
    """The pool's work over pieces of mapped files: hash them there (first pass), hash them
    again and copy them into place (second pass, into='s leaves)."""

    def __init__(
        self,
        mapped: Mapped,
        pieces: PieceLists,
        verifier: Verifier,
        outcome: Outcome,
        on_bytes: Callable[[int], None],
    ) -> None:
        self.mapped = mapped  # the mappings live as long as this
        self.pieces = pieces
        self.verifier = verifier
        self.outcome = outcome
        self.on_bytes = on_bytes

    def _view(self, pid: int) -> memoryview:
        p = self.pieces
        offset = p.offset[pid]
        return self.mapped.views[p.file[pid]][offset : offset + p.nbytes[pid]]

    def hash(self, number: int, pids: list[int]) -> None:
        """First pass: hash pieces where they are (a direct blob's pieces are unmapped again:
        the second pass maps them once more)."""
        try:
            nbytes = self.verifier.verify(pids, [self._view(p) for p in pids], None)
            self._unmap_direct(pids)
        except BaseException as exc:
            self.outcome.fail(number, exc)
            return
        self.on_bytes(nbytes)

    def copy(self, number: int, pids: list[int]) -> None:
        """Second pass over a direct blob's pieces: hash each again where it lies and copy it
        into place if it still matches, while it is in the CPU's cache."""
        address, p = self.mapped.address, self.pieces
        try:
            for pid in pids:
                source = address[p.file[pid]] + p.offset[pid]
                self.verifier.verify([pid], [self._view(pid)], [source])
            self._unmap_direct(pids)
        except BaseException as exc:
            self.outcome.fail(number, exc)

    def _unmap_direct(self, pids: list[int]) -> None:
        """Unmap the pieces of direct blobs that lie alone in their file (no other blob's
        bytes share their pages: a leaf built over those could lose what was written to
        it)."""
        p, address, alone = self.pieces, self.mapped.address, self.mapped.alone
        for pid in pids:
            if p.direct[pid] and alone(p.blob[pid]):
                _native.dontneed(address[p.file[pid]] + p.offset[pid], p.nbytes[pid])
