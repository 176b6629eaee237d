"""Accelerate's FSDP2 path on a CPU job: the one thing Accelerate itself will not do there.

Accelerate picks ``DistributedType.FSDP`` only for a job on accelerators: on a CPU (gloo) job
its state is ``MULTI_CPU`` whatever plugin it is given, and ``prepare`` wraps the model in DDP
(the HF Trainer's ``fsdp=`` with ``use_cpu=True`` likewise trains with DDP). These functions
set the type and the plugin where Accelerate would have; from there on ``prepare``,
``backward``, ``save_state`` and ``load_state`` are Accelerate's own FSDP2 code
(``fully_shard`` on a CPU mesh over gloo). Run on the caller's thread, once per process.
"""

from __future__ import annotations

from typing import Any

__all__ = ["as_cpu_fsdp2", "cpu_fsdp2_accelerator"]


def cpu_fsdp2_accelerator(plugin: Any = None, **options: Any) -> Any:
    """``accelerate.Accelerator(cpu=True, fsdp_plugin=plugin, **options)`` made FSDP2 by
    :func:`as_cpu_fsdp2`: its ``prepare(model, optimizer)`` shards the model with FSDP2."""
    from accelerate import Accelerator

    plugin = _fsdp2_plugin(plugin)
    return as_cpu_fsdp2(Accelerator(cpu=True, fsdp_plugin=plugin, **options), plugin)


def as_cpu_fsdp2(accelerator: Any, plugin: Any = None) -> Any:
    """``accelerator`` (of a CPU job of several ranks, not prepared anything yet; an HF
    Trainer's, say) with the distributed type ``FSDP`` and ``plugin`` (default
    ``FullyShardedDataParallelPlugin(fsdp_version=2)``), as Accelerate's state would have made
    it on accelerators. A plugin of FSDP version 1, or another kind of job, is a
    ``ValueError``: torch's FSDP1 needs a device, and a single process has no distributed type.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    plugin = _fsdp2_plugin(plugin)
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        raise ValueError(
            f"as_cpu_fsdp2 needs the accelerator of a CPU job of several ranks (torchrun); "
            f"this one's is {accelerator.distributed_type}"
        )
    # AcceleratorState copies PartialState's fields each time it is made: both, or the next
    # AcceleratorState() (a prepared dataloader makes one) would put MULTI_CPU back.
    PartialState().distributed_type = DistributedType.FSDP
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":  # what AcceleratorState does for an FSDP plugin
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    return accelerator


def _fsdp2_plugin(plugin: Any) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    if plugin is None:
        return FullyShardedDataParallelPlugin(fsdp_version=2)
    if not isinstance(plugin, FullyShardedDataParallelPlugin) or plugin.fsdp_version != 2:
        raise ValueError(
            f"plugin must be a FullyShardedDataParallelPlugin(fsdp_version=2), got {plugin!r:.80}"
        )
    return plugin
