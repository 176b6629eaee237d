"""The XOR rebuild at open: a rank whose scratch lost versions the rest of its set holds gets
its files back from their files and parity, verified chunk by chunk before its commit records.

One lost rank per set can be rebuilt; with two, the set's lost versions come from the
persistent level. Runs on the caller's thread at open; its collectives on the coordinator given.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap import engine
from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import Lineage, commit_key
from cryosnap._run.redundancy import partner as _partner
from cryosnap._run.redundancy.xor import (
    STATUS_FAILED,
    STATUS_OK,
    Parity,
    ParityIndex,
    Payload,
    index_key,
    segment_of,
    xor_into,
)
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointError
from cryosnap.storage import BlobWriter, Store, WrapperStore

__all__ = ["Rebuilt", "below", "commit_rebuilt", "rebuild"]

log = logging.getLogger("cryosnap")


@dataclass(frozen=True)
class _Round:
    """One round of a plan: stripe ``stripe``'s window at ``offset`` of index ``entry``."""

    entry: int
    stripe: int
    offset: int
    nbytes: int


def rebuild(coord: Coordinator, own: Store, parity: Parity, *, level: str = "scratch") -> list[int]:
    """At open (collective): rebuild the lost rank of each set that has one on ``level``
    (``own``: this rank's store there, named in the log). The steps this rank got back
    (verified and committed there)."""
    status = {
        "versions": [[s, *_lin(lin)] for s, lin in engine.list_versions(own).items()],
        "indexes": parity.store.list("index"),
    }
    told = coord.all_gather(status)
    lost, leader = _lost(parity.ranks, told, level)
    plan = None
    if lost is not None and coord.rank == leader:
        plan = _plan(parity, lost, told)
    plans = [p for p in coord.all_gather(plan) if p]
    mine = next((p for p in plans if coord.rank in p["set"]), None)
    rounds = max((_rounds(p) for p in plans), default=0)
    if rounds == 0:
        return []
    if mine is not None and mine["lost"] == coord.rank:
        return _receive(coord, own, parity, mine, rounds, level)
    _send(coord, own, parity, mine, rounds)
    return []


def _lin(lineage: Lineage | None) -> list[int]:
    return [0, 0] if lineage is None else [lineage.generation, lineage.fork]


def _lost(ranks: Sequence[int], told: list[Any], level: str) -> tuple[int | None, int | None]:
    """The one rank of the set ``ranks`` lacking versions newer than its newest that every
    other member holds, and the lowest other member (who plans); (None, None) if none. Two
    members behind: logged, nothing rebuilt (the persistent level serves them)."""
    held = {r: {tuple(v) for v in told[r]["versions"]} for r in ranks}
    newest = {r: max((v[0] for v in held[r]), default=-1) for r in ranks}
    top = max(newest.values())
    behind = [r for r in ranks if newest[r] < top]
    for m in behind:
        others = [held[r] for r in ranks if r != m]
        common = set.intersection(*others)
        if any(v[0] > newest[m] for v in common):
            return m, min(r for r in ranks if r != m)
    if len(behind) > 1:
        log.warning(
            "XOR set %s: ranks %s lost versions on %s (newest steps %s); a set rebuilds one "
            "lost rank: their versions come from %s",
            list(ranks),
            behind,
            level,
            [newest[r] for r in behind],
            below(level),
        )
    return None, None


