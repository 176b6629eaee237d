"""The RS rebuild at open: the ranks of a set whose scratch lost versions the rest of the set
holds (at most M of them) get their files and parity back, decoded from K survivors' blocks,
verified chunk by chunk before their commit records (as xor_rebuild.py does).

More than M lost ranks in a set: logged, nothing rebuilt, their versions come from the
persistent level. Runs on the caller's thread at open; its collectives on the coordinator given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryosnap import engine
from cryosnap._format.keys import Lineage
from cryosnap._run.redundancy import partner as _partner
from cryosnap._run.redundancy.rs import Code, RSIndex, RSParity, element_of, stripe_of, window
from cryosnap._run.redundancy.xor import STATUS_FAILED, STATUS_OK, Payload, index_key
from cryosnap._run.redundancy.xor_rebuild import Rebuilt, below, commit_rebuilt
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointError
from cryosnap.storage import BlobWriter, Store

__all__ = ["lost_ranks", "rebuild"]

log = logging.getLogger("cryosnap")


@dataclass(frozen=True)
class _Round:
    """One round of a plan: block ``block`` (each lost rank's own) of index ``entry``, the
    window at ``offset``."""

    entry: int
    block: int
    offset: int
    nbytes: int


def rebuild(
    coord: Coordinator, own: Store, parity: RSParity, *, level: str = "scratch"
) -> list[int]:
    """At open (collective): rebuild the lost ranks (at most M) of each set that has some on
    ``level`` (``own``: this rank's store there, named in the log). The steps this rank got
    back (verified and committed there)."""
    status = {
        "versions": [[s, *_lin(lin)] for s, lin in engine.list_versions(own).items()],
        "indexes": parity.store.list("index"),
    }
    told = coord.all_gather(status)
    lost = lost_ranks(parity.ranks, parity.m, told, level)
    plan = None
    if lost and coord.rank == min(r for r in parity.ranks if r not in lost):
        plan = _plan(parity, lost, told)
    plans = [p for p in coord.all_gather(plan) if p]
    mine = next((p for p in plans if coord.rank in p["set"]), None)
    rounds = max((len(_schedule(p)) for p in plans), default=0)
    if rounds == 0:
        return []
    if mine is not None and coord.rank in mine["lost"]:
        return _receive(coord, own, parity, mine, rounds, level)
    _send(coord, own, parity, mine, rounds)
    return []


def _lin(lineage: Lineage | None) -> list[int]:
    return [0, 0] if lineage is None else [lineage.generation, lineage.fork]


def lost_ranks(ranks: Sequence[int], m: int, told: list[Any], level: str = "scratch") -> list[int]:
    """The ranks of the set ``ranks`` lacking versions newer than their newest that every
    other member holds (``told[r]["versions"]``: rank r's [step, generation, fork]); [] if
    none. More than ``m`` behind: logged, [] (the persistent level serves their versions)."""
    held = {r: {tuple(v) for v in told[r]["versions"]} for r in ranks}
    newest = {r: max((v[0] for v in held[r]), default=-1) for r in ranks}
    top = max(newest.values())
    behind = [r for r in ranks if newest[r] < top]
    if len(behind) > m:
        log.warning(
            "RS set %s: ranks %s lost versions on %s (newest steps %s); a set rebuilds at most "
            "M=%d lost ranks: their versions come from %s",
            list(ranks),
            behind,
            level,
            [newest[r] for r in behind],
            m,
            below(level),
        )
        return []
    if not behind:
        return []
    common = set.intersection(*(held[r] for r in ranks if r not in behind))
    return [r for r in behind if any(v[0] > newest[r] for v in common)]


def _plan(parity: RSParity, lost: list[int], told: list[Any]) -> dict[str, Any] | None:
    """The leader: which indexes to decode for ``lost`` and which versions each gets back."""
    others = [r for r in parity.ranks if r not in lost]
    common = set.intersection(*({tuple(v) for v in told[r]["versions"]} for r in others))
    held = set.intersection(*(set(told[r]["indexes"]) for r in others))
    try:
        indexes = {k: parity.read_index(k) for k in held}
    except CheckpointError as exc:
        log.warning("RS rebuild of ranks %s: reading %s failed: %s", lost, parity.store.url, exc)
        return None
    entries: dict[str, None] = {}
    targets: dict[str, list[list[Any]]] = {}
    for r in lost:
        newest = max((v[0] for v in told[r]["versions"]), default=-1)
        covering = {
            f: k for k, idx in indexes.items() if r in idx.members for f, _ in idx.members[r].files
        }
        for step, gen, fork in sorted(v for v in common if v[0] > newest):
            idx = indexes.get(index_key(step, Lineage(gen, fork) if gen else None))
            if idx is None or idx.ranks != parity.ranks or idx.m != parity.m:
                log.warning("RS rebuild of rank %d: step %d has no parity of this set", r, step)
                continue
            missing = [f for f in idx.members[r].needs if f not in covering]
            if missing:
                log.warning(
                    "RS rebuild of rank %d: step %d: no parity covers %s", r, step, missing[0]
                )
                continue
            entries.update(dict.fromkeys(covering[f] for f in idx.members[r].needs))
            targets.setdefault(str(r), []).append([step, gen, fork, idx.members[r].record])
    if not targets:
        return None
    return {
        "set": list(parity.ranks),
        "m": parity.m,
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
    """Every window of ``plan``, the same on every rank: for each index, each lost rank's
    data segments in payload order, then its parity blocks, window after window."""
    n = len(plan["set"])
    w = max(1, _partner.WINDOW_BYTES // max(1, n - plan["m"]))
    out: list[_Round] = []
    for e, entry in enumerate(plan["entries"]):
        seg = int(entry["segment_bytes"])
        for block in range(n):
            out.extend(_Round(e, block, o, min(w, seg - o)) for o in range(0, seg, w))
    return out


def _sources(plan: dict[str, Any], stripe: int) -> list[int]:
    """The K survivors (positions) whose blocks of ``stripe`` rebuild it: the first ones."""
    lost = {plan["set"].index(r) for r in plan["lost"]}
    return [p for p in range(len(plan["set"])) if p not in lost][: len(plan["set"]) - plan["m"]]


def _send(
    coord: Coordinator, own: Store, parity: RSParity, plan: dict[str, Any] | None, rounds: int
) -> None:
    """A survivor (or a rank of a set with nothing to rebuild: ``plan`` None): in each round,
    to each lost rank whose stripe this round it is a source of, its block's window."""
    schedule = _schedule(plan) if plan is not None else []
    indexes: dict[int, RSIndex | None] = {}
    n, m, me = len(parity.ranks), parity.m, parity.position
    for t in range(rounds):
        sends: dict[int, bytes] = {}
        if plan is not None and t < len(schedule):
            r = schedule[t]
            if r.entry not in indexes:
                indexes[r.entry] = _own_index(parity, plan["entries"][r.entry])
            for lost in plan["lost"]:
                s = stripe_of(plan["set"].index(lost), r.block, n, m)
                if me in _sources(plan, s):
                    sends[lost] = _piece(own, parity, indexes[r.entry], s, r)
        coord.exchange(sends)


def _own_index(parity: RSParity, entry: dict[str, Any]) -> RSIndex | None:
    """This survivor's index of a plan's ``entry`` (None: unreadable, or of another layout)."""
    try:
        idx = parity.read_index(entry["key"])
    except CheckpointError as exc:
        log.warning("RS rebuild: %s", exc)
        return None
    if idx.segment_bytes != entry["segment_bytes"] or idx.ranks != parity.ranks:
        log.warning("RS rebuild: %s is not the index the plan names", entry["key"])
        return None
    return idx


def _piece(own: Store, parity: RSParity, idx: RSIndex | None, stripe: int, r: _Round) -> bytes:
    """This survivor's window of its block of ``stripe``: a parity block's, or its segment's."""
    if idx is None:
        return STATUS_FAILED + b"no readable parity index of this version here"
    n, seg = len(parity.ranks), idx.segment_bytes
    e = element_of(parity.position, stripe, n, parity.m)
    k = n - parity.m
    if e >= k:
        key, nbytes = idx.parity[e - k]
        return window(Payload(parity.store, [(key, nbytes)]), r.offset, r.nbytes, seg)
    files = idx.members[parity.rank].files
    return window(Payload(own, files), e * seg + r.offset, r.nbytes, (e + 1) * seg)


_Open = tuple[Rebuilt, list[BlobWriter], RSIndex]  # a lost rank's files, parity, index


def _receive(
    coord: Coordinator,
    own: Store,
    parity: RSParity,
    plan: dict[str, Any],
    rounds: int,
    level: str,
) -> list[int]:
    """A lost rank: decode its blocks from the K sources' windows into its files and its
    parity, then commit each version whose every chunk verifies."""
    schedule = _schedule(plan)
    n, m, me = len(plan["set"]), plan["m"], parity.position
    k = n - m
    code = Code(k, m)
    entries = [RSIndex.from_json(e["index"].encode(), "the rebuild plan") for e in plan["entries"]]
    broken: dict[int, str] = {}
    writers: dict[int, _Open] = {}
    try:
        for t in range(rounds):
            got = coord.exchange({})
            if t >= len(schedule) or schedule[t].entry in broken:
                continue
            r = schedule[t]
            try:
                files, outs, idx = writers.get(r.entry) or _start(
                    own, parity, entries[r.entry], writers, r.entry
                )
                s = stripe_of(me, r.block, n, m)
                known: dict[int, bytes] = {}
                for pos in _sources(plan, s):
                    body = got.get(plan["set"][pos], STATUS_FAILED + b"no window arrived")
                    if body[:1] != STATUS_OK or len(body) != 1 + r.nbytes:
                        raise CheckpointError(bytes(body[1:200]).decode(errors="replace"))
                    known[element_of(pos, s, n, m)] = body[1:]
                data = code.block(known, r.block)
                if r.block >= k:
                    outs[r.block - k].write([data])
                else:
                    # This window's bytes of the rank's payload; past its end, padding.
                    start = r.block * idx.segment_bytes + r.offset
                    files.append(memoryview(data)[: max(0, min(len(data), files.nbytes - start))])
            except CheckpointError as exc:
                broken[r.entry] = str(exc)
                _abort(writers.pop(r.entry, None))
        _finish(parity, writers, broken)
    finally:
        for x in writers.values():
            _abort(x)
    targets = plan["targets"].get(str(parity.rank), [])
    return commit_rebuilt(own, parity.rank, targets, broken, "RS", level)


def _start(
    own: Store, parity: RSParity, idx: RSIndex, writers: dict[int, _Open], entry: int
) -> _Open:
    files = Rebuilt(own, idx.members[parity.rank].files)
    outs = [
        parity.store.open_writer(f"parity/{idx.name}-r{parity.rank:05d}-{j}.rs")
        for j in range(idx.m)
    ]
    writers[entry] = (files, outs, idx)
    return writers[entry]


def _abort(w: _Open | None) -> None:
    if w is not None:
        w[0].abort()
        for out in w[1]:
            out.abort()


def _finish(parity: RSParity, writers: dict[int, _Open], broken: dict[int, str]) -> None:
    """Commit the rebuilt parity of each index and write this rank's index of it."""
    for entry, (files, outs, idx) in list(writers.items()):
        try:
            if not files.complete:
                raise CheckpointError(f"step {idx.step}: the rebuilt files are incomplete")
            sizes = [out.tell() for out in outs]
            for out in outs:
                out.commit()
            mine = RSIndex(
                idx.step,
                idx.generation,
                idx.ranks,
                parity.rank,
                idx.m,
                idx.segment_bytes,
                tuple((out.key, size) for out, size in zip(outs, sizes, strict=True)),
                idx.members,
            )
            parity.store.write(mine.key, mine.to_json())
        except CheckpointError as exc:
            broken[entry] = str(exc)
            _abort((files, outs, idx))
        del writers[entry]
