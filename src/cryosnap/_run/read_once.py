"""Read-once replicated restore: each replicated chunk is read by one rank and sent to the others.

At the world size that saved a version, every rank's manifest names the same locations for the
replicated chunks (the share each rank wrote). :func:`shared_reads` reads this rank's share
(the chunks in the data files it wrote) and sends it to every other rank over one
:meth:`Coordinator.exchange`; the store it returns serves the others' shares from what they
sent, so the job reads the replicated bytes once, not once per rank. The read path above it is
unchanged: every chunk is still verified against its hash, and whatever a rank did not
receive is read from the store as before. Runs on the caller's thread (a restore),
collective on the channel it is given. docs/design/distributed.md has the why.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from cryosnap import engine
from cryosnap._format.commit import CommitRecord
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointError
from cryosnap.storage import Store, StoreCapabilities
from cryosnap.storage._wrap import WrapperStore

__all__ = ["READ_ONCE_VARIABLE", "SharedReads", "read_once_enabled", "shared_reads"]

log = logging.getLogger("cryosnap")

# Set to 0 on every rank to have each rank read the replicated state itself (a shared file
# system that serves N readers of the same bytes better than the network moves them).
READ_ONCE_VARIABLE = "CRYOSNAP_RESTORE_READ_ONCE"

_WRITER = re.compile(r"data/[0-9]{12}-r([0-9]{5})-[^/]+\.dat")

# One replicated chunk: its data file, offset and length.
Range = tuple[str, int, int]


def read_once_enabled() -> bool:
    """Whether restores share the replicated reads (``CRYOSNAP_RESTORE_READ_ONCE``, default
    on; ``0``, ``false`` or ``no`` turn it off). The same on every rank, as the job's
    environment is: it decides whether the ranks run the exchange."""
    value = os.environ.get(READ_ONCE_VARIABLE, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(
        f"{READ_ONCE_VARIABLE}={value!r} is invalid: allowed are 1/true/yes/on or 0/false/no/off"
    )


def shared_reads(coord: Coordinator, store: Store, record: CommitRecord) -> Store:
    """Collective: ``store`` with the other ranks' shares of the replicated chunks of
    ``record``'s version held in memory (:class:`SharedReads`), after reading this rank's
    share and sending it to every other rank. A part this rank cannot resolve or read sends
    nothing: the others then read those chunks themselves, and this rank's own read meets
    the error as it would have."""
    me, world = coord.rank, coord.world_size
    mine: list[Range] = []
    wanted: list[Range] = []
    try:
        for where in _replicated_ranges(store, record, me):
            writer = _writer(where[0])
            if writer is None:
                continue
            (mine if writer % world == me else wanted).append(where)
        payload = _payload(store, mine)
    except CheckpointError as exc:
        log.warning("rank %d: sharing its replicated chunks failed: %s", me, exc)
        payload = b""
    got = coord.exchange({r: payload for r in range(world) if r != me} if payload else {})
    held = SharedReads(store)
    held.take(payload, me)  # this rank's own share, read once too
    for src, body in got.items():
        held.take(body, src)
    return held


def _replicated_ranges(store: Store, record: CommitRecord, rank: int) -> list[Range]:
    """Every replicated chunk of rank's part: (data file, offset, bytes), sorted."""
    manifest, part, keys, _where = engine.resolve_part(store, record, rank)
    replicated = manifest.replicated
    if replicated is None or part.coded:
        return []  # nothing replicated, or coded files (their offsets are the frames')
    chunk = manifest.chunk_bytes
    out: set[Range] = set()
    for blob, key in zip(part.blobs, keys, strict=True):
        if not (replicated is True or (bool(key) and key[0] in replicated)):
            continue
        for j, (f, offset) in enumerate(zip(blob.files, blob.offsets, strict=True)):
            nbytes = min(chunk, blob.nbytes - j * chunk)
            out.add((part.files[int(f)], int(offset), nbytes))
    return sorted(out)


def _writer(key: str) -> int | None:
    m = _WRITER.fullmatch(key)
    return None if m is None else int(m.group(1))


