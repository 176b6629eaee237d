"""Partner copies: each rank's node-local scratch versions, also on a rank of another node.

With ``partner=True`` a scratch version is durable only once every rank's part is on its own
node and on its partner's; at restart the partner sends lost versions back (:func:`rebuild`).
Runs on the writer thread (copies) and the caller's thread at open (rebuild).
docs/design/distributed.md has the why.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryosnap import engine
from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import commit_key, parse_commit_key
from cryosnap._run.lock import RunLock, acquire_run_lock
from cryosnap.dist import Coordinator, agree
from cryosnap.errors import CheckpointError, CheckpointFormatError, CoordinationError
from cryosnap.policy import RetentionPolicy
from cryosnap.storage import BlobWriter, Store, join_location

__all__ = ["NODE_ENV", "WINDOW_BYTES", "Partners", "node_name", "partner_map", "rebuild"]

log = logging.getLogger("cryosnap")

NODE_ENV = "CRYOSNAP_NODE"
WINDOW_BYTES = 64 << 20  # bytes per message: bounded memory on both sides
_OK, _FAILED = b"\x00", b"\x01"


def node_name() -> str:
    """This process's node: ``$CRYOSNAP_NODE`` when set and not empty, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def partner_map(nodes: Sequence[str]) -> list[int]:
    """Per rank of a job whose rank ``r`` runs on ``nodes[r]``, its partner: the rank of another
    node holding its copies. Every rank computes the same map from the gathered names, and no
    rank holds more copies than the layout forces (each is scratch space, and bytes received
    at every save). A world whose ranks all run on one node has no partners: :class:`ValueError`.

    Where no node holds more than half the ranks, every rank holds exactly one copy
    (:func:`_ring`); otherwise the big node's ranks are dealt out over all the others, and
    theirs over its ranks (:func:`_dealt`)."""
    by_node = _ranks_by_node(nodes)
    if len(by_node) < 2:
        raise ValueError(
            f"partner=True needs ranks on at least two nodes, but all {len(nodes)} run on "
            f"{nodes[0]!r} (node identity: the host name, or ${NODE_ENV})"
        )
    biggest = max(by_node, key=len)
    if 2 * len(biggest) <= len(nodes):
        return _ring(by_node)
    return _dealt(biggest, [r for ranks in by_node if ranks is not biggest for r in ranks])


def _ranks_by_node(nodes: Sequence[str]) -> list[list[int]]:
    """The ranks of each node, in rank order; the nodes in the order of their first rank."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    return list(by_node.values())


def _ring(by_node: Sequence[Sequence[int]]) -> list[int]:
    """The ranks listed node after node, each one's partner ``m`` places on (wrapping around),
    ``m`` the most ranks of one node: with equal nodes a ring over the nodes, node i's j-th
    rank copied to node i+1's j-th. A permutation, so each rank holds one copy; never on the
    source's node while no node has more than half the ranks (a node's ``g <= m <= n - m``
    ranks cannot lie ``m`` places apart, either way round)."""
    order = [r for ranks in by_node for r in ranks]
    m = max(len(ranks) for ranks in by_node)
    out = [0] * len(order)
    for i, rank in enumerate(order):
        out[rank] = order[(i + m) % len(order)]
    return out


def _dealt(big: Sequence[int], others: Sequence[int]) -> list[int]:
    """A node with more ranks (``big``) than all the others together: its parts must go to
    the ``others``, round-robin, so each holds ``len(big) / len(others)`` copies, rounded up
    or down; theirs go one each to ``big``'s first ranks (the rest of ``big`` holds none)."""
    out = [0] * (len(big) + len(others))
    for j, rank in enumerate(big):
        out[rank] = others[j % len(others)]
    for j, rank in enumerate(others):
        out[rank] = big[j]
    return out


