"""Shared helpers for the unit tests: Hypothesis strategies for state trees and exact comparisons.

Comparisons are *exact*: floating point content is compared byte for byte (NaN payloads, -0.0),
container and scalar types must match (a tuple stays a tuple, an int key stays an int, a numpy
scalar keeps its type), tensors keep dtype, shape, ``requires_grad`` and ``nn.Parameter``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from hypothesis import strategies as st

__all__ = [
    "NUMPY_DTYPES",
    "STRUCT_DTYPE",
    "TORCH_DTYPES",
    "assert_same",
    "blob_bytes_of",
    "commit_checksum",
    "count_calls",
    "make_array",
    "make_tensor",
    "numpy_arrays",
    "numpy_scalars",
    "python_scalars",
    "rewrite_version",
    "snapshot",
    "state_trees",
    "tensor_bytes",
    "torch_tensors",
]

TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
]
_GRAD_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}

STRUCT_DTYPE = np.dtype(
    [("id", "<i4"), ("xy", "<f8", (2,)), ("flag", "?"), ("inner", [("a", "u1"), ("b", ">i2")])]
)
NUMPY_DTYPES = [
    np.dtype("<f4"),
    np.dtype(">f8"),
    np.dtype("<f2"),
    np.dtype("<i2"),
    np.dtype("<u8"),
    np.dtype("u1"),
    np.dtype("?"),
    np.dtype("<c8"),
    np.dtype("<c16"),
    np.dtype("<M8[ns]"),
    np.dtype("<m8[s]"),
    np.dtype("<U3"),
    np.dtype("S4"),
    STRUCT_DTYPE,
]


# ---------------------------------------------------------------------------------------------
# building leaves from a seed (fast; Hypothesis draws the seed, shapes and layouts)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A contiguous tensor of ``dtype``/``shape`` whose bytes are random (NaN payloads included)."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    item = torch.empty(0, dtype=dtype).element_size()
    if dtype == torch.bool:
        raw = rng.integers(0, 2, n, dtype=np.uint8).tobytes()
    else:
        raw = rng.bytes(n * item)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
    return flat.reshape(shape)


def make_array(dtype: np.dtype[Any], shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A C-ordered array of ``dtype``/``shape`` with random content."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "U":
        chars = dtype.itemsize // 4
        codes = rng.integers(0x20, 0xD7FF, n * chars, dtype=np.uint32).astype("<u4")
        return codes.view(dtype).reshape(shape)
    return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype).reshape(shape).copy()


_shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)


@st.composite
def torch_tensors(draw: st.DrawFn, dtypes: list[torch.dtype] = TORCH_DTYPES) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(_shapes)
    base = make_tensor(dtype, shape, draw(st.integers(0, 2**32 - 1)))
    layout = draw(st.sampled_from(["plain", "transpose", "step", "narrow", "expand", "conj"]))
    t = base
    if layout == "transpose" and base.dim() >= 2:
        t = base.transpose(0, -1)
    elif layout == "step" and base.dim() >= 1:
        t = base[::2]
    elif layout == "narrow" and base.dim() >= 1 and base.shape[0] > 1:
        t = base[1:]
    elif layout == "expand":
        t = base.unsqueeze(0).expand(2, *base.shape)
    elif layout == "conj" and base.is_complex():
        t = base.conj()
    if dtype in _GRAD_DTYPES:
        grad = draw(st.sampled_from(["none", "requires_grad", "param", "param_frozen"]))
        if grad == "requires_grad":
            t = t.detach().requires_grad_(True)
        elif grad == "param":
            t = torch.nn.Parameter(t.detach(), requires_grad=True)
        elif grad == "param_frozen":
            t = torch.nn.Parameter(t.detach(), requires_grad=False)
    return t


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    shape = draw(_shapes)
    arr = make_array(dtype, shape, draw(st.integers(0, 2**32 - 1)))
    layout = draw(st.sampled_from(["C", "F", "step", "transpose"]))
    if layout == "F":
        arr = np.asfortranarray(arr)
    elif layout == "step" and arr.ndim >= 1:
        arr = arr[::2]
    elif layout == "transpose":
        arr = arr.T
    return arr


def numpy_scalars() -> st.SearchStrategy[Any]:
    nan_payload = np.frombuffer(struct.pack("<Q", 0xFFF8_0000_0000_0F0F), "<f8")[0]
    fixed = [
        np.float32(1.5),
        np.float64(-0.0),
        nan_payload,
        np.float16(np.inf),
        np.longdouble(1) / 3,
        np.int8(-7),
        np.int64(2**62),
        np.uint8(255),
        np.uint64(2**64 - 1),
        np.bool_(True),
        np.complex64(1 - 2j),
        np.complex128(complex(math.inf, -0.0)),
        np.datetime64("2024-02-29T12:00:00", "s"),
        np.datetime64("NaT"),
        np.timedelta64(-5, "ms"),
        np.str_("héllo ✓"),
        np.bytes_(b"\x00ab"),
        np.zeros((), STRUCT_DTYPE)[()],
    ]
    return st.sampled_from(fixed) | st.floats(width=32).map(np.float32)


def python_scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from([2**64, -(2**200), 10**1000, 1 << 4000]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324]),
        st.complex_numbers(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.binary(max_size=16),
        st.binary(max_size=16).map(bytearray),
    )


@st.composite
def big_leaves(draw: st.DrawFn) -> Any:
    """A leaf of a few KiB, so that ``chunk_bytes=4096`` cuts it into several chunks."""
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["tensor", "array", "bytes"]))
    n = draw(st.integers(1025, 5000))
    if kind == "tensor":
        return make_tensor(torch.float32, (n,), seed)
    if kind == "array":
        return make_array(np.dtype("<f8"), (n // 2,), seed)
    return np.random.default_rng(seed).bytes(n * 2)


def _leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        torch_tensors(), numpy_arrays(), numpy_scalars(), python_scalars(), big_leaves()
    )


_keys = st.one_of(st.text(max_size=5), st.integers(-(2**70), 2**70))


def state_trees(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Nested dict (str and int keys) / list / tuple / OrderedDict trees of every leaf kind."""
    return st.recursive(
        _leaves(),
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(_keys, children, max_size=4),
            st.dictionaries(st.text(max_size=3), children, max_size=3).map(OrderedDict),
        ),
        max_leaves=max_leaves,
    )


