"""Capture: a version's state copied out of the program into its job's batches, the only part
of a save the program waits for.

``capturer`` runs a capture (eager or lazy) over a :class:`~cryosnap._run.job.Job`; ``staging``
is the pooled, budgeted slabs it copies into; ``through`` hands live blobs to a direct-I/O
writer instead; ``snapshot`` clones CUDA blobs on their device for a first eager capture;
``devdiff`` and ``fingerprint`` find the chunks that changed where the tensors live;
``priority`` lowers a lazy capture thread's nice value. No storage, no collectives: the capture
imports nothing of the levels or the redundancy rooms (the import contract in pyproject.toml).
Runs on the caller's thread (eager) and the capture threads (lazy). docs/design/capture.md.
"""
