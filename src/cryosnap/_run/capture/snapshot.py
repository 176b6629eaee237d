"""Snapshots: a version's blobs cloned where they lie, so that their copy into the staging can
run in the background while the program goes on.

An eager capture of CUDA state that would first have to allocate staging (the first save of a
session: pinned memory is slow to get, 1.75 s for 4 GiB on an H200 against 0.08 s for the
copy into it) clones its CUDA blobs on their device instead (a device-to-device copy, queued
on the caller's stream after its kernels and before its next ones) and its host blobs in host
memory, and the capture thread copies from the clones while it allocates the staging. Taken
only where each device has room for the clones beside what the program has needed at its
peak so far (torch's allocator statistics) and a spare; else the capture stays as it was.

Runs on the caller's thread; no I/O, no threads. docs/design/capture.md has the why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from cryosnap._run.capture.staging import StagingPool
from cryosnap._state import Blob, FlatState

__all__ = ["SPARE", "cuda_bytes", "device_room", "snapshot", "would_allocate"]

# The share of a device's memory left free beside the clones and the program's peak.
SPARE = 0.05


def would_allocate(flat: FlatState, pool: StagingPool) -> bool:
    """Whether a full capture of ``flat`` would allocate staging: the pool's idle slabs hold
    less than its bytes and the budget (if any) leaves room to allocate."""
    need = sum(b.nbytes for b in flat.blobs if not b.private)
    if not need or pool.room_bytes() >= need:
        return False
    return pool.budget_bytes is None or pool.allocated_bytes < pool.budget_bytes


def cuda_bytes(flat: FlatState) -> dict[Any, int]:
    """The bytes of ``flat``'s CUDA blobs, by device."""
    out: dict[Any, int] = {}
    for b in flat.blobs:
        src = b.source
        if b.nbytes and not isinstance(src, (bytes, np.ndarray)) and src.is_cuda:
            out[src.device] = out.get(src.device, 0) + b.nbytes
    return out


def device_room(torch: Any, need: Mapping[Any, int], spare: float = SPARE) -> bool:
    """Whether every device of ``need`` (device -> bytes) can hold that many more bytes while
    the program still has what it used at its peak: free memory plus what torch's allocator
    holds unused, against the clones, the peak above today's use and ``spare`` of the
    device."""
    cuda = torch.cuda
    for device, nbytes in need.items():
        free, total = cuda.mem_get_info(device)
        allocated = cuda.memory_allocated(device)
        cached = cuda.memory_reserved(device) - allocated
        peak = max(cuda.max_memory_allocated(device) - allocated, 0)
        if nbytes + peak + int(total * spare) > free + cached:
            return False
    return True


def snapshot(flat: FlatState) -> FlatState:
    """``flat`` with every blob the program may change afterwards cloned: CUDA and host
    tensors and arrays (a CUDA clone is queued on the current stream: ordered after the
    kernels queued before it, and before the ones queued after). The host clones are the
    capture's own memory (``private``: written from where they lie, not copied again);
    ``bytes`` and private blobs are kept as they are."""
    return dataclasses.replace(flat, blobs=[_cloned(b) for b in flat.blobs])


def _cloned(blob: Blob) -> Blob:
    src = blob.source
    if blob.private or not blob.nbytes or isinstance(src, bytes):
        return blob
    if isinstance(src, np.ndarray):
        return dataclasses.replace(blob, source=src.copy(), private=True)
    copy = src.clone()
    return dataclasses.replace(blob, source=copy, private=not copy.is_cuda)
