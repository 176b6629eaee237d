"""Replicated state: top-level keys identical on every rank, written once in total.

Each rank writes its share of the replicated chunks; the leader checks that the replicas
agree (:class:`~cryosnap.ReplicaDivergenceError` otherwise) and tells every rank where every
share lies (:func:`cryosnap.dist.agree`: O(1) bytes per rank in N).
Runs on the caller's thread (:func:`replicated_keys`) and the writer thread (the rest).
docs/design/distributed.md has the why.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from cryosnap import engine
from cryosnap._format.manifest import Replicated
from cryosnap._format.skeleton import Json, dict_items, encode_key, iter_leaves
from cryosnap._state import FlatState
from cryosnap.dist import Coordinator, agree
from cryosnap.engine.write import Owners, assign_shares
from cryosnap.errors import CheckpointError, ReplicaDivergenceError

__all__ = ["Plan", "exchange", "plan", "replicated_keys", "send_failure", "top_level_keys"]


# -- the caller's thread: the argument ----------------------------------------------------------


def top_level_keys(skeleton: Json) -> list[str | int] | None:
    """The keys of a state whose root is a dict; None for any other root."""
    if skeleton.get("t") not in ("dict", "odict"):
        return None
    return [k for k, _v in dict_items(skeleton, "<root>")]


def replicated_keys(replicated: object, flat: FlatState) -> Replicated:
    """``save(replicated=...)`` checked against the flattened state: a tuple of top-level keys
    (in the caller's order, without repeats), True (the whole state) or None."""
    if replicated is None or replicated is False or replicated is True:
        return True if replicated is True else None
    if not isinstance(replicated, (list, tuple)):
        raise TypeError(
            "replicated must be True, None or a list of top-level keys of the state, "
            f"got {type(replicated).__name__}"
        )
    for k in replicated:
        if type(k) not in (str, int):
            raise TypeError(f"replicated: keys are str or int, got {k!r:.80}")
    if not replicated:
        return None
    top = top_level_keys(flat.skeleton)
    if top is None:
        raise ValueError(
            f"replicated={list(replicated)!r:.120} names top-level keys, but the state is not a "
            "dict: pass replicated=True to mark the whole state as replicated"
        )
    known = set(top)
    for k in replicated:
        if k not in known:
            raise ValueError(
                f"replicated: {k!r:.80} is not a top-level key of the state "
                f"(its keys: {top!r:.200})"
            )
    return tuple(dict.fromkeys(replicated))


# -- the writer thread: the split and the exchange ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """One version's replicated blobs and who writes which of their chunks."""

    keys: Replicated
    # Flat indices of the replicated blobs, in the order every rank agrees on (leaf paths).
    blobs: list[int] = field(default_factory=list)
    # Blob -> the rank that writes each of its chunks (a world of one: empty, all its own).
    shares: dict[int, Owners] = field(default_factory=dict)

    def foreign(self, rank: int) -> dict[int, np.ndarray[Any, np.dtype[np.bool_]]]:
        """Blob -> per chunk, whether a rank other than ``rank`` writes it (the capture hashes
        those in place instead of copying them)."""
        return {b: owners != rank for b, owners in self.shares.items()}


def _in(keys: Replicated, key: tuple[str | int, ...]) -> bool:
    return keys is True or (keys is not None and bool(key) and key[0] in keys)


def plan(flat: FlatState, keys: Replicated, world_size: int, chunk_bytes: int) -> Plan:
    """The split of ``flat``'s replicated blobs among ``world_size`` ranks. A blob belongs to
    the top-level key of its first leaf (tied tensors are one blob)."""
    if keys is None:
        return Plan(None)
    blobs = [i for i, b in enumerate(flat.blobs) if _in(keys, b.key)]
    blobs.sort(key=lambda i: (flat.blobs[i].path, repr(flat.blobs[i].key)))
    if world_size == 1:
        return Plan(keys, blobs)
    owners = assign_shares([flat.blobs[i].nbytes for i in blobs], world_size, chunk_bytes)
    return Plan(keys, blobs, dict(zip(blobs, owners, strict=True)))


def _keys_json(keys: Replicated) -> Any:
    if keys is None or keys is True:
        return keys
    return sorted((encode_key(k) for k in keys), key=repr)


def _leaves(flat: FlatState, keys: Replicated, root: Any) -> dict[str, list[list[Any]]]:
    """Per replicated key (by ``repr``), its leaves as ``[path, node]`` with each blob index
    replaced by the blob's Merkle root (ranks may number blobs differently) and no saved path
    of a file leaf (its bytes must agree, not where each rank read them)."""
    skeleton = flat.skeleton
    if keys is True:
        subtrees: list[tuple[str, Json, tuple[str | int, ...]]] = [("True", skeleton, ())]
    else:
        assert keys is not None
        items = dict(dict_items(skeleton, "<root>"))
        subtrees = [(repr(k), items[k], (k,)) for k in keys]
    out: dict[str, list[list[Any]]] = {}
    for name, node, path in subtrees:
        leaves = []
        for where, leaf in iter_leaves(node, path):
            b = leaf.get("b")
            if leaf.get("t") == "file":
                # A file's bytes are what is replicated: each rank may read its copy from a
                # path of its own (its node's scratch), kept in its own manifest.
                leaf = {k: v for k, v in leaf.items() if k != "path"}
            leaves.append([where, {**leaf, "b": root(b).hex()} if type(b) is int else leaf])
        out[name] = leaves
    return out


def _digest(obj: Any) -> str:
    body = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_128_hexdigest(body.encode())


def send_failure(coord: Coordinator, error: BaseException) -> None:
    """This rank failed before the exchange: take part in it, saying so."""
    agree(coord, {"error": f"{type(error).__name__}: {error}"}, _decide)


def exchange(
    coord: Coordinator, step: int, flat: FlatState, writer: engine.PartWriter, plan: Plan
) -> None:
    """Compare the replicated keys across ranks, then give ``writer`` the others' shares.

    The leader compares and merges (:func:`_decide`); every rank receives the decision, whose
    size is bounded by the replicated state's chunks, not by the ranks. Raises
    :class:`ReplicaDivergenceError` (on every rank alike) when the replicated state or the
    ``replicated=`` argument differs, :class:`CheckpointError` when another rank failed."""
    leaves = _leaves(flat, plan.keys, writer.blob_root) if plan.keys is not None else {}
    files: dict[str, int] = {}
    position = {b: c for c, b in enumerate(plan.blobs)}
    runs = [
        [position[i], first, count, files.setdefault(key, len(files)), offset]
        for i, first, count, key, offset in writer.owned_locations()
    ]
    coded = writer.coded
    mine = {
        "keys": _keys_json(plan.keys),
        "blobs": len(plan.blobs),
        "digests": {name: _digest(v) for name, v in leaves.items()},
        "files": list(files),
        "runs": runs,
        # Of those files, the ones coded on the level (its codec): the other ranks' manifests
        # name them coded too.
        "coded": [i for i, key in enumerate(files) if key in coded],
    }
    decided = agree(coord, mine, _decide)
    if "failed" in decided:
        reason = "; ".join(f"rank {r}: {e}" for r, e in decided["failed"])
        raise CheckpointError(f"step {step} was not committed: {reason}")
    if "keys" in decided:
        raise ReplicaDivergenceError(
            f"step {step}: the ranks passed different replicated= ({decided['keys']}); every "
            "rank must name the same keys. Nothing was committed"
        )
    if plan.keys is None:
        return
    if "differing" in decided:
        wanted: list[str] = decided["differing"] or sorted(leaves)
        told = agree(
            coord,
            {k: leaves.get(k, []) for k in wanted},
            lambda detail: _divergence(step, wanted, detail),
        )
        raise ReplicaDivergenceError(told)
    me = coord.rank
    theirs = [run for run in decided["runs"] if run[0] != me]
    coded_at = set(decided["coded"])
    writer.place_external(
        [
            (plan.blobs[c], first, count, decided["files"][f], offset)
            for _, c, first, count, f, offset in theirs
        ],
        coded={decided["files"][run[4]] for run in theirs if run[4] in coded_at},
    )


def _decide(gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """The leader's decision over every rank's replicated summary: ``failed`` (ranks that
    failed), ``keys`` (the replicated= arguments differ), ``differing`` (leaves whose content
    differs; [] when only the blob counts do), else the merged table of every rank's shares:
    ``files``, ``runs`` (``[rank, blob, first, count, file, offset]``) and ``coded`` (the
    files coded on the level, by index)."""
    failed = [[r, g["error"]] for r, g in enumerate(gathered) if "error" in g]
    if failed:
        return {"failed": failed}
    if len({json.dumps(g["keys"]) for g in gathered}) > 1:
        told = ", ".join(f"rank {r}: {g['keys']!r:.80}" for r, g in enumerate(gathered))
        return {"keys": told}
    differing = sorted(
        {k for g in gathered for k in g["digests"] if _differs(gathered, "digests", k)}
    )
    if differing or len({g["blobs"] for g in gathered}) > 1:
        return {"differing": differing}
    files: dict[str, int] = {}
    runs = [
        [r, c, first, count, files.setdefault(g["files"][f], len(files)), offset]
        for r, g in enumerate(gathered)
        for c, first, count, f, offset in g["runs"]
    ]
    coded = sorted({files[g["files"][i]] for g in gathered for i in g["coded"]})
    return {"files": list(files), "runs": runs, "coded": coded}


def _differs(gathered: Sequence[dict[str, Any]], field: str, key: str) -> bool:
    return len({g[field].get(key) for g in gathered}) > 1


def _divergence(step: int, keys: list[str], detail: list[dict[str, Any]]) -> str:
    """The first leaf (in rank order of appearance) whose content differs, and who holds what."""
    for k in keys:
        per_rank = [{path: _digest(node) for path, node in d.get(k, [])} for d in detail]
        paths = list(dict.fromkeys(p for leaves in per_rank for p in leaves))
        for path in paths:
            groups: dict[str | None, list[int]] = {}
            for r, leaves in enumerate(per_rank):
                groups.setdefault(leaves.get(path), []).append(r)
            if len(groups) > 1:
                missing = groups.pop(None, [])
                held = " vs ".join(f"ranks {ranks}" for ranks in groups.values())
                gone = f"; ranks {missing} do not have it" if missing else ""
                return (
                    f"step {step}: replicated leaf {path} differs between ranks: {held}{gone}. "
                    "State saved as replicated must be identical on every rank; nothing was "
                    "committed"
                )
    return (
        f"step {step}: the replicated state differs between ranks (keys "
        f"{', '.join(keys)}); nothing was committed"
    )
