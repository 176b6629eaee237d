"""Integrations with training frameworks: exact resume of what lives outside the model.

``.torch`` (RNG state, resumable data order), ``.lightning`` and ``.transformers`` (one callback
each, on ``._base.RunSaver``; ``.lightning`` also a plugin and its DDP and FSDP strategies).
Each submodule imports its framework itself; importing ``cryosnap`` imports none of them.
docs/INTEGRATIONS.md shows how to use them.
"""

__all__: list[str] = []  # the submodules are the API: import cryosnap.integrations.torch, ...
