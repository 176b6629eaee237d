"""State trees: flatten into a JSON skeleton plus byte blobs, and build them back.

A *state* is a tree of dict / list / tuple holding tensors, arrays, scalars, strings, bytes,
None and *stateful* objects (anything with ``state_dict()`` and ``load_state_dict()``).
:func:`flatten` turns it into a :class:`FlatState`: a *skeleton* (plain JSON: containers, types,
dtypes, shapes, inline scalars) and a list of :class:`Blob` (the raw bytes of every tensor, array
and bytes leaf). :class:`Restorer` does the reverse in two phases, so the caller can read the
blob bytes straight into the final tensors: ``allocate()`` creates empty leaves and hands out a
writable byte view per blob, ``build()`` assembles the tree once they are filled; in between,
``to_device()`` may move the torch leaves to a GPU (restore's ``map_location``).

Tensors that share storage (tied weights, views of one buffer) become *one* blob that covers the
bytes they use; each tensor records its byte offset and strides inside it, and they come back
sharing one storage, as ``torch.save`` does. A tensor that shares with nobody is stored compact
(contiguous), whatever its strides: a small view never drags its whole base storage along.

With ``pack_bytes`` (the Checkpointer passes its chunk size, at most :data:`PACK_BYTES`), small
CPU tensors that share with nobody are *packed*: copied back to back (each at a multiple of its
element size, zeros in the gaps) into one blob of at most ``pack_bytes``, each recording its
byte offset there (``"at"``). A state of thousands of small tensors then costs one blob, one hash
and one manifest row per pack instead of per tensor; every byte is still verified (by the
pack's chunk hashes), and each leaf comes back as a tensor of its own.

Leaf paths name leaves in messages: the keys from the root joined by ``/``
(``optim/state/0/exp_avg``). No pickle is involved unless ``allow_pickle=True``: then unknown
objects are pickled into a blob and only unpickled by a load that also allows it.

Pure, no I/O (``to_device`` aside, a copy to a GPU); runs on the caller's thread. torch is
imported only when a tensor is met.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from . import _native
from ._devcopy import copy_to_device, to_device
from ._format.skeleton import (
    _BIG_INT_BITS,
    MAX_DEPTH,
    MAX_ELEMENTS,
    MAX_NDIM,
    Json,
    _key_text,
    dict_items,
    encode_key,
    format_path,
)
from ._gc import paused_gc
from ._torch_import import import_torch, loaded_torch
from .errors import CheckpointError, CheckpointFormatError, StateMismatchError

__all__ = [
    "Blob",
    "FlatState",
    "Restorer",
    "apply_into",
    "check_into",
    "direct_targets",
    "flatten",
    "is_stateful",
]


# Packing of small tensors (see the module docstring): the largest pack, and the largest leaf
# packed (a fraction of the pack, so that a pack holds many).
PACK_BYTES = 1 << 20
PACK_LEAF_FRACTION = 16


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` follows the ``state_dict()`` / ``load_state_dict()`` protocol."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


@dataclass(slots=True)
class Blob:
    """The bytes of one stored buffer.

    ``source`` is a 1-D uint8 view of the live data (a torch tensor, maybe on a GPU, or a numpy
    array) or an immutable ``bytes``. It is not copied here: the caller captures or writes it.
    """

    key: tuple[str | int, ...]
    nbytes: int
    source: Any
    # data_ptr of the torch storage the bytes come from (0: not a tensor, or a private copy);
    # lazy capture uses it to find the blobs an optimizer step mutates.
    origin: int = 0
    # The source is memory of cryosnap's own that nothing else writes (a pack of small
    # tensors, copied by flatten): the capture hands it to the writer without copying it.
    private: bool = False

    @property
    def path(self) -> str:
        """The leaf path of the blob's first owner (formatted when asked: most saves never
        need it)."""
        return format_path(self.key)

    def host_view(self) -> memoryview:
        """A flat byte view of the data in host memory (copies only from a GPU)."""
        src = self.source
        kind = type(src)
        if kind is bytes:
            return memoryview(src)
        if kind is np.ndarray or isinstance(src, np.ndarray):
            return src.data.cast("B") if src.nbytes else memoryview(b"")
        if isinstance(src, bytes):
            return memoryview(src)
        if not src.is_cpu:  # a flag: src.device would build an object per call
            src = src.cpu()
        return src.numpy().data if src.nbytes else memoryview(b"")


@dataclass(slots=True)
class FlatState:
    """A flattened state: the JSON skeleton, its blobs and a count of leaves."""

    skeleton: Json
    blobs: list[Blob]
    leaves: int
    logical_bytes: int
    stateful: list[tuple[str, Any]] = field(default_factory=list)
    packed: bool = False  # whether any tensor of the skeleton is packed (has "at")


# ---------------------------------------------------------------------------------------------
# flatten


_SCALARS = (int, float, bool, str, bytes, bytearray, complex, type(None))
_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> its name in a skeleton ("float32")


def flatten(
    state: Any, *, allow_pickle: bool = False, pack_bytes: int = 0, pack_apart: object = None
) -> FlatState:
    """Split ``state`` into a JSON skeleton and blobs; ``TypeError`` names any unsupported leaf.

    ``pack_bytes`` > 0 packs small CPU tensors into shared blobs of at most that many bytes
    (capped at :data:`PACK_BYTES`; see the module docstring); 0 stores every tensor alone.
    ``pack_apart``: top-level keys (a list or tuple, as ``save(replicated=...)`` takes them)
    whose leaves never share a pack with the other keys' leaves."""
    apart = frozenset(
        k
        for k in (pack_apart if isinstance(pack_apart, (list, tuple)) else ())
        if type(k) in (str, int)
    )
    with paused_gc():
        return _Flattener(allow_pickle, min(max(pack_bytes, 0), PACK_BYTES), apart).run(state)


