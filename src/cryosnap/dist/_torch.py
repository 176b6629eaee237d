"""TorchCoordinator: the participants of a torch.distributed job (``torchrun``, DDP, FSDP).

Checkpoint traffic runs on gloo groups of its own (one per channel), never the training's;
every collective is bounded by a timeout passed to gloo (:class:`~cryosnap.CoordinationError`).
Runs on whichever thread calls it; each channel must be used by one thread at a time.
torch is imported on construction. docs/design/distributed.md has the why.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from cryosnap._validate import integer, seconds
from cryosnap.dist._common import DEFAULT_TIMEOUT_SECONDS, outgoing, to_bytes
from cryosnap.errors import CoordinationError

__all__ = ["TorchCoordinator", "initialized_world"]

_T = TypeVar("_T")

# gloo's tags are non-negative C ints; an exchange tags its messages with its number on the
# channel, so a message left over from one that failed can never be taken for the next one's.
_TAG_LIMIT = 2**31


def initialized_world() -> bool:
    """Whether this process is part of an initialized torch.distributed job of more than one
    process (without importing torch when the program did not)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    return int(dist.get_world_size()) > 1


class TorchCoordinator:
    """The ranks of ``group`` (default: every process of the job), over private gloo groups.

    ``timeout`` (seconds) bounds each collective that is not given its own, and the creation of
    each group. ``torch.distributed`` must be initialized (any backend).
    """

    def __init__(self, group: Any = None, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.timeout = seconds(timeout, "timeout")
        self._dist = _torch_distributed()
        self._ranks: list[int] | None = None
        if group is not None:
            ranks = list(self._dist.get_process_group_ranks(group))
            if self._dist.get_rank() not in ranks:
                raise ValueError(
                    f"this process (global rank {self._dist.get_rank()}) is not in group "
                    f"{ranks}: only its members construct a TorchCoordinator of it"
                )
            if len(ranks) < self._dist.get_world_size():
                self._ranks = ranks
        self._name = "main"
        self._group = self._new_group("main")
        self._rank = int(self._group.rank())
        self._world = int(self._group.size())
        self._issued = 0
        self._channels: dict[str, TorchCoordinator] = {}
        self._lock = threading.Lock()
        # Exchanges that failed: their sends and receives may still be pending in gloo, which
        # reads and writes the tensors they hold; kept, as the group is broken for good anyway.
        self._abandoned: list[Any] = []

    def _new_group(self, name: str) -> Any:
        try:
            # A subgroup is created by its members only (hashed group name), the whole world by
            # every process; either way the same calls in the same order on each of them.
            return self._dist.new_group(
                self._ranks,
                backend="gloo",
                timeout=timedelta(seconds=self.timeout),
                use_local_synchronization=self._ranks is not None,
            )
        except RuntimeError as exc:
            raise CoordinationError(
                f"creating the gloo group of channel {name!r} did not complete within "
                f"{self.timeout:g} s (is every rank constructing it?): {_first_line(exc)}"
            ) from exc

    def __repr__(self) -> str:
        return f"<TorchCoordinator rank {self._rank}/{self._world} {self._name!r}>"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def channel(self, name: str) -> TorchCoordinator:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} is invalid: allowed is a non-empty str")
        with self._lock:
            known = self._channels.get(name)
            if known is not None:
                return known
            out = self._sibling(f"{self._name}/{name}")
            self._channels[name] = out
            return out

    def _sibling(self, name: str) -> TorchCoordinator:
        """The same participants on a new gloo group of their own (collective)."""
        out = copy.copy(self)
        out._name = name
        out._group = self._new_group(name)
        out._issued = 0
        out._channels, out._lock = {}, threading.Lock()
        out._abandoned = []
        return out

    # -- collectives ---------------------------------------------------------------------------

    def barrier(self, *, timeout: float | None = None) -> None:
        call = _Call(self, "barrier", timeout)
        call.run(lambda left: self._group.barrier(timeout=left))

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        torch = self._torch()
        call = _Call(self, "all_gather", timeout)
        data = _encode(obj)
        mine = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world)]
        call.run(lambda left: self._group.allgather(sizes, mine, timeout=left))
        lengths = [int(s.item()) for s in sizes]
        buf = torch.zeros(max(lengths), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(self._world)]
        call.run(lambda left: self._group.allgather(out, buf, timeout=left))
        return [_decode(t[:n].numpy().tobytes()) for t, n in zip(out, lengths, strict=True)]

    def gather(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> list[Any] | None:
        integer(root, "root", minimum=0, maximum=self._world - 1)
        torch = self._torch()
        call = _Call(self, "gather", timeout)
        data = _encode(obj)
        mine = torch.tensor([len(data)], dtype=torch.int64)
        here = self._rank == root
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world)] if here else []
        # gloo's gather wants equal sizes: the sizes are gathered, then each payload goes
        # straight to the root (so no rank pads to the largest one, nor receives any but root).
        call.run(lambda left: self._group.gather(sizes, mine, root, timeout=left))
        tag = call.number % _TAG_LIMIT
        if not here:
            payload = _uint8(torch, memoryview(data))
            work = call.post(self._group.send, [payload], root, tag)
            self._finish(call, [work], (work, payload))
            return None
        incoming = {
            src: torch.empty(int(n.item()), dtype=torch.uint8)
            for src, n in enumerate(sizes)
            if src != root
        }
        works = [call.post(self._group.recv, [buf], src, tag) for src, buf in incoming.items()]
        self._finish(call, works, (works, incoming))
        return [
            obj if r == root else _decode(incoming[r].numpy().tobytes())
            for r in range(self._world)
        ]

    def _finish(self, call: _Call, works: list[Any], keep: Any) -> None:
        """Wait for ``works``; on a failure keep them (gloo may still use their tensors)."""
        try:
            for work in works:
                call.wait(work)
        except CoordinationError:
            self._abandoned.append(keep)
            raise

    def broadcast(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> Any:
        integer(root, "root", minimum=0, maximum=self._world - 1)
        torch = self._torch()
        call = _Call(self, "broadcast", timeout)
        data = _encode(obj) if self._rank == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        call.run(lambda left: self._group.broadcast(size, root, timeout=left))
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self._rank == root:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        call.run(lambda left: self._group.broadcast(buf, root, timeout=left))
        return _decode(buf.numpy().tobytes())

    def exchange(
        self, sends: Mapping[int, bytes | bytearray | memoryview], *, timeout: float | None = None
    ) -> dict[int, bytes]:
        views = outgoing(sends, self._world)
        torch = self._torch()
        call = _Call(self, "exchange", timeout)
        got: dict[int, bytes] = {}
        if self._rank in views:
            got[self._rank] = to_bytes(views.pop(self._rank))
        mine = torch.full((self._world,), -1, dtype=torch.int64)  # -1: nothing for that rank
        for dst, view in views.items():
            mine[dst] = view.nbytes
        sizes = torch.empty(self._world, dtype=torch.int64)
        call.run(lambda left: self._group.alltoall_base(sizes, mine, [], [], timeout=left))
        incoming = {
            src: torch.empty(n, dtype=torch.uint8)
            for src, n in enumerate(sizes.tolist())
            if n >= 0 and src != self._rank
        }
        tag = call.number % _TAG_LIMIT
        works: list[Any] = []
        try:
            # Every receive and send is posted before any is waited for: ranks that send to
            # each other never wait on one another's order.
            for src, buf in incoming.items():
                if buf.numel():  # an empty payload is told by its size alone
                    works.append(call.post(self._group.recv, [buf], src, tag))
            for dst, view in views.items():
                if view.nbytes:
                    works.append(call.post(self._group.send, [_uint8(torch, view)], dst, tag))
            for work in works:
                call.wait(work)
        except CoordinationError:
            self._abandoned.append((works, incoming, views))
            raise
        got.update((src, buf.numpy().tobytes()) for src, buf in incoming.items())
        return dict(sorted(got.items()))

    def _torch(self) -> Any:
        return sys.modules["torch"]

    def _next(self) -> int:
        self._issued += 1
        return self._issued


class _Call:
    """One collective of a channel: its deadline, and gloo's failures as CoordinationError."""

    def __init__(self, coord: TorchCoordinator, what: str, timeout: float | None) -> None:
        self.coord = coord
        self.limit = coord.timeout if timeout is None else seconds(timeout, "timeout")
        self.deadline = time.monotonic() + self.limit
        self.number = coord._next()
        self.what = f"{what} {self.number}"

    def run(self, start: Callable[[timedelta], Any]) -> None:
        """Start one gloo operation with the time left and wait for it."""
        # gloo enforces the timeout itself (a send or receive that does not complete in time
        # fails), so wait() never blocks longer than that.
        self.step(lambda left: start(left).wait())

    def post(self, start: Callable[..., Any], *args: Any) -> Any:
        """Start a gloo send or receive (``start(*args)``) to be waited for with :meth:`wait`."""
        return self.step(lambda _left: start(*args))

    def wait(self, work: Any) -> None:
        """Wait for an operation started earlier (a send, a receive) with the time left."""

        def finish(left: timedelta) -> None:
            if not work.wait(left):
                raise TimeoutError("the operation did not complete in the time left")

        self.step(finish)

    def step(self, action: Callable[[timedelta], _T]) -> _T:
        """``action(time left)``, its gloo failure or the deadline as CoordinationError."""
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("no time left for its next step")
            return action(timedelta(seconds=left))
        except (RuntimeError, TimeoutError) as exc:
            c = self.coord
            raise CoordinationError(
                f"rank {c.rank}/{c.world_size}: {self.what} on channel {c._name!r} failed (a "
                f"participant died, or did not arrive within {self.limit:g} s): "
                f"{_first_line(exc)}"
            ) from exc


def _uint8(torch: Any, view: memoryview) -> Any:
    """A uint8 tensor of ``view``'s bytes, sharing its memory when it is writable. torch warns
    about a read-only buffer (it cannot mark a tensor read-only), so ``bytes`` are copied once."""
    return torch.frombuffer(view if not view.readonly else bytearray(view), dtype=torch.uint8)


def _torch_distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - torch is a dependency of the torch extra
        raise CoordinationError(f"TorchCoordinator needs torch: {exc}") from exc
    if not dist.is_available() or not dist.is_initialized():
        raise CoordinationError(
            "TorchCoordinator needs an initialized torch.distributed: call "
            "torch.distributed.init_process_group(...) first (torchrun sets its environment)"
        )
    if not dist.is_gloo_available():
        raise CoordinationError("TorchCoordinator needs torch.distributed's gloo backend")
    return dist


def _encode(obj: Any) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a collective carries JSON-like objects only, got {obj!r}: {exc}") from exc


def _decode(data: bytes) -> Any:
    return json.loads(data.decode())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
