"""The keys of a run on a tier: where versions, manifests and data files lie, which commit
records are versions (lineages, docs/FORMAT.md "Superseding"), and what a safe key is.

Pure: strings in, strings out; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Lineage",
    "commit_key",
    "data_key",
    "data_writers",
    "manifest_key",
    "max_generation",
    "parse_commit_key",
    "parse_manifest_key",
    "step_of_commit_key",
    "step_of_data_key",
    "supersedes",
    "validate_key",
    "version_prefix",
    "visible_versions",
    "written_by",
]

_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9_.\-]+$")


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise ``ValueError``.

    Safe: non-empty ``/``-separated segments of letters, digits, ``_``, ``.``, ``-``; no segment
    is ``.`` or ``..``; no leading ``/``. This is what keeps a manifest from naming a file outside
    the run.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid storage key {key!r}: must be a non-empty string")
    for seg in key.split("/"):
        if seg in ("", ".", "..") or not _KEY_SEGMENT.match(seg):
            raise ValueError(
                f"invalid storage key {key!r}: segments must be non-empty, not '.' or '..', "
                "and made of letters, digits, '_', '.', '-'"
            )
    name = key.rsplit("/", 1)[-1]
    if name.endswith(".partial") or (name.startswith(".") and name.endswith(".tmp")):
        # These names are the stores' own files in progress (see _local.py).
        raise ValueError(f"invalid storage key {key!r}: '.partial' and '.*.tmp' are reserved")
    return key


def version_prefix(step: int) -> str:
    return f"versions/{step:012d}"


@dataclass(frozen=True, slots=True, order=True)
class Lineage:
    """Which trajectory a version belongs to, for versions saved after a rewind.

    A Checkpointer that restored step ``fork`` while the run held later versions saves its
    next versions in a new *generation* ``generation`` (1 + the highest in the run): they
    supersede every version of an older generation whose step is above ``fork``. Versions of
    generation 0 (every run that never rewound) carry no lineage (``None``). Both numbers are
    in the commit record's key, so a listing alone says which versions are visible.
    """

    generation: int
    fork: int


_LINEAGE_COMMIT = re.compile(r"COMMIT-g([1-9][0-9]{0,8})-f([0-9]{12})\.json")


def commit_key(step: int, lineage: Lineage | None = None) -> str:
    if lineage is None:
        return f"{version_prefix(step)}/COMMIT.json"
    return f"{version_prefix(step)}/COMMIT-g{lineage.generation}-f{lineage.fork:012d}.json"


def manifest_key(step: int, rank: int, generation: int = 0) -> str:
    if generation == 0:
        return f"{version_prefix(step)}/rank-{rank:05d}.json"
    return f"{version_prefix(step)}/rank-{rank:05d}-g{generation}.json"


def data_key(step: int, rank: int, token: str) -> str:
    return f"data/{step:012d}-r{rank:05d}-{token}.dat"


_DATA_NAME = re.compile(r"data/([0-9]{12})-r[0-9]{5}-[^/]+\.dat")


_DATA_WRITER = re.compile(r"data/([0-9]{12})-r([0-9]{5})-[^/]+\.dat")


def data_writers(keys: Iterable[str]) -> tuple[list[list[int]], list[str]]:
    """Data files ``keys`` as the writers that made them, ``[step, first rank, last rank]``
    (ranks in a run), and the keys that are no :func:`data_key`: a description whose size
    grows with the versions, not with the ranks, when every rank's files of a step are in it.
    It names more than ``keys`` where a writer made files that ``keys`` leaves out."""
    pairs: set[tuple[int, int]] = set()
    other: list[str] = []
    for key in keys:
        m = _DATA_WRITER.fullmatch(key)
        if m is None:
            other.append(key)
        else:
            pairs.add((int(m.group(1)), int(m.group(2))))
    runs: list[list[int]] = []
    for step, rank in sorted(pairs):
        if runs and runs[-1][0] == step and runs[-1][2] == rank - 1:
            runs[-1][2] = rank
        else:
            runs.append([step, rank, rank])
    return runs, sorted(other)


def written_by(runs: Sequence[Sequence[int]], other: Collection[str]) -> Callable[[str], bool]:
    """Whether a data file is among those :func:`data_writers` described (a predicate)."""
    ranks: dict[int, list[tuple[int, int]]] = {}
    for step, lo, hi in runs:
        ranks.setdefault(int(step), []).append((int(lo), int(hi)))
    named = frozenset(other)

    def test(key: str) -> bool:
        if key in named:
            return True
        m = _DATA_WRITER.fullmatch(key)
        if m is None:
            return False
        rank = int(m.group(2))
        return any(lo <= rank <= hi for lo, hi in ranks.get(int(m.group(1)), ()))

    return test


def step_of_data_key(key: str) -> int | None:
    """The step of the version that wrote data file ``key`` (:func:`data_key`), or None."""
    m = _DATA_NAME.fullmatch(key)
    return None if m is None else int(m.group(1))


_MANIFEST_NAME = re.compile(r"rank-([0-9]{5})(?:-g([1-9][0-9]{0,8}))?(?:-[0-9a-f]{8})?\.json")


def parse_manifest_key(key: str) -> tuple[int, int] | None:
    """The rank and generation in a manifest's key (``rank-<r>[-g<gen>][-<token>].json``: a
    token when the step was saved again while its old manifest stayed), or None."""
    m = _MANIFEST_NAME.fullmatch(key.rsplit("/", 1)[-1])
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)) if m.group(2) else 0


def parse_commit_key(key: str) -> tuple[int, Lineage | None] | None:
    """The step and lineage of a commit record's key, or None for any other key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "versions":
        return None
    s = parts[1]
    if len(s) != 12 or not s.isdigit():
        return None
    if parts[2] == "COMMIT.json":
        return int(s), None
    m = _LINEAGE_COMMIT.fullmatch(parts[2])
    if m is None:
        return None
    return int(s), Lineage(int(m.group(1)), int(m.group(2)))


