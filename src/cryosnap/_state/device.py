"""Device copies: host tensors -> tensors on a device, staged through a few pinned slabs.

The host copy of the next piece overlaps the DMA of the previous ones; the results are ready
for the caller on any stream. :func:`copy_to_device` runs on the caller's thread (the one
restoring); a :class:`DeviceFeed` copies on a thread of its own while the caller's reads go on.
No I/O. torch is imported only when called. docs/design/capture.md has the why.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryosnap._state.torch_import import import_torch, loaded_torch
from cryosnap._validate import bad_value, wrong_type

__all__ = [
    "SLABS",
    "DeviceFeed",
    "SLAB_BYTES",
    "SMALL_BYTES",
    "copy_to_device",
    "target_device",
    "to_device",
]

# Four slabs of 16 MiB keep a host-to-device DMA busy while the next piece is copied on the
# host, and the first DMA starts soon. On an H200, 1 GiB from pageable memory (warm): 30-46
# GiB/s this way against 5.5-9.2 with a plain copy_; 4 x 64 MiB gave 26, 4 x 8 MiB 33.
SLAB_BYTES = 16 << 20
SLABS = 4
# Tensors of at most this many bytes are packed and sent in groups (see _Copier).
SMALL_BYTES = 1 << 20


def target_device(value: object, name: str = "map_location") -> Any:
    """``value`` as the ``torch.device`` a restore puts its tensors on (None stays None).

    A value that is neither a str nor a ``torch.device`` is a ``TypeError``; a device torch
    does not know, or one this machine does not have (``"cuda"`` without CUDA), a
    ``ValueError`` naming ``name``: raised before the restore reads any byte.
    """
    if value is None:
        return None
    loaded = loaded_torch()
    if not isinstance(value, str) and not (loaded is not None and isinstance(value, loaded.device)):
        wrong_type(value, name, "None, a str or a torch.device ('cpu', 'cuda', 'cuda:1')")
    try:
        torch = _torch()
    except ImportError as exc:
        raise ValueError(f"{name}={value!r} needs torch, which is not installed") from exc
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"{name}={value!r:.60} is invalid: allowed is a device torch knows ('cpu', 'cuda', "
            f"'cuda:1'): {_first_line(exc)}"
        ) from exc
    if device.type == "meta":
        bad_value(value, name, "a device that holds data (not 'meta')")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name}={value!r} is invalid: CUDA is not available here "
                "(torch.cuda.is_available() is False)"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            bad_value(value, name, f"one of the {count} CUDA device(s) here: 0..{count - 1}")
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as exc:  # RuntimeError, or AssertionError ("not compiled with XPU")
            raise ValueError(
                f"{name}={value!r} is invalid: torch cannot allocate there: {_first_line(exc)}"
            ) from exc
    return device


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{text.splitlines()[0] if text else type(exc).__name__:.200}"


def copy_to_device(
    pairs: Sequence[tuple[Any, Any]], *, slab_bytes: int = SLAB_BYTES, slabs: int = SLABS
) -> None:
    """Copy each host tensor ``src`` into its ``dst`` (same dtype and shape, any device).

    When this returns every destination holds its bytes and is safe to use on its device's
    current stream. A ``src`` that is not on the CPU, or a pair whose dtypes or shapes differ,
    is a ``ValueError`` raised before anything is copied.
    """
    if slab_bytes < 1 or slabs < 1:
        raise ValueError(f"slab_bytes={slab_bytes} and slabs={slabs} must be positive")
    if not pairs:
        return  # a state without tensors: torch stays unimported
    torch = _torch()
    with torch.no_grad():
        jobs = [_job(torch, src, dst) for src, dst in pairs]
        _Copier(torch, jobs, slab_bytes=slab_bytes, slabs=slabs).run()


def to_device(
    sources: Sequence[Any], device: Any, *, slab_bytes: int = SLAB_BYTES, slabs: int = SLABS
) -> list[Any]:
    """New contiguous tensors on ``device`` holding the values of the host tensors ``sources``
    (plain tensors: wrapping in ``nn.Parameter`` is the caller's)."""
    torch = _torch()
    dsts = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in sources]
    copy_to_device(list(zip(sources, dsts, strict=True)), slab_bytes=slab_bytes, slabs=slabs)
    return dsts