class _Flattener:
    def __init__(
        self, allow_pickle: bool, pack_bytes: int = 0, apart: frozenset[Any] = frozenset()
    ) -> None:
        self.allow_pickle = allow_pickle
        self.pack_bytes = pack_bytes
        self.apart = apart
        self.blobs: list[Blob] = []
        self.leaves = 0
        self.stateful: list[tuple[str, Any]] = []
        # Tensors are grouped by storage after the walk, so tied weights become one blob.
        self.tensors: list[tuple[dict[str, Any], Any, tuple[str | int, ...]]] = []
        self._active: set[int] = set()
        self._depth = 0

    def run(self, state: Any) -> FlatState:
        skeleton = self.visit(state, ())
        packed = self._assign_tensor_blobs()
        logical = sum(b.nbytes for b in self.blobs)
        return FlatState(skeleton, self.blobs, self.leaves, logical, self.stateful, packed)

    def pickled(self, obj: Any, path: tuple[str | int, ...]) -> Json:
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"cannot checkpoint {format_path(path)}: pickling failed: {exc}"
            ) from exc
        return {"t": "pickle", "b": self.add_blob(path, data, len(data))}

    def add_blob(self, path: tuple[str | int, ...], source: Any, nbytes: int) -> int:
        self.blobs.append(Blob(path, nbytes, source))
        return len(self.blobs) - 1

    def visit(self, obj: Any, path: tuple[str | int, ...]) -> Json:
        if self._depth > MAX_DEPTH:
            # What load() refuses (check_depth) must not be saved in the first place.
            raise TypeError(
                f"cannot checkpoint {format_path(path)}: the state is nested deeper than "
                f"{MAX_DEPTH} levels"
            )
        self._depth += 1
        try:
            return self._visit(obj, path)
        finally:
            self._depth -= 1

    def _visit(self, obj: Any, path: tuple[str | int, ...]) -> Json:
        tp = type(obj)
        if tp in _SCALARS:
            self.leaves += 1
            return self.scalar(obj, path)
        torch = loaded_torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            self.leaves += 1
            return self.tensor(obj, path)
        if type(obj) is np.ndarray:
            self.leaves += 1
            return self.ndarray(obj, path)
        if isinstance(obj, np.generic):
            self.leaves += 1
            return self.npscalar(obj, path)
        if isinstance(obj, (dict, list, tuple)):
            key = id(obj)
            if key in self._active:
                raise TypeError(f"state contains a reference cycle at {format_path(path)}")
            self._active.add(key)
            try:
                return self.container(obj, path)
            finally:
                self._active.discard(key)
        if is_stateful(obj):
            self.stateful.append((format_path(path), obj))
            cls = type(obj)
            return {
                "t": "stateful",
                "type": f"{cls.__module__}.{cls.__qualname__}",
                "v": self.visit(obj.state_dict(), path),
            }
        if self.allow_pickle:
            self.leaves += 1
            return self.pickled(obj, path)
        raise TypeError(
            f"cannot checkpoint {format_path(path)}: unsupported type "
            f"{tp.__module__}.{tp.__qualname__} (supported: tensors, numpy arrays and scalars, "
            "int/float/bool/complex/str/bytes/None, dict/list/tuple, objects with state_dict(); "
            "pass allow_pickle=True to pickle anything else)"
        )

    def container(self, obj: Any, path: tuple[str | int, ...]) -> Json:
        if isinstance(obj, dict):
            keys: list[str | int] = []
            for k in obj:
                if type(k) not in (str, int):
                    raise TypeError(
                        f"cannot checkpoint {format_path(path)}: dict key {k!r} of type "
                        f"{type(k).__name__} (keys must be str or int)"
                    )
                keys.append(k)
            kind = "odict" if isinstance(obj, OrderedDict) else "dict"
            torch = loaded_torch()
            plain = torch.Tensor if torch is not None and self._depth <= MAX_DEPTH else None
            vals: list[Json] = []
            for k in keys:
                v = obj[k]
                if type(v) is plain:  # a state dict's tensors: visit() without its checks
                    self.leaves += 1
                    vals.append(self.tensor(v, (*path, k)))
                else:
                    vals.append(self.visit(v, (*path, k)))
            return {"t": kind, "k": [encode_key(k) for k in keys], "v": vals}
        if type(obj) is list:
            return {"t": "list", "v": [self.visit(v, (*path, i)) for i, v in enumerate(obj)]}
        if type(obj) is tuple:
            return {"t": "tuple", "v": [self.visit(v, (*path, i)) for i, v in enumerate(obj)]}
        torch = loaded_torch()
        if torch is not None and type(obj) is torch.Size:
            return {"t": "size", "v": list(obj)}
        if self.allow_pickle:
            self.leaves += 1
            return self.pickled(obj, path)
        tp = type(obj)
        raise TypeError(
            f"cannot checkpoint {format_path(path)}: {tp.__module__}.{tp.__qualname__} is a "
            "list/tuple subclass (namedtuples and the like need allow_pickle=True)"
        )

    def scalar(self, obj: Any, path: tuple[str | int, ...]) -> Json:
        if obj is None:
            return {"t": "none"}
        if isinstance(obj, bool):
            return {"t": "bool", "v": obj}
        if isinstance(obj, int):
            if obj.bit_length() > _BIG_INT_BITS:
                return {"t": "int", "hex": hex(obj)}
            return {"t": "int", "v": obj}
        if isinstance(obj, float):
            if math.isnan(obj):  # float.hex() says 'nan' for every NaN: keep sign and payload
                return {"t": "float", "bits": struct.pack("<d", obj).hex()}
            return {"t": "float", "v": obj.hex()}
        if isinstance(obj, complex):
            if math.isnan(obj.real) or math.isnan(obj.imag):  # keep NaN sign and payload
                return {"t": "complex", "bits": struct.pack("<dd", obj.real, obj.imag).hex()}
            return {"t": "complex", "v": [obj.real.hex(), obj.imag.hex()]}
        if isinstance(obj, str):
            return {"t": "str", "v": obj}
        data = bytes(obj)
        kind = "bytes" if isinstance(obj, bytes) else "bytearray"
        return {"t": kind, "b": self.add_blob(path, data, len(data))}

    def ndarray(self, arr: np.ndarray, path: tuple[str | int, ...]) -> Json:
        if arr.dtype.hasobject:
            if self.allow_pickle:
                return self.pickled(arr, path)
            raise TypeError(
                f"cannot checkpoint {format_path(path)}: numpy array of dtype {arr.dtype} holds "
                "Python objects (pass allow_pickle=True to pickle it)"
            )
        node: dict[str, Any] = {
            "t": "numpy",
            "dtype": np.lib.format.dtype_to_descr(arr.dtype),
            "shape": list(arr.shape),
        }
        if arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous:
            node["order"] = "F"
            flat = arr.T.reshape(-1)
        else:
            flat = np.ascontiguousarray(arr).reshape(-1)
        raw = flat.view(np.uint8) if flat.size else np.empty(0, np.uint8)
        node["b"] = self.add_blob(path, raw, raw.nbytes)
        return node

    def npscalar(self, obj: np.generic, path: tuple[str | int, ...]) -> Json:
        if obj.dtype.hasobject:
            return self._refuse_object(obj, path)
        return {
            "t": "npscalar",
            "dtype": np.lib.format.dtype_to_descr(obj.dtype),
            "hex": obj.tobytes().hex(),
        }

    def _refuse_object(self, obj: Any, path: tuple[str | int, ...]) -> Json:
        if self.allow_pickle:
            return self.pickled(obj, path)
        raise TypeError(
            f"cannot checkpoint {format_path(path)}: numpy object scalar "
            "(pass allow_pickle=True to pickle it)"
        )

    def tensor(self, t: Any, path: tuple[str | int, ...]) -> Json:
        torch = sys.modules["torch"]
        if t.layout != torch.strided or t.is_quantized or t.is_meta:
            if self.allow_pickle and not t.is_meta:
                return self.pickled(t, path)
            raise TypeError(
                f"cannot checkpoint {format_path(path)}: {t.layout} / quantized / meta tensors "
                "are not supported (dense strided tensors only)"
            )
        dtype = t.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
        node: dict[str, Any] = {
            "t": "torch",
            "dtype": name,
            "shape": list(t.shape),
            # is_cpu is a flag; t.device builds an object (and str() a string) per call.
            "device": "cpu" if t.is_cpu else str(t.device),
        }
        # Parameter's metaclass makes isinstance slow; plain tensors skip it.
        if type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter):
            node["param"] = True
        if t.requires_grad:
            node["grad"] = True
        self.tensors.append((node, t, path))
        return node

    def _assign_tensor_blobs(self) -> bool:
        """Give every tensor its blob; whether any was packed."""
        torch = loaded_torch()
        if torch is None or not self.tensors:
            return False
        # No autograd bookkeeping for the views taken below (cheaper than detach() each).
        with torch.no_grad():
            return self._assign_groups(torch)

    def _assign_groups(self, torch: Any) -> bool:
        groups: dict[tuple[str, int, int], list[int]] = {}
        ptrs: list[int] = []
        for i, (_node, t, _path) in enumerate(self.tensors):
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            ptrs.append(ptr)
            if size == 0 or t.numel() == 0:
                groups[("empty", i, 0)] = [i]
            else:
                # Two storages may start at one address (views of one numpy buffer): the size
                # is part of the key, so only the very same storage is shared.
                groups.setdefault(("cpu" if t.is_cpu else t.device.type, ptr, size), []).append(i)
        uint8, blobs, tensors = torch.uint8, self.blobs, self.tensors
        packer = _Packer(blobs, self.pack_bytes, torch, self.apart)
        leaf_max = self.pack_bytes // PACK_LEAF_FRACTION
        for members in groups.values():
            if len(members) == 1:
                i = members[0]
                node, t, path = tensors[i]
                x = t
                if x.is_complex():  # only complex tensors carry lazy conj/neg bits
                    x = x.resolve_conj().resolve_neg()
                if not x.is_contiguous():
                    x = x.contiguous()
                n = x.nbytes
                if 0 < n <= leaf_max and x.is_cpu:
                    # contiguous: its n bytes lie at x.data_ptr()
                    packer.add(node, path, x, n, x.element_size())
                    continue
                if n == x.element_size() and x.dim() and x.stride()[-1] != 1:
                    # torch calls a one-element view of any stride contiguous, but a byte view
                    # needs stride 1.
                    x = x.as_strided((1,), (1,))
                flat = x.reshape(-1).view(uint8) if n else x.new_empty(0).view(uint8).reshape(0)
                if flat.requires_grad:  # a view taken before no_grad (never, but be sure)
                    flat = flat.detach()
                # add_blob inlined (one call less per tensor of a state of many small ones)
                node["b"] = len(blobs)
                origin = ptrs[i] if x is t or x.untyped_storage().data_ptr() == ptrs[i] else 0
                blobs.append(Blob(path, n, flat, origin))
                continue
            # Shared storage: one blob covering every byte the group uses, aligned so each
            # member's offset stays a multiple of its element size.
            spans = []
            for i in members:
                _node, t, _path = self.tensors[i]
                item = t.element_size()
                start = t.storage_offset() * item
                extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
                spans.append((start, start + (extent + 1) * item, item))
            align = max(item for _s, _e, item in spans)
            lo = min(s for s, _e, _i in spans) // align * align
            hi = max(e for _s, e, _i in spans)
            _node, first, first_path = self.tensors[members[0]]
            base = torch.empty(0, dtype=torch.uint8, device=first.device)
            base.set_(first.untyped_storage(), lo, (hi - lo,), (1,))
            blob = self.add_blob(first_path, base.detach(), hi - lo)
            self.blobs[-1].origin = first.untyped_storage().data_ptr()
            for i, (start, _end, _item) in zip(members, spans, strict=True):
                node, t, _path = self.tensors[i]
                if t.is_conj() or t.is_neg():
                    raise TypeError(
                        f"cannot checkpoint {format_path(_path)}: a lazily conjugated/negated "
                        "view that shares storage; call .resolve_conj()/.resolve_neg() first"
                    )
                node["b"] = blob
                node["view"] = {"offset": start - lo, "stride": list(t.stride())}
        packer.close()
        return packer.packs > 0


