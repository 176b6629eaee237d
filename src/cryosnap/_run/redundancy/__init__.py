"""Redundancy: each rank's node-local scratch versions protected against the loss of a node.

``partner`` keeps a copy of each part on a rank of another node (``partner=True``) and owns the
partner map; ``xor`` encodes parity over sets of ranks on distinct nodes (``partner="xor"``);
``xor_rebuild`` gets a lost rank's files back from its set at open; ``rs`` and
``rs_rebuild`` do the same with Reed-Solomon sets of K + M ranks (``partner="rs:K+M"``), any
M lost. Imports nothing of the capture or the levels rooms (the import contract in
pyproject.toml). Runs on the writer
thread (copies, parity) and the caller's thread at open (rebuilds). docs/design/distributed.md.
"""
