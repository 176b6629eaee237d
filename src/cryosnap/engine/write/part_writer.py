"""Write one rank's part of a version (:class:`PartWriter`): hash each batch, diff it
(:class:`Differ`), append the new bytes (:class:`Appender`, one per data file), place the
replicated blobs' shares (:class:`ShareMap`); then the manifest, durable but not committed.

Runs on the writer thread; the appenders on their I/O threads. No collectives here.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from cryosnap import _native
from cryosnap._format.chunks import (
    chunk_count,
    hash_chunks_released,
    hash_each_released,
    merkle_root,
)
from cryosnap._format.commit import ManifestRef
from cryosnap._format.document import now_unix
from cryosnap._format.keys import Lineage, commit_key, data_key, manifest_key
from cryosnap._format.manifest import (
    FILES_FORMAT_VERSION,
    FORMAT_VERSION,
    NUMPY_PACKED_FORMAT_VERSION,
    PACKED_FORMAT_VERSION,
    BaseRef,
    Manifest,
    Replicated,
)
from cryosnap._format.skeleton_text import SkeletonTextCache
from cryosnap._state import FlatState
from cryosnap._state.gc import paused_gc
from cryosnap.engine._limits import WriteLimits
from cryosnap.engine._resolved import ResolvedPart, _Loc, _resolve_one
from cryosnap.engine.items import Hashed, Item, Piece, Unchanged
from cryosnap.engine.write import _compact
from cryosnap.engine.write._appender import Appender, FileCodec
from cryosnap.engine.write._differ import ALIGN_BYTES, Cursor, Differ, FileTable, Segments
from cryosnap.engine.write._shares import Location, Owners, ShareMap, owner_runs
from cryosnap.engine.write._stats import Recorder
from cryosnap.errors import CheckpointError, CheckpointExistsError, StorageError
from cryosnap.storage import Store, decoded
from cryosnap.storage._direct import BLOCK_BYTES, DIRECT_MIN_BYTES
from cryosnap.storage.striped import Placement

__all__ = ["PartResult", "PartWriter"]

_ZEROS = memoryview(bytes(BLOCK_BYTES))  # the longest padding before a run (run_pad)


@dataclass(slots=True)
class PartResult:
    """What one rank wrote for a version. ``resolved()`` (the version as the next one's base)
    is computed on first use: a one-shot save never needs it."""

    ref: ManifestRef
    manifest: Manifest
    base: ResolvedPart | None
    where: str
    new_index: dict[bytes, _Loc]
    logical_bytes: int
    written_bytes: int
    chunks: int
    new_chunks: int
    leaves: int
    root: bytes
    incremental: bool
    # The data files the version reads, exactly (None: own files and all of the base's).
    files: frozenset[str] | None = None
    compacted_bytes: int = 0  # remnants of older files copied into this part's (in written)
    _resolved: ResolvedPart | None = None

    def resolved(self) -> ResolvedPart:
        if self._resolved is None:
            with paused_gc():
                self._resolved = _resolve_one(
                    self.manifest, self.ref.key, self.ref.xxh3, self.base, self.where
                )
        return self._resolved

    def used_files(self) -> set[str]:
        """Data files this version may read: its own plus, if incremental, its base's (a
        superset of what it inherits; the chain is bounded, so retention still reclaims), or
        exactly those its chunks lie in when the writer knew them."""
        if self.files is not None:
            return set(self.files)
        own = set(self.manifest.data_files)
        if self.base is None:
            return own
        # The files the base's chunks lie in (as ResolvedPart.used_files, one numpy call for
        # every blob of a state of many small leaves, not one each).
        base = self.base
        files = [b.files for b in base.blobs]
        used = np.unique(np.concatenate(files)).tolist() if files else []
        return own | {base.files[i] for i in used}

    @property
    def depth(self) -> int:
        """Versions in this version's chain, itself included (as ResolvedPart.depth)."""
        return len(self.chain())

    def chain(self) -> tuple[int, ...]:
        return (
            (self.manifest.step,) if self.base is None else (*self.base.chain, self.manifest.step)
        )

    def chain_keys(self) -> tuple[str, ...]:
        """The keys of the manifests of :meth:`chain` (this rank's), oldest first."""
        return (self.ref.key,) if self.base is None else (*self.base.chain_keys, self.ref.key)