def step_of_commit_key(key: str) -> int | None:
    """The step of a commit record's key (``versions/<step>/COMMIT*.json``), or None."""
    parsed = parse_commit_key(key)
    return None if parsed is None else parsed[0]


def _generation(lineage: Lineage | None) -> int:
    return 0 if lineage is None else lineage.generation


def visible_versions(
    records: Iterable[tuple[int, Lineage | None]],
) -> dict[int, Lineage | None]:
    """Of the commit records listed (step, lineage), the versions: step -> its lineage.

    A record of generation ``r`` at step ``t`` is *superseded* when the records hold a newer
    generation ``g > r`` forked at a step below ``t``: that generation was started by a
    Checkpointer that restored its fork step and saved on from there, abandoning ``t``. Every
    other record is a version; at a step, the newest generation wins (an older one there is
    always superseded by it). Pure: the same listing gives the same versions on any tier, and
    on the union of several tiers' listings.
    """
    listed = set(records)
    forks: dict[int, int] = {}
    for _step, lineage in listed:
        if lineage is not None:
            g = lineage.generation
            forks[g] = min(forks.get(g, lineage.fork), lineage.fork)
    bounds: dict[int, float] = {}
    for r in {_generation(lin) for _s, lin in listed}:
        newer = [fork for g, fork in forks.items() if g > r]
        bounds[r] = min(newer) if newer else float("inf")
    out: dict[int, Lineage | None] = {}
    for step, lineage in sorted(listed, key=lambda rec: (rec[0], _generation(rec[1]))):
        if step <= bounds[_generation(lineage)]:
            out[step] = lineage  # ascending generations: the newest one at a step wins
    return out


def supersedes(lineage: Lineage | None, step: int, old: Lineage | None) -> bool:
    """Whether a version of ``step`` saved in ``lineage`` supersedes one of ``old`` at that step
    (or, for a base, whether a version saved in ``lineage`` may not build on version ``step`` of
    lineage ``old``: it is one the new generation abandoned)."""
    if lineage is None:
        return False
    return _generation(old) < lineage.generation and step > lineage.fork


def max_generation(records: Iterable[tuple[int, Lineage | None]]) -> int:
    """The newest generation among the records listed (0 for a run that never rewound)."""
    return max((_generation(lin) for _s, lin in records), default=0)