class DeviceFeed:
    """Copies groups of host tensors to their destinations on a thread of its own, each group
    as soon as the caller says its bytes are ready (:meth:`ready`, from any thread), through
    one copier's pinned slabs: a restore's host-to-device copies overlap its reads and
    verification instead of following them.

    ``groups``: key -> the (source, destination) pairs of that key (as for
    :func:`copy_to_device`; checked here, before the thread starts). Made on the thread
    whose current streams the destinations were allocated on: the copies wait for what
    those streams queued. :meth:`close` (every group ready; those never said to be are
    copied then, counted in ``late``) returns once every destination holds its bytes and is
    safe to use on that thread's current streams, and raises what a copy raised;
    :meth:`abort` stops the copies (the destinations are then garbage). Exactly one of them
    is called, on the thread that made the feed.
    """

    _END = -1

    def __init__(
        self,
        groups: Mapping[int, Sequence[tuple[Any, Any]]],
        *,
        slab_bytes: int = SLAB_BYTES,
        slabs: int = SLABS,
    ) -> None:
        torch = self._torch = _torch()
        with torch.no_grad():
            jobs = {k: [_job(torch, s, d) for s, d in pairs] for k, pairs in groups.items()}
        self._jobs = {k: js for k, js in jobs.items() if any(j.nbytes for j in js)}
        every = [j for js in self._jobs.values() for j in js]
        self._copier = _Copier(torch, every, slab_bytes=slab_bytes, slabs=slabs)
        self._copier.open_streams()
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._said: set[int] = set()
        self._lock = threading.Lock()
        self._stop = False
        self._error: BaseException | None = None
        self.late = 0  # groups first copied by close(): never said to be ready before
        self._thread = threading.Thread(target=self._work, name="cryosnap-device", daemon=True)
        self._thread.start()

    def ready(self, key: int) -> None:
        """Group ``key``'s sources hold their final bytes: copy them (keys of no group, or
        said twice, are ignored)."""
        with self._lock:
            if key not in self._jobs or key in self._said:
                return
            self._said.add(key)
        self._queue.put(key)

    def close(self) -> None:
        for key in self._jobs:
            if key not in self._said:
                self.late += 1
                self.ready(key)
        self._end()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        self._stop = True
        with contextlib.suppress(Exception):
            self._end()

    def _end(self) -> None:
        self._queue.put(self._END)
        self._thread.join()
        self._copier._finish()

    def _work(self) -> None:
        copier = self._copier
        with self._torch.no_grad():
            while (key := self._queue.get()) != self._END:
                if self._stop or self._error is not None:
                    continue  # drained to the end
                try:
                    for job in self._jobs[key]:
                        copier.add(job)
                except BaseException as exc:
                    self._error = exc
            if not self._stop and self._error is None:
                try:
                    copier.close()
                except BaseException as exc:
                    self._error = exc


def _torch() -> Any:
    return import_torch()


@dataclass(slots=True)
class _Job:
    """One pair as flat byte views; ``temp`` is a contiguous stand-in for ``dst``."""

    src: Any
    out: Any
    nbytes: int
    dst: Any = None
    temp: Any = None


def _flat_bytes(torch: Any, t: Any) -> Any:
    """A flat uint8 view of ``t``'s bytes, or None where it has none."""
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        return None
    if t.numel() == 1:
        t = t.as_strided((1,), (1,))  # a one-element view of any stride counts as contiguous
    try:
        return t.flatten().view(torch.uint8)  # flatten of a 1-D tensor is the tensor itself
    except RuntimeError:
        return None


