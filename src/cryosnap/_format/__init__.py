"""The on-disk format: limits, keys of a run, the skeleton codec and its text, chunks and hashes,
what its JSON documents share, blob entries, manifests and commit records (docs/FORMAT.md is
the prose version).

Pure: (de)serialization and validation only, no I/O, no global state; imports nothing above
itself.
"""