class PartWriter:
    """Streams one rank's part of a version: new chunks into one packed data file (one per
    device with a ``placement`` over several scratch devices), then the manifest (durable, not
    yet committed).

    With a ``base`` the version is incremental: chunks equal to the base's at the same place
    are inherited, and ``index`` (hash -> location of content in kept versions) turns content
    seen before into references. Without one, the version is full: self-contained, with
    duplicate chunks inside it stored once. Pieces of a blob arrive in order and start on chunk
    boundaries.

    ``shares`` (blob index -> the rank that writes each of its chunks, :func:`assign_shares`)
    marks replicated blobs: chunks of another rank's share are hashed (or arrive
    :class:`Hashed` from the capture) and diffed but not written; once every piece is added,
    :meth:`owned_locations` says where this rank's share lies and :meth:`place_external` takes
    where the other ranks' shares lie, before :meth:`finish`. ``replicated`` is recorded in
    the manifest. ``limits``: the groups batches are hashed and queued in (None:
    :meth:`WriteLimits.current`, taken here, on the thread that makes the writer).

    ``codec`` (the persistent level's, ``Checkpointer(codec=)``) stores the part's data files
    coded where it says so, compressed on the appenders' I/O threads; the manifest names them
    coded, and so every older file it names that is coded on the level (chunk hashes and
    offsets stay those of the plain bytes: docs/FORMAT.md, "Coded data files").
    """

    def __init__(
        self,
        store: Store,
        step: int,
        flat: FlatState,
        *,
        chunk_bytes: int,
        rank: int = 0,
        base: ResolvedPart | None = None,
        index: dict[bytes, _Loc] | None = None,
        placement: Placement | None = None,
        shares: dict[int, Owners] | None = None,
        replicated: Replicated = None,
        lineage: Lineage | None = None,
        compact: bool = False,
        skeleton_texts: SkeletonTextCache | None = None,
        limits: WriteLimits | None = None,
        stats: bool = True,
        codec: FileCodec | None = None,
    ) -> None:
        self.limits = limits if limits is not None else WriteLimits.current()
        if store.exists(commit_key(step, lineage)):
            raise CheckpointExistsError(f"step {step} already exists in {store.url}")
        self.generation = 0 if lineage is None else lineage.generation
        self.store = store
        self.step = step
        self.rank = rank
        self.flat = flat
        self.chunk_bytes = chunk_bytes
        self.base = base if base is not None and base.manifest.chunk_bytes == chunk_bytes else None
        self.index = index if self.base is not None and index is not None else {}
        self.placement = placement
        self.replicated = replicated
        # Copy small remnants of older files forward (engine/write/_compact.py): only where
        # retention will drop versions.
        self.compact = compact
        # The writer's cache of the last skeleton's text (None: the manifest keeps nothing).
        self.skeleton_texts = skeleton_texts
        self._used: frozenset[str] | None = None
        self._compacted = 0
        token = secrets.token_hex(4)
        if placement is None:
            keys = [data_key(step, rank, token)]
        else:
            # One data file per device; the key names its device (storage/striped.py).
            keys = [data_key(step, rank, f"{token}-d{d}") for d in range(placement.devices)]
        # File index d is device d's data file; references to older files come after.
        self._files = FileTable(keys)
        self._differ = Differ(
            flat.blobs, chunk_bytes=chunk_bytes, base=self.base, index=self.index, files=self._files
        )
        self._shares = ShareMap(
            shares or {},
            rank=rank,
            step=step,
            blobs=flat.blobs,
            differ=self._differ,
            files=self._files,
        )
        # Decided once per part, before its first write: the manifest, built while the files
        # are still being written and fsynced, says which are coded.
        coded = codec is not None and codec.use()
        self._ios = [
            Appender(store, k, placement, d, codec=codec, coded=coded) for d, k in enumerate(keys)
        ]
        # The files this part may name that are coded on the level: its own (if coded), its
        # chain's, the other ranks' shares' (place_external).
        self._coded: set[str] = set(keys) if coded else set()
        if self.base is not None:
            self._coded.update(self.base.coded)
        self._cursors = [Cursor(d, k) for d, k in enumerate(keys)]
        self._device = 0  # the device taking the new bytes of the batch being diffed
        self._new_share = 1.0  # moving share of new bytes in a batch, to size placements
        self._started = False  # whether a batch was added (the first is split: add)
        # Per-leaf statistics of the float leaves, from the bytes hashed (None: stats=False).
        self._stats = (
            Recorder(flat.skeleton, [b.nbytes for b in flat.blobs], chunk_bytes) if stats else None
        )

    @property
    def files(self) -> list[str]:
        """The data files this part's segments may name (its own first)."""
        return self._files.keys

    @property
    def coded(self) -> frozenset[str]:
        """The data files this part may name that are coded on its level."""
        return frozenset(self._coded)

    @property
    def shares(self) -> dict[int, Owners]:
        return self._shares.shares

    @property
    def new_index(self) -> dict[bytes, _Loc]:
        """Hash -> where this part stored the content (its new chunks)."""
        return self._differ.new_index

    @property
    def chunks(self) -> int:
        return self._differ.chunks

    @property
    def new_chunks(self) -> int:
        return self._differ.new_chunks

    @property
    def written_bytes(self) -> int:
        """The new chunks' bytes (the alignment padding between them is not counted)."""
        return sum(c.offset for c in self._cursors) - self._differ.padding

    def add(self, pieces: Sequence[Item], release: Callable[[], None] = lambda: None) -> None:
        """Hash and diff ``pieces``; their new bytes are appended by the I/O thread, which
        calls ``release`` once it no longer needs the pieces' memory (also on failure).
        :class:`~cryosnap.engine.items.Unchanged` runs (found on the device) are inherited
        from the base, which must be the version the capture compared with."""
        if self.placement is None:
            groups: list[Sequence[Item]] = [pieces]
            if not self._started:
                # The version's first batch: its first few MiB hashed and queued alone, so the
                # disk starts while the rest of the batch is hashed, group by group.
                self._started = True
                groups = _first_groups(pieces, self.chunk_bytes, self.limits)
            self._add_groups(groups, release)
            return
        _add_placed(self, pieces, release, self.placement)

    def _add_groups(self, groups: list[Sequence[Item]], release: Callable[[], None]) -> None:
        """:meth:`add` of the pieces of ``groups`` (in order, one file), each group hashed and
        queued in turn, its new bytes the views back to back at the end of the file;
        ``release`` runs once every group's I/O is done."""
        release_one = release if len(groups) == 1 else _release_after(len(groups), release)
        for i, group in enumerate(groups):
            try:
                before = self._cursors[0].offset
                out = self._diff(group)
            except BaseException:
                for _ in range(len(groups) - i):  # the groups not handed to the I/O thread
                    release_one()
                raise
            self._ios[0].append(out, release_one, self._cursors[0].offset - before)

    def _diff(self, pieces: Sequence[Item]) -> list[memoryview]:
        out: list[memoryview] = []
        cb = self.chunk_bytes
        shares = self._shares
        blobs = self.flat.blobs
        ones: list[Piece] = []  # whole blobs of one chunk, not replicated: _diff_ones
        for p in pieces:
            if type(p) is Piece:
                n = p.view.nbytes
                if (
                    p.offset == 0
                    and 0 < n <= cb
                    and n == blobs[p.blob].nbytes
                    and (not shares or p.blob not in shares.shares)
                ):
                    ones.append(p)
                    continue
            if ones:
                self._diff_ones(ones, out)
                ones = []
            if isinstance(p, Unchanged):
                self._unchanged(p)
            elif isinstance(p, Hashed):
                shares.hashed(p)
            else:
                self._diff_shared(p, out)
        if ones:
            self._diff_ones(ones, out)
        if self._stats is not None:  # once diffed: a blob equal to the base's takes its rows
            self._stats.items(pieces, self._differ)
        return out

    def _diff_shared(self, p: Piece, out: list[memoryview]) -> None:
        """A piece that is not one whole small blob: this rank's chunks diffed and written,
        those of another rank's share (of a replicated blob) hashed and diffed only."""
        owners = self._shares.owners(p.blob) if self._shares else None
        if owners is None:
            self._diff_piece(p, out)
            return
        cb = self.chunk_bytes
        first = p.offset // cb
        for a, count, rank in owner_runs(owners, first, chunk_count(p.view.nbytes, cb)):
            lo = (a - first) * cb
            q = Piece(p.blob, p.offset + lo, p.view[lo : lo + count * cb])
            if rank == self.rank:
                self._diff_piece(q, out)
            else:
                self._shares.foreign(q.blob, a, hash_chunks_released(q.view, cb), rank)

    def _diff_piece(self, p: Piece, out: list[memoryview]) -> None:
        view = p.view
        digests = hash_chunks_released(view, self.chunk_bytes)
        first = p.offset // self.chunk_bytes
        at = self._cursors[self._device]
        address = _native.address_of(view) if view.nbytes >= DIRECT_MIN_BYTES else 0
        for pad, lo, hi in self._differ.diff(p.blob, first, digests, view.nbytes, at, address):
            if pad:
                out.append(_ZEROS[:pad])
            out.append(view[lo:hi])

    def _diff_ones(self, ones: list[Piece], out: list[memoryview]) -> None:
        """Whole blobs of one chunk each, not replicated (most small leaves): hashed in one
        call, each one segment (:meth:`Differ.diff_ones`)."""
        views = [p.view for p in ones]
        digests = hash_each_released(views)
        at = self._cursors[self._device]
        min_bytes = DIRECT_MIN_BYTES
        addresses = [_native.address_of(v) if v.nbytes >= min_bytes else 0 for v in views]
        pads = self._differ.diff_ones([p.blob for p in ones], digests, at, addresses)
        for view, pad in zip(views, pads, strict=True):
            if pad > 0:
                out.append(_ZEROS[:pad])
            if pad >= 0:
                out.append(view)

    def _unchanged(self, u: Unchanged) -> None:
        """Chunks the capture found unchanged since the base: inherited, with the base's
        hashes (the chunks are the same bytes), whoever's share they are."""
        if not self._differ.unchanged(u.blob, u.first, u.count):
            base = self.base
            raise CheckpointError(
                f"step {self.step}: leaf {self.flat.blobs[u.blob].path}: chunks {u.first}.."
                f"{u.first + u.count - 1} were found unchanged on the device, but the base "
                f"version {'(none)' if base is None else base.step} does not hold them"
            )

    # -- replicated blobs: where each rank's share lies -----------------------------------------

    def blob_root(self, i: int) -> bytes:
        """The Merkle root of blob ``i`` (every piece added)."""
        return self._differ.root(i)

    def owned_locations(self) -> list[Location]:
        """Where this rank's share of the replicated blobs lies, every piece added: runs
        ``(blob, first chunk, chunks, data file, offset)`` of chunks back to back in one file
        (new, referenced or inherited: every chunk of the share)."""
        return self._shares.owned_locations()

    def place_external(self, runs: Sequence[Location], coded: Collection[str] = ()) -> None:
        """The other ranks' shares: runs ``(blob, first chunk, chunks, data file, offset)``
        (their :meth:`owned_locations`) become stored segments of this part; ``coded``: the
        files of those runs that are coded on the level (their :attr:`coded`)."""
        self._shares.place_external(runs)
        self._coded.update(coded)

    # -- the end of the part ---------------------------------------------------------------------

    def finish(self) -> PartResult:
        # The manifest is built while the I/O threads fsync the data, and written after; a
        # compacting part's segments first, for the copy of its remnants before the fsync.
        compacting = self.base is not None and self.compact
        segments = self._compacted_segments() if compacting else None
        for io in self._ios:
            io.start_commit()
        try:
            if self.base is not None and not compacting:
                segments = self._compacted_segments()  # nothing to copy: beside the fsync
            with paused_gc():
                manifest, body = self._build(segments)
        finally:
            try:
                for io in self._ios:
                    io.wait_commit()
            finally:
                if self.placement is not None:
                    self.placement.release()
        return self._write_manifest(manifest, body)

    def _check_complete(self) -> None:
        self._shares.check_placed()
        incomplete = self._differ.incomplete()
        if incomplete is not None:
            path = self.flat.blobs[incomplete].path
            raise CheckpointError(f"step {self.step}: leaf {path} was captured incompletely")

    def _compacted_segments(self) -> Segments:
        """The part's segments, with the small remnants of older files it reads copied into
        its own file (appended here, before the fsync); notes the files it reads exactly."""
        self._check_complete()
        with paused_gc():
            segments = self._differ.segments()
            refs = _compact.expand(segments, self.base, self.chunk_bytes)
        if self.compact:
            moves = _compact.plan(
                refs,
                own=set(self._files.keys[: len(self._ios)]),
                fixed_blobs=set(self.shares),
                size_of=self.plain_store().size,
            )
            if moves is not None:
                segments, files = _append_moved(self, segments, refs, moves)
                self._used = frozenset(files)
                return segments
        self._used = frozenset(refs.files())
        return segments

    def plain_store(self) -> Store:
        """The level's store reading the coded files this part may name as their plain bytes
        (the remnants compaction copies forward, their files' sizes)."""
        return decoded(self.store, self._coded)

    def _build(self, segments: Segments | None = None) -> tuple[Manifest, bytes]:
        if segments is None:
            self._check_complete()
            segments = self._differ.segments()
        base, flat = self.base, self.flat
        manifest = Manifest(
            step=self.step,
            rank=self.rank,
            chunk_bytes=self.chunk_bytes,
            data_files=tuple(segments.data_files),
            blobs=tuple(segments.entries),
            skeleton=flat.skeleton,
            leaves=flat.leaves,
            logical_bytes=flat.logical_bytes,
            created_unix=now_unix(),
            base=None if base is None else BaseRef(base.step, base.key, base.xxh3),
            replicated=self.replicated,
            stats=None
            if self._stats is None
            else self._stats.result(None if base is None else base.manifest.stats),
            coded=frozenset(self._coded.intersection(segments.data_files)),
            format_version=(
                NUMPY_PACKED_FORMAT_VERSION
                if flat.numpy_packed
                else FILES_FORMAT_VERSION
                if flat.files
                else PACKED_FORMAT_VERSION
                if flat.packed
                else FORMAT_VERSION
            ),
        )
        # Its format_version as written (columns or not).
        return manifest.encode(self.skeleton_texts)

    def _write_manifest(self, manifest: Manifest, body: bytes) -> PartResult:
        base = self.base
        mkey = manifest_key(self.step, self.rank, self.generation)
        if self.store.exists(mkey):
            # A step saved again (after remove, retention or a crash) whose old manifest a
            # later version may still resolve through: never overwrite it, take a name of its
            # own (the commit record names the key; retention reclaims the old one).
            mkey = f"{mkey.removesuffix('.json')}-{secrets.token_hex(4)}.json"
        self.store.write(mkey, body)
        xxh3 = xxhash.xxh3_128_hexdigest(body)
        return PartResult(
            ref=ManifestRef(self.rank, mkey, xxh3, len(body)),
            manifest=manifest,
            base=base,
            where=f"{self.store.url}: {mkey}",
            new_index=self.new_index,
            logical_bytes=self.flat.logical_bytes,
            written_bytes=self.written_bytes,
            chunks=self.chunks,
            new_chunks=self.new_chunks,
            leaves=self.flat.leaves,
            root=merkle_root([e.root for e in manifest.blobs]),
            incremental=base is not None,
            files=self._used,
            compacted_bytes=self._compacted,
        )

    def abort(self) -> None:
        try:
            for io in self._ios:
                io.abort()
        finally:
            if self.placement is not None:
                self.placement.release()