def _job(torch: Any, src: Any, dst: Any) -> _Job:
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        raise ValueError(
            f"copy_to_device copies tensors, got {type(src).__name__} -> {type(dst).__name__}"
        )
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise ValueError(
            f"copy_to_device: {src.dtype}{list(src.shape)} cannot fill {dst.dtype}{list(dst.shape)}"
        )
    if src.device.type != "cpu":
        raise ValueError(f"copy_to_device copies from host tensors, got one on {src.device}")
    # No detach(): the caller runs this under no_grad, where views of a Parameter need none.
    flat_src = _flat_bytes(torch, src)
    if flat_src is None:
        flat_src = _flat_bytes(torch, src.resolve_conj().resolve_neg().contiguous())
    out = _flat_bytes(torch, dst)
    if out is not None or dst.numel() == 0:
        return _Job(flat_src, out, 0 if out is None else out.numel())
    temp = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
    out = _flat_bytes(torch, temp)
    return _Job(flat_src, out, out.numel(), dst=dst, temp=temp)


@dataclass(slots=True)
class _Slab:
    buf: Any
    # The CUDA devices its current bytes are being copied to; once sealed, an event per such
    # device's copy stream, recorded after the last copy out of the slab.
    devices: set[Any] = field(default_factory=set)
    events: list[Any] = field(default_factory=list)


