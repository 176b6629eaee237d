"""The save/load workloads (dense, many-small, sparse): every peer on the same state, interleaved
round robin, each repetition's save and restores timed. Runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryosnap.bench import _probes
from cryosnap.bench._clock import Clock, CtrlC
from cryosnap.bench._config import SPARSE_FRACTION, BenchConfig, ProgressFn
from cryosnap.bench._peers import DenseReferencePeer, Peer, make_peers
from cryosnap.bench._probes import (
    MemoryMeter,
    file_sizes,
    settle_disk,
    warm_page_cache,
    written_between,
)
from cryosnap.bench._result import BenchResult, PeerFigures, new_result
from cryosnap.bench._workloads import (
    SparseChange,
    build_state,
    dense_shapes,
    first_mismatch,
    many_small_shapes,
    state_nbytes,
)
from cryosnap.progress import human_bytes

if TYPE_CHECKING:
    import torch

    StateDict = dict[str, torch.Tensor]


def _title(workload: str, state: Mapping[str, Any], nbytes: int) -> str:
    what = {
        "dense": "fp32",
        "many-small": "fp32, transformer-like names and mixed sizes",
        "sparse": f"fp32, {SPARSE_FRACTION:.0%} of its 1 MiB chunks changed before each save",
    }[workload]
    return f"{human_bytes(nbytes)} of {what} in {len(state):,} tensors"


def run_save_load(
    config: BenchConfig,
    root: Path,
    command: str,
    progress: ProgressFn | None,
    ctrl_c: CtrlC,
) -> BenchResult:
    import torch

    if config.workload == "many-small":
        shapes = many_small_shapes(config.state_bytes, config.tensors)
    else:
        shapes = dense_shapes(config.state_bytes)
    state = build_state(shapes)
    nbytes = state_nbytes(state)
    result = new_result(config, command, nbytes, len(state), _title(config.workload, state, nbytes))
    # One preallocated, touched destination for every in-place load and the memcpy limit.
    into = {name: torch.empty_like(t).zero_() for name, t in state.items()}
    peers, result.missing = make_peers(config.workload, into)
    figures = {p.key: PeerFigures(p.key, p.label, p.limit, note=p.note) for p in peers}
    result.peers = [figures[p.key] for p in peers]
    meter = MemoryMeter()
    result.memory_method = meter.description
    cold = config.cold
    result.cold = (
        "before each cold read the peer's files are fsynced and dropped from the page cache "
        "(POSIX_FADV_DONTNEED; mincore checks it); restore cold is into= where the peer has "
        "it (fresh otherwise), cold fresh the fresh load of such a peer; ratios: x the raw "
        "O_DIRECT read in the same run"
        if cold
        else "not measured (--no-cold)"
    )
    sparse = SparseChange(state) if config.workload == "sparse" else None
    if sparse is not None:
        result.notes.append(
            f"sparse: {sparse.chunks} random chunks of 1 MiB changed before every timed save; the "
            "cryosnap Checkpointers save incrementally against their untimed first version, the "
            "other peers save the whole state"
        )
    rounds = config.warmup + config.repeat
    cold_skipped: dict[str, str] = {}
    clock = Clock(rounds * len(peers), progress)
    try:
        for peer in peers:
            try:
                peer.setup(root, state)
            except Exception as exc:
                figures[peer.key].error = ctrl_c.failure(exc)
        for r in range(rounds):
            timed = r >= config.warmup
            shift = r % len(peers)
            label = f"round {r + 1}/{rounds}" + ("" if timed else " (warm-up)")
            for peer in peers[shift:] + peers[:shift]:
                fig = figures[peer.key]
                if fig.error is None:
                    work = root / f"{peer.key}-{r}"
                    try:
                        why = _measure_peer(
                            peer, fig if timed else None, state, into, work,
                            verify=r == 0, cold=cold, meter=meter, sparse=sparse,
                        )  # fmt: skip
                        if why is not None:
                            cold_skipped[peer.key] = why
                    except Exception as exc:
                        fig.error = ctrl_c.failure(exc)
                clock.tick(f"{label}: {peer.label}")
    finally:
        for peer in peers:
            with contextlib.suppress(Exception):
                peer.close()
    if cold and not any("restore_cold_seconds" in f.samples for f in result.peers):
        why = next(iter(cold_skipped.values()), "no peer's files left the page cache")
        result.cold = f"not measured: {why}"
    else:
        result.notes += [f"{key}: cold reads skipped: {why}" for key, why in cold_skipped.items()]
    result.notes += _cold_check(result.peers)
    for fig in result.peers:
        if fig.error is not None:
            result.notes.append(f"{fig.label}: failed: {fig.error}")
    result.notes += _per_byte(figures, peers, nbytes)
    result.notes += [f"{p.key}: {p.note}" for p in peers if p.note]
    result.notes += [f"{key}: not measured ({why})" for key, why in result.missing.items()]
    result.elapsed_seconds = clock.elapsed
    return result


def _cold_check(peers: list[PeerFigures]) -> list[str]:
    """The note of what ``mincore`` found of each peer's pages before its cold reads."""
    cached = sum(sum(p.samples.get("cold_cached_pages", [])) for p in peers)
    pages = sum(sum(p.samples.get("cold_pages", [])) for p in peers)
    readers = [p.key for p in peers if "cold_pages" in p.samples]
    if not pages:
        return []
    return [
        f"cold reads checked with mincore before each: {int(cached):,} of {int(pages):,} pages "
        f"of the peers' files were still in the page cache ({', '.join(readers)})"
    ]