def _plan(parity: Parity, lost: int, told: list[Any]) -> dict[str, Any] | None:
    """The leader: which indexes to decode for ``lost`` and which versions they give back."""
    others = [r for r in parity.ranks if r != lost]
    common = set.intersection(*({tuple(v) for v in told[r]["versions"]} for r in others))
    newest = max((v[0] for v in told[lost]["versions"]), default=-1)
    held = set.intersection(*(set(told[r]["indexes"]) for r in others))
    try:
        indexes = {k: parity.read_index(k) for k in held}
    except CheckpointError as exc:
        log.warning("XOR rebuild of rank %d: reading %s failed: %s", lost, parity.store.url, exc)
        return None
    covering = {
        f: k
        for k, idx in indexes.items()
        if lost in idx.members
        for f, _ in idx.members[lost].files
    }
    entries: dict[str, None] = {}
    targets: list[list[Any]] = []
    for step, gen, fork in sorted(v for v in common if v[0] > newest):
        key = index_key(step, Lineage(gen, fork) if gen else None)
        idx = indexes.get(key)
        if idx is None or tuple(idx.ranks) != tuple(parity.ranks):
            log.warning("XOR rebuild of rank %d: step %d has no parity of this set", lost, step)
            continue
        needs = idx.members[lost].needs
        missing = [f for f in needs if f not in covering]
        if missing:
            log.warning(
                "XOR rebuild of rank %d: step %d: no parity covers %s", lost, step, missing[0]
            )
            continue
        entries.update(dict.fromkeys(covering[f] for f in needs))
        targets.append([step, gen, fork, idx.members[lost].record])
    if not targets:
        return None
    return {
        "set": list(parity.ranks),
        "lost": lost,
        "entries": [
            {
                "key": k,
                "segment_bytes": indexes[k].segment_bytes,
                "index": indexes[k].to_json().decode(),
            }
            for k in sorted(entries)
        ],
        "targets": targets,
    }


def _schedule(plan: dict[str, Any]) -> list[_Round]:
    """Every window of ``plan``, the same on every rank: for each index, the lost rank's
    segments in payload order (stripe after stripe), then its own parity's stripe."""
    ranks: list[int] = plan["set"]
    k, pm = len(ranks), ranks.index(plan["lost"])
    w = _partner.WINDOW_BYTES  # one message per rank and round: the chain below
    out: list[_Round] = []
    for e, entry in enumerate(plan["entries"]):
        seg = int(entry["segment_bytes"])
        for stripe in [(pm + 1 + q) % k for q in range(k - 1)] + [pm]:
            out.extend(_Round(e, stripe, o, min(w, seg - o)) for o in range(0, seg, w))
    return out


def _chain(plan: dict[str, Any]) -> list[int]:
    """The survivors in stripe order, then the lost rank: window t leaves the first survivor
    in round t, each next one XORs its own piece in and passes it on a round later, and the
    lost rank gets the XOR of all of them (one message a round, not k-1)."""
    return [r for r in plan["set"] if r != plan["lost"]] + [plan["lost"]]


def _rounds(plan: dict[str, Any]) -> int:
    return len(_schedule(plan)) + len(plan["set"]) - 2


def _send(
    coord: Coordinator, own: Store, parity: Parity, plan: dict[str, Any] | None, rounds: int
) -> None:
    """A survivor (or a rank of a set with nothing to rebuild: ``plan`` None): its windows,
    each XORed with what the survivor before it in the chain passed on."""
    schedule = _schedule(plan) if plan is not None else []
    chain = _chain(plan) if plan is not None else [parity.rank]
    i = chain.index(parity.rank)
    k = len(parity.ranks)
    me = parity.position
    indexes: dict[int, ParityIndex | None] = {}
    carried: bytes | None = None
    for u in range(rounds):
        sends: dict[int, bytes | bytearray] = {}
        t = u - i  # the window this survivor handles in round u
        if plan is not None and 0 <= t < len(schedule):
            r = schedule[t]
            if r.entry not in indexes:
                indexes[r.entry] = _own_index(parity, plan["entries"][r.entry])
            piece = _piece(own, parity, indexes[r.entry], r, me, k)
            sends[chain[i + 1]] = piece if carried is None else _combine(piece, carried)
        got = coord.exchange(sends)
        carried = got.get(chain[i - 1]) if i > 0 else None


def _combine(a: bytes | bytearray, b: bytes) -> bytes | bytearray:
    """Two windows XORed (zero-padded to the longer); a failure marker wins."""
    if a[:1] != STATUS_OK:
        return a
    if b[:1] != STATUS_OK:
        return b
    out = bytearray(max(len(a), len(b)))
    acc = np.frombuffer(out, np.uint8, offset=1)
    xor_into(acc, a)
    xor_into(acc, b)
    return out


