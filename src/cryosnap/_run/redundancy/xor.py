"""XOR parity sets (``partner="xor"``): each rank's scratch part protected by parity spread
over k ranks of k distinct nodes, at about 1/(k-1) of a part per rank (SCR's and VeloC's XOR).

Owns the sets, the parity files of each version (encoded on the writer thread, collectively
over ``Coordinator.exchange``) and their retention; the rebuild at open is in xor_rebuild.py.
docs/design/distributed.md has the why and the layout, docs/FORMAT.md the files.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cryosnap import engine
from cryosnap._format.keys import Lineage
from cryosnap._run.redundancy import partner as _partner
from cryosnap.dist import Coordinator, agree
from cryosnap.errors import CheckpointError, CheckpointFormatError
from cryosnap.storage import BlobWriter, Store, join_location, validate_key

__all__ = [
    "DEFAULT_SET_SIZE",
    "SET_SIZE_ENV",
    "STATUS_FAILED",
    "STATUS_OK",
    "Index",
    "Member",
    "Parity",
    "ParityIndex",
    "Payload",
    "count",
    "exchange_layouts",
    "index_key",
    "layout",
    "members_from_json",
    "members_to_json",
    "payload_keys",
    "retire",
    "segment_bytes",
    "segment_of",
    "set_size",
    "to_member",
    "version_name",
    "xor_into",
    "xor_sets",
]

log = logging.getLogger("cryosnap")

SET_SIZE_ENV = "CRYOSNAP_XOR_SET_SIZE"
DEFAULT_SET_SIZE = 8  # SCR's and VeloC's default
INDEX_FORMAT = 1
STATUS_OK, STATUS_FAILED = b"\x00", b"\x01"  # the first byte of every window sent


# -- the sets ------------------------------------------------------------------------------------


def set_size(environ: Mapping[str, str] | None = None) -> int:
    """k, the most ranks (and nodes) of one set: ``$CRYOSNAP_XOR_SET_SIZE``, else 8."""
    env = os.environ if environ is None else environ
    raw = env.get(SET_SIZE_ENV, "").strip()
    if not raw:
        return DEFAULT_SET_SIZE
    try:
        k = int(raw)
    except ValueError:
        k = 0
    if k < 3:
        raise ValueError(
            f"${SET_SIZE_ENV}={raw!r:.40} is invalid: an XOR set holds 3 or more ranks (2 would "
            "be a full copy: partner=True)"
        )
    return k


def xor_sets(nodes: Sequence[str], k: int) -> list[list[int]]:
    """The XOR sets of a job whose rank ``r`` runs on ``nodes[r]``: the nodes, in the order of
    their first rank, cut into the fewest groups of at most ``k`` consecutive nodes (sizes
    balanced); in each group, the ``l``-th rank of every node forms a set. So no set holds two
    ranks of one node. A rank left alone in its set (its node has more ranks than the others
    of its group; all ranks on one node) raises :class:`ValueError`."""
    order = list(dict.fromkeys(nodes))
    by_node: dict[str, list[int]] = {n: [] for n in order}
    for rank, node in enumerate(nodes):
        by_node[node].append(rank)
    if len(order) < 2:
        raise ValueError(
            f"partner='xor' needs ranks on at least two nodes, but all {len(nodes)} run on "
            f"{order[0]!r} (node identity: the host name, or ${_partner.NODE_ENV})"
        )
    groups = math.ceil(len(order) / k)
    bounds = [round(i * len(order) / groups) for i in range(groups + 1)]
    sets: list[list[int]] = []
    for lo, hi in itertools.pairwise(bounds):
        group = order[lo:hi]
        for level in range(max(len(by_node[n]) for n in group)):
            members = [by_node[n][level] for n in group if len(by_node[n]) > level]
            if len(members) < 2:
                raise ValueError(
                    f"partner='xor': rank {members[0]} on {nodes[members[0]]!r} has no rank of "
                    f"another node to form an XOR set with (nodes {group} hold "
                    f"{[len(by_node[n]) for n in group]} ranks): run as many ranks on every node"
                )
            sets.append(sorted(members))
    return sets


# -- the layout (pure) ---------------------------------------------------------------------------


def segment_bytes(payload_bytes: Sequence[int], k: int) -> int:
    """The segment size of a set whose members' payloads have these sizes: the largest split
    in ``k - 1`` (the others count as padded to it; the padding is never stored)."""
    return -(-max(payload_bytes, default=0) // (k - 1))


def segment_of(holder: int, member: int, k: int) -> int:
    """Which of ``member``'s segments (0..k-2) the parity held by ``holder`` covers (both are
    positions in the set; ``holder != member``)."""
    return (holder - member - 1) % k


def version_name(step: int, generation: int) -> str:
    """``<step:012d>[-g<generation>]``: how a version's parity files are named."""
    return f"{step:012d}" if generation == 0 else f"{step:012d}-g{generation}"