def _add_placed(
    self: PartWriter, pieces: Sequence[Item], release: Callable[[], None], placement: Placement
) -> None:
    """:meth:`PartWriter.add` over several devices: groups of about ``place_bytes``, each on the
    device the placement chooses; ``release`` runs once every group's I/O is done."""
    groups = _split_pieces(pieces, self.limits.place_bytes, self.chunk_bytes)
    release_one = _release_after(len(groups), release)
    for i, group in enumerate(groups):
        queued = False
        try:
            logical = sum(p.view.nbytes for p in group if isinstance(p, Piece))
            device = placement.choose(int(logical * self._new_share), reserve=logical)
            self._device = device
            before = self._cursors[device].offset
            out = self._diff(group)
            nbytes = self._cursors[device].offset - before
            # Only what the batch writes keeps its reservation of the device's capacity.
            placement.unreserve(device, logical - nbytes)
            if logical:
                self._new_share = 0.5 * self._new_share + 0.5 * nbytes / logical
            placement.enqueue(device, nbytes)
            queued = True
            self._ios[device].append(out, release_one, nbytes)
        except BaseException:
            # Groups not handed to an I/O thread are released here (a queued one is
            # released by its thread, even when its append reports an earlier failure).
            for _ in range(len(groups) - i - (1 if queued else 0)):
                release_one()
            raise