def _own_index(parity: Parity, entry: dict[str, Any]) -> ParityIndex | None:
    """This survivor's index of a plan's ``entry`` (None: unreadable, or of another layout)."""
    try:
        idx = parity.read_index(entry["key"])
    except CheckpointError as exc:
        log.warning("XOR rebuild: %s", exc)
        return None
    if idx.segment_bytes != entry["segment_bytes"] or parity.rank not in idx.members:
        log.warning("XOR rebuild: %s is not the index the plan names", entry["key"])
        return None
    return idx


def _piece(
    own: Store, parity: Parity, idx: ParityIndex | None, r: _Round, me: int, k: int
) -> bytes | bytearray:
    """This survivor's window of round ``r``: its parity if it holds the stripe, else the
    window of its segment the stripe covers."""
    if idx is None:
        return STATUS_FAILED + b"no readable parity index of this version here"
    seg = idx.segment_bytes
    if r.stripe == me:
        return Payload(parity.store, [(idx.parity_key, idx.parity_bytes)]).window(
            r.offset, r.nbytes, seg
        )
    q = segment_of(r.stripe, me, k)
    files = idx.members[parity.rank].files
    return Payload(own, files).window(q * seg + r.offset, r.nbytes, (q + 1) * seg)


class Rebuilt:
    """The lost rank's files of one index, written in payload order (a file it still has at
    the right size is not written again)."""

    def __init__(self, store: Store, files: Sequence[tuple[str, int]]) -> None:
        self.store = store
        self.files = list(files)
        self.nbytes = sum(n for _, n in files)
        self._i = 0
        self._at = 0
        self._writer: BlobWriter | None = None
        self._open()

    @property
    def complete(self) -> bool:
        return self._i >= len(self.files)

    def _open(self) -> None:
        while self._i < len(self.files):
            key, size = self.files[self._i]
            kept = key.startswith("data/") and _has(self.store, key, size)
            self._writer = None if kept else self.store.open_writer(key)
            if size:
                return
            self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.commit()
        self._writer, self._at = None, 0
        self._i += 1

    def append(self, data: memoryview) -> None:
        while data.nbytes and self._i < len(self.files):
            size = self.files[self._i][1]
            n = min(size - self._at, data.nbytes)
            if self._writer is not None:
                self._writer.write([data[:n]])
            self._at += n
            data = data[n:]
            if self._at == size:
                self._close()
                self._open()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


_Open = tuple[Rebuilt, BlobWriter, ParityIndex]  # a lost rank's files, parity, index of one entry


def _has(store: Store, key: str, nbytes: int) -> bool:
    try:
        return store.exists(key) and store.size(key) == nbytes
    except CheckpointError:
        return False


def _receive(
    coord: Coordinator, own: Store, parity: Parity, plan: dict[str, Any], rounds: int, level: str
) -> list[int]:
    """The lost rank: XOR the survivors' windows into its files and its parity, then commit
    each version whose every chunk verifies."""
    schedule = _schedule(plan)
    k, pm = len(plan["set"]), plan["set"].index(coord.rank)
    last = _chain(plan)[-2]  # the survivor that hands this rank each window's XOR
    entries = [
        ParityIndex.from_json(e["index"].encode(), "the rebuild plan") for e in plan["entries"]
    ]
    broken: dict[int, str] = {}
    writers: dict[int, _Open] = {}
    try:
        for u in range(rounds):
            got = coord.exchange({})
            t = u - (k - 2)
            if not 0 <= t < len(schedule) or schedule[t].entry in broken:
                continue
            r = schedule[t]
            try:
                files, out, idx = writers.get(r.entry) or _start(
                    own, parity, entries[r.entry], writers, r.entry
                )
                body = got.get(last, STATUS_FAILED + b"no window arrived")
                if body[:1] != STATUS_OK:
                    raise CheckpointError(bytes(body[1:]).decode(errors="replace"))
                data = memoryview(body)[1:]
                if r.stripe == pm:
                    out.write([data])
                else:
                    # This window's bytes of the lost rank's payload; past its end, padding.
                    start = segment_of(r.stripe, pm, k) * idx.segment_bytes + r.offset
                    files.append(data[: max(0, min(data.nbytes, files.nbytes - start))])
            except CheckpointError as exc:
                broken[r.entry] = str(exc)
                _abort(writers.pop(r.entry, None))
        _finish(parity, writers, broken)
    finally:
        for w in writers.values():
            _abort(w)
    return commit_rebuilt(own, plan["lost"], plan["targets"], broken, "XOR", level)


