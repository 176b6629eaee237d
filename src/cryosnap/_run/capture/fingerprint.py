"""Chunk fingerprints computed where a tensor lives (GPU or CPU), to find the chunks that changed
since the previous version without copying them to the host first (128 bits per chunk).

Runs on whichever thread calls it, on the current CUDA stream.
docs/design/capture.md has the hash, its collision bound and the why.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["COLLISION_BOUND_LOG2", "Fingerprinter", "supported"]

log = logging.getLogger("cryosnap")

COLLISION_BOUND_LOG2 = -82  # see the module docstring

# Rows of chunks fingerprinted per torch call: bounds the int64 temporaries (8x the input).
_BLOCK_BYTES = 32 << 20


def supported(chunk_bytes: int) -> bool:
    """Whether chunks of this size can be fingerprinted (whole 32-bit words)."""
    return chunk_bytes % 4 == 0


class Fingerprinter:
    """Fingerprints the chunks of 1-D uint8 tensors with one random key per instance."""

    def __init__(self, chunk_bytes: int, *, seed: int | None = None) -> None:
        if not supported(chunk_bytes):
            raise ValueError(f"chunk_bytes={chunk_bytes} is not a whole number of 32-bit words")
        self.chunk_bytes = chunk_bytes
        self.words = chunk_bytes // 4
        rng = np.random.default_rng(
            int.from_bytes(os.urandom(16), "little") if seed is None else seed
        )
        keys = rng.integers(0, 2**64, size=(2, self.words), dtype=np.uint64, endpoint=False)
        self._keys_host = keys.view(np.int64)
        self._keys: dict[str, Any] = {}  # device -> (2, words) int64 tensor
        self._lock = threading.Lock()
        # True once the Triton kernel ran here, False once it failed (torch then takes over).
        self._triton: bool | None = None

    def _keys_on(self, device: Any) -> Any:
        name = str(device)
        with self._lock:
            keys = self._keys.get(name)
            if keys is None:
                torch = sys.modules["torch"]
                keys = torch.from_numpy(self._keys_host.copy()).to(device)
                self._keys[name] = keys
            return keys

    def chunks(self, data: Any) -> Any:
        """The ``(n_chunks, 2)`` int64 fingerprints of the 1-D uint8 tensor ``data``."""
        torch = sys.modules["torch"]
        n = -(-data.numel() // self.chunk_bytes)
        if n == 0:
            return torch.zeros((0, 2), dtype=torch.int64, device=data.device)
        words = self._as_words(data, n)
        keys = self._keys_on(data.device)
        if data.is_cuda and self._triton is not False:
            try:
                out = _triton_fingerprints(words, keys)
                self._triton = True
                return out
            except Exception as exc:  # no Triton, or it cannot compile here: torch does it
                self._triton = False
                log.info("cryosnap: Triton fingerprints unavailable (%s); using torch", exc)
        return self.chunks_torch(words, keys)

    def _as_words(self, data: Any, n: int) -> Any:
        """``data`` as an ``(n, words)`` int32 tensor, zero-padded at the end if needed."""
        torch = sys.modules["torch"]
        full = n * self.chunk_bytes
        aligned = data.storage_offset() % 4 == 0 and data.is_contiguous()
        if data.numel() == full and aligned:
            return data.view(torch.int32).view(n, self.words)
        padded = torch.zeros(full, dtype=torch.uint8, device=data.device)
        padded[: data.numel()].copy_(data)
        return padded.view(torch.int32).view(n, self.words)

    @staticmethod
    def chunks_torch(words: Any, keys: Any) -> Any:
        """The fingerprints with plain torch operations (any device)."""
        torch = sys.modules["torch"]
        n, width = words.shape
        rows = max(1, _BLOCK_BYTES // (4 * width))
        out = torch.empty((n, 2), dtype=torch.int64, device=words.device)
        mask = 0xFFFFFFFF
        for lo in range(0, n, rows):
            w = words[lo : lo + rows].to(torch.int64) & mask  # the unsigned word values
            out[lo : lo + rows, 0] = (w * keys[0]).sum(1)
            w = ((w << 16) | (w >> 16)) & mask
            out[lo : lo + rows, 1] = (w * keys[1]).sum(1)
        return out


# -- the Triton kernel (CUDA only) ---------------------------------------------------------------

_BLOCK_WORDS = 4096
_kernel: Any = None


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def fingerprint_kernel(words, keys, partial, width, blocks, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        pid = tl.program_id(0).to(tl.int64)
        row = pid // blocks
        col = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
        inside = col < width
        w = tl.load(words + row * width + col, mask=inside, other=0)
        w = w.to(tl.uint32, bitcast=True).to(tl.uint64)
        ka = tl.load(keys + col, mask=inside, other=0).to(tl.uint64, bitcast=True)
        kb = tl.load(keys + width + col, mask=inside, other=0).to(tl.uint64, bitcast=True)
        a = tl.sum(w * ka, axis=0)
        r = ((w << 16) | (w >> 16)) & 0xFFFFFFFF
        b = tl.sum(r * kb, axis=0)
        tl.store(partial + pid * 2, a.to(tl.int64, bitcast=True))
        tl.store(partial + pid * 2 + 1, b.to(tl.int64, bitcast=True))

    return fingerprint_kernel


def _triton_fingerprints(words: Any, keys: Any) -> Any:
    global _kernel
    torch = sys.modules["torch"]
    if _kernel is None:
        _kernel = _build_kernel()
    n, width = words.shape
    blocks = -(-width // _BLOCK_WORDS)
    partial = torch.empty((n * blocks, 2), dtype=torch.int64, device=words.device)
    _kernel[(n * blocks,)](words, keys, partial, width, blocks, BLOCK=_BLOCK_WORDS)
    return partial.view(n, blocks, 2).sum(1)