def _append_moved(
    self: PartWriter, segments: Segments, refs: _compact.ChunkRefs, moves: _compact.CompactPlan
) -> tuple[Segments, set[str]]:
    """Read the remnants ``moves`` names and append them to one of the part's files (of
    ``self``, in its ``finish``); the segments that name them there and the files the part
    reads then (as before when a read or the placement failed)."""
    device = 0
    if self.placement is not None:
        nbytes = int(refs.nbytes[moves.distinct].sum()) + ALIGN_BYTES * len(moves.distinct)
        try:
            device = self.placement.choose(nbytes, reserve=nbytes)
        except StorageError:  # no room for the copy on scratch: the references stay
            return segments, refs.files()
    at = self._cursors[device]
    placed = moves.placed(refs, at.offset)
    views = _compact.read_moves(self.plain_store(), refs, moves, placed)
    if views is None:
        return segments, refs.files()
    nbytes = placed.end - placed.start
    if self.placement is not None:
        self.placement.enqueue(device, nbytes)
    self._ios[device].append(views, lambda: None, nbytes)
    at.offset = placed.end
    self._compacted = int(refs.nbytes[moves.distinct].sum())
    self._differ.padding += nbytes - self._compacted
    new_index, key = self.new_index, at.key
    for blob, chunks in _compact.by_blob(refs, moves, placed).items():
        self._differ.relocate(blob, at.file, chunks)
        for _k, offset, _n, digest in chunks:
            new_index[digest] = (key, offset)
    return self._differ.segments(), _compact.files_after(refs, moves, at.key)


