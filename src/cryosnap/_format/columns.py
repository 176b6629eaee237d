"""Columns: a state dict's tensor leaves stored as one list per field (docs/FORMAT.md, "State
dicts in columns").

A dict node whose values are all plain tensor leaves (``torch`` nodes with a dtype, shape,
device, blob and, packed, an offset; no view, no DTensor record) is written with ``"cols"``
instead of ``"v"``: its leaves' dtypes, shapes, devices, blobs, pack offsets and flags as one
list each. A model of 20,000 tensors then parses as a few lists of ints instead of 20,000 JSON
objects, and a restore checks and fills them in bulk (numpy) instead of leaf by leaf.

:func:`encode` makes the columns of such a node (None for any other node); :func:`parse`
validates the stored form, every field at once, into a :class:`Columns` (a ``dict`` holding
that same JSON, so a skeleton holding it encodes as it was read) with the fields as arrays;
:meth:`Columns.nodes` gives the leaves as the nodes they stand for, for every walk that reads a
skeleton leaf by leaf.

Pure: no I/O, no torch. Runs on whichever thread calls it.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from cryosnap._format.limits import MAX_BLOB_BYTES, MAX_ELEMENTS, MAX_NDIM
from cryosnap.errors import CheckpointFormatError

__all__ = ["MIN_LEAVES", "Columns", "encode", "parse"]

# A dict node of fewer tensor leaves than this keeps one node per leaf: the columns save
# nothing there, and a manifest without columns stays readable by a cryosnap from before them.
MIN_LEAVES = 8

# The fields a tensor leaf node may have to be stored in columns.
_LEAF_KEYS = frozenset(("t", "dtype", "shape", "device", "b", "at", "param", "grad"))
PARAM, GRAD = 1, 2  # the bits of the "flags" column
_FIELDS = ("dtypes", "dtype", "ndim", "dims", "devices", "device", "b", "at", "flags")


def encode(values: list[Any]) -> dict[str, Any] | None:
    """The columns of a dict node's ``values`` (its ``"v"``), or None where they are not all
    tensor leaves that columns can hold, or fewer than :data:`MIN_LEAVES`."""
    if len(values) < MIN_LEAVES:
        return None
    dtypes: dict[str, int] = {}
    devices: dict[str, int] = {}
    dtype, ndim, dims, device, blobs, at, flags = [], [], [], [], [], [], []
    keys = _LEAF_KEYS
    for v in values:
        if type(v) is not dict or v.get("t") != "torch" or not v.keys() <= keys:
            return None
        name, shape, dev = v.get("dtype"), v.get("shape"), v.get("device")
        b, a = v.get("b"), v.get("at", -1)
        if (
            type(name) is not str
            or type(shape) is not list
            or type(dev) is not str
            or type(b) is not int
            or type(a) is not int
            or a < -1
            or not all(type(d) is int for d in shape)
            or v.get("param", True) is not True
            or v.get("grad", True) is not True
        ):
            return None
        dtype.append(dtypes.setdefault(name, len(dtypes)))
        device.append(devices.setdefault(dev, len(devices)))
        ndim.append(len(shape))
        dims += shape
        blobs.append(b)
        at.append(a)
        flags.append(PARAM * ("param" in v) + GRAD * ("grad" in v))
    return {
        "dtypes": list(dtypes),
        "dtype": dtype,
        "ndim": ndim,
        "dims": dims,
        "devices": list(devices),
        "device": device,
        "b": blobs,
        "at": at,
        "flags": flags,
    }


class Columns(dict[str, Any]):
    """The validated columns of one dict node: the stored JSON (this dict itself) and, as
    int64 arrays, ``dtype`` (index into ``dtypes``), ``ndim``, ``dims``, ``device`` (index
    into ``devices``), ``b``, ``at`` (-1: not packed), ``flags``; ``dtype_names``, each
    leaf's dtype name."""

    __slots__ = ("_nodes", "at", "b", "device", "dims", "dtype", "flags", "ndim")

    at: np.ndarray[Any, np.dtype[np.int64]]
    b: np.ndarray[Any, np.dtype[np.int64]]
    device: np.ndarray[Any, np.dtype[np.int64]]
    dims: np.ndarray[Any, np.dtype[np.int64]]
    dtype: np.ndarray[Any, np.dtype[np.int64]]
    flags: np.ndarray[Any, np.dtype[np.int64]]
    ndim: np.ndarray[Any, np.dtype[np.int64]]
    _nodes: list[dict[str, Any]] | None

    @property
    def dtype_names(self) -> list[str]:
        """Each leaf's dtype name."""
        return [self.dtypes[i] for i in self["dtype"]]

    @property
    def count(self) -> int:
        """The leaves."""
        return len(self.b)

    @property
    def dtypes(self) -> list[str]:
        return self["dtypes"]  # type: ignore[no-any-return]

    @property
    def devices(self) -> list[str]:
        return self["devices"]  # type: ignore[no-any-return]

    def elements(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Each leaf's elements, the product of its dims (int64: the caller bounds what it
        multiplies by; a product of dims a crafted manifest sets can wrap)."""
        counts = np.ones(self.count, np.int64)
        if len(self.dims):
            ends = np.cumsum(self.ndim)
            has = self.ndim > 0
            # Each leaf's product of its dims: reduceat over the starts of those that have any.
            counts[has] = np.multiply.reduceat(self.dims, (ends - self.ndim)[has])
        return counts

    def with_blobs(self, blobs: list[int]) -> Columns:
        """These columns with the blob references ``blobs`` instead (-1: a reference that
        stays invalid, which the restorer names)."""
        out = Columns(self)
        out["b"] = blobs
        out.dtype, out.ndim, out.dims, out.device = self.dtype, self.ndim, self.dims, self.device
        out.at, out.flags = self.at, self.flags
        out.b, out._nodes = np.array(blobs, np.int64), None
        return out

    def same_shapes(self, shapes: list[Any]) -> bool:
        """Whether ``shapes`` (one sequence of ints per leaf) are the leaves' shapes."""
        return bool(
            list(map(len, shapes)) == self["ndim"]
            and list(itertools.chain.from_iterable(shapes)) == self["dims"]
        )

    def same_dtypes(self, dtypes: Sequence[Hashable], names: dict[Any, str]) -> bool:
        """Whether ``dtypes`` (one per leaf, each one of ``names``' keys) are the leaves'
        dtypes, ``names`` giving each one's name."""
        index = {name: i for i, name in enumerate(self.dtypes)}
        code = {d: index.get(name, -1) for d, name in names.items()}
        return bool(list(map(code.__getitem__, dtypes)) == self["dtype"])

    def nodes(self) -> list[dict[str, Any]]:
        """Each leaf as the ``torch`` node it stands for (made once, then the same objects:
        walks that key things by node identity see one node per leaf)."""
        if self._nodes is None:
            dims = self["dims"]
            ends = np.cumsum(self.ndim)
            devices = [self.devices[i] for i in self["device"]]
            out = [
                {
                    "t": "torch",
                    "dtype": name,
                    "shape": dims[start:end],
                    "device": dev,
                    "b": b,
                    "at": at,
                }
                for name, start, end, dev, b, at in zip(
                    self.dtype_names,
                    (ends - self.ndim).tolist(),
                    ends.tolist(),
                    devices,
                    self["b"],
                    self["at"],
                    strict=True,
                )
            ]
            for i in np.flatnonzero(self.at < 0).tolist():
                del out[i]["at"]  # a blob of its own
            for i, flags in zip(
                np.flatnonzero(self.flags).tolist(),
                self.flags[self.flags != 0].tolist(),
                strict=True,
            ):
                if flags & PARAM:
                    out[i]["param"] = True
                if flags & GRAD:
                    out[i]["grad"] = True
            self._nodes = out
        return self._nodes


