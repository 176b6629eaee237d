"""Per-leaf statistics recorded at save time (docs/FORMAT.md, "Statistics"): the value
(:class:`LeafStats`) and its JSON form in a manifest's ``stats`` field, validated on load.

Pure: no I/O, no numpy over data. Writers (engine/write/_stats.py) compute the values on the
writer thread; readers (``Run.stats``) take them from the manifest on the caller's thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryosnap._format.document import fail

__all__ = ["LeafStats", "decode_stats", "encode_stats"]

# Leaves a manifest's stats field may name (a state has at most a few hundred thousand).
_MAX_STATS = 1 << 24


@dataclass(frozen=True, slots=True)
class LeafStats:
    """Statistics of one floating-point leaf of a version, recorded when it was saved.

    ``nan`` and ``inf``: how many elements are NaN and how many are +-Inf. ``min``, ``max``,
    ``mean`` and ``norm`` (the L2 norm) are over the finite elements only, so that one NaN
    does not hide the others; each is None where the leaf has no finite element (``norm``
    is 0.0 then). A leaf holding NaN or Inf makes its version "unhealthy"."""

    nan: int
    inf: int
    min: float | None
    max: float | None
    mean: float | None
    norm: float

    @property
    def finite(self) -> bool:
        """Whether every element is finite (no NaN, no Inf)."""
        return self.nan == 0 and self.inf == 0

    def to_json(self) -> dict[str, Any]:
        """A plain dict (``cryosnap log --json``): floats as JSON numbers, None as null."""
        return {
            "nan": self.nan,
            "inf": self.inf,
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "norm": self.norm if math.isfinite(self.norm) else None,
        }


def _hex(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def encode_stats(stats: Mapping[str, LeafStats]) -> dict[str, list[Any]]:
    """The manifest's ``stats`` field: per leaf path ``[nan, inf, min, max, mean, norm]``,
    floats as ``float.hex`` text (exact, and the norm may overflow to inf), None as null."""
    return {
        path: [s.nan, s.inf, _hex(s.min), _hex(s.max), _hex(s.mean), float(s.norm).hex()]
        for path, s in stats.items()
    }


def _float(raw: Any, where: str, path: str, *, nullable: bool) -> float | None:
    if raw is None and nullable:
        return None
    if not isinstance(raw, str) or len(raw) > 40:
        raise fail(where, f"stats of leaf {path!r:.80}: malformed number {raw!r:.40}")
    try:
        return float.fromhex(raw)
    except ValueError as exc:
        raise fail(where, f"stats of leaf {path!r:.80}: malformed number {raw!r:.40}") from exc


def _count(raw: Any, where: str, path: str) -> int:
    if type(raw) is not int or raw < 0:
        raise fail(where, f"stats of leaf {path!r:.80}: malformed count {raw!r:.40}")
    return raw


def decode_stats(raw: Any, where: str) -> dict[str, LeafStats]:
    """The ``stats`` field of a manifest, checked (a malformed one raises
    :class:`~cryosnap.errors.CheckpointFormatError` naming ``where``)."""
    if not isinstance(raw, dict) or len(raw) > _MAX_STATS:
        raise fail(where, f"malformed field 'stats' {raw!r:.80}")
    out: dict[str, LeafStats] = {}
    for path, row in raw.items():
        if not isinstance(row, list) or len(row) != 6:
            raise fail(where, f"stats of leaf {path!r:.80}: malformed row {row!r:.80}")
        norm = _float(row[5], where, path, nullable=False)
        assert norm is not None
        out[path] = LeafStats(
            _count(row[0], where, path),
            _count(row[1], where, path),
            _float(row[2], where, path, nullable=True),
            _float(row[3], where, path, nullable=True),
            _float(row[4], where, path, nullable=True),
            norm,
        )
    return out