def _release_after(count: int, release: Callable[[], None]) -> Callable[[], None]:
    """A callback that runs ``release`` on its ``count``-th call (from any thread)."""
    remaining = [count]
    lock = threading.Lock()

    def release_one() -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            release()

    return release_one


def _first_groups(
    pieces: Sequence[Item], chunk_bytes: int, limits: WriteLimits
) -> list[Sequence[Item]]:
    """A version's first batch in the groups it is hashed and queued in: its first
    ``first_bytes``, then groups of ``next_bytes``."""
    split = _split_pieces(pieces, limits.first_bytes, chunk_bytes)
    if len(split) == 1:
        return [pieces]
    rest = [p for g in split[1:] for p in g]
    return [split[0], *_split_pieces(rest, limits.next_bytes, chunk_bytes)]


def _split_pieces(pieces: Sequence[Item], limit: int, chunk_bytes: int) -> list[list[Item]]:
    """``pieces`` in groups of about ``limit`` bytes; pieces are cut on chunk boundaries
    (unchanged and hashed runs cost nothing and stay in order)."""
    step = max(limit // chunk_bytes, 1) * chunk_bytes
    groups: list[list[Item]] = [[]]
    size = 0
    for p in pieces:
        if not isinstance(p, Piece):
            groups[-1].append(p)
            continue
        lo, n = 0, p.view.nbytes
        if size + n < step:  # the whole piece (most small leaves), not sliced
            groups[-1].append(p)
            size += n
            continue
        while lo < n:
            room = max((step - size) // chunk_bytes, 1) * chunk_bytes
            take = min(n - lo, room)
            groups[-1].append(Piece(p.blob, p.offset + lo, p.view[lo : lo + take]))
            lo += take
            size += take
            if size >= step:
                groups.append([])
                size = 0
    return [g for g in groups if g]