def _per_byte(figures: dict[str, PeerFigures], peers: list[Peer], nbytes: int) -> list[str]:
    """The eager Checkpointer's figures per byte against the dense reference of the same
    rounds (a many-small run: :class:`DenseReferencePeer`), as a note."""
    ref = next((p for p in peers if isinstance(p, DenseReferencePeer)), None)
    if ref is None or not ref.nbytes:
        return []
    small, dense = figures.get("cryosnap_eager"), figures.get(ref.key)
    if small is None or dense is None:
        return []
    scale = ref.nbytes / nbytes
    parts = []
    for metric, what in (
        ("stall_seconds", "stall"),
        ("durable_seconds", "durable"),
        ("restore_into_seconds", "restore into"),
        ("restore_seconds", "fresh restore"),
    ):
        a, b = small.median(metric), dense.median(metric)
        if a == a and b == b and b > 0:  # both measured (not NaN)
            parts.append(f"{what} {a * scale / b:.2f}x")
    if not parts:
        return []
    return [
        "many small tensors per byte against the same bytes dense, in the same rounds (the "
        "eager Checkpointer, medians): " + ", ".join(parts)
    ]


def _measure_peer(
    peer: Peer,
    fig: PeerFigures | None,
    state: StateDict,
    into: StateDict,
    work: Path,
    *,
    verify: bool,
    cold: bool,
    meter: MemoryMeter,
    sparse: SparseChange | None,
) -> str | None:
    """One repetition of one peer: save (timed), then its restores (timed); ``fig`` None: a
    warm-up round (nothing recorded). ``work`` is removed at the end, whatever happens.
    Returns why its cold reads were skipped (None: measured, or not asked for)."""
    work.mkdir()
    state, into = peer.saved_state(state), peer.into_for(into)
    try:
        peer.begin(work, state)
        if sparse is not None:
            sparse.apply(state)
        sample = _time_save(peer, work, state, meter)
        if fig is not None:
            for metric, value in sample.items():
                fig.add(metric, value)
        if peer.restores or peer.restores_into:
            warm_page_cache(peer.folder(work))
        if peer.restores:
            seconds, peak, loaded = _time_restore(lambda: peer.load(work), meter)
            if verify:
                _check_round_trip(state, loaded)
            del loaded
            if fig is not None:
                fig.add("restore_seconds", seconds)
                fig.add("restore_peak_bytes", peak)
        if peer.restores_into:
            if verify:
                for tensor in into.values():
                    tensor.zero_()  # so a load that fills nothing cannot pass the check
            seconds, peak, loaded = _time_restore(lambda: peer.load_into(work, into), meter)
            if verify:
                _check_round_trip(state, loaded)
            del loaded
            if fig is not None:
                fig.add("restore_into_seconds", seconds)
                fig.add("restore_into_peak_bytes", peak)
        if cold:
            return _time_cold(peer, fig, work, into, meter)
        return None
    finally:
        try:
            peer.end()
        finally:
            shutil.rmtree(work, ignore_errors=True)
            settle_disk()