class _Packer:
    """Collects small tensors into packs (see the module docstring), in the order they come;
    a pack is closed when the next leaf would not fit, or when it crosses between the
    top-level keys in ``apart`` and the others (replicated state is chosen by top-level key,
    and a blob belongs to the key of its first leaf: a pack never mixes the two kinds)."""

    def __init__(
        self, blobs: list[Blob], pack_bytes: int, torch: Any, apart: frozenset[Any]
    ) -> None:
        self.blobs = blobs
        self.pack_bytes = pack_bytes
        self.torch = torch
        self.apart = apart
        # (node, contiguous CPU tensor, its bytes, its offset in the pack)
        self.members: list[tuple[dict[str, Any], Any, int, int]] = []
        self.path: tuple[str | int, ...] = ()
        self.kind = False  # whether the open pack holds leaves of keys in apart
        self.size = 0
        self.packs = 0  # packs closed

    def add(
        self, node: dict[str, Any], path: tuple[str | int, ...], t: Any, n: int, item: int
    ) -> None:
        at = -(-self.size // item) * item
        kind = bool(self.apart) and bool(path) and path[0] in self.apart
        if self.members and (at + n > self.pack_bytes or kind != self.kind):
            self.close()
            at = 0
        if not self.members:
            self.path, self.kind = path, kind
        self.members.append((node, t, n, at))
        self.size = at + n

    def close(self) -> None:
        members = self.members
        if not members:
            return
        self.members = []
        pack = self.torch.empty(self.size, dtype=self.torch.uint8)
        # One memmove per leaf, by address (what capture does for small pieces: torch's copy_
        # and cat cost more per call and run on its intra-op threads), and zeros in the
        # alignment gaps: every byte of a pack is defined.
        base, index = pack.data_ptr(), len(self.blobs)
        memmove, zero = _native.memmove, _native.zero
        end = 0
        for node, t, n, at in members:
            if at > end:
                zero(base + end, at - end)
            memmove(base + at, t.data_ptr(), n)
            end = at + n
            node["b"] = index
            node["at"] = at
        # A private copy: nothing the program does from now on can change it (origin 0).
        self.blobs.append(Blob(self.path, self.size, pack, 0, True))
        self.packs += 1


# ---------------------------------------------------------------------------------------------
# restore


def _torch() -> Any:
    try:
        torch = import_torch()
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise CheckpointFormatError(
            "this checkpoint holds torch tensors but torch is not installed "
            "(pip install 'cryosnap[torch]')"
        ) from exc
    return torch


def _torch_dtype(name: Any, path: str) -> Any:
    torch = _torch()
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"leaf {path}: unknown torch dtype {name!r}")
    if type(name) is str:
        _TORCH_DTYPES[name] = dtype
    return dtype


_TORCH_DTYPES: dict[str, Any] = {}  # the dtype names _torch_dtype found, and their dtypes


def _np_dtype(descr: Any, path: str) -> np.dtype[Any]:
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
    return dtype


def _shape(node: dict[str, Any], path: str) -> tuple[int, ...]:
    shape = node.get("shape")
    # The common case (vectors, matrices) in a few operations: well inside every limit.
    if (
        type(shape) is list
        and len(shape) <= 2
        and all(type(s) is int and 0 <= s < _SMALL_DIM for s in shape)
    ):
        return tuple(shape)
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(s) is int and 0 <= s <= MAX_ELEMENTS for s in shape)
        or math.prod(max(s, 1) for s in shape) > MAX_ELEMENTS
    ):
        raise CheckpointFormatError(f"leaf {path}: invalid shape {shape!r:.120}")
    return tuple(shape)