def _ints(raw: dict[str, Any], field: str, n: int | None, where: str) -> np.ndarray[Any, Any]:
    values = raw.get(field)
    if type(values) is not list or (n is not None and len(values) != n):
        raise CheckpointFormatError(f"{where}: malformed columns (field {field!r})")
    if not values:
        return np.empty(0, np.int64)
    try:
        # Ints only: numpy makes anything else (a float, a string, a list, an int beyond
        # int64, a bool alone) an array of another kind.
        array = np.array(values)
    except (ValueError, OverflowError) as exc:
        raise CheckpointFormatError(f"{where}: malformed columns (field {field!r})") from exc
    if array.ndim != 1 or array.dtype != np.int64:
        raise CheckpointFormatError(f"{where}: malformed columns (field {field!r}: not ints)")
    return array


def _names(raw: dict[str, Any], field: str, where: str) -> list[str]:
    names = raw.get(field)
    if type(names) is not list or not all(type(s) is str for s in names):
        raise CheckpointFormatError(f"{where}: malformed columns (field {field!r})")
    return names


def parse(raw: Any, nkeys: int, where: str) -> Columns:
    """The columns of a dict node of ``nkeys`` keys as stored, every field checked at once;
    :class:`CheckpointFormatError` naming ``where`` for anything else. Blob references are
    checked against the manifest's blobs where they are used (a restore's allocation)."""
    if type(raw) is not dict or set(raw) != set(_FIELDS):
        raise CheckpointFormatError(f"{where}: malformed columns")
    dtypes, devices = _names(raw, "dtypes", where), _names(raw, "devices", where)
    dtype = _ints(raw, "dtype", nkeys, where)
    ndim = _ints(raw, "ndim", nkeys, where)
    dims = _ints(raw, "dims", None, where)
    device = _ints(raw, "device", nkeys, where)
    b, at, flags = (_ints(raw, f, nkeys, where) for f in ("b", "at", "flags"))
    if (
        ((dtype < 0) | (dtype >= len(dtypes))).any()
        or ((device < 0) | (device >= len(devices))).any()
        or ((ndim < 0) | (ndim > MAX_NDIM)).any()
        or int(ndim.sum()) != len(dims)
        or ((dims < 0) | (dims > MAX_ELEMENTS)).any()
        or (b < 0).any()
        or (at < -1).any()
        or (at > MAX_BLOB_BYTES).any()  # an offset inside a blob: at + bytes stays in int64
        or ((flags < 0) | (flags > PARAM + GRAD)).any()
    ):
        raise CheckpointFormatError(f"{where}: malformed columns")
    cols = Columns(raw)
    cols.dtype, cols.ndim, cols.dims, cols.device = dtype, ndim, dims, device
    cols.b, cols.at, cols.flags = b, at, flags
    cols._nodes = None
    return cols
