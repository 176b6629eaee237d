"""The commit record: the document whose presence makes a version exist (docs/FORMAT.md,
"Commit record"), what it says of each rank's manifest (:class:`ManifestRef`), and the
summary of a rank's part it is made of (:class:`PartSummary`, gathered from every rank).

Pure: (de)serialization and validation only, no I/O. Runs on whichever thread calls it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from cryosnap._format.chunks import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from cryosnap._format.document import (
    data_file,
    fail,
    int_field,
    names_ancestor,
    now_unix,
    parse_json,
    unix_field,
    version_file,
)
from cryosnap._format.keys import Lineage, commit_key
from cryosnap._format.limits import MAX_COUNT, MAX_JSON_DEPTH, MAX_RANK, MAX_STEP

__all__ = [
    "COMMIT_FORMAT_VERSION",
    "FORK_COMMIT_FORMAT_VERSION",
    "RUN_ID_PATTERN",
    "CommitRecord",
    "ManifestRef",
    "PartSummary",
]

# Every commit record says this, whatever its manifests say (their versions grow with what
# their skeletons hold: manifest.py; a commit record's fields are the same in all of them).
COMMIT_FORMAT_VERSION = 1
# A commit record naming a data file of an ancestor run (a fork's version, docs/FORMAT.md
# "Forks") says this, so that a cryosnap from before forks refuses it by its version.
FORK_COMMIT_FORMAT_VERSION = 2
# A run id (which training wrote a version): letters, digits and ._:- only, 1 to 128 of them,
# so it is safe in a log line, a file name or a shell command.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True, slots=True)
class ManifestRef:
    """Where a rank's manifest is and what it hashes to."""

    rank: int
    key: str
    xxh3: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class PartSummary:
    """What the commit record needs of one rank's part, and nothing more: small and
    JSON-serialisable, so the parts written by every participant can be gathered and committed
    by one (rank 0 of a distributed run)."""

    ref: ManifestRef
    data_files: tuple[str, ...]  # every data file the part reads (its own and inherited)
    logical_bytes: int
    written_bytes: int
    leaves: int
    root: str  # hex Merkle root of the part
    incremental: bool
    chain: tuple[int, ...]  # steps whose manifests the part resolves through
    # The keys of those manifests (gathered only, never in a record: a commit record in doubt
    # reserves exactly them from retention).
    chain_keys: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.ref.rank,
            "key": self.ref.key,
            "xxh3_128": self.ref.xxh3,
            "bytes": self.ref.nbytes,
            "data_files": list(self.data_files),
            "logical_bytes": self.logical_bytes,
            "written_bytes": self.written_bytes,
            "leaves": self.leaves,
            "root": self.root,
            "incremental": self.incremental,
            "chain": list(self.chain),
            "chain_keys": list(self.chain_keys),
        }

    @classmethod
    def from_json(cls, doc: Any, where: str) -> PartSummary:
        if not isinstance(doc, dict) or not isinstance(doc.get("xxh3_128"), str):
            raise fail(where, f"malformed part summary {doc!r:.120}")
        files = doc.get("data_files")
        if not isinstance(files, list) or not isinstance(doc.get("root"), str):
            raise fail(where, "part summary: 'data_files' must be a list, 'root' a string")
        return cls(
            ref=ManifestRef(
                int_field(doc, "rank", where, hi=MAX_RANK),
                version_file(doc.get("key"), where),
                doc["xxh3_128"],
                int_field(doc, "bytes", where),
            ),
            data_files=tuple(data_file(f, where) for f in files),
            logical_bytes=int_field(doc, "logical_bytes", where),
            written_bytes=int_field(doc, "written_bytes", where),
            leaves=int_field(doc, "leaves", where),
            root=doc["root"],
            incremental=doc.get("incremental") is True,
            chain=tuple(_steps(doc.get("chain", []), where)),
            chain_keys=tuple(
                version_file(k, where) for k in _list(doc.get("chain_keys", []), where)
            ),
        )


