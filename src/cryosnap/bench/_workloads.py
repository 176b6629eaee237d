"""The states the peers save: dense, many-small (transformer-like names and mixed sizes), the
sparse change applied before each save, and the round-trip check. torch is imported lazily.
Runs on the caller's thread.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cryosnap.bench._config import CHUNK_BYTES, SEED, SPARSE_FRACTION

if TYPE_CHECKING:
    import torch

    StateDict = dict[str, torch.Tensor]

_DENSE_TENSORS = 16


# ------------------------------------------------------------------------------------ states


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def dense_shapes(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """fp32 in 16 tensors of (rows, 4096), about ``size_bytes`` in all (1 GiB: 4096 rows each)."""
    per_tensor = size_bytes // _DENSE_TENSORS // 4
    cols = 4096 if per_tensor >= 4096 else max(1, per_tensor)
    rows = max(1, per_tensor // cols)
    return [(f"blocks.{i}.weight", (rows, cols)) for i in range(_DENSE_TENSORS)]


def many_small_shapes(size_bytes: int, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """A deep, narrow transformer-like state dict: ``tensors`` tensors, about ``size_bytes``.

    Layers of 20 tensors each (hidden 64, MLP 256): norms, biases and rotary buffers (small and
    fixed), projection matrices and two vocabulary matrices whose rows scale to reach the size
    (with 20,000 tensors and 300 MB it is bench_save_load.py's state b). Below the size of the
    fixed vectors, the matrices keep one row each.
    """
    hidden, mlp, vocab = 64, 256, 65536
    layers = max(1, (tensors - 5) // 20)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.append((f"{p}.input_layernorm.weight", (hidden,)))
        shapes.append((f"{p}.input_layernorm.bias", (hidden,)))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes.append((f"{p}.attn.{proj}.weight", (hidden, hidden)))
            shapes.append((f"{p}.attn.{proj}.bias", (hidden,)))
        shapes.append((f"{p}.attn.q_norm.weight", (hidden,)))
        shapes.append((f"{p}.attn.k_norm.weight", (hidden,)))
        shapes.append((f"{p}.attn.rotary_emb.inv_freq", (hidden // 2,)))
        shapes.append((f"{p}.post_attention_layernorm.weight", (hidden,)))
        shapes.append((f"{p}.post_attention_layernorm.bias", (hidden,)))
        shapes.append((f"{p}.mlp.gate_proj.weight", (mlp, hidden)))
        shapes.append((f"{p}.mlp.up_proj.weight", (mlp, hidden)))
        shapes.append((f"{p}.mlp.up_proj.bias", (mlp,)))
        shapes.append((f"{p}.mlp.down_proj.weight", (hidden, mlp)))
        shapes.append((f"{p}.mlp.down_proj.bias", (hidden,)))
    shapes += [
        ("model.norm.weight", (hidden,)),
        ("model.norm.bias", (hidden,)),
        ("lm_head.weight", (vocab, hidden)),
    ]
    fixed = sum(_numel(s) * 4 for _, s in shapes if len(s) < 2)
    rows = sum(s[0] for _, s in shapes if len(s) >= 2)
    row_bytes = sum(_numel(s) * 4 for _, s in shapes if len(s) >= 2) / rows
    scale = max(0.0, size_bytes - fixed) / (rows * row_bytes)
    return [
        (name, shape if len(shape) < 2 else (max(1, round(shape[0] * scale)), *shape[1:]))
        for name, shape in shapes
    ]


def build_state(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> StateDict:
    """Random normal fp32 from a fixed seed: incompressible, no two chunks alike."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    return {
        name: torch.randn(shape, generator=generator, dtype=torch.float32) for name, shape in shapes
    }


def state_nbytes(state: Mapping[str, Any]) -> int:
    return sum(int(t.numel()) * int(t.element_size()) for t in state.values())


class SparseChange:
    """Changes 1% of the state's chunks (cryosnap's 1 MiB grid from the start of each leaf)."""

    def __init__(self, state: StateDict) -> None:
        self._chunks: list[tuple[str, int, int]] = []  # (leaf, first element, elements)
        for name, tensor in state.items():
            per_chunk = CHUNK_BYTES // tensor.element_size()
            total = int(tensor.numel())
            for start in range(0, total, per_chunk):
                self._chunks.append((name, start, min(per_chunk, total - start)))
        self.chunks = max(1, round(SPARSE_FRACTION * len(self._chunks)))
        self._random = random.Random(SEED)

    def apply(self, state: StateDict) -> int:
        """Overwrite a fresh random 1% of the chunks with new values; returns bytes changed."""
        import torch

        changed = 0
        for name, start, count in self._random.sample(self._chunks, self.chunks):
            flat = state[name].view(-1)
            flat[start : start + count] = torch.randn(count)
            changed += count * flat.element_size()
        return changed


def first_mismatch(expected: Mapping[str, Any], loaded: object) -> str | None:
    """None when ``loaded`` is a mapping equal to ``expected`` leaf by leaf, else what differs."""
    import torch

    if not isinstance(loaded, Mapping):
        return f"load returned {type(loaded).__name__}, not a mapping"
    if set(loaded) != set(expected):
        missing = sorted(set(expected) - set(loaded))[:3]
        extra = sorted(set(loaded) - set(expected))[:3]
        return f"keys differ: missing {missing}, unexpected {extra}"
    for name, want in expected.items():
        got = loaded[name]
        if not isinstance(got, torch.Tensor):
            return f"{name}: got {type(got).__name__}, not a torch.Tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return (
                f"{name}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
            )
        if not torch.equal(got, want):
            return f"{name}: values differ"
    return None


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (writable when the tensor is)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("raw I/O needs contiguous tensors")
    view: memoryview = tensor.reshape(-1).view(torch.uint8).numpy().data
    return view
