"""Flatten a state into a JSON skeleton plus byte blobs (:func:`flatten`, :class:`FlatState`):
tensors sharing storage become one blob, small CPU tensors are packed several to a blob.

Pure (a ``cryosnap.File`` leaf aside: files.py opens and maps its file); runs on the caller's
thread; torch is imported only when a tensor is met.
docs/design/state-trees.md has the why.
"""

from __future__ import annotations

import math
import pickle
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cryosnap import _native
from cryosnap._format.skeleton import (
    _BIG_INT_BITS,
    MAX_DEPTH,
    Json,
    encode_key,
    format_path,
)
from cryosnap._state import dtensor
from cryosnap._state.files import File, file_leaf
from cryosnap._state.gc import paused_gc
from cryosnap._state.tensor_meta import Copies, storage_address
from cryosnap._state.torch_import import loaded_torch
from cryosnap._units import human_bytes

# Packing of small tensors (see the module docstring): the largest pack, and the largest leaf
# packed (a fraction of the pack, so that a pack holds many).
PACK_BYTES = 1 << 20
PACK_LEAF_FRACTION = 4


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
    files: bool = False  # whether the skeleton holds cryosnap.File leaves
    numpy_packed: bool = False  # whether any numpy array of the skeleton is packed
    # Packs not filled yet (flatten's ``defer_packs``): the capture fills them first.
    deferred: DeferredPacks | None = None


class DeferredPacks:
    """The packs of a reused flatten that a lazy capture's thread fills (the caller returns
    before these copies, as before any other): each pack with its copies by address. Only packs
    whose every tensor an optimizer of the state mutates are deferred, as that optimizer's
    ``step()`` waits for them (``packs``: the addresses of the storages of each one's tensors,
    by blob index; ``mutated``: each optimizer's storages, by its id, for its hook); other
    small tensors (a BatchNorm's running statistics, a plain dict of tensors) are copied in
    ``save()``, as before. ``keep`` holds the deferred tensors' storages until filled, so that
    a tensor the program rebinds meanwhile (``p.data = ...``) leaves the memory the copies read
    alive, as a blob of a tensor alone holds a view of it."""

    __slots__ = ("_fills", "_keep", "_lock", "mutated", "packs")

    def __init__(
        self,
        fills: list[tuple[Any, Copies]],
        keep: list[Any],
        packs: dict[int, list[int]],
        mutated: dict[int, set[int]],
    ) -> None:
        self._fills = fills
        self._keep = keep
        self._lock = threading.Lock()
        self.packs = packs
        self.mutated = mutated

    def fill(self) -> None:
        """Fill every pack (once; later calls return at once)."""
        with self._lock:
            fill_packs(self._fills)
            self._fills, self._keep = [], []


def mutated_storages(opt: Any, torch: Any) -> set[int]:
    """The addresses of the storages ``opt.step()`` writes: its parameters' and their state's
    (a DTensor's: its local shard's, what flatten captures of it). Each address from the
    tensor's own and its storage offset: no storage object made per tensor, and the DTensor
    check only for a subclass (half the time of 24,000 tensors, docs/PERFORMANCE.md)."""
    plain = (torch.Tensor, torch.nn.Parameter)
    tensor = torch.Tensor
    out = set()

    def add(t: Any) -> None:
        if type(t) not in plain:
            t = dtensor.fill_target(t)
        out.add(storage_address(t.data_ptr(), t.storage_offset(), t.dtype.itemsize))

    for group in opt.param_groups:
        for p in group["params"]:
            add(p)
            for v in opt.state.get(p, {}).values():
                if isinstance(v, tensor):
                    add(v)
    out.discard(0)
    return out


_SCALARS = (int, float, bool, str, bytes, bytearray, complex, type(None))
_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> its name in a skeleton ("float32")


