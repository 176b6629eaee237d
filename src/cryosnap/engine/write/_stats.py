"""Per-leaf statistics of a part, computed from the bytes the writer hashes (:class:`Recorder`):
count of NaN and Inf, min, max, mean and L2 norm of every floating-point leaf (float16,
bfloat16, float32, float64), accumulated piece by piece (a leaf may span batches) and leaf by
leaf inside a pack of small tensors (segment reductions, not one numpy call per leaf).

Runs on the writer thread, inside ``PartWriter.add``; numpy releases the GIL over the data.
Reads no file; a leaf whose chunks were all found unchanged by the capture, or whose whole
blob hashes as the base's, takes its base's statistics (no reduction).
docs/design/lineage.md ("Statistics and marks") says why and what is left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cryosnap._format.skeleton import iter_leaves
from cryosnap._format.stats import LeafStats
from cryosnap.engine.items import Item, Piece, Unchanged
from cryosnap.engine.write._differ import Differ

__all__ = ["Recorder", "leaf_spans"]

# Elements reduced at once by the single-leaf path: a block that stays in the core's cache
# across its four reductions (sum, min, max, dot), each in the elements' own type (a float64
# sum of float32 elements casts them: four times slower), the blocks' sums added in float64.
_BLOCK = 1 << 16

_TORCH_FLOATS = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "bfloat16": "bf16"}


@dataclass(frozen=True, slots=True)
class Span:
    """The bytes ``lo .. hi`` of blob ``blob`` hold floating-point leaf ``path`` of ``dtype``
    (a numpy dtype string, or "bf16")."""

    path: str
    dtype: str
    blob: int
    lo: int
    hi: int


def _float_dtype(node: Mapping[str, Any]) -> str | None:
    t, dtype = node.get("t"), node.get("dtype")
    if t == "torch" and isinstance(dtype, str):
        return _TORCH_FLOATS.get(dtype)
    if t == "numpy" and isinstance(dtype, str):
        try:
            d = np.dtype(dtype)
        except TypeError:
            return None
        return d.str if d.kind == "f" and d.itemsize in (2, 4, 8) else None
    return None


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bf16" else int(dtype[2])


def leaf_spans(skeleton: Any, sizes: list[int]) -> dict[int, list[Span]]:
    """Per blob, the floating-point leaves it holds, by byte range (packed leaves by their
    ``at``). Views into a storage shared with other tensors are left out (their elements are
    strided over the blob)."""
    out: dict[int, list[Span]] = {}
    for path, node in iter_leaves(skeleton):
        dtype = _float_dtype(node)
        b = node.get("b")
        if dtype is None or type(b) is not int or not 0 <= b < len(sizes) or "view" in node:
            continue
        lo, hi = 0, sizes[b]
        if "at" in node:
            shape, at = node.get("shape"), node.get("at")
            if not isinstance(shape, list) or type(at) is not int:
                continue
            lo = at
            hi = at + int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
            if hi > sizes[b]:
                continue
        out.setdefault(b, []).append(Span(path, dtype, b, lo, hi))
    for spans in out.values():
        spans.sort(key=lambda s: s.lo)
    return out


def _as_float(raw: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """Bytes as the float elements they hold: float16 and bfloat16 widened to float32."""
    if dtype == "bf16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    x = raw.view(np.dtype(dtype))
    return x.astype(np.float32) if x.dtype.itemsize == 2 else x


class _Acc:
    """The running statistics of one leaf: [nan, inf, finite, sum, sumsq, min, max], and the
    bytes seen and found unchanged."""

    __slots__ = ("finite", "inf", "max", "min", "nan", "seen", "sum", "sumsq", "unchanged")

    def __init__(self) -> None:
        self.nan = self.inf = self.finite = self.seen = self.unchanged = 0
        self.sum = self.sumsq = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(
        self, nan: int, inf: int, finite: int, s: float, ss: float, lo: float, hi: float
    ) -> None:
        self.nan += nan
        self.inf += inf
        self.finite += finite
        self.sum += s
        self.sumsq += ss
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)

    def value(self) -> LeafStats:
        if not self.finite:
            return LeafStats(self.nan, self.inf, None, None, None, 0.0)
        return LeafStats(
            self.nan,
            self.inf,
            float(self.min),
            float(self.max),
            self.sum / self.finite,
            math.sqrt(self.sumsq),
        )


def _reduce_one(x: np.ndarray[Any, Any], acc: _Acc) -> None:
    """One leaf's elements ``x`` (float32 or float64) into ``acc``, block by block: sum, min,
    max and dot while the block is in cache; a block with a NaN or Inf masked."""
    for a in range(0, len(x), _BLOCK):
        b = x[a : a + _BLOCK]
        s = float(b.sum())
        if math.isfinite(s):
            ss = float(np.dot(b, b))
            if not math.isfinite(ss):  # float32 squares overflow: again in float64
                w = b.astype(np.float64)
                ss = float(np.dot(w, w))
            acc.add(0, 0, len(b), s, ss, float(b.min()), float(b.max()))
            continue
        fin = np.isfinite(b)
        nan = int(np.isnan(b).sum())
        f = b[fin].astype(np.float64)
        nfin = len(f)
        lo = float(f.min()) if nfin else math.inf
        hi = float(f.max()) if nfin else -math.inf
        acc.add(nan, len(b) - nfin - nan, nfin, float(f.sum()), float(np.dot(f, f)), lo, hi)


def _reduce_many(x: np.ndarray[Any, Any], bounds: list[tuple[int, int]], accs: list[_Acc]) -> None:
    """Several leaves of one pack (element ranges ``bounds`` of ``x``, ascending, none empty)
    at once, with segment reductions (gaps between them are reduced and dropped)."""
    edges = np.array([e for pair in bounds for e in pair], np.int64)
    keep = slice(0, None, 2)
    if edges[-1] == len(x):
        edges = edges[:-1]
    fin = np.isfinite(x)
    nan = np.add.reduceat(np.isnan(x), edges, dtype=np.int64)[keep]
    nfin = np.add.reduceat(fin, edges, dtype=np.int64)[keep]
    f = np.where(fin, x, 0).astype(np.float64)
    sums = np.add.reduceat(f, edges)[keep]
    sumsq = np.add.reduceat(f * f, edges)[keep]
    mins = np.minimum.reduceat(np.where(fin, x, np.inf), edges)[keep]
    maxs = np.maximum.reduceat(np.where(fin, x, -np.inf), edges)[keep]
    rows = zip(
        bounds,
        accs,
        nan.tolist(),
        nfin.tolist(),
        sums.tolist(),
        sumsq.tolist(),
        mins.tolist(),
        maxs.tolist(),
        strict=True,
    )
    for (a, b), acc, n, k, s, ss, lo, hi in rows:
        acc.add(n, b - a - n - k, k, s, ss, lo, hi)


class Recorder:
    """The statistics of one part's floating-point leaves, from its pieces as they are added;
    :meth:`result` once every piece is (``base``: the base version's statistics, taken for a
    leaf whose every chunk the capture found unchanged, or whose whole blob equals the
    base's)."""

    def __init__(self, skeleton: Any, sizes: list[int], chunk_bytes: int) -> None:
        self.spans = leaf_spans(skeleton, sizes)
        self.sizes = sizes
        self.chunk_bytes = chunk_bytes
        self._base_spans: dict[int, list[Span]] | None = None  # the base's, when first asked
        self.accs = {s.path: _Acc() for spans in self.spans.values() for s in spans}

    def items(self, pieces: Sequence[Item], differ: Differ) -> None:
        """The statistics of ``pieces``, once ``differ`` diffed them: a whole blob whose Merkle
        root and leaves are the base's takes the base's rows (no reduction), any other piece
        is reduced."""
        base = differ.base
        rows = None if base is None else base.manifest.stats
        for p in pieces:
            if type(p) is Piece and rows and self._as_base(p, differ, rows):
                for s in self.spans[p.blob]:
                    self.accs[s.path].unchanged += s.hi - s.lo
            else:
                self.item(p)

    def _as_base(self, p: Piece, differ: Differ, rows: Mapping[str, LeafStats]) -> bool:
        """Whether piece ``p`` is its whole blob, equal to the base's, with the same float
        leaves at the same places, each with a row in the base."""
        spans = self.spans.get(p.blob)
        j = differ.base_blob(p.blob)
        base = differ.base
        if (
            not spans
            or j is None
            or base is None
            or p.offset
            or p.view.nbytes != self.sizes[p.blob]
        ):
            return False
        if self._base_spans is None:
            sizes = [b.nbytes for b in base.manifest.blobs]
            self._base_spans = leaf_spans(base.manifest.skeleton, sizes)
        theirs = self._base_spans.get(j, [])
        same = [(s.path, s.dtype, s.lo, s.hi) for s in spans] == [
            (s.path, s.dtype, s.lo, s.hi) for s in theirs
        ]
        return (
            same
            and all(s.path in rows for s in spans)
            and differ.root(p.blob) == base.manifest.blobs[j].root
        )

    def item(self, p: Item) -> None:
        """A piece's bytes, or a run the capture found unchanged (a hashed run, whose bytes
        another rank holds, leaves its leaves without statistics)."""
        if type(p) is Piece:
            self.piece(p)
        elif isinstance(p, Unchanged):
            self.unchanged(p)

    def piece(self, p: Piece) -> None:
        """The bytes of piece ``p`` (a run of its blob's bytes, from ``p.offset``)."""
        spans = self.spans.get(p.blob)
        if not spans:
            return
        # NaN, Inf and overflow are what is counted here, not warnings to raise.
        with np.errstate(all="ignore"):
            self._piece(p, spans)

    def _piece(self, p: Piece, spans: list[Span]) -> None:
        start, end = p.offset, p.offset + p.view.nbytes
        raw = np.frombuffer(p.view, np.uint8)
        inside = [s for s in spans if s.lo < end and s.hi > start]
        by_dtype: dict[str, list[Span]] = {}
        for s in inside:
            by_dtype.setdefault(s.dtype, []).append(s)
        for dtype, group in by_dtype.items():
            item = _itemsize(dtype)
            if len(group) == 1 or any((s.lo - start) % item for s in group):
                for s in group:
                    a, b = max(s.lo, start) - start, min(s.hi, end) - start
                    self._one(raw[a:b], s, dtype)
                continue
            x = _as_float(raw[: (end - start) // item * item], dtype)
            bounds, accs = [], []
            for s in group:
                a, b = max(s.lo, start) - start, min(s.hi, end) - start
                self.accs[s.path].seen += b - a
                if b > a:
                    bounds.append((a // item, b // item))
                    accs.append(self.accs[s.path])
            if bounds:
                _reduce_many(x, bounds, accs)

    def _one(self, raw: np.ndarray[Any, Any], s: Span, dtype: str) -> None:
        acc = self.accs[s.path]
        acc.seen += len(raw)
        if len(raw):
            _reduce_one(_as_float(raw, dtype), acc)

    def unchanged(self, u: Unchanged) -> None:
        """Chunks the capture found unchanged since the base: counted, not read."""
        start = u.first * self.chunk_bytes
        end = start + u.nbytes
        for s in self.spans.get(u.blob, ()):
            if s.lo < end and s.hi > start:
                self.accs[s.path].unchanged += min(s.hi, end) - max(s.lo, start)

    def result(self, base: Mapping[str, LeafStats] | None) -> dict[str, LeafStats]:
        """Per leaf path, its statistics: computed where every byte was seen, the base's
        where every byte was unchanged, none otherwise (bytes hashed elsewhere)."""
        out: dict[str, LeafStats] = {}
        for spans in self.spans.values():
            for s in spans:
                acc = self.accs[s.path]
                if acc.seen == s.hi - s.lo:
                    out[s.path] = acc.value()
                elif acc.seen == 0 and acc.unchanged == s.hi - s.lo and base and s.path in base:
                    out[s.path] = base[s.path]
        return out