class _Copier:
    """The pipeline of one :func:`copy_to_device` call.

    A large job goes in pieces, each copied from the slab straight to its destination. Small
    jobs packed side by side in a slab form a *group*: one ``torch.cat`` on the host, one copy
    of the whole region to a staging buffer on the device, then one ``_foreach_copy_`` to the
    destinations, so thousands of small tensors do not cost thousands of transfers.
    """

    def __init__(self, torch: Any, jobs: list[_Job], *, slab_bytes: int, slabs: int) -> None:
        self.torch = torch
        self.jobs = [j for j in jobs if j.nbytes]
        total = sum(j.nbytes for j in self.jobs)
        self.slab_bytes = min(slab_bytes, max(total, 1))
        self.max_slabs = min(slabs, -(-total // self.slab_bytes))
        self.small_bytes = min(SMALL_BYTES, self.slab_bytes)
        self.stage_bytes = sum(j.nbytes for j in self.jobs if j.nbytes <= self.small_bytes)
        self.stage_bytes = min(self.slab_bytes, self.stage_bytes)
        cuda = any(j.out.is_cuda for j in self.jobs)
        self.pin = bool(cuda and torch.cuda.is_available())
        self.slabs: list[_Slab] = []
        self.streams: dict[Any, Any] = {}  # CUDA device -> its copy stream
        self.stages: dict[Any, Any] = {}  # CUDA device -> its staging buffer for groups
        self.turn = -1  # fills so far, minus one
        self.slab: _Slab | None = None
        self.fill = 0  # bytes of the current slab in use
        self.group: list[_Job] = []
        self.group_at = 0  # where the group starts in the current slab
        self.temps: list[_Job] = []  # the jobs added whose destination has a stand-in

    def run(self) -> None:
        if not self.jobs:
            return
        try:
            for job in self.jobs:
                self.add(job)
            self.close()
        finally:
            self._finish()

    def open_streams(self) -> None:
        """Make the copy streams now, on this thread: each waits for what the destinations'
        devices' current streams (this thread's) have queued. (Made later, on another
        thread, they would wait on that thread's current streams instead.)"""
        for job in self.jobs:
            if job.out.is_cuda:
                self._stream(job.out.device)

    def add(self, job: _Job) -> None:
        """Issue the copies of ``job`` (one of ``jobs``; any order)."""
        if not job.nbytes:
            return
        if self.slab is None:
            self._rotate()
        if job.nbytes <= self.small_bytes:
            self._add_small(job)
        else:
            self._add_large(job)
        if job.temp is not None:
            self.temps.append(job)

    def close(self) -> None:
        """Issue what is still pending once every job was added; :meth:`_finish` waits."""
        self._flush_group()
        # Every piece is issued: the contiguous stand-ins go to their destinations (on the
        # streams of the pieces, so after them).
        for job in self.temps:
            self._copy_back(job)
        self.temps = []

    def _add_small(self, job: _Job) -> None:
        if self.group and self.group[0].out.device != job.out.device:
            self._flush_group()
        if self.fill + job.nbytes > self.slab_bytes:
            self._flush_group()
            self._rotate()
        if not self.group:
            self.group_at = self.fill
        self.group.append(job)
        self.fill += job.nbytes

    def _add_large(self, job: _Job) -> None:
        self._flush_group()
        at = 0
        while at < job.nbytes:
            if self.fill == self.slab_bytes:
                self._rotate()
            n = min(job.nbytes - at, self.slab_bytes - self.fill)
            self._copy_piece(job, at, n)
            self.fill, at = self.fill + n, at + n

    def _copy_piece(self, job: _Job, at: int, n: int) -> None:
        assert self.slab is not None
        staged = self.slab.buf[self.fill : self.fill + n]
        staged.copy_(job.src[at : at + n])
        out = job.out[at : at + n]
        if out.is_cuda:
            with self.torch.cuda.stream(self._stream(out.device)):
                out.copy_(staged, non_blocking=self.pin)
            self.slab.devices.add(out.device)
        else:
            out.copy_(staged)

    def _flush_group(self) -> None:
        group, self.group = self.group, []
        if not group:
            return
        assert self.slab is not None
        torch = self.torch
        staged = self.slab.buf[self.group_at : self.fill]
        torch.cat([j.src for j in group], out=staged)
        outs, sizes = [j.out for j in group], [j.nbytes for j in group]
        device = outs[0].device
        if not outs[0].is_cuda:
            _scatter(torch, outs, staged.split(sizes))
            return
        with torch.cuda.stream(self._stream(device)):
            stage = self.stages.get(device)
            if stage is None:  # allocated on the copy stream, used only there
                stage = torch.empty(self.stage_bytes, dtype=torch.uint8, device=device)
                self.stages[device] = stage
            # Stream order makes the stage free again for the next group's bytes.
            region = stage[: staged.numel()]
            region.copy_(staged, non_blocking=self.pin)
            _scatter(torch, outs, region.split(sizes))
        self.slab.devices.add(device)

    def _copy_back(self, job: _Job) -> None:
        if job.dst.is_cuda:
            with self.torch.cuda.stream(self._stream(job.dst.device)):
                job.dst.copy_(job.temp)
        else:
            job.dst.copy_(job.temp)

    def _stream(self, device: Any) -> Any:
        stream = self.streams.get(device)
        if stream is None:
            cuda = self.torch.cuda
            stream = cuda.Stream(device=device)
            # The destinations may still be in use (or just freed) on the caller's stream.
            stream.wait_stream(cuda.current_stream(device))
            self.streams[device] = stream
        return stream

    def _rotate(self) -> None:
        """Seal the current slab (if any) and take the next one."""
        if self.slab is not None:
            self._seal(self.slab)
        self.slab, self.fill = self._next_slab(), 0

    def _seal(self, slab: _Slab) -> None:
        """Mark the end of the copies out of ``slab``: one event per stream that read it."""
        for device in slab.devices:
            # A new event each time: an event may only be recorded on its first device.
            event = self.torch.cuda.Event()
            event.record(self.streams[device])
            slab.events.append(event)
        slab.devices.clear()

    def _next_slab(self) -> _Slab:
        self.turn += 1
        if len(self.slabs) < self.max_slabs:
            buf = self.torch.empty(self.slab_bytes, dtype=self.torch.uint8, pin_memory=self.pin)
            self.slabs.append(_Slab(buf))
            return self.slabs[-1]
        slab = self.slabs[self.turn % len(self.slabs)]
        # Its bytes may still be on their way to a device: overwrite them only once they left.
        for event in slab.events:
            event.synchronize()
        slab.events.clear()
        return slab

    def _finish(self) -> None:
        cuda = self.torch.cuda
        for device, stream in self.streams.items():
            stream.synchronize()
            cuda.current_stream(device).wait_stream(stream)


def _scatter(torch: Any, outs: list[Any], parts: Sequence[Any]) -> None:
    """``outs[i].copy_(parts[i])`` for every i, in one multi-tensor kernel where torch has it."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(outs, list(parts))
        return
    for out, part in zip(outs, parts, strict=True):
        out.copy_(part)