def dtype_name(dtype: Any) -> str:
    """A torch dtype's name in a skeleton ("float32"), made once per dtype (_DTYPE_NAMES)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DESCRS: dict[Any, str] = {}  # numpy dtype -> its descr, where that is a string ("<f4")


def _descr(dtype: np.dtype[Any]) -> Any:
    """A numpy dtype's descr in a skeleton; a string one (any but a record's) made once per
    dtype (_DESCRS): 1.1 us a call, 20,000 small arrays a save."""
    descr = _DESCRS.get(dtype)
    if descr is None:
        made: Any = np.lib.format.dtype_to_descr(dtype)
        if not isinstance(made, str):
            return made  # a record's list: a fresh one per node
        descr = _DESCRS[dtype] = made
    return descr


def pack_options(pack_bytes: int, pack_apart: object) -> tuple[int, frozenset[str | int]]:
    """The pack size (``pack_bytes`` capped at :data:`PACK_BYTES`, 0 for none) and the keys
    packed apart that :func:`flatten` takes (those of a list or tuple of str or int)."""
    apart = frozenset(
        k
        for k in (pack_apart if isinstance(pack_apart, (list, tuple)) else ())
        if type(k) in (str, int)
    )
    return min(max(pack_bytes, 0), PACK_BYTES), apart


def flatten(
    state: Any,
    *,
    allow_pickle: bool = False,
    pack_bytes: int = 0,
    pack_apart: object = None,
) -> FlatState:
    """Split ``state`` into a JSON skeleton and blobs; ``TypeError`` names any unsupported leaf.

    ``pack_bytes`` > 0 packs small CPU tensors into shared blobs of at most that many bytes
    (capped at :data:`PACK_BYTES`; see the module docstring); 0 stores every tensor alone.
    ``pack_apart``: top-level keys (a list or tuple, as ``save(replicated=...)`` takes them)
    whose leaves never share a pack with the other keys' leaves. A flatten that reuses the
    last one of a state of the same structure: :meth:`FlattenCache.flatten` (reuse.py)."""
    pack, apart = pack_options(pack_bytes, pack_apart)
    with paused_gc():
        return Flattener(allow_pickle, pack, apart).run(state)


class Flattener:
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
        self.files = False
        # Small numpy arrays are packed as they are met (their bytes are copied into the pack
        # at the end of the walk), in packs of their own: numpy memory, no torch needed.
        self._arrays = _Packer(self.blobs, pack_bytes, None, apart)

    def run(self, state: Any) -> FlatState:
        skeleton = self.visit(state, ())
        self._arrays.finish()
        packed = self._assign_tensor_blobs()
        logical = sum(b.nbytes for b in self.blobs)
        return FlatState(
            skeleton,
            self.blobs,
            self.leaves,
            logical,
            self.stateful,
            packed,
            self.files,
            numpy_packed=self._arrays.packs > 0,
        )

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
            if tp is not torch.Tensor and tp is not torch.nn.Parameter:
                return self.subclass(obj, path)
            return self.tensor(obj, path)
        if type(obj) is np.ndarray:
            self.leaves += 1
            return self.ndarray(obj, path)
        if isinstance(obj, np.generic):
            self.leaves += 1
            return self.npscalar(obj, path)
        if isinstance(obj, File):
            self.leaves += 1
            self.files = True
            node, source, nbytes = file_leaf(obj, path)
            node["b"] = self.add_blob(path, source, nbytes)
            return node
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
        return self._refuse_object(obj, path)

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
            shallow = self._depth <= MAX_DEPTH
            plain = torch.Tensor if torch is not None and shallow else None
            array = np.ndarray if shallow else None
            vals: list[Json] = []
            for k in keys:
                v = obj[k]
                tv = type(v)
                # A state dict's tensors and a dict's arrays: visit() without its checks.
                if tv is plain:
                    self.leaves += 1
                    vals.append(self.tensor(v, (*path, k)))
                elif tv is array:
                    self.leaves += 1
                    vals.append(self.ndarray(v, (*path, k)))
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

    def inline(self, obj: Any) -> Json:
        """The node of a leaf held in the skeleton itself: a scalar of no blob, a Size."""
        if type(obj) in _SCALARS:
            return self.scalar(obj, ())
        return {"t": "size", "v": list(obj)}

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
        dtype = arr.dtype
        if dtype.hasobject:
            if self.allow_pickle:
                return self.pickled(arr, path)
            raise TypeError(
                f"cannot checkpoint {format_path(path)}: numpy array of dtype {dtype} holds "
                "Python objects (pass allow_pickle=True to pickle it)"
            )
        node: dict[str, Any] = {"t": "numpy", "dtype": _descr(dtype), "shape": list(arr.shape)}
        flags = arr.flags
        if flags.c_contiguous:
            flat = arr  # its bytes lie in C order where it is
        elif arr.ndim > 1 and flags.f_contiguous:
            node["order"] = "F"
            flat = arr.T
        else:
            flat = np.ascontiguousarray(arr)
        n = arr.nbytes
        if 0 < n <= self.pack_bytes // PACK_LEAF_FRACTION and "order" not in node:
            # Small: packed ("b" and "at" set when its pack closes), as small CPU tensors are
            # (the pack copies its n bytes from where they lie).
            self._arrays.add(node, path, flat, n, dtype.itemsize)
            return node
        raw = flat.reshape(-1).view(np.uint8) if n else np.empty(0, np.uint8)
        node["b"] = self.add_blob(path, raw, n)
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
        """A leaf of no type flatten stores (a numpy object scalar, any other object):
        pickled where allowed, else a TypeError saying what to do instead."""
        if self.allow_pickle:
            return self.pickled(obj, path)
        where = f"cannot checkpoint {format_path(path)}"
        if isinstance(obj, np.generic):
            raise TypeError(f"{where}: numpy object scalar (pass allow_pickle=True to pickle it)")
        tp = type(obj)
        name = f"{tp.__module__}.{tp.__qualname__}"
        data = sys.modules.get("torch.utils.data")
        if data is not None and isinstance(obj, data.DataLoader):
            # Pickling one would store no position: a resumed epoch would start over.
            raise TypeError(
                f"{where}: {name} has no state_dict(), so its position in the epoch cannot be "
                "saved; build it as cryosnap.integrations.torch.ResumableLoader (a DataLoader "
                "that saves and resumes its position), or leave it out of the state"
            )
        raise TypeError(
            f"{where}: unsupported type {name} (supported: tensors, numpy arrays and scalars, "
            "int/float/bool/complex/str/bytes/None, dict/list/tuple, objects with state_dict(); "
            "pass allow_pickle=True to pickle anything else)"
        )

    def subclass(self, t: Any, path: tuple[str | int, ...]) -> Json:
        """A tensor of a subclass of torch.Tensor: a DTensor as its local shard and layout
        (_state/dtensor.py), another as a tensor when its bytes can be read."""
        shard = dtensor.local_shard(t, path)
        if shard is not None:
            node = self.tensor(shard[0], path)
            node["dtensor"] = shard[1]
            return node
        why = dtensor.unreadable(t)
        if why is None:
            return self.tensor(t, path)
        if self.allow_pickle:
            return self.pickled(t, path)
        tp = type(t)
        raise TypeError(
            f"cannot checkpoint {format_path(path)}: {tp.__module__}.{tp.__qualname__} is a "
            f"tensor subclass whose bytes cannot be read ({why}); store its plain tensors "
            "(DTensors are stored as their local shards), or pass allow_pickle=True"
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
        node: dict[str, Any] = {
            "t": "torch",
            "dtype": dtype_name(t.dtype),
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
        for i, (_node, t, path) in enumerate(self.tensors):
            try:
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError) as exc:  # no storage of its own (vmap's)
                raise TypeError(f"cannot checkpoint {format_path(path)}: {exc}") from exc
            if ptr == 0 and size:
                raise TypeError(
                    f"cannot checkpoint {format_path(path)}: its storage holds no memory"
                )
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
                    refuse_expanded(x, path)
                    x = x.contiguous()
                n = x.nbytes
                if 0 < n <= leaf_max and x.is_cpu:
                    # contiguous: its n bytes lie at x.data_ptr()
                    packer.add(node, path, x, n, x.element_size())
                    continue
                node["b"] = len(blobs)
                blobs.append(alone_blob(t, x, n, path, ptrs[i], uint8))
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
        packer.finish()
        return packer.packs > 0


# The largest copy of an expanded view (a stride of 0) that a save makes: beyond it the view
# is most likely a broadcast kept by mistake, whose copy could exhaust the host's memory.
EXPANDED_COPY_MAX_BYTES = 1 << 30


def refuse_expanded(t: Any, path: tuple[str | int, ...]) -> None:
    """Raise ValueError, before any copy, for a tensor expanded (stride 0 in a dimension of
    more than one element) to over :data:`EXPANDED_COPY_MAX_BYTES` of elements."""
    n = t.nbytes
    if n <= EXPANDED_COPY_MAX_BYTES:
        return
    dims = [
        d
        for d, (size, st) in enumerate(zip(t.shape, t.stride(), strict=True))
        if size > 1 and st == 0
    ]
    if not dims:
        return
    stored = t.untyped_storage().nbytes()
    raise ValueError(
        f"cannot checkpoint {format_path(path)}: an expanded view (stride 0 in dimension "
        f"{dims[0]}) of {human_bytes(stored)} of storage, whose copy would take "
        f"{human_bytes(n)}; call .contiguous() on it first if every element is meant to be "
        "stored, or save the tensor it was expanded from (before .expand()) instead"
    )


def alone_blob(t: Any, x: Any, n: int, path: tuple[str | int, ...], ptr: int, uint8: Any) -> Blob:
    """The blob of tensor ``t`` stored alone: ``x`` is ``t`` contiguous (and resolved), of
    ``n`` bytes; ``ptr`` the data_ptr of ``t``'s storage."""
    if n == x.element_size() and x.dim() and x.stride()[-1] != 1:
        # torch calls a one-element view of any stride contiguous, but a byte view needs
        # stride 1.
        x = x.as_strided((1,), (1,))
    flat = x.reshape(-1).view(uint8) if n else x.new_empty(0).view(uint8).reshape(0)
    if flat.requires_grad:  # a view taken before no_grad (never, but be sure)
        flat = flat.detach()
    origin = ptr if x is t or x.untyped_storage().data_ptr() == ptr else 0
    return Blob(path, n, flat, origin)