_SMALL_DIM = 2**31  # two such dimensions multiply to less than MAX_ELEMENTS


def _expect_bytes(shape: tuple[int, ...], itemsize: int, have: int, path: str) -> None:
    """Refuse a leaf whose shape does not fit its blob *before* anything is allocated for it."""
    need = math.prod(shape) * itemsize
    if need != have:
        raise CheckpointFormatError(
            f"leaf {path}: shape {list(shape)} of {itemsize}-byte items needs {need} bytes, "
            f"its blob has {have}"
        )


_Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]


def _view_of(base: Any, dtype: Any, geometry: _Geometry) -> Any:
    """A tensor of ``dtype`` over the storage of ``base`` at ``geometry`` (offset in elements,
    shape, stride), on the device of ``base``."""
    offset, shape, stride = geometry
    t = _torch().empty(0, dtype=dtype, device=base.device)
    return t.set_(base.untyped_storage(), offset, shape, stride)


# Where a blob's bytes already lie (engine/_fetch.py's mapped data files): blob, alignment ->
# the memory, or None (see Restorer).
Place = Callable[[int, int], "memoryview | None"]
# The alignment asked of a storage that views of several dtypes share: the largest element.
_MAX_ALIGN = 16

_ITEMSIZE: dict[Any, int] = {}
_NUMPY_DTYPES: frozenset[Any] = frozenset()


def _itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype (no tensor made for it after the first time)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = _torch().empty(0, dtype=dtype).element_size()
    return size


def _byte_view(t: Any) -> memoryview:
    """A flat writable byte view of the fresh contiguous CPU tensor ``t``, which it keeps
    alive (a read that outlives a failed restore writes into memory still owned)."""
    global _NUMPY_DTYPES
    if not t.numel():
        return memoryview(bytearray())
    if not _NUMPY_DTYPES:
        torch = _torch()
        names = "float16 float32 float64 complex64 complex128 bool uint8 int8 int16 int32 int64"
        _NUMPY_DTYPES = frozenset(getattr(torch, n) for n in names.split())
    if t.dtype in _NUMPY_DTYPES:
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.reshape(-1).view(_torch().uint8).numpy())


def _as_leaf(t: Any, node: dict[str, Any], path: str) -> Any:
    """``t`` as the saved leaf was: a Parameter, or requiring grad, if it was."""
    try:
        if node.get("param"):
            return _torch().nn.Parameter(t, requires_grad=bool(node.get("grad")))
        if node.get("grad"):
            t.requires_grad_(True)
    except RuntimeError as exc:  # e.g. requires_grad on an integer tensor
        raise CheckpointFormatError(f"leaf {path}: {exc}") from exc
    return t