def _list(raw: Any, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise fail(where, f"malformed list {raw!r:.120}")
    return raw


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """The record whose presence makes a version exist.

    Written last, atomically, once every manifest and data file it names is durable on the tier.
    It names every data file the version references, so retention can count references without
    opening the manifests.
    """

    step: int
    world_size: int
    manifests: tuple[ManifestRef, ...]
    data_files: tuple[str, ...]
    logical_bytes: int
    written_bytes: int
    leaves: int
    chunk_bytes: int
    root: str
    created_unix: float
    incremental: bool = False
    chain: tuple[int, ...] = ()
    metrics: dict[str, float] | None = None
    run_id: str | None = None  # the training that wrote the version (Checkpointer(run_id=))
    lineage: Lineage | None = None  # a version saved after a rewind (None: generation 0)

    @property
    def key(self) -> str:
        """Where this record lies on a tier."""
        return commit_key(self.step, self.lineage)

    def for_rank(self, rank: int) -> CommitRecord:
        """This record as one rank needs it to read its part: the header and that rank's
        manifest reference only (no data file list: a part's reader checks the files its own
        manifests name). Never written: a distributed restore's leader hands it to the rank."""
        # The references are sorted by rank, one per rank (from_json checks it): O(1).
        if 0 <= rank < len(self.manifests) and self.manifests[rank].rank == rank:
            refs: tuple[ManifestRef, ...] = (self.manifests[rank],)
        else:
            refs = tuple(m for m in self.manifests if m.rank == rank)
        return dataclasses.replace(self, manifests=refs, data_files=())

    def header_json(self) -> dict[str, Any]:
        """What :meth:`for_rank` keeps, as JSON (with ``rank``'s reference as ``manifests``)."""
        return {
            "step": self.step,
            "world_size": self.world_size,
            "manifests": [[m.rank, m.key, m.xxh3, m.nbytes] for m in self.manifests],
            "logical_bytes": self.logical_bytes,
            "written_bytes": self.written_bytes,
            "leaves": self.leaves,
            "chunk_bytes": self.chunk_bytes,
            "root": self.root,
            # As the float's hex (always as long): a rank's entry is the same size whenever
            # the version was made, so the leader sends the same bytes for the same version.
            "created_unix": float(self.created_unix).hex(),
            "incremental": self.incremental,
            "chain": list(self.chain),
            "run_id": self.run_id,
            "lineage": None
            if self.lineage is None
            else [self.lineage.generation, self.lineage.fork],
        }

    @classmethod
    def from_header_json(cls, doc: dict[str, Any]) -> CommitRecord:
        """:meth:`header_json` back (from the leader, which read and checked the record)."""
        lineage = doc["lineage"]
        return cls(
            step=int(doc["step"]),
            world_size=int(doc["world_size"]),
            manifests=tuple(
                ManifestRef(int(r), str(k), str(h), int(n)) for r, k, h, n in doc["manifests"]
            ),
            data_files=(),
            logical_bytes=int(doc["logical_bytes"]),
            written_bytes=int(doc["written_bytes"]),
            leaves=int(doc["leaves"]),
            chunk_bytes=int(doc["chunk_bytes"]),
            root=str(doc["root"]),
            created_unix=float.fromhex(doc["created_unix"]),
            incremental=bool(doc["incremental"]),
            chain=tuple(int(s) for s in doc["chain"]),
            metrics=None,
            run_id=doc["run_id"],
            lineage=None if lineage is None else Lineage(int(lineage[0]), int(lineage[1])),
        )

    @classmethod
    def of_parts(
        cls,
        step: int,
        parts: Sequence[PartSummary],
        *,
        chunk_bytes: int,
        root: str,
        metrics: dict[str, float] | None = None,
        run_id: str | None = None,
        lineage: Lineage | None = None,
    ) -> CommitRecord:
        """The record of ``step`` made of every rank's part (``root``: the Merkle root over
        the parts' roots, in rank order)."""
        parts = sorted(parts, key=lambda p: p.ref.rank)
        return cls(
            step=step,
            world_size=len(parts),
            manifests=tuple(p.ref for p in parts),
            data_files=tuple(sorted({f for p in parts for f in p.data_files})),
            logical_bytes=sum(p.logical_bytes for p in parts),
            written_bytes=sum(p.written_bytes for p in parts),
            leaves=sum(p.leaves for p in parts),
            chunk_bytes=chunk_bytes,
            root=root,
            created_unix=now_unix(),
            incremental=any(p.incremental for p in parts),
            chain=tuple(sorted({s for p in parts for s in p.chain})),
            metrics=metrics or None,
            run_id=run_id,
            lineage=lineage,
        )

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "format_version": FORK_COMMIT_FORMAT_VERSION
            if names_ancestor(self.data_files)
            else COMMIT_FORMAT_VERSION,
            "kind": "cryosnap.commit",
            "step": self.step,
            "world_size": self.world_size,
            "manifests": [
                {"rank": m.rank, "key": m.key, "xxh3_128": m.xxh3, "bytes": m.nbytes}
                for m in self.manifests
            ],
            "data_files": list(self.data_files),
            "logical_bytes": self.logical_bytes,
            "written_bytes": self.written_bytes,
            "leaves": self.leaves,
            "chunk_bytes": self.chunk_bytes,
            "root": self.root,
            "created_unix": self.created_unix,
            "incremental": self.incremental,
            "chain": list(self.chain),
        }
        if self.metrics:
            doc["metrics"] = dict(self.metrics)
        if self.run_id is not None:  # written only when set: older readers never see it
            doc["run_id"] = self.run_id
        if self.lineage is not None:  # the same: only versions saved after a rewind
            doc["lineage"] = {
                "generation": self.lineage.generation,
                "fork": self.lineage.fork,
            }
        doc["checksum"] = _checksum(doc)
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitRecord:
        doc = parse_json(data, where, (COMMIT_FORMAT_VERSION, FORK_COMMIT_FORMAT_VERSION))
        if doc.get("kind") != "cryosnap.commit":
            raise fail(where, "not a cryosnap commit record")
        # A commit record is small and flat: its whole document is checked, so the checksum's
        # own serialization cannot recurse out of the stack.
        _check_depth(doc, where)
        checksum = doc.pop("checksum", None)
        if checksum != _checksum(doc):
            raise fail(where, "checksum mismatch: the commit record is damaged")
        world_size = int_field(doc, "world_size", where, lo=1, hi=MAX_RANK)
        raw = doc.get("manifests")
        if not isinstance(raw, list) or len(raw) != world_size:
            raise fail(where, "field 'manifests' must list one manifest per rank")
        refs = []
        for m in raw:
            if not isinstance(m, dict) or not isinstance(m.get("xxh3_128"), str):
                raise fail(where, f"malformed manifest reference {m!r:.120}")
            key = version_file(m.get("key"), where)
            refs.append(
                ManifestRef(
                    int_field(m, "rank", where, hi=MAX_RANK),
                    str(key),
                    m["xxh3_128"],
                    int_field(m, "bytes", where),
                )
            )
        if sorted(r.rank for r in refs) != list(range(world_size)):
            raise fail(where, "field 'manifests' must name each rank 0..world_size-1 once")
        files = doc.get("data_files")
        if not isinstance(files, list):
            raise fail(where, "field 'data_files' must be a list")
        data_files = tuple(data_file(f, where) for f in files)
        if doc["format_version"] < FORK_COMMIT_FORMAT_VERSION and names_ancestor(data_files):
            raise fail(where, "an ancestor's data file in a commit record of format_version 1")
        created = unix_field(doc, "created_unix", where)
        if not isinstance(doc.get("root"), str):
            raise fail(where, "field 'root' must be a string")
        return cls(
            step=int_field(doc, "step", where, hi=MAX_STEP),
            world_size=world_size,
            manifests=tuple(sorted(refs, key=lambda r: r.rank)),
            data_files=data_files,
            logical_bytes=int_field(doc, "logical_bytes", where),
            written_bytes=int_field(doc, "written_bytes", where),
            leaves=int_field(doc, "leaves", where),
            chunk_bytes=int_field(
                doc, "chunk_bytes", where, lo=MIN_CHUNK_BYTES, hi=MAX_CHUNK_BYTES
            ),
            root=doc["root"],
            created_unix=created,
            incremental=bool(doc.get("incremental", False)),
            chain=tuple(_steps(doc.get("chain", []), where)),
            metrics=_metrics(doc.get("metrics"), where),
            run_id=_run_id(doc.get("run_id"), where),
            lineage=_lineage(doc.get("lineage"), where),
        )