@dataclass
class Partners:
    """This rank's side of the partner scheme: whom it copies to, whose copies it holds."""

    rank: int
    target: int  # the rank holding this rank's copies
    held: dict[int, Store]  # owner rank -> the store of its copies on this node
    locks: list[RunLock] = field(default_factory=list)

    @classmethod
    def open(
        cls, coord: Coordinator, root: str, *, open_store: Any, timeout: float | None
    ) -> Partners:
        """Agree on the partner map (collective) and open the copies this rank holds under
        ``root`` (its first scratch path), each with its write lock."""
        nodes = coord.all_gather(node_name())
        partners = partner_map(nodes)
        held = {
            r: open_store(join_location(root, f"partner/rank-{r:05d}"), timeout_seconds=timeout)
            for r, p in enumerate(partners)
            if p == coord.rank
        }
        out = cls(coord.rank, partners[coord.rank], held)
        try:
            for store in held.values():
                out.locks.append(acquire_run_lock(store))
        except BaseException:
            out.release()
            raise
        return out

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks.clear()

    # -- the writer: copy a version's new files, then its commit record -----------------------

    def copy_files(self, coord: Coordinator, src: Store, step: int, keys: Sequence[str]) -> None:
        """Copy ``keys`` of ``src`` that the partner lacks to it, and receive the files of the
        ranks this one holds (collective). Raises after the rounds if any side failed."""
        errors = transfer(coord, {self.target: (src, list(keys))}, self.held)
        if errors:
            raise CheckpointError(f"step {step}: partner copy: {'; '.join(errors)}")

    def copy_record(self, coord: Coordinator, step: int, record: bytes | None) -> list[str]:
        """Send this version's commit record to the partner and write the ones received
        (collective; ``record`` None: this rank has none to send). The failures, if any."""
        got = coord.exchange({self.target: record} if record is not None else {})
        errors: list[str] = []
        for owner, body in got.items():
            store = self.held.get(owner)
            if store is None:
                errors.append(f"rank {owner} sent a commit record to a rank not its partner")
                continue
            try:
                sent = CommitRecord.from_json(body, f"rank {owner}'s commit record")
                if sent.step != step:
                    raise CheckpointFormatError(f"it is the record of step {sent.step}")
                store.write(sent.key, body)
            except CheckpointError as exc:
                errors.append(f"rank {owner}'s copy on {store.url}: {exc}")
        return errors

    def retire(self, keep: int | RetentionPolicy | None, persistent: Store | None) -> None:
        """The copies follow their owners' scratch retention (``keep_scratch``), except that a
        copy of a version the ``persistent`` level has not committed yet is kept: until then
        it may be the only copy left of that version when its owner's node is lost (the
        owner's own flush may lag behind this rank's)."""
        if keep is None:
            return
        try:
            done = set(engine.list_steps(persistent)) if persistent is not None else None
        except CheckpointError as exc:
            log.warning("partner copies kept: listing %s failed: %s", persistent, exc)
            return
        for store in self.held.values():
            try:
                waiting = (
                    {s for s in engine.list_steps(store) if s not in done}
                    if done is not None
                    else set()
                )
                engine.retire(store, keep=keep, protect=waiting)
            except CheckpointError as exc:
                log.warning("retention of partner copies on %s failed: %s", store.url, exc)


def version_keys(store: Store, step: int) -> list[str]:
    """The files version ``step`` of a one-participant run needs, commit record excluded."""
    record = engine.read_commit(store, step)
    return [*record.data_files, *engine.chain_keys(store, record)]


def rebuild(
    coord: Coordinator, own: Store, partners: Partners, *, level: str = "scratch"
) -> list[int]:
    """At open (collective): a rank whose own store on ``level`` (``own``) lacks the newest
    versions its partner holds gets every file of them back from the partner. The steps this
    rank got back."""
    newest = _newest(own)
    mine = {"own": newest, "held": {str(r): _newest(s) for r, s in partners.held.items()}}
    told = coord.all_gather(mine)
    outgoing: dict[int, tuple[Store, list[str]]] = {}
    for owner, store in partners.held.items():
        if _newest(store) > told[owner]["own"]:
            outgoing[owner] = (store, _files_newer_than(store, told[owner]["own"]))
    holder = partners.target
    have = told[holder]["held"].get(str(coord.rank), -1)
    incoming = {holder: own} if have > newest else {}
    steps: list[int] = []
    errors = transfer(coord, outgoing, incoming)
    if errors:
        raise CheckpointError(f"rebuilding {level} from partner copies: {'; '.join(errors)}")
    if incoming:
        steps = [s for s in engine.list_steps(own) if s > newest]
        log.warning(
            "rank %d: %s %s lacked versions %s; copied back from rank %d's partner copy",
            coord.rank,
            level,
            own.url,
            steps,
            holder,
        )
    return steps


def _newest(store: Store) -> int:
    steps = engine.list_steps(store)
    return steps[-1] if steps else -1


def _files_newer_than(store: Store, step: int) -> list[str]:
    """Every file the versions after ``step`` need (their chains included), records last."""
    keys: dict[str, None] = {}
    versions = engine.list_versions(store)
    newer = [s for s in versions if s > step]
    for s in newer:
        keys.update(dict.fromkeys(version_keys(store, s)))
    keys.update(dict.fromkeys(commit_key(s, versions[s]) for s in newer))
    return list(keys)


# -- the transfer protocol ------------------------------------------------------------------------