def copies_of(rows: list[tuple[int, int, int]]) -> Copies:
    """The :data:`Copies` of a pack from its ``(source address, nbytes, offset)`` rows."""
    return np.array(rows, np.int64).reshape(-1, 3)


def fill_packs(fills: Sequence[tuple[Any, Copies]]) -> None:
    """Fill each pack (a uint8 CPU tensor, or a uint8 array for numpy leaves) with its
    :data:`Copies` (in offset order), zeros in the alignment gaps: every byte of a pack is
    defined. The copies of every pack go to the
    kernel together (:func:`cryosnap._native.copy_pieces`, split between threads): no Python
    call per leaf, nor torch's ``copy_``/``cat`` (which run on its intra-op threads: with the
    writer busy on another core those wait for each other)."""
    fills = [(pack, rows) for pack, rows in fills if len(rows)]
    if not fills:
        return
    rows = np.concatenate([r for _p, r in fills])
    counts = np.array([len(r) for _p, r in fills], np.int64)
    bases = np.repeat(np.array([_native.leaf_address(p) for p, _r in fills], np.int64), counts)
    at, n = rows[:, 2], rows[:, 1]
    # Where the bytes before each copy end in its pack (0 for a pack's first): a gap if less.
    end = np.empty_like(at)
    end[1:] = (at + n)[:-1]
    end[np.cumsum(counts) - counts] = 0
    gaps = np.flatnonzero(at > end)
    zero = _native.zero
    for lo, hi in zip((bases + end)[gaps].tolist(), (bases + at)[gaps].tolist(), strict=True):
        zero(lo, hi - lo)
    _native.copy_pieces(bases + at, rows[:, 0], n, threads=_native.COPY_THREADS)