def _payload(store: Store, ranges: Sequence[Range]) -> bytes:
    """``ranges`` read from ``store``: a JSON line naming them, then their bytes in order."""
    if not ranges:
        return b""
    body = bytearray(sum(n for _f, _o, n in ranges))
    view = memoryview(body)
    by_file: dict[str, list[tuple[int, list[memoryview]]]] = {}
    at = 0
    for f, offset, n in ranges:
        by_file.setdefault(f, []).append((offset, [view[at : at + n]]))
        at += n
    for f, reads in by_file.items():
        store.read_ranges(f, reads)
    head = json.dumps([list(r) for r in ranges], separators=(",", ":")).encode()
    return head + b"\n" + bytes(body)


class SharedReads(WrapperStore):
    """``inner`` with some byte ranges of its data files held in memory (what other ranks
    read and sent); a read covered by them is served from memory, any other part of it read
    from ``inner``. Declares no local path, so the read path reads through it (no mapping)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        # Per data file: sorted offsets and the bytes held at each.
        self._starts: dict[str, list[int]] = {}
        self._bodies: dict[str, list[bytes]] = {}
        self.held_bytes = 0

    @property
    def capabilities(self) -> StoreCapabilities:
        return dataclasses.replace(self.inner.capabilities, local_path=None)

    def take(self, payload: bytes, src: int) -> None:
        """Hold what rank ``src`` sent (:func:`_payload`'s layout); a malformed payload is
        ignored (its chunks are read from the store, and verified there)."""
        if not payload:
            return
        cut = payload.find(b"\n")
        try:
            ranges: list[list[Any]] = json.loads(payload[:cut])
        except ValueError:
            log.warning("rank %d sent replicated chunks that cannot be read; reading them", src)
            return
        at = cut + 1
        pieces: dict[str, list[tuple[int, bytes]]] = {}
        for f, offset, n in ranges:
            pieces.setdefault(str(f), []).append((int(offset), payload[at : at + int(n)]))
            at += int(n)
        if at != len(payload):
            log.warning("rank %d sent a truncated share of replicated chunks; reading it", src)
            return
        for f, items in pieces.items():
            known = zip(self._starts.get(f, []), self._bodies.get(f, []), strict=True)
            merged = sorted([*known, *items])
            self._starts[f] = [o for o, _b in merged]
            self._bodies[f] = [b for _o, b in merged]
            self.held_bytes += sum(len(b) for _o, b in items)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.read_ranges(key, [(offset, buffers)])

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        starts = self._starts.get(key)
        if starts is None:
            self.inner.read_ranges(key, ranges)
            return
        rest: list[tuple[int, list[memoryview]]] = []
        for offset, buffers in ranges:
            at = offset
            for buf in buffers:
                flat = memoryview(buf).cast("B")
                rest.extend(self._fill(key, at, flat))
                at += flat.nbytes
        if rest:
            self.inner.read_ranges(key, rest)

    def _fill(self, key: str, offset: int, out: memoryview) -> list[tuple[int, list[memoryview]]]:
        """Copy into ``out`` (file bytes from ``offset``) what is held; the gaps, to read."""
        starts, bodies = self._starts[key], self._bodies[key]
        gaps: list[tuple[int, list[memoryview]]] = []
        pos, end = offset, offset + out.nbytes
        i = max(0, bisect.bisect_right(starts, pos) - 1)
        while pos < end:
            if i < len(starts) and starts[i] <= pos < starts[i] + len(bodies[i]):
                n = min(end, starts[i] + len(bodies[i])) - pos
                lo = pos - starts[i]
                out[pos - offset : pos - offset + n] = bodies[i][lo : lo + n]
                pos += n
                i += 1
                continue
            if i < len(starts) and starts[i] <= pos:
                i += 1  # a piece that ends before pos
                continue
            upto = min(end, starts[i]) if i < len(starts) else end
            gaps.append((pos, [out[pos - offset : upto - offset]]))
            pos = upto
        return gaps