class Restorer:
    """Rebuilds a tree from its skeleton, with leaves filled from blob bytes.

    ``allocate()`` creates every tensor/array empty and returns, per blob, a writable flat byte
    view of the memory its bytes go to. Fill them, then ``build()`` returns the tree.

    ``allocate(targets)`` (from :func:`direct_targets`) allocates nothing for those leaves: the
    view of such a blob is the memory of ``into=``'s own tensor or array (``direct[b]`` is
    True), which the built tree holds, so :func:`apply_into` has nothing to copy for it.

    ``allocate(place=...)`` allocates nothing for the tensors and arrays whose bytes already
    lie in memory: ``place(blob, alignment)`` returns that memory (a view of a mapped data
    file, engine/_fetch.py) when its address is a multiple of ``alignment``, or None; the leaf
    is built over it (``placed[b]`` is True) and the reader only verifies it there.
    """

    def __init__(self, skeleton: Json, blob_sizes: list[int], *, allow_pickle: bool) -> None:
        self.skeleton = skeleton
        self.blob_sizes = blob_sizes
        self.allow_pickle = allow_pickle
        self.blob_paths: list[str] = [""] * len(blob_sizes)
        self.direct: list[bool] = [False] * len(blob_sizes)
        self.placed: list[bool] = [False] * len(blob_sizes)
        self._place: Place | None = None
        self._dest: list[Any] = [None] * len(blob_sizes)
        self._values: dict[int, Any] = {}
        self._items: dict[int, list[tuple[str | int, Json]]] = {}  # each dict node's, decoded
        self._targets: Mapping[int, Any] = {}
        # The blobs packed leaves claimed, each with where its last leaf so far ends: the leaves
        # of a pack come in the order they were packed, each after the one before.
        self._packs: dict[int, int] = {}
        # Every torch leaf: its node, its blob and, for a view of a shared storage, its
        # (offset in elements, shape, stride) in that storage.
        self._tensors: list[tuple[dict[str, Any], int, _Geometry | None]] = []

    # phase 1 -------------------------------------------------------------------------------
    def allocate(
        self, targets: Mapping[int, Any] | None = None, place: Place | None = None
    ) -> list[memoryview]:
        self._targets = targets or {}
        self._place = place
        try:
            self._alloc(self.skeleton, "")
        finally:
            self._place = None
        if self._packs:  # what a message about a damaged pack names
            packed = Counter(b for node, b, _g in self._tensors if "at" in node)
            for b, count in packed.items():
                if count > 1:
                    more = count - 1
                    self.blob_paths[b] += f" (packed with {more} more tensor{'s' * (more > 1)})"
        views: list[memoryview] = []
        for i, dest in enumerate(self._dest):
            if dest is None:
                raise CheckpointFormatError(f"blob {i} is referenced by no leaf")
            views.append(dest)
        return views

    def _blob(self, node: dict[str, Any], path: str) -> int:
        b = node.get("b")
        if type(b) is not int or not 0 <= b < len(self.blob_sizes):
            raise CheckpointFormatError(f"leaf {path}: invalid blob reference {b!r}")
        if not self.blob_paths[b]:
            self.blob_paths[b] = path
        return b

    def _claim(self, b: int, view: memoryview, path: str) -> None:
        if self._dest[b] is not None:
            raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
        if view.nbytes != self.blob_sizes[b]:
            raise CheckpointFormatError(
                f"leaf {path}: holds {view.nbytes} bytes but its blob has {self.blob_sizes[b]}"
            )
        self._dest[b] = view

    def _alloc(self, node: Json, where: str) -> None:
        """Allocate the leaves under ``node``, at ``where`` (its path as format_path writes it,
        built key by key on the way down; the root's is empty)."""
        if not isinstance(node, dict):
            raise CheckpointFormatError(f"leaf {where or '<root>'}: malformed node {node!r:.80}")
        t = node.get("t")
        if t in ("dict", "odict"):
            items = self._items[id(node)] = dict_items(node, where or "<root>")
            prefix = f"{where}/" if where else ""
            fast = self._plain_tensor
            for k, v in items:
                path = prefix + (k if type(k) is str else _key_text(k))
                if not fast(v, path):
                    self._alloc(v, path)
        elif t in ("list", "tuple"):
            vals = node.get("v")
            if not isinstance(vals, list):
                raise CheckpointFormatError(f"{where or '<root>'}: malformed {t} node")
            for i, v in enumerate(vals):
                self._alloc(v, f"{where}/{i}" if where else str(i))
        elif t == "stateful":
            self._alloc(node.get("v"), where)
        elif t == "torch":
            self._alloc_tensor(node, where or "<root>")
        elif t == "numpy":
            p = where or "<root>"
            dtype, shape = _np_dtype(node.get("dtype"), p), _shape(node, p)
            order: Literal["C", "F"] = "F" if node.get("order") == "F" else "C"
            b = self._blob(node, p)
            _expect_bytes(shape, dtype.itemsize, self.blob_sizes[b], p)
            target = self._targets.get(id(node))
            if target is not None:  # into='s own C-contiguous array (direct_targets)
                self._claim(b, target.reshape(-1).view(np.uint8).data, p)
                self.direct[b] = True
                self._values[id(node)] = target
                return
            placed = self._placed(b, dtype.alignment)
            if placed is not None:
                # The blob holds the array's elements in its order: C, or F (the transpose's C).
                if order == "F":
                    arr = np.frombuffer(placed, dtype=dtype).reshape(shape[::-1]).T
                else:
                    arr = np.frombuffer(placed, dtype=dtype).reshape(shape)
                self._claim(b, placed, p)
                self._values[id(node)] = arr
                return
            arr = np.empty(shape, dtype=dtype, order=order)
            flat = arr.T.reshape(-1) if order == "F" else arr.reshape(-1)
            self._claim(b, flat.view(np.uint8).data if flat.size else memoryview(bytearray()), p)
            self._values[id(node)] = arr
        elif t in ("bytes", "bytearray", "pickle"):
            p = where or "<root>"
            if t == "pickle" and not self.allow_pickle:
                # Not damage: the version is fine, the caller has to opt in.
                raise CheckpointError(
                    f"leaf {p} is pickled; loading it could run code from the checkpoint, "
                    "so it needs allow_pickle=True"
                )
            b = self._blob(node, p)
            buf = bytearray(self.blob_sizes[b])
            self._claim(b, memoryview(buf), p)
            self._values[id(node)] = buf
        elif t not in ("none", "bool", "int", "float", "complex", "str", "npscalar", "size"):
            raise CheckpointFormatError(f"leaf {where or '<root>'}: unknown node type {t!r}")

    def _placed(self, b: int, alignment: int) -> memoryview | None:
        """The memory ``place`` has for blob ``b`` at ``alignment`` (and ``placed[b]`` set),
        or None: the leaf is allocated (always for an empty blob)."""
        if self._place is None or not self.blob_sizes[b]:
            return None
        view = self._place(b, alignment)
        if view is not None:
            self.placed[b] = True
        return view

    def _plain_tensor(self, node: Any, path: str) -> bool:
        """Allocate ``node`` if it is the most common leaf of a state dict (a plain CPU tensor
        of a known dtype and up to two dimensions, not a view, not filled in place; or packed,
        in a pack an earlier leaf claimed) with every check :meth:`_alloc_tensor` makes, inline;
        False (nothing done) for anything else, which :meth:`_alloc` then takes, errors
        included."""
        if type(node) is not dict or node.get("t") != "torch" or "view" in node:
            return False
        name = node.get("dtype")
        dtype = _TORCH_DTYPES.get(name) if type(name) is str else None
        shape = node.get("shape")
        b = node.get("b")
        if (
            dtype is None
            or type(shape) is not list
            or type(b) is not int
            or not 0 <= b < len(self._dest)
        ):
            return False
        at = node.get("at")
        if at is None:
            if self._dest[b] is not None:
                return False
        elif type(at) is not int or at < self._packs.get(b, _NO_PACK):
            return False  # not packed here yet (the first leaf), or malformed
        n = len(shape)
        if n == 1:
            d0 = shape[0]
            if type(d0) is not int or not 0 <= d0 < _SMALL_DIM:
                return False
            count = d0
        elif n == 2:
            d0, d1 = shape
            if type(d0) is not int or type(d1) is not int:
                return False
            if not (0 <= d0 < _SMALL_DIM and 0 <= d1 < _SMALL_DIM):
                return False
            count = d0 * d1
        else:
            return False
        item = _ITEMSIZE.get(dtype)
        if item is None or (self._targets and id(node) in self._targets):
            return False
        # A dtype in _TORCH_DTYPES was found in torch: it is imported.
        torch = sys.modules["torch"]
        nbytes = count * item
        if at is not None:  # packed (as _packed does it)
            if not nbytes or at < 0 or at % item or at + nbytes > self.blob_sizes[b]:
                return False
            t = torch.frombuffer(self._dest[b][at : at + nbytes], dtype=dtype)
            if n == 2:
                t = t.view(shape)
            self._packs[b] = at + nbytes
            self._tensors.append((node, b, None))
            self._values[id(node)] = (
                _as_leaf(t, node, path) if "param" in node or "grad" in node else t
            )
            return True
        if nbytes != self.blob_sizes[b]:
            return False
        placed = self._placed(b, item)
        if placed is not None:
            t = torch.frombuffer(placed, dtype=dtype)  # one dimension: the shape already
            if n == 2:
                t = t.view(shape)
            self._dest[b] = placed
        else:
            t = torch.empty(shape, dtype=dtype)
            self._dest[b] = (
                memoryview(t.numpy()).cast("B")
                if dtype in _NUMPY_DTYPES and count
                else _byte_view(t)
            )
        if not self.blob_paths[b]:
            self.blob_paths[b] = path
        self._tensors.append((node, b, None))
        self._values[id(node)] = _as_leaf(t, node, path) if "param" in node or "grad" in node else t
        return True

    def _alloc_tensor(self, node: dict[str, Any], path: str) -> None:
        torch = _torch()
        name = node.get("dtype")
        dtype = _TORCH_DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            dtype = _torch_dtype(name, path)
        shape = _shape(node, path)
        b = self._blob(node, path)
        view = node.get("view")
        item = _itemsize(dtype)
        if "at" in node:
            if view is not None:
                raise CheckpointFormatError(f"leaf {path}: both packed and a view")
            t = self._packed(node, b, dtype, item, shape, path)
            self._tensors.append((node, b, None))
            self._values[id(node)] = (
                _as_leaf(t, node, path) if "param" in node or "grad" in node else t
            )
            return
        if view is None:
            if math.prod(shape) * item != self.blob_sizes[b]:
                _expect_bytes(shape, item, self.blob_sizes[b], path)
            target = self._targets.get(id(node))
            if target is not None:  # into='s own contiguous CPU tensor (direct_targets)
                self._claim(b, _byte_view(target.detach()), path)
                self.direct[b] = True
                self._values[id(node)] = target
                return
            if self._dest[b] is not None:
                raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
            placed = self._placed(b, item)
            if placed is not None:
                t = torch.frombuffer(placed, dtype=dtype).view(shape)
                self._dest[b] = placed
            else:
                t = torch.empty(shape, dtype=dtype)
                self._dest[b] = _byte_view(t)
            self._tensors.append((node, b, None))
            self._values[id(node)] = (
                _as_leaf(t, node, path) if "param" in node or "grad" in node else t
            )
            return
        else:
            if not isinstance(view, dict):
                raise CheckpointFormatError(f"leaf {path}: malformed view {view!r}")
            offset, stride = view.get("offset"), view.get("stride")
            if (
                type(offset) is not int
                or not 0 <= offset <= MAX_ELEMENTS
                or offset % item
                or not isinstance(stride, list)
                or len(stride) != len(shape)
                or not all(type(s) is int and 0 <= s <= MAX_ELEMENTS for s in stride)
            ):
                raise CheckpointFormatError(f"leaf {path}: malformed view {view!r}")
            extent = sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
            if math.prod(shape) and offset + (extent + 1) * item > self.blob_sizes[b]:
                raise CheckpointFormatError(f"leaf {path}: view reaches past its blob")
            base = self._dest[b]
            if base is None:
                # A storage shared by views of any dtypes: placed only if aligned for all.
                placed = self._placed(b, _MAX_ALIGN)
                if placed is not None:
                    base_t = torch.frombuffer(placed, dtype=torch.uint8)
                    self._claim(b, placed, path)
                else:
                    base_t = torch.empty(self.blob_sizes[b], dtype=torch.uint8)
                    self._claim(b, memoryview(base_t.numpy()), path)
                self._values[-b - 1] = base_t  # keep the shared storage for its views
            geometry = (offset // item, shape, tuple(stride))
            try:
                t = _view_of(self._values[-b - 1], dtype, geometry)
            except RuntimeError as exc:
                raise CheckpointFormatError(f"leaf {path}: malformed view {view!r:.80}") from exc
            self._tensors.append((node, b, geometry))
        self._values[id(node)] = _as_leaf(t, node, path)

    def _packed(
        self, node: dict[str, Any], b: int, dtype: Any, item: int, shape: tuple[int, ...], path: str
    ) -> Any:
        """The tensor of a packed leaf: its own tensor over its bytes in the pack's memory
        (claimed by the first of its leaves: mapped, or allocated once for all of them)."""
        torch = _torch()
        at = node["at"]
        need = math.prod(shape) * item
        if type(at) is not int or not 0 <= at <= self.blob_sizes[b] - need or at % item:
            raise CheckpointFormatError(f"leaf {path}: malformed pack offset {at!r:.40}")
        dest = self._dest[b]
        if dest is None:
            dest = self._placed(b, _MAX_ALIGN)
            if dest is None:
                dest = _byte_view(torch.empty(self.blob_sizes[b], dtype=torch.uint8))
            self._claim(b, dest, path)
        elif b not in self._packs:
            raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
        elif at < self._packs[b]:
            # Leaves over the same bytes would change each other: never as saved.
            raise CheckpointFormatError(f"leaf {path}: overlaps the tensor packed before it")
        self._packs[b] = at + need
        if not need:
            return torch.empty(shape, dtype=dtype)
        # A storage of its own over the pack's memory (which it keeps alive): the leaf is as
        # independent of its neighbours as when it was saved.
        return torch.frombuffer(dest[at : at + need], dtype=dtype).view(shape)

    def to_device(self, device: Any) -> None:
        """Move every torch leaf to ``device`` (a ``torch.device``), once the blobs are filled
        and before :meth:`build`: through the pinned slabs of :mod:`._devcopy`. Leaves that
        shared a storage share one storage there; Parameters stay Parameters. (The leaves are
        copied even when ``device`` is the CPU: callers skip that case.)"""
        if not self._tensors:
            return
        plain = [(node, b) for node, b, geometry in self._tensors if geometry is None]
        bases = sorted({b for _node, b, geometry in self._tensors if geometry is not None})
        sources = [self._values[id(node)].detach() for node, _b in plain]
        sources += [self._values[-b - 1] for b in bases]
        moved = to_device(sources, device)
        for (node, _b), t in zip(plain, moved[: len(plain)], strict=True):
            self._values[id(node)] = _as_leaf(t, node, "")
        for b, base in zip(bases, moved[len(plain) :], strict=True):
            self._values[-b - 1] = base
        for node, b, geometry in self._tensors:
            if geometry is not None:
                dtype = self._values[id(node)].dtype
                view = _view_of(self._values[-b - 1], dtype, geometry)
                self._values[id(node)] = _as_leaf(view, node, "")

    # phase 2 -------------------------------------------------------------------------------
    def build(self) -> Any:
        return self._build(self.skeleton, ())

    def _build(self, node: dict[str, Any], path: tuple[str | int, ...]) -> Any:
        t = node["t"]
        if t in ("dict", "odict"):
            items = self._items.get(id(node))
            if items is None:
                items = dict_items(node, format_path(path))
            values = self._values
            # A leaf allocated by allocate() is taken as it is, without a call per leaf.
            built = {
                k: values[id(v)] if v["t"] in _ALLOCATED else self._build(v, (*path, k))
                for k, v in items
            }
            return OrderedDict(built) if t == "odict" else built
        if t == "list":
            return [self._build(v, (*path, i)) for i, v in enumerate(node["v"])]
        if t == "tuple":
            return tuple(self._build(v, (*path, i)) for i, v in enumerate(node["v"]))
        if t == "stateful":
            return self._build(node["v"], path)
        if t in _ALLOCATED:
            return self._values[id(node)]
        if t == "bytes":
            return bytes(self._values[id(node)])
        if t == "pickle":
            return pickle.loads(self._values[id(node)])
        return _scalar(node, format_path(path))


_ALLOCATED = frozenset(("torch", "numpy", "bytearray"))
_NO_PACK = 1 << 63  # Restorer._packs' answer for a blob no packed leaf claimed yet


def _scalar(node: dict[str, Any], path: str) -> Any:
    t = node["t"]
    v: Any = node.get("v")
    try:
        if t == "none":
            return None
        if t == "bool" and type(v) is bool:
            return v
        if t == "int" and type(v) is int:
            return v
        if t == "int" and isinstance(node.get("hex"), str):
            return int(node["hex"], 16)
        if t == "float":
            bits = node.get("bits")
            if bits is not None:
                return float(struct.unpack("<d", bytes.fromhex(bits))[0])
            return float.fromhex(v)
        if t == "complex" and "bits" in node:
            real, imag = struct.unpack("<dd", bytes.fromhex(node["bits"]))
            return complex(real, imag)
        if t == "complex":
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
        if t == "str" and type(v) is str:
            return v
        if t == "size":
            return _torch().Size(v)
        if t == "npscalar":
            dtype = _np_dtype(node.get("dtype"), path)
            raw = bytes.fromhex(node["hex"])
            # Indexing an array strips trailing NULs of fixed-width strings: rebuild those.
            if dtype.kind == "S":
                return np.bytes_(raw)
            if dtype.kind == "U":
                big = dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big")
                return np.str_(raw.decode("utf-32-be" if big else "utf-32-le"))
            return np.frombuffer(raw, dtype=dtype)[0]
    except (
        TypeError,
        ValueError,
        IndexError,
        KeyError,
        OverflowError,
        RuntimeError,
        struct.error,
    ) as exc:
        # OverflowError: float.fromhex of a huge exponent; RuntimeError: torch.Size of one;
        # struct.error: NaN bits of the wrong length.
        raise CheckpointFormatError(f"leaf {path}: malformed {t} value {v!r:.80}") from exc
    raise CheckpointFormatError(f"leaf {path}: malformed {t} value {v!r:.80}")


# ---------------------------------------------------------------------------------------------
# into=


def check_into(skeleton: Json, into: Any) -> None:
    """Check that ``into`` can take the saved tree; raise :class:`StateMismatchError` if not.

    Nothing is filled here: :func:`apply_into` does that once every byte has been read and
    verified, so a mismatch or a corrupt chunk leaves ``into`` untouched.
    """
    _check(skeleton, into, ())


def _mismatch(path: tuple[str | int, ...], what: str) -> StateMismatchError:
    return StateMismatchError(f"into= does not match the checkpoint at {format_path(path)}: {what}")


def _fillable(into: Any) -> bool:
    torch = loaded_torch()
    return isinstance(into, np.ndarray) or (torch is not None and isinstance(into, torch.Tensor))


def _is_object(into: Any) -> bool:
    kind = type(into)
    if kind in _PLAIN_VALUES:
        return False  # the common case, without two failed attribute lookups
    torch = loaded_torch() if _PLAIN_TORCH else None
    if torch is not None:
        _PLAIN_VALUES.update((torch.Tensor, torch.nn.Parameter))
        _PLAIN_TORCH.clear()
        if kind in _PLAIN_VALUES:
            return False
    return is_stateful(into) and not isinstance(into, (dict, list, tuple))


# Types that are no stateful object (torch's added once a tensor is met: cryosnap never
# imports torch itself).
_PLAIN_VALUES: set[type] = {dict, list, tuple, np.ndarray, str, int, float, bool, bytes, type(None)}
_PLAIN_TORCH = [True]


def _check_optimizer(inner: Json, into: Any, path: tuple[str | int, ...]) -> None:
    # Optimizer.load_state_dict refuses other group/parameter counts; find out before any
    # leaf is filled.
    saved = dict(dict_items(inner, format_path(path)))
    groups = saved.get("param_groups", {}).get("v", [])
    sizes = []
    for g in groups:
        params = dict(dict_items(g, format_path(path))).get("params", {})
        sizes.append(len(params.get("v", [])))
    have = [len(g["params"]) for g in into.param_groups]
    if sizes != have:
        raise _mismatch(
            path, f"saved optimizer has parameter groups of sizes {sizes}, into= has {have}"
        )


def _check(node: Json, into: Any, path: tuple[str | int, ...]) -> None:
    t = node["t"]
    torch = loaded_torch()
    if t == "stateful" or _is_object(into):
        if not _is_object(into):
            raise _mismatch(path, f"saved a stateful object, into= has {type(into).__name__}")
        inner = node["v"] if t == "stateful" else node
        if inner.get("t") not in ("dict", "odict"):
            raise _mismatch(path, f"saved a {inner.get('t')} leaf, into= has a stateful object")
        if torch is not None and isinstance(into, torch.nn.Module):
            # Module.load_state_dict copies parameter by parameter and reports mismatches only
            # at the end: check keys and shapes up front so a mismatch changes nothing.
            _check(inner, into.state_dict(), path)
        elif torch is not None and isinstance(into, torch.optim.Optimizer):
            _check_optimizer(inner, into, path)
        return
    if t in ("dict", "odict"):
        if not isinstance(into, dict):
            raise _mismatch(path, f"saved a dict, into= has {type(into).__name__}")
        items = dict_items(node, format_path(path))
        saved = [k for k, _v in items]
        missing = [k for k in saved if k not in into]
        known = set(saved)
        extra = [k for k in into if k not in known]
        if missing or extra:
            raise _mismatch(path, f"keys missing from into=: {missing}, unexpected: {extra}")
        plain = torch.Tensor if torch is not None else None
        for k, v in items:
            x = into[k]
            # A state dict's tensors, checked here without a call each (what the torch
            # branch below checks).
            if (
                type(x) is plain
                and v.get("t") == "torch"
                and _DTYPE_NAMES.get(x.dtype) == v.get("dtype")
                and list(x.shape) == v.get("shape")
            ):
                continue
            _check(v, x, (*path, k))
        return
    if t in ("list", "tuple"):
        if not isinstance(into, (list, tuple)):
            raise _mismatch(path, f"saved a {t}, into= has {type(into).__name__}")
        if len(into) != len(node["v"]):
            raise _mismatch(path, f"saved {len(node['v'])} items, into= has {len(into)}")
        for i, v in enumerate(node["v"]):
            _check(v, into[i], (*path, i))
        return
    if isinstance(into, (dict, list, tuple)):
        raise _mismatch(path, f"saved a {t} leaf, into= has a {type(into).__name__}")
    if t == "torch" and torch is not None and isinstance(into, torch.Tensor):
        dtype = _DTYPE_NAMES.get(into.dtype)
        if dtype is None:
            dtype = _DTYPE_NAMES[into.dtype] = str(into.dtype).removeprefix("torch.")
        if list(into.shape) != node["shape"] or dtype != node["dtype"]:
            raise _mismatch(
                path,
                f"saved {node['dtype']}{node['shape']}, into= has {dtype}{list(into.shape)}",
            )
        return
    if t == "numpy" and isinstance(into, np.ndarray):
        saved_dtype = _np_dtype(node["dtype"], format_path(path))
        if list(into.shape) != node["shape"] or into.dtype != saved_dtype:
            raise _mismatch(
                path,
                f"saved {saved_dtype}{node['shape']}, into= has {into.dtype}{list(into.shape)}",
            )
        if not into.flags.writeable:
            raise _mismatch(path, "into= array is read-only")
        return
    if _fillable(into):
        raise _mismatch(path, f"saved a {t} leaf, into= has {type(into).__name__}")
    # Scalars, strings, bytes, None: nothing to fill in place; the loaded value replaces them.


def direct_targets(skeleton: Json, into: Any, *, min_bytes: int = 0) -> dict[int, Any]:
    """The leaves of ``into`` (checked by :func:`check_into`) of at least ``min_bytes`` that a
    restore may read straight into: ``id`` of the skeleton node -> ``into``'s tensor or array.

    Those are the tensors and arrays :func:`apply_into` would fill by a plain copy (not those
    inside stateful objects, which ``load_state_dict`` fills), that are on the CPU, C-contiguous,
    writable, non-empty, of a plain type (``torch.Tensor``, ``nn.Parameter``, ``np.ndarray``;
    no inference tensor) and not a view of a shared saved storage, and whose memory overlaps
    no other leaf's that apply_into fills: where two overlap, the order of their copies decides
    what is left, so both keep the copy.
    """
    found: list[tuple[int, Any]] = []
    spans: list[tuple[int, int, int]] = []  # (first byte, end, index in found or -1)
    try:
        _targets(skeleton, into, found, spans, min_bytes)
    except _Unknown:
        return {}  # a leaf whose memory cannot be told: every leaf keeps the copy
    spans.sort()
    shared: set[int] = set()
    reach = -1
    for i, (lo, hi, which) in enumerate(spans):
        overlaps = lo < reach or (i + 1 < len(spans) and spans[i + 1][0] < hi)
        if overlaps and which >= 0:
            shared.add(which)
        reach = max(reach, hi)
    return {key: leaf for i, (key, leaf) in enumerate(found) if i not in shared}


def _targets(
    node: Json,
    into: Any,
    found: list[tuple[int, Any]],
    spans: list[tuple[int, int, int]],
    min_bytes: int,
) -> None:
    t = node["t"]
    if _is_object(into):
        return  # filled by its load_state_dict
    if t in ("dict", "odict"):
        torch = loaded_torch()
        plain, strided = (torch.Tensor, torch.strided) if torch is not None else (None, None)
        for k, v in dict_items(node, ""):
            x = into[k]
            if type(x) is plain and x.is_cpu and x.layout == strided and x.is_contiguous():
                # A state dict's tensors, without a call each (what _span and _direct find)
                n = x.nbytes
                if not n:
                    continue
                lo = x.data_ptr()
                direct = n >= min_bytes and _direct(v, x)
                spans.append((lo, lo + n, len(found) if direct else -1))
                if direct:
                    found.append((id(v), x))
                continue
            _targets(v, x, found, spans, min_bytes)
        return
    if t in ("list", "tuple"):
        for i, v in enumerate(node["v"]):
            _targets(v, into[i], found, spans, min_bytes)
        return
    if not _fillable(into):
        return
    span = _span(into)
    if span is None:
        return  # on a GPU, or empty
    direct = span[1] - span[0] >= min_bytes and _direct(node, into)
    spans.append((*span, len(found) if direct else -1))
    if direct:
        found.append((id(node), into))


class _Unknown(Exception):
    """A leaf of into= whose host memory cannot be told (direct_targets then picks none)."""


def _span(leaf: Any) -> tuple[int, int] | None:
    """The bytes ``leaf`` (a tensor or array) spans in host memory; None on a GPU, empty or not
    strided (sparse)."""
    if isinstance(leaf, np.ndarray):
        if not leaf.size:
            return None
        addr, item, strides = leaf.ctypes.data, leaf.itemsize, leaf.strides
        if leaf.flags.c_contiguous:
            return addr, addr + leaf.nbytes
        shape: tuple[int, ...] = leaf.shape
    else:
        torch = _torch()
        if leaf.device.type != "cpu" or leaf.layout != torch.strided or not leaf.numel():
            return None
        if type(leaf) not in (torch.Tensor, torch.nn.Parameter):
            raise _Unknown  # a subclass (DTensor, fake tensors...): its memory is its own business
        addr, item = leaf.data_ptr(), leaf.element_size()
        if leaf.is_contiguous():
            return addr, addr + leaf.numel() * item
        strides, shape = tuple(s * item for s in leaf.stride()), tuple(leaf.shape)
    lo = addr + sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if st < 0)
    hi = addr + item + sum((n - 1) * st for n, st in zip(shape, strides, strict=True) if st > 0)
    return lo, hi


