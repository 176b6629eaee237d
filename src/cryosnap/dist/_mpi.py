"""MPICoordinator: the participants of an MPI job (``mpiexec``, ``srun``), over mpi4py.

Checkpoint traffic never shares a communicator with the program (``comm`` is duplicated per
channel); collectives are nonblocking, polled until their deadline. MPI must run at
``MPI_THREAD_MULTIPLE``: the writer thread calls it while the program does from the main thread.
mpi4py is imported on construction. docs/design/distributed.md has the why.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from cryosnap._validate import integer, seconds
from cryosnap.dist._common import DEFAULT_TIMEOUT_SECONDS, outgoing, to_bytes
from cryosnap.errors import CoordinationError

__all__ = ["MPICoordinator"]

# Polling interval of a pending collective: starts short (a healthy collective completes in
# microseconds) and backs off, so a long wait costs no CPU the training needs.
_POLL_FIRST, _POLL_MAX = 50e-6, 5e-3

# MPI guarantees tags up to 32767 (MPI_TAG_UB may be larger). An exchange tags its messages with
# its number on the channel, so one left over from an exchange that failed is not the next one's.
_TAG_LIMIT = 32768


class MPICoordinator:
    """The ranks of the mpi4py communicator ``comm`` (e.g. ``MPI.COMM_WORLD``).

    ``timeout`` (seconds) bounds each collective that is not given its own, and the
    duplication of ``comm`` for each channel.
    """

    def __init__(self, comm: Any, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.timeout = seconds(timeout, "timeout")
        self._MPI = _mpi4py()
        if not isinstance(comm, self._MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        level = self._MPI.Query_thread()
        if level < self._MPI.THREAD_MULTIPLE:
            raise CoordinationError(
                f"MPI runs at thread level {level}; the Checkpointer's writer thread needs "
                f"MPI_THREAD_MULTIPLE ({self._MPI.THREAD_MULTIPLE}): leave mpi4py.rc.thread_level "
                "at its default, 'multiple'"
            )
        # Collectives that timed out: MPI may still write into their buffers.
        self._abandoned: list[tuple[Any, ...]] = []
        self._name = "main"
        self._comm = self._dup(comm, "main")
        self._rank = int(self._comm.Get_rank())
        self._world = int(self._comm.Get_size())
        self._issued = 0
        self._channels: dict[str, MPICoordinator] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<MPICoordinator rank {self._rank}/{self._world} {self._name!r}>"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def channel(self, name: str) -> MPICoordinator:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} is invalid: allowed is a non-empty str")
        with self._lock:
            known = self._channels.get(name)
            if known is None:
                known = copy.copy(self)
                known._name = f"{self._name}/{name}"
                known._comm = self._dup(self._comm, known._name)
                known._issued, known._channels, known._lock = 0, {}, threading.Lock()
                known._abandoned = []
                self._channels[name] = known
            return known

    def _dup(self, comm: Any, name: str) -> Any:
        out, request = comm.Idup()
        _Call(self, f"creating channel {name!r}", None, rank=comm.Get_rank()).wait(request, ())
        return out

    # -- collectives ---------------------------------------------------------------------------

    def barrier(self, *, timeout: float | None = None) -> None:
        call = _Call(self, "barrier", timeout)
        call.wait(self._comm.Ibarrier(), ())

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        MPI = self._MPI
        call = _Call(self, "all_gather", timeout)
        data = np.frombuffer(_encode(obj), dtype=np.uint8)
        mine = np.array([data.size], dtype=np.int64)
        sizes = np.zeros(self._world, dtype=np.int64)
        request = self._comm.Iallgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T])
        call.wait(request, (mine, sizes))
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        request = self._comm.Iallgatherv(
            [data, MPI.BYTE], [out, (sizes.tolist(), displs.tolist()), MPI.BYTE]
        )
        call.wait(request, (data, out))
        return [
            _decode(out[int(d) : int(d) + int(n)].tobytes())
            for d, n in zip(displs, sizes, strict=True)
        ]

    def gather(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> list[Any] | None:
        integer(root, "root", minimum=0, maximum=self._world - 1)
        MPI = self._MPI
        call = _Call(self, "gather", timeout)
        data = np.frombuffer(_encode(obj), dtype=np.uint8)
        mine = np.array([data.size], dtype=np.int64)
        here = self._rank == root
        sizes = np.zeros(self._world if here else 0, dtype=np.int64)
        request = self._comm.Igather([mine, MPI.INT64_T], [sizes, MPI.INT64_T], root=root)
        call.wait(request, (mine, sizes))
        if not here:
            call.wait(self._comm.Igatherv([data, MPI.BYTE], None, root=root), (data,))
            return None
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        request = self._comm.Igatherv(
            [data, MPI.BYTE], [out, (sizes.tolist(), displs.tolist()), MPI.BYTE], root=root
        )
        call.wait(request, (data, out))
        return [
            _decode(out[int(d) : int(d) + int(n)].tobytes())
            for d, n in zip(displs, sizes, strict=True)
        ]

    def broadcast(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> Any:
        integer(root, "root", minimum=0, maximum=self._world - 1)
        MPI = self._MPI
        call = _Call(self, "broadcast", timeout)
        data = _encode(obj) if self._rank == root else b""
        size = np.array([len(data)], dtype=np.int64)
        call.wait(self._comm.Ibcast([size, MPI.INT64_T], root=root), (size,))
        buf = np.zeros(int(size[0]), dtype=np.uint8)
        if self._rank == root:
            buf[:] = np.frombuffer(data, dtype=np.uint8)
        call.wait(self._comm.Ibcast([buf, MPI.BYTE], root=root), (buf,))
        return _decode(buf.tobytes())

    def exchange(
        self, sends: Mapping[int, bytes | bytearray | memoryview], *, timeout: float | None = None
    ) -> dict[int, bytes]:
        views = outgoing(sends, self._world)
        MPI = self._MPI
        call = _Call(self, "exchange", timeout)
        got: dict[int, bytes] = {}
        if self._rank in views:
            got[self._rank] = to_bytes(views.pop(self._rank))
        mine = np.full(self._world, -1, dtype=np.int64)  # -1: nothing for that rank
        for dst, view in views.items():
            mine[dst] = view.nbytes
        sizes = np.empty(self._world, dtype=np.int64)
        request = self._comm.Ialltoall([mine, MPI.INT64_T], [sizes, MPI.INT64_T])
        call.wait(request, (mine, sizes))
        incoming = {
            src: np.empty(int(n), dtype=np.uint8)
            for src, n in enumerate(sizes)
            if n >= 0 and src != self._rank
        }
        tag = call.number % _TAG_LIMIT
        # Every receive and send is posted before any is waited for; an empty payload is told
        # by its size alone.
        requests = [
            self._comm.Irecv([buf, MPI.BYTE], source=src, tag=tag)
            for src, buf in incoming.items()
            if buf.size
        ]
        requests += [
            self._comm.Isend([view, MPI.BYTE], dest=dst, tag=tag)
            for dst, view in views.items()
            if view.nbytes
        ]
        call.wait(_All(MPI, requests), (incoming, views))
        got.update((src, buf.tobytes()) for src, buf in incoming.items())
        return dict(sorted(got.items()))

    def _next(self) -> int:
        self._issued += 1
        return self._issued


class _Call:
    """One collective of a channel: its deadline, polled nonblocking requests."""

    def __init__(
        self, coord: MPICoordinator, what: str, timeout: float | None, *, rank: int | None = None
    ) -> None:
        self.coord = coord
        self.limit = coord.timeout if timeout is None else seconds(timeout, "timeout")
        self.deadline = time.monotonic() + self.limit
        self.number = 0 if rank is not None else coord._next()
        self.what = what if rank is not None else f"{what} {self.number}"
        self.rank = coord._rank if rank is None else rank

    def wait(self, request: Any, buffers: tuple[Any, ...]) -> None:
        """Poll ``request`` until it completes; past the deadline keep it (and the buffers MPI
        may still fill) and raise."""
        pause = _POLL_FIRST
        while not request.Test():
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.coord._abandoned.append((request, *buffers))
                c = self.coord
                raise CoordinationError(
                    f"rank {self.rank}: {self.what} on MPI channel {c._name!r} did not complete "
                    f"within {self.limit:g} s (a participant hangs or did not arrive)"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX)


class _All:
    """Several requests polled as one (``_Call.wait`` keeps it, and so them, on a timeout)."""

    def __init__(self, MPI: Any, requests: list[Any]) -> None:
        self._MPI = MPI
        self.requests = requests

    def Test(self) -> bool:  # mpi4py's name: _Call.wait polls either kind
        return bool(self._MPI.Request.Testall(self.requests))


def _mpi4py() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise CoordinationError(
            f"MPICoordinator needs mpi4py (pip install 'cryosnap[mpi]'): {exc}"
        ) from exc
    return MPI


def _encode(obj: Any) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a collective carries JSON-like objects only, got {obj!r}: {exc}") from exc


def _decode(data: bytes) -> Any:
    return json.loads(data.decode())