def transfer(
    coord: Coordinator,
    outgoing: Mapping[int, tuple[Store, list[str]]],
    incoming: Mapping[int, Store],
) -> list[str]:
    """Copy files between ranks (collective: every rank calls it, maybe with nothing to do).

    ``outgoing[dst] = (store, keys)``: offer ``keys`` of ``store`` to ``dst``; ``incoming[src]``:
    the store the files offered by ``src`` go to. A file the receiver has at the same size is
    not sent (data files are never rewritten under one name; manifests and records of a step
    saved again are compared by size, and rewritten when it differs). Commit records are
    written after every other file of the same sender. Returns the failures (both sides')."""
    errors: list[str] = []
    offers: dict[int, bytes] = {}
    sizes: dict[int, dict[str, int]] = {}
    for dst, (store, keys) in outgoing.items():
        try:
            sizes[dst] = {k: store.size(k) for k in keys}
        except CheckpointError as exc:
            errors.append(f"reading {store.url}: {exc}")
            sizes[dst] = {}
        offers[dst] = json.dumps(sizes[dst]).encode()
    offered = {src: json.loads(body) for src, body in coord.exchange(offers).items()}
    wants: dict[int, bytes] = {}
    plan_in: dict[int, list[tuple[str, int]]] = {}
    for src, files in offered.items():
        into = incoming.get(src)
        if into is None:
            raise CoordinationError(f"rank {coord.rank}: rank {src} offered files unasked")
        lacking = [(k, int(n)) for k, n in files.items() if not _has(into, k, int(n))]
        lacking.sort(key=lambda kn: _is_record(kn[0]))  # records last
        plan_in[src] = lacking
        wants[src] = json.dumps([k for k, _ in lacking]).encode()
    wanted = {dst: json.loads(body) for dst, body in coord.exchange(wants).items()}
    senders = {
        dst: _Sender(outgoing[dst][0], [(k, sizes[dst][k]) for k in keys if k in sizes[dst]])
        for dst, keys in wanted.items()
    }
    receivers = {src: _Receiver(incoming[src], files) for src, files in plan_in.items()}
    rounds = agree(coord, max((s.windows for s in senders.values()), default=0), max)
    for _ in range(rounds):
        sends = {dst: s.next() for dst, s in senders.items() if not s.done}
        for src, body in coord.exchange(sends).items():
            receivers[src].take(body)
    for dst, s in senders.items():
        errors.extend(f"sending to rank {dst}: {e}" for e in s.errors)
    for src, r in receivers.items():
        errors.extend(f"receiving from rank {src}: {e}" for e in r.finish())
    return errors


def _is_record(key: str) -> bool:
    return parse_commit_key(key) is not None


def _has(store: Store, key: str, nbytes: int) -> bool:
    try:
        return store.exists(key) and store.size(key) == nbytes
    except CheckpointError:
        return False


class _Sender:
    """One destination's files, read window by window in order."""

    def __init__(self, store: Store, files: list[tuple[str, int]]) -> None:
        self.store = store
        self.files = files
        self.windows = sum(max(1, -(-n // WINDOW_BYTES)) for _, n in files)
        self.errors: list[str] = []
        self._file = 0
        self._offset = 0
        self._sent = 0

    @property
    def done(self) -> bool:
        return self._sent >= self.windows

    def next(self) -> bytes | bytearray:
        key, nbytes = self.files[self._file]
        n = min(WINDOW_BYTES, nbytes - self._offset)
        self._sent += 1
        body: bytes | bytearray
        try:
            # The status byte (zero: _OK), then the window read straight into the message.
            body = bytearray(1 + n)
            if n:
                self.store.read_into(key, self._offset, [memoryview(body)[1:]])
        except CheckpointError as exc:
            self.errors.append(f"{self.store.url}/{key}: {exc}")
            body = _FAILED + str(exc).encode()
        self._offset += n
        if self._offset >= nbytes:
            self._file, self._offset = self._file + 1, 0
        return body


class _Receiver:
    """One sender's files, written window by window; commit records held until the end."""

    def __init__(self, store: Store, files: list[tuple[str, int]]) -> None:
        self.store = store
        self.files = files
        self.errors: list[str] = []
        self._file = 0
        self._got = 0
        self._writer: BlobWriter | None = None
        self._records: list[tuple[str, bytes]] = []
        self._broken: set[str] = set()

    def take(self, body: bytes) -> None:
        key, nbytes = self.files[self._file]
        data = memoryview(body)[1:]
        if body[:1] != _OK:
            self._broken.add(key)
            self.errors.append(f"{key}: the sender could not read it: {bytes(data).decode()}")
        elif key not in self._broken:
            try:
                if _is_record(key):
                    self._records.append((key, bytes(data)))
                else:
                    if self._writer is None:
                        self._writer = self.store.open_writer(key)
                    self._writer.write([data])
            except CheckpointError as exc:
                self._broken.add(key)
                self.errors.append(f"{self.store.url}/{key}: {exc}")
                self._abort()
        self._got += len(data)
        if self._got >= nbytes:
            if self._writer is not None and key not in self._broken:
                try:
                    self._writer.commit()
                except CheckpointError as exc:
                    self._broken.add(key)
                    self.errors.append(f"{self.store.url}/{key}: {exc}")
            self._writer = None
            self._file, self._got = self._file + 1, 0

    def _abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None

    def finish(self) -> list[str]:
        """Write the commit records, unless a file failed (a record never names a missing
        file). The failures."""
        self._abort()
        if self._broken or self._file < len(self.files):
            if self._file < len(self.files):
                self.errors.append(f"{len(self.files) - self._file} file(s) never arrived")
            return self.errors
        for key, body in self._records:
            try:
                self.store.write(key, body)
            except CheckpointError as exc:
                self.errors.append(f"{self.store.url}/{key}: {exc}")
        return self.errors