# ---------------------------------------------------------------------------------------------
# exact comparison


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s values in C order (lazy conj/neg resolved)."""
    if t.numel() == 0:
        return b""
    # clone(contiguous_format) gives stride 1 even for one-element views, which torch calls
    # contiguous whatever their stride.
    x = t.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    return bytes(x.reshape(-1).view(torch.uint8).numpy().tobytes())


def _float_bytes(x: float) -> bytes:
    return struct.pack("<d", x)


def _same_float(a: float, b: float) -> bool:
    # Bitwise: -0.0 stays -0.0, and a NaN keeps its sign and payload.
    return _float_bytes(a) == _float_bytes(b)


def blob_bytes_of(leaf: Any) -> int:
    """Bytes a non-shared leaf occupies in the data file (0 for inline leaves)."""
    if isinstance(leaf, torch.Tensor):
        return leaf.numel() * leaf.element_size()
    if isinstance(leaf, np.ndarray):
        return int(leaf.nbytes)
    if isinstance(leaf, (bytes, bytearray)) and not isinstance(leaf, np.generic):
        return len(leaf)
    return 0


def assert_same(expected: Any, actual: Any, path: str = "<root>") -> None:
    """Assert that ``actual`` equals ``expected`` exactly, types and bytes included."""
    where = f"at {path}"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual)} is not a tensor"
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        assert actual.requires_grad == expected.requires_grad, f"{where}: requires_grad"
        assert actual.device.type == "cpu", where
        assert tensor_bytes(actual) == tensor_bytes(expected), f"{where}: tensor bytes differ"
        return
    if isinstance(expected, np.ndarray):
        assert type(actual) is np.ndarray, f"{where}: {type(actual)} is not an ndarray"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        assert actual.tobytes(order="C") == expected.tobytes(order="C"), f"{where}: bytes"
        if expected.ndim > 1 and expected.flags.f_contiguous and not expected.flags.c_contiguous:
            assert actual.flags.f_contiguous, f"{where}: Fortran order was lost"
        assert actual.flags.writeable, f"{where}: restored array is read-only"
        return
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.tobytes() == expected.tobytes(), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        assert [type(k) for k in actual] == [type(k) for k in expected], f"{where}: key types"
        for k in expected:
            name = hex(k) if isinstance(k, int) and k.bit_length() > 63 else k  # no huge str()
            assert_same(expected[k], actual[k], f"{path}/{name}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}/{i}")
    elif isinstance(expected, float):
        assert _same_float(expected, actual), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, complex):
        ok = all(
            _same_float(e, a)
            for e, a in ((expected.real, actual.real), (expected.imag, actual.imag))
        )
        assert ok, f"{where}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------------------------------
# snapshots of an into= tree, to prove that nothing changed


def snapshot(tree: Any) -> list[tuple[str, bytes]]:
    """(path, bytes) of every tensor and array reachable from ``tree``, stateful objects included.

    Module parameters and buffers are read through ``state_dict(keep_vars=True)``, optimizers and
    other stateful objects through ``state_dict()``; so the snapshot covers what ``into=`` fills.
    """
    out: list[tuple[str, bytes]] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            out.append((path, tensor_bytes(obj)))
        elif isinstance(obj, np.ndarray):
            out.append((path, obj.tobytes()))
        elif isinstance(obj, torch.nn.Module):
            walk(dict(obj.state_dict(keep_vars=True)), path)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        elif callable(getattr(obj, "state_dict", None)):
            walk(obj.state_dict(), path)
        else:
            out.append((path, repr(obj).encode()))

    walk(tree, "")
    return out


def count_calls(obj: Any, method: str) -> Callable[[], int]:
    """Wrap ``obj.method`` to count its calls; returns a function giving the count."""
    calls = [0]
    original = getattr(obj, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(obj, method, wrapper)
    return lambda: calls[0]


def commit_checksum(doc: dict[str, Any]) -> str:
    """The checksum of a commit record document (without its ``checksum`` field).

    Written out here, independently of the format's code, as the format documents it: xxh3-128
    (hex) of the document serialized with sorted keys and no whitespace.
    """
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return str(xxhash.xxh3_128_hexdigest(body))


def rewrite_version(
    read: Callable[[str], bytes],
    write: Callable[[str, bytes], None],
    step: int,
    *,
    manifest: Callable[[dict[str, Any]], None] | None = None,
    commit: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Edit rank 0's manifest and/or the commit record of ``step`` in place (``read`` and
    ``write`` by key, as a store does), keeping every hash consistent: the manifest's recorded
    xxh3 and size, and the commit record's checksum."""
    mkey = f"versions/{step:012d}/rank-00000.json"
    ckey = f"versions/{step:012d}/COMMIT.json"
    mdoc = json.loads(read(mkey))
    if manifest is not None:
        manifest(mdoc)
    mbody = json.dumps(mdoc, separators=(",", ":")).encode()
    write(mkey, mbody)
    cdoc = json.loads(read(ckey))
    cdoc.pop("checksum")
    cdoc["manifests"][0].update(xxh3_128=xxhash.xxh3_128_hexdigest(mbody), bytes=len(mbody))
    if commit is not None:
        commit(cdoc)
    cdoc["checksum"] = commit_checksum(cdoc)
    write(ckey, json.dumps(cdoc, separators=(",", ":")).encode())


def leaves_of(tree: Any) -> list[Any]:
    """The leaves of a plain tree of dict / list / tuple, in order."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in leaves_of(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in leaves_of(v)]
    return [tree]


def evict(path: Path) -> None:
    """fsync ``path`` (a file, or every file under a folder) and drop its pages from the page
    cache (``POSIX_FADV_DONTNEED``)."""
    for p in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_pages_of(paths: Iterable[Path]) -> tuple[int, int] | None:
    """(pages in the page cache, pages) over ``paths`` (``mincore``); None where it cannot be
    told for one of them."""
    from cryosnap import _native

    cached = total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            counts = _native.cached_pages(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if counts is None:
            return None
        cached, total = cached + counts[0], total + counts[1]
    return cached, total