def _direct(node: dict[str, Any], leaf: Any) -> bool:
    """Whether a restore may read the bytes of ``node`` straight into ``leaf``."""
    if isinstance(leaf, np.ndarray):
        return (
            node["t"] == "numpy"
            and node.get("order") != "F"
            and type(leaf) is np.ndarray
            and leaf.flags.c_contiguous
            and leaf.flags.writeable
            and list(leaf.shape) == node["shape"]
        )
    torch = _torch()
    return (
        node["t"] == "torch"
        and "view" not in node
        and "at" not in node
        and type(leaf) in (torch.Tensor, torch.nn.Parameter)
        and leaf.layout == torch.strided
        and leaf.is_contiguous()
        and not leaf.is_inference()
        and not leaf.is_conj()
        and not leaf.is_neg()
        and (_DTYPE_NAMES.get(leaf.dtype) or str(leaf.dtype).removeprefix("torch."))
        == node["dtype"]
        and list(leaf.shape) == node["shape"]
    )


def apply_into(
    node: Json, loaded: Any, into: Any, *, fill_direct: Callable[[], None] | None = None
) -> Any:
    """Fill ``into`` from the verified ``loaded`` tree; return the tree as restored.

    Stateful objects get ``load_state_dict`` first (the only step that can still refuse), then
    ``fill_direct`` fills the leaves that ``loaded`` shares with ``into`` (read straight into
    them: :func:`direct_targets`), then the other tensors and arrays are copied in place (those
    on a GPU in one batch through the pinned slabs of :mod:`._devcopy`) and mutable containers
    (dict, list) get the new values of their non-fillable leaves.
    """
    loads: list[tuple[tuple[str | int, ...], Any, Any]] = []
    fills: list[tuple[Any, Any]] = []
    sets: list[tuple[Any, Any, Any]] = []
    result = _plan(node, loaded, into, (), loads, fills, sets)
    for path, obj, state in loads:
        try:
            obj.load_state_dict(state)
        except Exception as exc:
            raise StateMismatchError(
                f"into= does not match the checkpoint at {format_path(path)}: "
                f"{type(obj).__name__}.load_state_dict refused it: {exc}"
            ) from exc
    if fill_direct is not None:
        fill_direct()
    torch = loaded_torch()
    on_device = []
    direct = []
    with torch.no_grad() if torch is not None else contextlib.nullcontext():
        for dst, src in fills:
            if dst is src:
                if not isinstance(dst, np.ndarray):
                    direct.append(dst)
            elif isinstance(dst, np.ndarray):
                np.copyto(dst, src)
            elif dst.device.type != "cpu":
                on_device.append((src, dst))  # one batch through pinned slabs, below
            else:
                dst.copy_(src)
    copy_to_device(on_device)
    if direct:
        # Read straight into them: what a copy_ would have done to their version counters
        # (autograd's check of the tensors it saved for backward), done here.
        torch.autograd.graph.increment_version(direct)  # type: ignore[union-attr]
    for container, key, value in sets:
        container[key] = value
    return result


def _plan(
    node: Json,
    loaded: Any,
    into: Any,
    path: tuple[str | int, ...],
    loads: list[tuple[tuple[str | int, ...], Any, Any]],
    fills: list[tuple[Any, Any]],
    sets: list[tuple[Any, Any, Any]],
) -> Any:
    t = node["t"]
    if _is_object(into):
        loads.append((path, into, loaded))
        return into
    if t in ("dict", "odict"):
        torch = loaded_torch()
        plain = torch.Tensor if torch is not None else None
        for k, v in dict_items(node, format_path(path)):
            x = into[k]
            if type(x) is plain:  # a state dict's tensors: filled in place (as below)
                fills.append((x, loaded[k]))
                continue
            new = _plan(v, loaded[k], x, (*path, k), loads, fills, sets)
            if new is not x:
                sets.append((into, k, new))
        return into
    if t in ("list", "tuple"):
        items = [
            _plan(v, loaded[i], into[i], (*path, i), loads, fills, sets)
            for i, v in enumerate(node["v"])
        ]
        if isinstance(into, list):
            sets.extend((into, i, new) for i, new in enumerate(items) if new is not into[i])
            return into
        return tuple(items)
    if _fillable(into):
        fills.append((into, loaded))
        return into
    return loaded
