"""Levels: the ordered stores a version travels through, fastest first, and the flush that
copies a committed version from one to the next.

``levels`` holds :class:`~cryosnap._run.levels.levels.Levels` (each level's store, write
lock and retention, and the hand-offs between them); ``flush`` copies one version, verified
chunk by chunk, its commit record last. Imports nothing of the capture or the redundancy
rooms (the import contract in pyproject.toml). Runs on the writer thread and the hand-off
threads. docs/design/levels.md.
"""