def _start(
    own: Store, parity: Parity, idx: ParityIndex, writers: dict[int, _Open], entry: int
) -> _Open:
    files = Rebuilt(own, idx.members[parity.rank].files)
    key = f"parity/{idx.name}-r{parity.rank:05d}.xor"
    writers[entry] = (files, parity.store.open_writer(key), idx)
    return writers[entry]


def _abort(w: _Open | None) -> None:
    if w is not None:
        w[0].abort()
        w[1].abort()


def _finish(
    parity: Parity,
    writers: dict[int, _Open],
    broken: dict[int, str],
) -> None:
    """Commit the rebuilt parity of each index and write this rank's index of it."""
    for entry, (files, out, idx) in list(writers.items()):
        try:
            if not files.complete:
                raise CheckpointError(f"step {idx.step}: the rebuilt files are incomplete")
            nbytes = out.tell()
            out.commit()
            mine = ParityIndex(
                idx.step,
                idx.generation,
                idx.ranks,
                parity.rank,
                idx.segment_bytes,
                out.key,
                nbytes,
                idx.members,
            )
            parity.store.write(mine.key, mine.to_json())
        except CheckpointError as exc:
            broken[entry] = str(exc)
            _abort((files, out, idx))
        del writers[entry]


class _WithRecord(WrapperStore):
    """``inner`` as if the commit record ``key`` were written: verify before it is."""

    def __init__(self, inner: Store, key: str, body: bytes) -> None:
        super().__init__(inner)
        self._key, self._body = key, body

    def read(self, key: str) -> bytes:
        return self._body if key == self._key else self.inner.read(key)

    def exists(self, key: str) -> bool:
        return key == self._key or self.inner.exists(key)

    def size(self, key: str) -> int:
        return len(self._body) if key == self._key else self.inner.size(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        keys = self.inner.list(prefix)
        return sorted({*keys, self._key}) if self._key.startswith(prefix) else keys


def below(level: str) -> str:
    """Where a version lost on ``level`` (and not rebuilt) is read from instead."""
    return "the persistent level" if level == "scratch" else "scratch or the persistent level"


def commit_rebuilt(
    own: Store,
    lost: int,
    targets: Sequence[Sequence[Any]],
    broken: dict[int, str],
    what: str,
    level: str,
) -> list[int]:
    """Write the commit record of each rebuilt version (``targets``: [step, generation, fork,
    record text], oldest first) whose part verifies on ``own``, the store of rank ``lost`` on
    ``level`` (scratch or memory, named in the log); ``broken``: the entries that failed,
    logged. The steps committed."""
    if broken:
        log.warning(
            "%s rebuild of rank %d on %s: %s", what, lost, level, "; ".join(broken.values())
        )
    out: list[int] = []
    for step, gen, fork, text in targets:
        lineage = Lineage(gen, fork) if gen else None
        key = commit_key(step, lineage)
        body = text.encode()
        try:
            record = CommitRecord.from_json(body, f"rank {lost}'s record of step {step}")
            if record.step != step or record.lineage != lineage:
                raise CheckpointError(f"it is the record of step {record.step}")
            engine.verify_part(_WithRecord(own, key, body), step)
            own.write(key, body)
        except CheckpointError as exc:
            log.warning(
                "rank %d: step %d could not be rebuilt on %s from %s parity (%s); %s serves it",
                lost,
                step,
                level,
                what,
                exc,
                below(level),
            )
            continue
        out.append(step)
    if out:
        log.warning(
            "rank %d: %s %s lacked versions %s; rebuilt from %s parity",
            lost,
            level,
            own.url,
            out,
            what,
        )
    return out
