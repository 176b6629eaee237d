"""ChainIndex: what the next incremental version builds on (the base and the content index).

Invariant: the index never names a data file that retention deleted or is about to delete.
Runs on the writer thread only (flushers set :meth:`reset` through a flag).
docs/design/write-path.md has the why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from cryosnap import engine
from cryosnap._format.keys import Lineage, supersedes
from cryosnap.errors import CheckpointError
from cryosnap.storage import Store

__all__ = ["ChainIndex"]

log = logging.getLogger("cryosnap")

Base = engine.ResolvedPart | engine.PartResult


class ChainIndex:
    """The base and content index of one rank's chain on the level versions are written to."""

    def __init__(self, *, incremental: bool, full_every: int, chunk_bytes: int, rank: int) -> None:
        self.incremental = incremental
        self.full_every = full_every
        self.chunk_bytes = chunk_bytes
        self.rank = rank
        self._base: Base | None = None
        # The lineage of the version the base belongs to: a version saved after a rewind
        # never builds on one its lineage supersedes (docs/FORMAT.md, "Superseding").
        self._base_lineage: Lineage | None = None
        self.index: dict[bytes, tuple[str, int]] = {}
        self._loaded = False
        self._reset = False  # set from another thread: the next version must be full
        # Set from the caller's thread by a restore that rewinds the run: the next version
        # builds on that step (or is full), never on a version it supersedes.
        self._restart: int | None = None

    def restart_from(self, step: int) -> None:
        """The next version builds on version ``step`` (a restore rewound the run to it)."""
        self._restart = step

    def request_full(self) -> None:
        """The next version is written in full (a flusher found the chain damaged)."""
        self._reset = True

    def base_for_next(
        self,
        store: Store,
        *,
        full: bool = False,
        exact: int | None = None,
        step: int | None = None,
        lineage: Lineage | None = None,
    ) -> engine.ResolvedPart | None:
        """The resolved base of the next version, or None when it must be full.

        ``full``: the capture asks for a full version. ``exact``: the capture left out chunks
        it found unchanged since version ``exact``, so the base must be that version, whatever
        the chain's depth; when it is not (that version failed, or the chain was reset) the
        version cannot be written: :class:`~cryosnap.CheckpointError`. ``step``, ``lineage``:
        the next version's; a base at or after ``step``, or one ``lineage`` supersedes (the
        chain was left on a trajectory a rewind abandoned: a flush that was behind, a level
        the rewind did not restart), is dropped for the newest version it may build on.
        """
        if self._reset:
            self._reset = False
            self.forget()
        restart, self._restart = self._restart, None
        if restart is not None or (step is not None and not self._fits(step, lineage)):
            self.forget()
            self._loaded = False
        if not self._loaded:
            self._load(store, restart, step, lineage)
        base = self._base if self.incremental else None
        if full:
            return None
        if exact is not None:
            have = None if base is None else base.manifest.step
            if have != exact:
                raise CheckpointError(
                    f"the chunks found unchanged on the device since step {exact} were not "
                    f"copied, but step {exact} is not the base of this version (it failed or "
                    f"the chain was reset; the base is {have}): the version is lost, the next "
                    "one is captured in full"
                )
        elif base is None or base.depth >= self.full_every:
            return None  # full: no chain yet, or the chain is long enough
        if isinstance(base, engine.PartResult):
            # Resolved only when it is a base: a run that saves once, writes only full versions
            # or ends a chain here never pays for it.
            base = self._base = base.resolved()
        return base

    def _fits(self, step: int, lineage: Lineage | None) -> bool:
        """Whether the current base may be the base of version ``step`` of ``lineage``."""
        base = self._base
        if base is None:
            return True
        at = base.manifest.step
        return at < step and not supersedes(lineage, at, self._base_lineage)

    def _load(
        self,
        store: Store,
        restart: int | None = None,
        step: int | None = None,
        lineage: Lineage | None = None,
    ) -> None:
        # First save of this session (or after a rewind): continue the run's chain from its
        # newest version that version ``step`` of ``lineage`` may build on (before it, not
        # superseded by it), or from ``restart``, the version a restore rewound the run to,
        # when this level has it.
        self._loaded = True
        versions = engine.list_versions(store)
        latest = [
            s
            for s, lin in versions.items()
            if step is None or (s < step and not supersedes(lineage, s, lin))
        ]
        if restart is not None:
            latest = [restart] if restart in latest else []
        if not latest or not self.incremental:
            return
        try:
            base = engine.resolve_version(store, latest[-1], rank=self.rank)
        except CheckpointError as exc:
            log.warning("step %d cannot be a base, next version is full: %s", latest[-1], exc)
            return
        if base.manifest.chunk_bytes == self.chunk_bytes:
            self._base, self.index = base, base.locations()
            self._base_lineage = versions[latest[-1]]

    def advance(self, part: engine.PartResult, lineage: Lineage | None = None) -> None:
        """``part`` (of ``lineage``) is committed: it is the next base, its new chunks join
        the index."""
        self._base, self._base_lineage = part, lineage
        if part.incremental:
            self.index.update(part.new_index)
        else:
            # A full version starts a new chain; older content stays referenced only by older
            # versions, so retention can reclaim it.
            self.index = dict(part.new_index)

    def forget_files(self, files: Collection[str]) -> None:
        """No later version may reference these data files (retention is about to delete
        them). The base, the version just committed, is protected by retention."""
        gone = set(files)
        if gone:
            self.forget_where(gone.__contains__)

    def forget_where(self, doomed: Callable[[str], bool]) -> None:
        """:meth:`forget_files` of every data file ``doomed`` says yes to (a description of
        the doomed files that need not list them: retention's decision on a shared level)."""
        if not self.index:
            return
        verdicts: dict[str, bool] = {}
        kept: dict[bytes, tuple[str, int]] = {}
        for h, loc in self.index.items():
            key = loc[0]
            gone = verdicts.get(key)
            if gone is None:
                gone = verdicts[key] = doomed(key)
            if not gone:
                kept[h] = loc
        self.index = kept

    def forget(self) -> None:
        """The next version is full: what the base points to may be gone."""
        self._base, self._base_lineage, self.index = None, None, {}
