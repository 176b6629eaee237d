"""The dtypes of a restore's leaves: torch dtype names and numpy descrs decoded (a manifest's
own strings: refused with :class:`CheckpointFormatError`, never trusted), the process-wide
caches of those found, element sizes, and the two torch helpers every route of a restore
shares (a fresh tensor's byte view; a leaf marked as saved).

Pure; any thread (the caches are filled by whichever restore meets a dtype first: a lost race
stores the same value twice). The hot routes read the caches directly, without a call per leaf.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cryosnap._state.torch_import import import_torch
from cryosnap.errors import CheckpointFormatError

__all__ = [
    "ITEMSIZE",
    "NP_DTYPES",
    "NUMPY_DTYPES",
    "TORCH_DTYPES",
    "as_leaf",
    "byte_view",
    "itemsize",
    "np_dtype",
    "require_torch",
    "torch_dtype",
]

# The torch dtype names torch_dtype found, and their dtypes.
TORCH_DTYPES: dict[str, Any] = {}
# String descrs parsed so far ("<f4"): a restore of 20,000 arrays parses a handful of them
# 40,000 times. Bounded: a hostile manifest's made-up descrs do not grow it past that.
NP_DTYPES: dict[str, np.dtype[Any]] = {}
_NP_DTYPES_MAX = 256
# Bytes per element of each torch dtype met so far.
ITEMSIZE: dict[Any, int] = {}
# The torch dtypes numpy has a dtype for (filled on the first byte_view).
NUMPY_DTYPES: set[Any] = set()


def require_torch() -> Any:
    """``torch``, or :class:`CheckpointFormatError` saying how to install it."""
    try:
        torch = import_torch()
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise CheckpointFormatError(
            "this checkpoint holds torch tensors but torch is not installed "
            "(pip install 'cryosnap[torch]')"
        ) from exc
    return torch


def torch_dtype(name: Any, path: str) -> Any:
    """The torch dtype named ``name`` by the leaf at ``path`` (noted in TORCH_DTYPES)."""
    torch = require_torch()
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"leaf {path}: unknown torch dtype {name!r}")
    if type(name) is str:
        TORCH_DTYPES[name] = dtype
    return dtype


def np_dtype(descr: Any, path: str) -> np.dtype[Any]:
    """The numpy dtype of the descr ``descr`` of the leaf at ``path``: none that holds Python
    objects (a string descr noted in NP_DTYPES, up to a bound)."""
    if type(descr) is str:
        known = NP_DTYPES.get(descr)
        if known is not None:
            return known

    def tuples(d: Any) -> Any:
        if isinstance(d, list):
            return [tuple(tuples(x) for x in f) if isinstance(f, list) else f for f in d]
        return d

    try:
        if isinstance(descr, list):
            descr = [tuple(tuples(x) if isinstance(x, list) else x for x in f) for f in descr]
        dtype: np.dtype[Any] = np.lib.format.descr_to_dtype(descr)
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, RecursionError) as exc:
        raise CheckpointFormatError(f"leaf {path}: invalid numpy dtype {descr!r}") from exc
    if dtype.hasobject:
        raise CheckpointFormatError(f"leaf {path}: numpy dtype {descr!r} holds Python objects")
    if type(descr) is str and len(NP_DTYPES) < _NP_DTYPES_MAX:
        NP_DTYPES[descr] = dtype
    return dtype


def itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype (no tensor made for it after the first time)."""
    size = ITEMSIZE.get(dtype)
    if size is None:
        size = ITEMSIZE[dtype] = require_torch().empty(0, dtype=dtype).element_size()
    return size


def byte_view(t: Any) -> memoryview:
    """A flat writable byte view of the fresh contiguous CPU tensor ``t``, which it keeps
    alive (a read that outlives a failed restore writes into memory still owned)."""
    if not t.numel():
        return memoryview(bytearray())
    if not NUMPY_DTYPES:
        torch = require_torch()
        names = "float16 float32 float64 complex64 complex128 bool uint8 int8 int16 int32 int64"
        NUMPY_DTYPES.update(frozenset(getattr(torch, n) for n in names.split()))
    if t.dtype in NUMPY_DTYPES:
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.reshape(-1).view(require_torch().uint8).numpy())


def as_leaf(t: Any, node: dict[str, Any], path: str) -> Any:
    """``t`` as the saved leaf ``node`` was: a Parameter, or requiring grad, if it was."""
    try:
        if node.get("param"):
            return require_torch().nn.Parameter(t, requires_grad=bool(node.get("grad")))
        if node.get("grad"):
            t.requires_grad_(True)
    except RuntimeError as exc:  # e.g. requires_grad on an integer tensor
        raise CheckpointFormatError(f"leaf {path}: {exc}") from exc
    return t