class _Packer:
    """Collects small tensors into packs (see the module docstring), in the order they come;
    a pack is closed when the next leaf would not fit, or when it crosses between the
    top-level keys in ``apart`` and the others (replicated state is chosen by top-level key,
    and a blob belongs to the key of its first leaf: a pack never mixes the two kinds)."""

    def __init__(
        self, blobs: list[Blob], pack_bytes: int, torch: Any, apart: frozenset[Any]
    ) -> None:
        """``torch``: the module its packs are tensors of; None: numpy arrays (the packs of
        numpy arrays, which need no torch)."""
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
        # The closed packs' copies, made together by finish(); the tensors they read.
        self.fills: list[tuple[Any, Copies]] = []
        self.hold: list[Any] = []

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
        if self.torch is None:
            pack = np.empty(self.size, np.uint8)
        else:
            pack = self.torch.empty(self.size, dtype=self.torch.uint8)
        # Fresh memory: its pages mapped in one call, not faulted in one by one as it fills.
        _native.populate(_native.leaf_address(pack), self.size)
        address = _native.leaf_address
        self.fills.append((pack, copies_of([(address(t), n, at) for _, t, n, at in members])))
        self.hold += [t for _node, t, _n, _at in members]
        index = len(self.blobs)
        for node, _t, _n, at in members:
            node["b"] = index
            node["at"] = at
        # A private copy: nothing the program does from now on can change it (origin 0).
        self.blobs.append(Blob(self.path, self.size, pack, 0, True))
        self.packs += 1

    def finish(self) -> None:
        """Close the open pack and fill every pack."""
        self.close()
        fill_packs(self.fills)
        self.fills, self.hold = [], []
