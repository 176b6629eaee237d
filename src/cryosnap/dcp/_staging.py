"""Staged copies for ``dcp.async_save``: the state dict copied into cryosnap's staging pool.

One copy is staged at a time, whole before ``stage`` returns (a state over ``staging_bytes`` is
refused); its save claims it and releases it once the version is committed or failed.
Runs on the caller's thread (``stage``) and DCP's save thread (``claim``, ``release``).
docs/design/dcp.md has the why.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from cryosnap._run.capture.staging import StagingPool
from cryosnap.dcp._schema import DcpError

__all__ = ["Staged", "Staging"]

_SLAB_BYTES = 64 << 20
_ALIGN = 64  # every staged tensor starts on this boundary: any dtype can view it
_POLL_SECONDS = 0.05


@dataclass(slots=True)
class _Place:
    slab: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Staged:
    """The staged copies a save claimed: when the first began (``time.perf_counter()``, on
    the caller's thread, in ``dcp.async_save``) and how long copying them took in all."""

    started: float
    seconds: float


class Staging:
    """Staged copies in one budgeted pool; see the module docstring."""

    def __init__(self, *, budget_bytes: int | None, timeout_seconds: float) -> None:
        self.budget_bytes = budget_bytes
        self.timeout_seconds = timeout_seconds
        self._pool: StagingPool | None = None
        self._cond = threading.Condition()
        self._generations: dict[int, list[Any]] = {}  # id -> slabs
        # id -> weak references to the staged tensors: a copy no save claimed and nobody
        # holds any more (its async save failed before setting up the writer) goes back.
        self._staged: dict[int, list[weakref.ref[Any]]] = {}
        self._claimed: dict[int, int] = {}  # generation -> the save that claimed it
        self._times: dict[int, tuple[float, float]] = {}  # generation -> (start, seconds)
        self._next = 0

    @property
    def allocated_bytes(self) -> int:
        """Host memory the pool holds (staged copies and free slabs)."""
        return 0 if self._pool is None else self._pool.allocated_bytes

    # -- caller's thread

    def stage(self, state_dict: Any) -> Any:
        """A copy of ``state_dict`` whose tensors live in the pool's slabs."""
        self._wait_released()
        t0 = time.perf_counter()
        leaves: list[Any] = []
        _collect(state_dict, leaves)
        sizes = [t.numel() * t.element_size() for t in leaves]
        pool, places = self._plan(sizes)
        slabs: list[Any] = []
        try:
            for _ in range(max((p.slab for p in places), default=-1) + 1):
                slabs.append(pool.acquire())
            staged = [_copy_into(t, slabs, p) for t, p in zip(leaves, places, strict=True)]
            if any(t.is_cuda for t in leaves):
                torch.cuda.synchronize()
        except BaseException:
            for slab in slabs:
                pool.release(slab)
            raise
        with self._cond:
            self._generations[self._next] = slabs
            self._staged[self._next] = [weakref.ref(t) for t in staged if t.numel()]
            self._times[self._next] = (t0, time.perf_counter() - t0)
            self._next += 1
        return _rebuild(state_dict, iter(staged))

    def _released(self) -> bool:
        """Whether no staged copy is left, once the orphans went back (under the lock)."""
        for g in list(self._generations):
            if g not in self._claimed and all(r() is None for r in self._staged.get(g, [])):
                self._drop(g)
        return not self._generations

    def _wait_released(self) -> None:
        deadline = time.monotonic() + self.timeout_seconds
        with self._cond:
            # Polled: an orphan goes back when its last tensor is freed, which notifies nobody.
            while not self._released():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, _POLL_SECONDS))
            if self._generations:
                raise DcpError(
                    f"the previous async save's staged copy was not written within "
                    f"{self.timeout_seconds:g} s: wait for each dcp.async_save to finish "
                    "(or fail) before the next one"
                )

    def _plan(self, sizes: list[int]) -> tuple[StagingPool, list[_Place]]:
        """Where each tensor goes: first fit in slabs of one size, large enough for the
        largest tensor (the pool is made anew when a state brings a larger one)."""
        slab_bytes = max(_SLAB_BYTES, -(-max(sizes, default=0) // (1 << 20)) << 20)
        if self._pool is None or self._pool.slab_bytes < slab_bytes:
            pin = torch.cuda.is_available()
            self._pool = StagingPool(slab_bytes=slab_bytes, budget_bytes=self.budget_bytes, pin=pin)
        slab_bytes = self._pool.slab_bytes
        places: list[_Place] = []
        fill: list[int] = []
        for n in sizes:
            index = next((i for i, f in enumerate(fill) if f + n <= slab_bytes), len(fill))
            if index == len(fill):
                fill.append(0)
            places.append(_Place(index, fill[index], n))
            fill[index] = -(-(fill[index] + n) // _ALIGN) * _ALIGN
        needed = len(fill) * slab_bytes
        if self.budget_bytes is not None and needed > max(self.budget_bytes, slab_bytes):
            raise DcpError(
                f"a staged copy of this state needs {needed} bytes of slabs ({sum(sizes)} bytes "
                f"of tensors), more than staging_bytes={self.budget_bytes}: a copy for "
                "dcp.async_save is whole before it returns; raise staging_bytes"
            )
        return self._pool, places

    # -- DCP's save thread

    def claim(self, save: int) -> Staged | None:
        """Save ``save`` (a number per save) writes every copy staged so far; copies an
        earlier save claimed and never released (it failed before writing) go back. When
        staging the claimed copies began and how long it took (None: none, a ``dcp.save``
        without staging)."""
        with self._cond:
            stale = [g for g, s in self._claimed.items() if s != save]
            for g in stale:
                self._drop(g)
            claimed = [g for g in self._generations if self._claimed.setdefault(g, save) == save]
            self._cond.notify_all()
            if not claimed:
                return None
            times = [self._times[g] for g in claimed]
            return Staged(started=min(t for t, _ in times), seconds=sum(s for _, s in times))

    def release(self, save: int) -> None:
        """The copies ``save`` claimed are written (or failed): their slabs go back."""
        with self._cond:
            for g in [g for g, s in self._claimed.items() if s == save]:
                self._drop(g)
            self._cond.notify_all()

    def _drop(self, generation: int) -> None:
        self._claimed.pop(generation, None)
        self._staged.pop(generation, None)
        self._times.pop(generation, None)
        assert self._pool is not None
        for slab in self._generations.pop(generation, []):
            self._pool.release(slab)

    def close(self) -> None:
        """Drop the idle slabs (a copy still being written keeps its own)."""
        with self._cond:
            if self._pool is not None:
                self._pool.clear()


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t


def _collect(obj: Any, out: list[Any]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(_local(obj))
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif _sequence(obj):
        for v in obj:
            _collect(v, out)


def _sequence(obj: Any) -> bool:
    """Containers walked for tensors: lists, tuples and namedtuples (not torch.Size)."""
    return type(obj) in (list, tuple) or (isinstance(obj, tuple) and hasattr(obj, "_fields"))


def _copy_into(src: Any, slabs: list[Any], place: _Place) -> Any:
    if place.nbytes == 0:
        return torch.empty(src.shape, dtype=src.dtype)
    raw = slabs[place.slab].tensor[place.offset : place.offset + place.nbytes]
    dst = raw.view(src.dtype).view(src.shape)
    with torch.no_grad():
        dst.copy_(src.detach(), non_blocking=src.is_cuda)
    return dst


def _rebuild(obj: Any, staged: Any) -> Any:
    """``obj`` with its tensors replaced, in :func:`_collect`'s order, by ``staged``."""
    if isinstance(obj, DTensor):
        return DTensor(next(staged), obj._spec, requires_grad=False)  # type: ignore[no-untyped-call]
    if isinstance(obj, torch.Tensor):
        return next(staged)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _rebuild(v, staged)
        return out
    if _sequence(obj):
        items = [_rebuild(v, staged) for v in obj]
        if type(obj) is list:
            return items
        return tuple(items) if type(obj) is tuple else type(obj)(*items)  # a namedtuple
    return copy.deepcopy(obj)
