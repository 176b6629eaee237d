"""The scratch level's devices: node-local stores that take a version first, and how its data
is split over them.

:class:`StripedStore` sees several devices as one store; :class:`Placement` sends each batch
of new bytes to the device that would finish it first.
Placement runs on the writer thread; the measurements arrive from the I/O threads (locked).
docs/design/storage.md has the model.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryosnap.errors import CheckpointError, CheckpointNotFoundError, StorageError
from cryosnap.storage.base import BlobWriter, BytesLike, Store, StoreCapabilities

__all__ = ["Device", "Placement", "StripedStore", "Tier", "device_of"]

_DEVICE_SUFFIX = re.compile(r"-d(\d+)\.dat$")
# On the first device: the devices a scratch tier was written with, in order (data file keys
# name their device by its position, so the list must not change under them).
LAYOUT_KEY = "scratch-devices.json"
# How fast older throughput samples fade: each new sample scales the old sums by this.
_DECAY = 0.8


@dataclass(frozen=True, slots=True)
class Device:
    """A storage device for the scratch level: a directory or fsspec URL.

    ``capacity_bytes`` caps the checkpoint data cryosnap keeps on it (None: no cap).
    ``direct_io``: its data files written with O_DIRECT (True), through the page cache
    (False), or as the Checkpointer's ``direct_io`` says (None).
    """

    path: str | os.PathLike[str] | Store
    capacity_bytes: int | None = None
    direct_io: bool | None = None

    def __post_init__(self) -> None:
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise TypeError(f"direct_io must be None, True or False, got {self.direct_io!r}")
        cap = self.capacity_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(
                f"capacity_bytes={cap!r} is invalid: allowed is a positive int or None"
            )


# The name of :class:`Device` in the first releases' API (``scratch=[Tier(...)]``); "tier"
# now names a storage level only (``SaveInfo.tiers``, ``result(tier=)``).
Tier = Device


def device_of(key: str, devices: int) -> int:
    """The device a key lives on: the ``-d<k>`` suffix of a data file, else the first."""
    m = _DEVICE_SUFFIX.search(key)
    if m is None:
        return 0
    k = int(m.group(1))
    return k if k < devices else 0


class StripedStore:
    """Several device stores seen as one: small files on the first, data files where their key
    says. With one device it is that device plus capacity accounting."""

    def __init__(self, devices: Sequence[Store], capacities: Sequence[int | None]) -> None:
        if not devices or len(devices) != len(capacities):
            raise ValueError("StripedStore needs one capacity per device and at least one device")
        self.devices = list(devices)
        self.capacities = list(capacities)
        self._check_layout()
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self.used = [0] * len(self.devices)
        for d, dev in enumerate(self.devices):
            for key in dev.list("data"):
                if device_of(key, len(self.devices)) == d:
                    self._account(key, dev.size(key))

    def __repr__(self) -> str:
        return f"StripedStore({[d.url for d in self.devices]})"

    def _check_layout(self) -> None:
        urls = [d.url for d in self.devices]
        first = self.devices[0]
        try:
            doc = json.loads(first.read(LAYOUT_KEY))
        except CheckpointNotFoundError:
            doc = None
        except ValueError:
            doc = None  # torn: rewritten below
        if isinstance(doc, dict) and doc.get("devices") != urls:
            raise CheckpointError(
                f"scratch tier {first.url} was written with the devices {doc.get('devices')}, "
                f"now given {urls}: give the same list in the same order, or empty the "
                "scratch directories (the persistent tier keeps every flushed version)"
            )
        if not isinstance(doc, dict):
            first.write(LAYOUT_KEY, json.dumps({"devices": urls}).encode())

    @property
    def url(self) -> str:
        urls = [d.url for d in self.devices]
        return urls[0] if len(urls) == 1 else "[" + ", ".join(urls) + "]"

    @property
    def capabilities(self) -> StoreCapabilities:
        # One device holds every key: it is that device. Over several, no one directory holds
        # every key, and nobody needs a lock or compare-and-swap across devices.
        if len(self.devices) == 1:
            return self.devices[0].capabilities
        return StoreCapabilities()

    def _dev(self, key: str) -> Store:
        return self.devices[device_of(key, len(self.devices))]

    def _account(self, key: str, nbytes: int) -> None:
        with self._lock:
            old = self._sizes.pop(key, 0)
            d = device_of(key, len(self.devices))
            self.used[d] += nbytes - old
            if nbytes:
                self._sizes[key] = nbytes

    def free_bytes(self, device: int) -> int | None:
        cap = self.capacities[device]
        return None if cap is None else cap - self.used[device]

    def read(self, key: str) -> bytes:
        return self._dev(key).read(key)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self._dev(key).read_into(key, offset, buffers)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self._dev(key).read_ranges(key, ranges)

    def write(self, key: str, data: BytesLike) -> None:
        self._dev(key).write(key, data)

    def open_writer(self, key: str) -> BlobWriter:
        return _AccountedWriter(self, self._dev(key).open_writer(key))

    def exists(self, key: str) -> bool:
        return self._dev(key).exists(key)

    def list(self, prefix: str = "") -> list[str]:
        n = len(self.devices)
        keys = [k for k in self.devices[0].list(prefix) if device_of(k, n) == 0]
        for d, dev in enumerate(self.devices[1:], start=1):
            keys.extend(k for k in dev.list(prefix) if device_of(k, n) == d)
        return sorted(keys)

    def size(self, key: str) -> int:
        return self._dev(key).size(key)

    def delete(self, key: str) -> None:
        self._dev(key).delete(key)
        if key.startswith("data/"):
            self._account(key, 0)

    def remove_incomplete(self, prefix: str = "") -> builtins.list[str]:
        # Every device: a crashed writer may have left a partial file on any of them.
        return sorted(k for dev in self.devices for k in dev.remove_incomplete(prefix))


class _AccountedWriter:
    def __init__(self, store: StripedStore, inner: BlobWriter) -> None:
        self._store = store
        self._inner = inner
        self.key = inner.key

    def write(self, buffers: Sequence[Any]) -> None:
        self._inner.write(buffers)

    def tell(self) -> int:
        return self._inner.tell()

    def commit(self) -> None:
        self._inner.commit()
        self._store._account(self.key, self._inner.tell())

    def abort(self) -> None:
        self._inner.abort()


class Placement:
    """Chooses the scratch device for each batch of new bytes (see the module docstring).

    ``strategy`` is ``"adaptive"`` (the model), or, for comparison in benchmarks,
    ``"fastest"`` (all on the device measured fastest) and ``"round_robin"``.
    """

    def __init__(self, store: StripedStore, *, strategy: str = "adaptive") -> None:
        if strategy not in ("adaptive", "fastest", "round_robin"):
            raise ValueError(f"strategy={strategy!r} is invalid: adaptive, fastest, round_robin")
        self.store = store
        self.strategy = strategy
        n = len(store.devices)
        self._lock = threading.Lock()
        self._bytes = [0.0] * n  # decayed sums of bytes written ...
        self._seconds = [0.0] * n  # ... and of the seconds it took
        self.queued = [0] * n
        self.reserved = [0] * n
        self._next = 0

    @property
    def devices(self) -> int:
        return len(self.store.devices)

    def rates(self) -> list[float | None]:
        """Measured bytes per second of each device (None: not measured yet)."""
        with self._lock:
            return [
                b / s if s > 0 and b > 0 else None
                for b, s in zip(self._bytes, self._seconds, strict=True)
            ]

    def observe(self, device: int, nbytes: int, seconds: float) -> None:
        """A device wrote ``nbytes`` (0 for an fsync) in ``seconds`` of busy time."""
        with self._lock:
            self._bytes[device] = self._bytes[device] * _DECAY + nbytes
            self._seconds[device] = self._seconds[device] * _DECAY + seconds

    def enqueue(self, device: int, nbytes: int) -> None:
        """``nbytes`` were handed to ``device``'s writer."""
        with self._lock:
            self.queued[device] += nbytes

    def done(self, device: int, nbytes: int) -> None:
        """``nbytes`` queued on ``device`` have been written."""
        with self._lock:
            self.queued[device] -= nbytes

    def unreserve(self, device: int, nbytes: int) -> None:
        """Give back ``nbytes`` of a reservation that the batch did not need."""
        with self._lock:
            self.reserved[device] = max(0, self.reserved[device] - nbytes)

    def release(self) -> None:
        """The version ended: its reservations become (accounted) files or nothing."""
        with self._lock:
            self.reserved = [0] * len(self.reserved)

    def _room(self, d: int, nbytes: int) -> bool:
        free = self.store.free_bytes(d)
        return free is None or free - self.reserved[d] >= nbytes

    def choose(self, nbytes: int, *, reserve: int) -> int:
        """The device for a batch expected to add ``nbytes``, reserving ``reserve`` bytes of
        its capacity (an upper bound of what the batch can write)."""
        n = self.devices
        fits = [d for d in range(n) if self._room(d, reserve)]
        if not fits:
            free = [self.store.free_bytes(d) for d in range(n)]
            raise StorageError(
                f"scratch tier {self.store.url} is full: a batch of up to {reserve} bytes does "
                f"not fit (free bytes per device: {free}); raise capacity_bytes, lower "
                "keep_scratch, or let pending flushes finish"
            )
        rates = self.rates()
        known = [r for r in rates if r is not None]
        default = max(known) if known else 1.0
        est = [default if r is None else r for r in rates]
        d: int
        if self.strategy == "round_robin":
            d = next(d for d in [*range(self._next, n), *range(self._next)] if d in fits)
            self._next = (d + 1) % n
        elif self.strategy == "fastest":
            d = max(fits, key=lambda d: est[d])
        else:
            with self._lock:
                queued = list(self.queued)
            d = min(fits, key=lambda d: (queued[d] + nbytes) / est[d])
        with self._lock:
            self.reserved[d] += reserve
        return d