def index_key(step: int, lineage: Lineage | None) -> str:
    return f"index/{version_name(step, 0 if lineage is None else lineage.generation)}.json"


@dataclass(frozen=True)
class Member:
    """One set member's part of a version: ``files`` (key, bytes) it wrote, in payload order;
    ``needs``: every file its part reads (inherited data files, the chain's manifests);
    ``record``: its commit record's JSON text."""

    files: tuple[tuple[str, int], ...]
    needs: tuple[str, ...]
    record: str

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.files)


@dataclass(frozen=True)
class ParityIndex:
    """What one rank's parity file of one version covers (docs/FORMAT.md, "XOR parity")."""

    step: int
    generation: int
    ranks: tuple[int, ...]  # the set, in stripe order
    rank: int  # the holder
    segment_bytes: int
    parity_key: str
    parity_bytes: int
    members: dict[int, Member]

    @property
    def name(self) -> str:
        return version_name(self.step, self.generation)

    @property
    def key(self) -> str:
        return f"index/{self.name}.json"

    def to_json(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT,
            "step": self.step,
            "generation": self.generation,
            "ranks": list(self.ranks),
            "rank": self.rank,
            "segment_bytes": self.segment_bytes,
            "parity": {"key": self.parity_key, "nbytes": self.parity_bytes},
            "members": members_to_json(self.members),
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ParityIndex:
        try:
            doc = json.loads(data)
            if doc["format"] != INDEX_FORMAT:
                raise ValueError(f"format {doc['format']!r} is not {INDEX_FORMAT}")
            out = cls(
                step=count(doc["step"]),
                generation=count(doc["generation"]),
                ranks=tuple(count(r) for r in doc["ranks"]),
                rank=count(doc["rank"]),
                segment_bytes=count(doc["segment_bytes"]),
                parity_key=validate_key(doc["parity"]["key"]),
                parity_bytes=count(doc["parity"]["nbytes"]),
                members=members_from_json(doc["members"]),
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointFormatError(f"{where}: not an XOR parity index: {exc}") from None
        if set(out.members) != set(out.ranks) or out.rank not in out.ranks:
            raise CheckpointFormatError(f"{where}: its members are not its set {out.ranks}")
        return out

    @property
    def parity_keys(self) -> tuple[str, ...]:
        return (self.parity_key,)


def members_to_json(members: Mapping[int, Member]) -> dict[str, Any]:
    return {
        str(r): {"files": [list(f) for f in m.files], "needs": list(m.needs), "record": m.record}
        for r, m in sorted(members.items())
    }


def members_from_json(doc: Any) -> dict[int, Member]:
    """The members of an index's JSON (raises ValueError, TypeError, KeyError)."""
    return {
        int(r): Member(
            files=tuple((validate_key(k), count(n)) for k, n in m["files"]),
            needs=tuple(validate_key(k) for k in m["needs"]),
            record=str(m["record"]),
        )
        for r, m in doc.items()
    }


def count(value: Any) -> int:
    """``value`` if it is a count (an int, not negative); else ValueError."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r:.40} is not a count")
    return value


# -- a member's payload: its files as one byte range -------------------------------------------


class Payload:
    """The files a member wrote for a version, read as one range (segments span files)."""

    def __init__(self, store: Store, files: Sequence[tuple[str, int]]) -> None:
        self.store = store
        self.files = list(files)
        self.nbytes = sum(n for _, n in self.files)

    def window(self, start: int, n: int, end: int) -> bytes | bytearray:
        """A message: the status byte, then the bytes ``[start, start + n)`` clipped to
        ``end`` and the payload's size (those beyond count as zeros: not sent)."""
        stop = min(start + n, end, self.nbytes)
        body = bytearray(1 + max(0, stop - start))
        view = memoryview(body)[1:]
        at, done = 0, 0
        try:
            for key, size in self.files:
                lo, hi = max(start, at), min(stop, at + size)
                if lo < hi:
                    self.store.read_into(key, lo - at, [view[done : done + hi - lo]])
                    done += hi - lo
                at += size
        except CheckpointError as exc:
            return STATUS_FAILED + f"{self.store.url}: {exc}".encode()
        return body


def xor_into(acc: np.ndarray[Any, np.dtype[np.uint8]], body: bytes | bytearray) -> int:
    """XOR a message's bytes into ``acc`` (zero-padded); their count."""
    data = np.frombuffer(body, np.uint8, offset=1)
    np.bitwise_xor(acc[: data.size], data, out=acc[: data.size])
    return int(data.size)


def window_bytes(k: int) -> int:
    """Bytes per member per round: a rank receives from ``k - 1`` members at once."""
    return max(1, _partner.WINDOW_BYTES // (k - 1))


# -- the room ------------------------------------------------------------------------------------


@dataclass
class Parity:
    """This rank's side of the XOR scheme: its set and the store of its parity files
    (``<first scratch path>/xor/rank-<r>``, on its node)."""

    rank: int
    ranks: tuple[int, ...]  # this rank's set, in stripe order
    store: Store

    @classmethod
    def open(
        cls,
        coord: Coordinator,
        root: str,
        *,
        open_store: Callable[..., Store],
        timeout: float | None,
    ) -> Parity:
        """Agree on the sets (collective: the node names are gathered) and open this rank's
        parity store under ``root``."""
        k = set_size()
        nodes = coord.all_gather(_partner.node_name())
        (mine,) = [s for s in xor_sets(nodes, k) if coord.rank in s]
        store = open_store(
            join_location(root, f"xor/rank-{coord.rank:05d}"), timeout_seconds=timeout
        )
        return cls(coord.rank, tuple(mine), store)

    @property
    def position(self) -> int:
        return self.ranks.index(self.rank)

    def read_index(self, key: str) -> ParityIndex:
        return ParityIndex.from_json(self.store.read(key), f"{self.store.url}: {key}")

    # -- the writer: one version's parity ------------------------------------------------------

    def encode(
        self,
        coord: Coordinator,
        store: Store,
        part: engine.PartResult,
        lineage: Lineage | None,
        record: bytes | None,
    ) -> list[str]:
        """Write this rank's parity of the version ``part`` belongs to, from the files the set's
        members wrote for it (collective on ``coord``: every rank calls it, ``record`` None
        when this rank has no commit record to protect). The failures (this set's), if any."""
        step = part.manifest.step
        mine, members, errors = exchange_layouts(coord, self.ranks, store, part, record)
        k = len(self.ranks)
        seg = segment_bytes([m.nbytes for m in members.values()], k)
        w = window_bytes(k)
        rounds = 0 if errors else -(-seg // w)
        everyone = agree(coord, rounds, max)
        generation = 0 if lineage is None else lineage.generation
        key = f"parity/{version_name(step, generation)}-{secrets.token_hex(4)}.xor"
        writer = self.store.open_writer(key) if not errors else None
        try:
            parity_bytes = self._stream(
                coord, Payload(store, mine.get("files", [])), seg, rounds, everyone, writer, errors
            )
            if writer is not None and not errors:
                writer.commit()
                index = ParityIndex(
                    step,
                    generation,
                    self.ranks,
                    self.rank,
                    seg,
                    key,
                    parity_bytes,
                    members,
                )
                self.store.write(index.key, index.to_json())
        except CheckpointError as exc:
            errors.append(f"{self.store.url}: {exc}")
        finally:
            if writer is not None and errors:
                writer.abort()
        return errors

    def _stream(
        self,
        coord: Coordinator,
        payload: Payload,
        seg: int,
        rounds: int,
        everyone: int,
        writer: BlobWriter | None,
        errors: list[str],
    ) -> int:
        """The rounds of :meth:`encode`: to each member the window of this rank's segment its
        parity covers; from each, the window of theirs this rank's covers, XORed and appended.
        Every rank takes part in ``everyone`` rounds. The parity's length."""
        k, me = len(self.ranks), self.position
        w = window_bytes(k)
        acc = np.zeros(w, np.uint8)
        written = 0
        for t in range(everyone):
            sends: dict[int, bytes | bytearray] = {}
            if t < rounds:
                o = t * w
                for pos, dst in enumerate(self.ranks):
                    if dst != self.rank:
                        q = segment_of(pos, me, k)
                        sends[dst] = payload.window(q * seg + o, min(w, seg - o), (q + 1) * seg)
            got = coord.exchange(sends)
            if t >= rounds or writer is None:
                continue
            acc[:] = 0
            n = 0
            for src, body in got.items():
                if body[:1] != STATUS_OK:
                    errors.append(f"rank {src}: {bytes(body[1:]).decode(errors='replace')}")
                    continue
                n = max(n, xor_into(acc, body))
            if not errors:
                writer.write([acc.data[:n]])
                written += n
        return written

    # -- retention -----------------------------------------------------------------------------

    def retire(self, own: Store) -> None:
        """Keep the parity of the versions on this rank's scratch (``own``): :func:`retire`."""
        retire(self.store, own, self.read_index, "XOR")


class Index(Protocol):
    """What retention reads of a parity index (XOR's or Reed-Solomon's)."""

    @property
    def members(self) -> dict[int, Member]: ...

    @property
    def parity_keys(self) -> tuple[str, ...]: ...


def retire(store: Store, own: Store, read_index: Callable[[str], Index], what: str) -> None:
    """Keep the parity (on ``store``) of the versions on this rank's scratch (``own``) and of
    every older version whose files they still read; delete the rest (indexes first, then the
    parity files no kept index names). Any failure to read keeps everything, logged."""
    try:
        versions = engine.list_versions(own)
        indexes = {k: read_index(k) for k in store.list("index")}
        parities = store.list("parity")
    except CheckpointError as exc:
        log.warning("%s parity kept: reading %s failed: %s", what, store.url, exc)
        return
    kept = {index_key(s, lin) for s, lin in versions.items()} & set(indexes)
    needed = {f for k in kept for m in indexes[k].members.values() for f in m.needs}
    kept |= {
        k
        for k, idx in indexes.items()
        if any(f in needed for m in idx.members.values() for f, _ in m.files)
    }
    named = {p for k in kept for p in indexes[k].parity_keys}
    try:
        for k in sorted(set(indexes) - kept):
            store.delete(k)
        for k in parities:
            if k not in named:
                store.delete(k)
    except CheckpointError as exc:
        log.warning("retention of %s parity on %s failed: %s", what, store.url, exc)


def payload_keys(part: engine.PartResult) -> list[str]:
    """The files a version wrote (its new data files, then its manifest): what its parity
    covers."""
    step = part.manifest.step
    new = [k for k in part.manifest.data_files if k.startswith(f"data/{step:012d}-")]
    return [*new, part.ref.key]


def layout(store: Store, part: engine.PartResult, record: bytes | None) -> dict[str, Any]:
    if record is None:
        return {"error": "no commit record"}
    try:
        files = [[k, store.size(k)] for k in payload_keys(part)]
    except CheckpointError as exc:
        return {"error": f"reading {store.url}: {exc}"}
    needs = sorted({*part.used_files(), *part.chain_keys()})
    return {"files": files, "needs": needs, "record": record.decode()}


def exchange_layouts(
    coord: Coordinator,
    ranks: Sequence[int],
    store: Store,
    part: engine.PartResult,
    record: bytes | None,
) -> tuple[dict[str, Any], dict[int, Member], list[str]]:
    """The first exchange of an encode (collective): this rank's layout of the version (its
    files on ``store``, needs and record) to the other members of its set ``ranks``, theirs
    back. This rank's layout, every member's part (empty on failure) and the failures."""
    mine = layout(store, part, record)
    body = json.dumps(mine).encode()
    got = coord.exchange({r: body for r in ranks if r != coord.rank})
    told: dict[int, Any] = {coord.rank: mine}
    errors: list[str] = []
    for src, raw in got.items():
        try:
            told[src] = json.loads(raw)
        except ValueError:
            errors.append(f"rank {src} sent no layout")
    errors += [f"rank {r}: {t['error']}" for r, t in sorted(told.items()) if "error" in t]
    if set(told) != set(ranks) and not errors:
        errors.append(f"the set {tuple(ranks)} did not all send their layout")
    members = {} if errors else {r: to_member(t) for r, t in told.items()}
    return mine, members, errors


def to_member(told: Any) -> Member:
    return Member(
        files=tuple((str(k), int(n)) for k, n in told["files"]),
        needs=tuple(str(k) for k in told["needs"]),
        record=str(told["record"]),
    )
