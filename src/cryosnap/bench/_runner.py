""":func:`run`: one benchmark from a :class:`BenchConfig` to a :class:`BenchResult`, in a
temporary folder deleted at the end. Runs on the caller's thread.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from cryosnap.bench._clock import CtrlC
from cryosnap.bench._config import BenchConfig, ProgressFn, require_torch
from cryosnap.bench._peers import import_peers, quiet_dcp
from cryosnap.bench._result import BenchResult
from cryosnap.bench._save_load import run_save_load
from cryosnap.bench._training import run_training


def run(
    config: BenchConfig, *, command: str = "", progress: ProgressFn | None = None
) -> BenchResult:
    """Run the benchmark ``config`` describes; ``progress`` is called after each measurement.

    Every file goes into a temporary folder inside ``config.directory`` (default: the system
    temp dir) that is deleted at the end, also on an exception or Ctrl-C.

    Method: every peer runs on the same in-memory state, in one process, interleaved round robin
    (the first peer rotates every round, so the drift of a shared machine spreads over all peers),
    after ``warmup`` untimed rounds; each repetition writes into a fresh folder that is deleted
    right after its timings (a ``Checkpointer`` of full versions lives for the whole run, as a job
    holds one), and the file systems are synced (untimed) before each timed save.
    Figures per peer and repetition:

    - **stall**: the save call until it returns (the program is blocked); for synchronous peers the
      whole save;
    - **durable**: the save call until the bytes are on disk (fsync'd);
    - **written**: bytes of the files the save created or grew;
    - **restore**: a fresh load, and a load into preallocated tensors (``into=``) where the peer has
      one, from a warm page cache (every peer's files read once first); cold after dropping the
      page cache where that is allowed;
    - **peak memory**: peak RSS during the call minus RSS just before it, read from ``VmHWM`` reset
      through ``/proc/self/clear_refs`` (Linux), else from a sampling thread (psutil), else from
      ``ru_maxrss`` (a lower bound); :data:`BenchResult.memory_method` says which;
    - **CPU seconds per GB**: ``time.process_time()`` (every thread of the process) from the save
      call until durable, per GB of state; "background" leaves out the stall's own CPU time.
    """
    require_torch()
    import torch  # noqa: F401  (fails here, once, rather than inside a peer)

    import_peers()
    root = Path(tempfile.mkdtemp(prefix="cryosnap-bench-", dir=config.directory))
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    # Garbage is collected before every timed call, so that no peer pays for another's; the
    # objects that exist now (torch's modules: a full collection of them takes ~0.2 s) are
    # moved out of the collector's way for the run.
    gc.collect()
    gc.freeze()
    try:
        with warnings.catch_warnings(), CtrlC() as ctrl_c:
            quiet_dcp()
            if config.workload == "training":
                result = run_training(config, root, command, progress, ctrl_c)
            else:
                result = run_save_load(config, root, command, progress, ctrl_c)
    finally:
        gc.unfreeze()
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    result.load_average = (load_before, load_after)
    cpus = os.cpu_count() or 1
    result.notes.append(
        f"1-minute load average {load_before:.2f} before, {load_after:.2f} after ({cpus} CPUs)"
    )
    if max(load_before, load_after) > cpus:
        result.notes.append(
            "the machine was busy: these figures carry other programs' load; compare quiet "
            "runs only"
        )
    return result
