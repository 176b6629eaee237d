"""Exact DDP resume without the user's help: a restore arms every ``nn.Module`` of ``into=``
(:func:`arm`), and the first training forward a DistributedDataParallel runs it in warms DDP's
gradient buckets up first (:func:`warm_up`, what ``prepare_ddp_resume`` runs by hand).
Caller's thread (arm); the hook runs inside DDP's forward, on every rank at the same step, and
its collectives are DDP's own. Never imports torch. docs/DISTRIBUTED.md, "Exact DDP resume".
"""

from __future__ import annotations

import random
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from cryosnap._state.torch_import import loaded_torch

__all__ = ["arm", "disarm", "warm_up"]

# The armed modules and their hooks' handles (a module restored twice is armed once).
_ARMED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def arm(into: Any) -> None:
    """After a restore filled ``into``: arm each module in it (a DDP's inner module for a DDP)
    when this process is one of several ranks of torch.distributed; else do nothing."""
    torch = loaded_torch()
    if torch is None or not _distributed(torch):
        return
    for module in _modules(into, torch.nn.Module, torch.nn.parallel.DistributedDataParallel):
        if module not in _ARMED:
            _ARMED[module] = module.register_forward_pre_hook(_hook, with_kwargs=True)


def disarm(module: Any) -> None:
    """Remove ``module``'s hook, if armed (``prepare_ddp_resume`` warms up by hand)."""
    handle = _ARMED.pop(module, None)
    if handle is not None:
        handle.remove()


def _distributed(torch: Any) -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _modules(obj: Any, module_type: Any, ddp_type: Any) -> Iterator[Any]:
    if isinstance(obj, ddp_type):
        yield obj.module
    elif isinstance(obj, module_type):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _modules(value, module_type, ddp_type)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _modules(value, module_type, ddp_type)


def _hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook of an armed module. The first forward with grad that DDP reduces
    (not under ``no_sync``) decides: when a DDP over this module would rebuild its buckets
    after it, a warm-up (a nested forward and backward of the DDP) and DDP's rebuild, which
    DDP itself would only do at the start of its next forward, come before the module
    computes. A forward with grad outside DDP disarms it: the module trains without DDP."""
    torch: Any = loaded_torch()  # loaded: the hook is on a module
    ddp_type = torch.nn.parallel.DistributedDataParallel
    ddp: Any = getattr(ddp_type, "_active_ddp_module", None)
    ours = ddp is not None and ddp.module is module
    if not torch.is_grad_enabled() or (ours and not ddp.require_backward_grad_sync):
        return  # an evaluation, or gradients accumulated under no_sync: not yet
    disarm(module)
    if not ours or not _rebuilds(ddp):
        return
    if ddp.static_graph:
        # Measured 1e-8 off both ways (this hook and prepare_ddp_resume), at 3 ranks.
        _inexact(torch, "static_graph=True (prepare_ddp_resume does not help)")
        return
    if _compiling(torch):
        _inexact(torch, "torch.compile: call prepare_ddp_resume(ddp, batch) on every rank")
        return
    try:
        warmed = warm_up(ddp, args, kwargs)
    finally:
        ddp_type._active_ddp_module = ddp  # torch 2.1's nested forward left None behind
    if not warmed:
        _inexact(torch, "its output holds no tensor with grad, to warm the buckets up on")
    elif ddp.reducer._rebuild_buckets():  # collective: the bucket indices of rank 0
        ddp._has_rebuilt_buckets = True


def _inexact(torch: Any, why: str) -> None:
    """One warning for the job (on rank 0, as Lightning's)."""
    if torch.distributed.get_rank() == 0:
        warnings.warn(
            "cryosnap: a DistributedDataParallel model trains its first step after the "
            "restore with its initial gradient buckets, and its weights may end some 1e-8 "
            f"off an uninterrupted run's; {why}",
            UserWarning,
            stacklevel=3,
        )


def _compiling(torch: Any) -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())


def _rebuilds(ddp: Any) -> bool:
    """Whether DDP would rebuild its buckets after its first backward and has not yet (its
    reducer's ``should_rebuild_buckets``); a python reducer (compiled autograd) or all
    parameters reduced at once have no buckets to rebuild."""
    if ddp._has_rebuilt_buckets:
        return False
    if getattr(ddp, "_use_python_reducer", False) or getattr(
        ddp, "_delay_all_reduce_all_params", False
    ):
        return False
    return bool(ddp.static_graph or not ddp.find_unused_parameters)


def warm_up(ddp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """One forward of ``ddp`` on ``args`` and ``kwargs`` and the backward of a zero loss: DDP
    reduces zeros (a collective) and records the order the gradients became ready in, by
    which it rebuilds its buckets before its next forward. Then every global random number
    generator, the module's buffers and the gradients (values, not only tensors: DDP writes
    the reduced ones into them) are put back as they were. False: the output holds no tensor
    that requires grad, and there was no backward."""
    torch: Any = loaded_torch()  # loaded: ddp is a module
    generators = _generators(torch)
    buffers = [b.detach().clone() for b in ddp.module.buffers()]
    params = list(ddp.parameters())
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    try:
        outputs = [t for t in _tensors(ddp(*args, **kwargs), torch) if t.requires_grad]
        if outputs:
            (sum(t.sum() for t in outputs) * 0.0).backward()
    finally:
        _set_generators(torch, generators)
        with torch.no_grad():
            for buffer, saved in zip(ddp.module.buffers(), buffers, strict=True):
                buffer.copy_(saved)
            for p, grad in zip(params, grads, strict=True):
                if grad is None or p.grad is None:
                    p.grad = grad
                else:
                    p.grad.copy_(grad)  # the same tensor: DDP's bucket views stay its views
    return bool(outputs)


def _tensors(obj: Any, torch: Any) -> Iterator[Any]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value, torch)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, torch)


def _generators(torch: Any) -> tuple[Any, ...]:
    """The global generators ``RNGState`` covers, CUDA's once CUDA is initialized (a model on a
    GPU has initialized it; asking sooner would make a context on a CPU-only rank)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state(), cuda


def _set_generators(torch: Any, generators: tuple[Any, ...]) -> None:
    python, numpy, cpu, cuda = generators
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