# A cold read starts with at most this share of the peer's pages in the page cache.
_COLD_LEFT = 0.1


def _time_cold(
    peer: Peer, fig: PeerFigures | None, work: Path, into: StateDict, meter: MemoryMeter
) -> str | None:
    """The cold restores of one repetition, each after the peer's files left the page cache:
    into= (``restore_cold_seconds``) where the peer has it, else the fresh load; the fresh
    load of a peer that has both (``restore_cold_fresh_seconds``). Before each, what ``mincore``
    says is left of the peer's pages: ``cold_cached_pages`` of ``cold_pages``. Returns why the
    cold reads were skipped (None: measured)."""
    loads: list[tuple[str, Callable[[], object]]] = []
    if peer.restores_into:
        loads.append(("restore_cold_seconds", lambda: peer.load_into(work, into)))
    if peer.restores:
        metric = "restore_cold_fresh_seconds" if peer.restores_into else "restore_cold_seconds"
        loads.append((metric, lambda: peer.load(work)))
    for metric, load in loads:
        try:
            counts = _probes.drop_file_cache(peer.folder(work))
        except OSError as exc:
            return f"its files could not be evicted ({exc.strerror or exc})"
        if counts is not None and counts[0] > _COLD_LEFT * counts[1]:
            # the file system keeps its pages (tmpfs): nothing cold to measure
            return (
                f"{counts[0]:,} of its {counts[1]:,} pages stayed in the page cache after "
                "POSIX_FADV_DONTNEED (a memory file system?)"
            )
        seconds, _, loaded = _time_restore(load, meter)
        del loaded
        if fig is not None:
            fig.add(metric, seconds)
            if counts is not None:
                fig.add("cold_cached_pages", counts[0])
                fig.add("cold_pages", counts[1])
    return None


def _time_save(peer: Peer, work: Path, state: StateDict, meter: MemoryMeter) -> dict[str, float]:
    gc.collect()
    settle_disk()
    before = file_sizes(peer.folder(work))
    meter.start()
    cpu0, t0 = time.process_time(), time.perf_counter()
    finish = peer.save(work, state)
    t1, cpu1 = time.perf_counter(), time.process_time()
    if finish is not None:
        finish()
    t2, cpu2 = time.perf_counter(), time.process_time()
    peak = meter.stop()
    sample = {"stall_seconds": t1 - t0, "save_peak_bytes": float(peak)}
    if peer.durable:
        sample.update(
            durable_seconds=t2 - t0,
            written_bytes=float(written_between(before, file_sizes(peer.folder(work)))),
            cpu_seconds=cpu2 - cpu0,
            background_cpu_seconds=(cpu2 - cpu0) - (cpu1 - cpu0),
        )
    return sample


def _time_restore(fn: Callable[[], object], meter: MemoryMeter) -> tuple[float, int, object]:
    gc.collect()
    meter.start()
    t0 = time.perf_counter()
    loaded = fn()
    seconds = time.perf_counter() - t0
    return seconds, meter.stop(), loaded


def _check_round_trip(state: StateDict, loaded: object) -> None:
    mismatch = first_mismatch(state, loaded)
    if mismatch is not None:
        raise ValueError(f"round trip differs: {mismatch}")
