"""The on-disk format: limits, keys of a run, the skeleton codec, chunks and hashes, manifests
and commit records (docs/FORMAT.md is the prose version).

Pure: (de)serialization and validation only, no I/O; imports nothing above itself.
"""
