"""Accelerate's FSDP2 path on a CPU job: the one thing Accelerate itself will not do there.

Accelerate picks ``DistributedType.FSDP`` only for a job on accelerators: on a CPU (gloo) job
its state is ``MULTI_CPU`` whatever plugin it is given, and ``prepare`` wraps the model in DDP.
:func:`cpu_fsdp2_accelerator` sets the type and the plugin where Accelerate would have; from
there on ``prepare``, ``backward``, ``save_state`` and ``load_state`` are Accelerate's own FSDP2
code (``fully_shard`` on a CPU mesh over gloo). Runs on the caller's thread, once per process.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cpu_fsdp2_accelerator"]


def cpu_fsdp2_accelerator(plugin: Any = None, **options: Any) -> Any:
    """An ``accelerate.Accelerator(cpu=True, fsdp_plugin=plugin, **options)`` of a CPU job of
    several ranks whose distributed type is ``FSDP`` with ``plugin`` (default
    ``FullyShardedDataParallelPlugin(fsdp_version=2)``), as Accelerate's state would have made
    it on accelerators: its ``prepare(model, optimizer)`` then shards the model with FSDP2.

    A plugin of FSDP version 1, or a job of one process, is a ``ValueError``: torch's FSDP1
    needs a device, and Accelerate runs a single process without a distributed type.
    """
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if plugin is None:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    if not isinstance(plugin, FullyShardedDataParallelPlugin) or plugin.fsdp_version != 2:
        raise ValueError(
            f"plugin must be a FullyShardedDataParallelPlugin(fsdp_version=2), got {plugin!r:.80}"
        )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, **options)
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        raise ValueError(
            f"cpu_fsdp2_accelerator needs a CPU job of several ranks (torchrun); Accelerate "
            f"made a {accelerator.distributed_type} one"
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
