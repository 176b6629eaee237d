"""Reed-Solomon sets (``partner="rs:K+M"``): each rank's scratch part protected by parity over
sets of K + M or more ranks on as many distinct nodes, M parity blocks per stripe, about M/K
of a part per rank; any M lost nodes of a set are rebuilt (SCR's and FTI's RS level).

Owns the parsing of ``"rs:K+M"``, the sets, the stripe layout, the parity files of each
version (encoded with zfec on the writer thread, collectively over ``Coordinator.exchange``)
and their retention; the rebuild at open is in rs_rebuild.py. XOR's pieces (members, payloads,
retention) are shared from xor.py. docs/design/distributed.md has the layout, docs/FORMAT.md
the files.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cryosnap import engine
from cryosnap._format.keys import Lineage
from cryosnap._run.redundancy import partner as _partner
from cryosnap._run.redundancy.xor import (
    STATUS_FAILED,
    STATUS_OK,
    Member,
    Payload,
    count,
    exchange_layouts,
    members_from_json,
    members_to_json,
    retire,
    version_name,
)
from cryosnap.dist import Coordinator, agree
from cryosnap.errors import CheckpointError, CheckpointFormatError, MissingDependencyError
from cryosnap.storage import BlobWriter, Store, join_location, validate_key

__all__ = [
    "Code",
    "RSIndex",
    "RSParity",
    "element_of",
    "holder_of",
    "parse_rs",
    "require_zfec",
    "rs_sets",
    "stripe_of",
    "window",
]

INDEX_FORMAT = 1
_SPEC = re.compile(r"rs:(\d{1,3})\+(\d{1,3})")


# -- the argument --------------------------------------------------------------------------------


def parse_rs(partner: str) -> tuple[int, int]:
    """(K, M) of ``partner="rs:K+M"``: K >= 2 data ranks and M >= 1 parity ranks per set."""
    match = _SPEC.fullmatch(partner)
    if match is None:
        raise ValueError(
            f"partner={partner!r:.40} is invalid: give False, True, 'xor' or 'rs:K+M' "
            "(Reed-Solomon sets of K data and M parity ranks, e.g. 'rs:4+2')"
        )
    k, m = int(match[1]), int(match[2])
    if k < 2:
        raise ValueError(f"partner={partner!r}: K={k} is invalid: a set needs K >= 2 data ranks")
    if m < 1:
        raise ValueError(
            f"partner={partner!r}: M={m} is invalid: M >= 1 parity ranks per set (M=0 protects "
            "nothing)"
        )
    if k + m > 255:
        raise ValueError(f"partner={partner!r}: K+M={k + m} is over 255, the code's limit")
    return k, m


def require_zfec(partner: str) -> None:
    """Raise MissingDependencyError unless zfec (the erasure code of RS sets) is installed."""
    if importlib.util.find_spec("zfec") is None:
        raise MissingDependencyError(
            f"partner={partner!r} needs the erasure-coding library zfec: pip install 'cryosnap[rs]'"
        )


# -- the sets ------------------------------------------------------------------------------------


def rs_sets(nodes: Sequence[str], k: int, m: int) -> list[list[int]]:
    """The RS sets of a job whose rank ``r`` runs on ``nodes[r]``: the nodes, in the order of
    their first rank, cut into as many groups of at least ``k + m`` consecutive nodes as fit
    (sizes balanced: a group has fewer than ``2 (k + m)``); in each group, the ``l``-th rank of
    every node forms a set. So no set holds two ranks of one node, and each has at least
    ``k`` data ranks. Fewer than ``k + m`` nodes, or a set short of ``k + m`` ranks (nodes with
    unequal rank counts), raise :class:`ValueError`."""
    order = list(dict.fromkeys(nodes))
    by_node: dict[str, list[int]] = {n: [] for n in order}
    for rank, node in enumerate(nodes):
        by_node[node].append(rank)
    n = k + m
    if len(order) < n:
        raise ValueError(
            f"partner='rs:{k}+{m}' needs ranks on K+M = {n} distinct nodes, but they run on "
            f"{len(order)} (node identity: the host name, or ${_partner.NODE_ENV})"
        )
    groups = len(order) // n
    bounds = [round(i * len(order) / groups) for i in range(groups + 1)]
    sets: list[list[int]] = []
    for lo, hi in itertools.pairwise(bounds):
        group = order[lo:hi]
        for level in range(max(len(by_node[x]) for x in group)):
            members = [by_node[x][level] for x in group if len(by_node[x]) > level]
            if len(members) < n:
                raise ValueError(
                    f"partner='rs:{k}+{m}': ranks {members} form a set of {len(members)} "
                    f"nodes, fewer than K+M = {n} (nodes {group} hold "
                    f"{[len(by_node[x]) for x in group]} ranks): run as many ranks on every node"
                )
            sets.append(sorted(members))
    return sets


# -- the layout (pure) ---------------------------------------------------------------------------
#
# A set of n members (positions 0..n-1), M parity blocks per stripe, K = n - M data blocks:
# n stripes; stripe s has its parity blocks j = 0..M-1 on positions s + j and its data blocks
# q = 0..K-1 from positions s + M + q (mod n), block q being that member's segment q. So each
# member gives its K segments to K stripes and holds M parity blocks: M/K of a part.


def element_of(position: int, stripe: int, n: int, m: int) -> int:
    """The block ``position`` holds in ``stripe``: its data segment q (0..K-1) as q, a parity
    block j as K + j (zfec's block numbers)."""
    d = (position - stripe) % n
    return n - m + d if d < m else d - m


def stripe_of(position: int, block: int, n: int, m: int) -> int:
    """The stripe in which ``position`` holds ``block`` (inverse of :func:`element_of`)."""
    k = n - m
    d = block - k if block >= k else block + m
    return (position - d) % n


def holder_of(stripe: int, block: int, n: int, m: int) -> int:
    """The position that holds ``block`` of ``stripe``."""
    k = n - m
    d = block - k if block >= k else block + m
    return (stripe + d) % n


def window(payload: Payload, start: int, nbytes: int, end: int) -> bytes:
    """The status byte, then ``nbytes`` of ``payload`` from ``start``, zeros past ``end`` and
    the payload's size (the padding the code counts; a failure marker if a read failed)."""
    body = payload.window(start, nbytes, end)
    if body[:1] != STATUS_OK:
        return bytes(body)
    return bytes(body) + bytes(1 + nbytes - len(body))


class Code:
    """zfec's Reed-Solomon code of K data and M parity blocks (equal-length bytes)."""

    def __init__(self, k: int, m: int) -> None:
        import zfec

        self.k, self.m = k, m
        self._encoder = zfec.Encoder(k, k + m)
        self._decoder = zfec.Decoder(k, k + m)

    def parity(self, data: Sequence[bytes], block: int) -> bytes:
        """Parity ``block`` (K..K+M-1) of the K ``data`` blocks."""
        return bytes(self._encoder.encode(list(data), [block])[0])

    def block(self, known: Mapping[int, bytes], block: int) -> bytes:
        """``block`` from K known blocks (by number)."""
        if block in known:
            return known[block]
        nums = sorted(known)[: self.k]
        data = [bytes(b) for b in self._decoder.decode([known[i] for i in nums], nums)]
        return data[block] if block < self.k else self.parity(data, block)


# -- the index -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RSIndex:
    """What one rank's parity files of one version cover (docs/FORMAT.md, "RS parity")."""

    step: int
    generation: int
    ranks: tuple[int, ...]  # the set, in stripe order
    rank: int  # the holder
    m: int  # parity blocks per stripe
    segment_bytes: int
    parity: tuple[tuple[str, int], ...]  # (key, bytes) of parity block j = 0..M-1
    members: dict[int, Member]

    @property
    def name(self) -> str:
        return version_name(self.step, self.generation)

    @property
    def key(self) -> str:
        return f"index/{self.name}.json"

    @property
    def parity_keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.parity)

    def to_json(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT,
            "code": "rs",
            "step": self.step,
            "generation": self.generation,
            "ranks": list(self.ranks),
            "rank": self.rank,
            "m": self.m,
            "segment_bytes": self.segment_bytes,
            "parity": [{"key": k, "nbytes": n} for k, n in self.parity],
            "members": members_to_json(self.members),
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> RSIndex:
        try:
            doc = json.loads(data)
            if doc["format"] != INDEX_FORMAT or doc["code"] != "rs":
                raise ValueError(f"format {doc['format']!r} {doc['code']!r:.20} is not rs 1")
            out = cls(
                step=count(doc["step"]),
                generation=count(doc["generation"]),
                ranks=tuple(count(r) for r in doc["ranks"]),
                rank=count(doc["rank"]),
                m=count(doc["m"]),
                segment_bytes=count(doc["segment_bytes"]),
                parity=tuple((validate_key(p["key"]), count(p["nbytes"])) for p in doc["parity"]),
                members=members_from_json(doc["members"]),
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointFormatError(f"{where}: not an RS parity index: {exc}") from None
        if set(out.members) != set(out.ranks) or out.rank not in out.ranks:
            raise CheckpointFormatError(f"{where}: its members are not its set {out.ranks}")
        if not 1 <= out.m <= len(out.ranks) - 2 or len(out.parity) != out.m:
            raise CheckpointFormatError(
                f"{where}: {len(out.parity)} parity files, M={out.m}, of a set of {len(out.ranks)}"
            )
        return out


# -- the room ------------------------------------------------------------------------------------


@dataclass
class RSParity:
    """This rank's side of the RS scheme: its set, M, and the store of its parity files
    (``<first scratch path>/rs/rank-<r>``, on its node)."""

    rank: int
    ranks: tuple[int, ...]  # this rank's set, in stripe order
    m: int
    store: Store

    @classmethod
    def open(
        cls,
        coord: Coordinator,
        root: str,
        *,
        k: int,
        m: int,
        open_store: Callable[..., Store],
        timeout: float | None,
    ) -> RSParity:
        """Agree on the sets (collective: the node names are gathered) and open this rank's
        parity store under ``root``."""
        nodes = coord.all_gather(_partner.node_name())
        (mine,) = [s for s in rs_sets(nodes, k, m) if coord.rank in s]
        store = open_store(
            join_location(root, f"rs/rank-{coord.rank:05d}"), timeout_seconds=timeout
        )
        return cls(coord.rank, tuple(mine), m, store)

    @property
    def position(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def k(self) -> int:
        return len(self.ranks) - self.m

    def read_index(self, key: str) -> RSIndex:
        return RSIndex.from_json(self.store.read(key), f"{self.store.url}: {key}")

    def window_bytes(self) -> int:
        """Bytes per block per round: a rank receives K blocks of each of its M stripes."""
        return max(1, _partner.WINDOW_BYTES // (self.k * self.m))

    # -- the writer: one version's parity ------------------------------------------------------

    def encode(
        self,
        coord: Coordinator,
        store: Store,
        part: engine.PartResult,
        lineage: Lineage | None,
        record: bytes | None,
    ) -> list[str]:
        """Write this rank's M parity blocks of the version ``part`` belongs to, from the files
        the set's members wrote for it (collective on ``coord``: every rank calls it,
        ``record`` None when this rank has no commit record to protect). The failures."""
        mine, members, errors = exchange_layouts(coord, self.ranks, store, part, record)
        seg = -(-max((x.nbytes for x in members.values()), default=0) // self.k)
        rounds = 0 if errors else -(-seg // self.window_bytes())
        everyone = agree(coord, rounds, max)
        name = version_name(part.manifest.step, 0 if lineage is None else lineage.generation)
        token = secrets.token_hex(4)
        keys = [f"parity/{name}-{token}-{j}.rs" for j in range(self.m)]
        writers = [self.store.open_writer(key) for key in keys] if not errors else []
        try:
            payload = Payload(store, mine.get("files", []))
            self._stream(coord, payload, seg, rounds, everyone, writers, errors)
            if writers and not errors:
                for w in writers:
                    w.commit()
                index = RSIndex(
                    part.manifest.step,
                    0 if lineage is None else lineage.generation,
                    self.ranks,
                    self.rank,
                    self.m,
                    seg,
                    tuple((key, seg) for key in keys),
                    members,
                )
                self.store.write(index.key, index.to_json())
        except CheckpointError as exc:
            errors.append(f"{self.store.url}: {exc}")
        finally:
            if writers and errors:
                for w in writers:
                    w.abort()
        return errors

    def _routes(self) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[int]]]:
        """Per other position: the (stripe, segment) windows this rank sends it each round, and
        the stripes (ascending) of the windows it receives from it."""
        n, m, me = len(self.ranks), self.m, self.position
        k = n - m
        sends: dict[int, list[tuple[int, int]]] = {}
        recvs: dict[int, list[int]] = {}
        for s in range(n):
            e = element_of(me, s, n, m)
            if e < k:  # a data block of s: to each of its holders
                for j in range(k, n):
                    sends.setdefault(holder_of(s, j, n, m), []).append((s, e))
            else:
                for q in range(k):
                    recvs.setdefault(holder_of(s, q, n, m), []).append(s)
        return sends, recvs

    def _stream(
        self,
        coord: Coordinator,
        payload: Payload,
        seg: int,
        rounds: int,
        everyone: int,
        writers: Sequence[BlobWriter],
        errors: list[str],
    ) -> None:
        """The rounds of :meth:`encode`: to each parity holder of a stripe this rank has a data
        block in, that block's window; from the data members of each stripe this rank holds a
        parity block of, theirs, encoded and appended to that block's file. Every rank takes
        part in ``everyone`` rounds."""
        n, m, me = len(self.ranks), self.m, self.position
        k, w = n - m, self.window_bytes()
        routes, recvs = self._routes()
        code = Code(k, m) if writers else None
        for t in range(everyone):
            sends: dict[int, bytes] = {}
            o, nbytes = t * w, min(w, seg - t * w)
            if t < rounds:
                for pos, blocks in routes.items():
                    parts = [
                        window(payload, q * seg + o, nbytes, (q + 1) * seg)
                        for q in (e for _, e in blocks)
                    ]
                    bad = [p for p in parts if p[:1] != STATUS_OK]
                    sends[self.ranks[pos]] = (
                        bad[0] if bad else STATUS_OK + b"".join(p[1:] for p in parts)
                    )
            got = coord.exchange(sends)
            if t >= rounds or code is None:
                continue
            data: dict[int, dict[int, bytes]] = {}
            for pos, stripes in recvs.items():
                body = got.get(self.ranks[pos], STATUS_FAILED + b"nothing arrived")
                if body[:1] != STATUS_OK or len(body) != 1 + nbytes * len(stripes):
                    errors.append(
                        f"rank {self.ranks[pos]}: {bytes(body[1:80]).decode(errors='replace')}"
                    )
                    continue
                for i, s in enumerate(stripes):
                    q = element_of(pos, s, n, m)
                    data.setdefault(s, {})[q] = body[1 + i * nbytes : 1 + (i + 1) * nbytes]
            if errors:
                continue
            for j in range(m):
                s = stripe_of(me, k + j, n, m)
                writers[j].write([code.parity([data[s][q] for q in range(k)], k + j)])

    # -- retention -----------------------------------------------------------------------------

    def retire(self, own: Store) -> None:
        """Keep the parity of the versions on this rank's scratch (``own``): xor.retire."""
        retire(self.store, own, self.read_index, "RS")
