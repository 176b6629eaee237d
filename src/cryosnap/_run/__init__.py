"""The managed run: a Checkpointer's options, its opening, and the rooms it wires together.

By lifecycle, top to bottom (the import contract in pyproject.toml holds it): ``saves`` and
``scavenge`` (a save on its way in; the flush of a run whose writer is gone) on ``open``, which
opens the stores, locks, partners and threads from the frozen :class:`RunOptions` that
``options`` validates (no I/O); ``writer`` and ``restore`` on the three rooms, ``capture/``,
``levels/`` and ``redundancy/``, which import nothing of each other; then ``job`` (a version on
its way from the caller to the writer) and the values and small rooms at the bottom:
``results``, ``chain``, ``replicated``, ``lock``, ``policy_room``, ``signals``, ``ddp``,
``config``. Runs on the caller's thread (open, restore); each room says where it runs.
"""
