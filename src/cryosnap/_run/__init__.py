"""The managed run: a Checkpointer's options, its opening, and the rooms it wires together.

``options`` validates every argument into a frozen :class:`RunOptions` (no I/O); ``open``
opens the stores, locks, partners and threads from it; ``restore`` reads versions back.
Runs on the caller's thread (open, restore); the rooms say where they run.
"""