def _metrics(raw: Any, where: str) -> dict[str, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and type(v) in (int, float) and abs(v) <= MAX_COUNT
        for k, v in raw.items()
    ):
        raise fail(where, f"malformed metrics {raw!r:.120}")
    return {k: float(v) for k, v in raw.items()}


def _run_id(raw: Any, where: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not RUN_ID_PATTERN.fullmatch(raw):
        raise fail(where, f"malformed run_id {raw!r:.120}")
    return raw


def _lineage(raw: Any, where: str) -> Lineage | None:
    if raw is None:
        return None
    ok = isinstance(raw, dict) and set(raw) == {"generation", "fork"}
    gen, fork = (raw.get("generation"), raw.get("fork")) if ok else (None, None)
    if not (type(gen) is int and 1 <= gen < 10**9 and type(fork) is int and 0 <= fork <= MAX_STEP):
        raise fail(where, f"malformed lineage {raw!r:.120}")
    return Lineage(gen, fork)


def _steps(raw: Any, where: str) -> list[int]:
    if not isinstance(raw, list) or not all(type(s) is int and 0 <= s <= MAX_STEP for s in raw):
        raise fail(where, f"malformed chain {raw!r:.120}")
    return list(raw)


def _checksum(doc: dict[str, Any]) -> str:
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_hexdigest(body)


def _check_depth(doc: Any, where: str) -> None:
    """Refuse a document nested deeper than MAX_JSON_DEPTH (iterative: no recursion here)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise fail(where, f"nested deeper than {MAX_JSON_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
