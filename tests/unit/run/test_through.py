"""Write-through capture (_run/capture/through.py): which blobs go to the writer from the live
memory, in what order, how the capture waits for them, and a writer failure midway (the version
fails with the storage's error, the capture returns, no thread and no slab is left behind)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap import engine
from cryosnap._run.capture.staging import StagingPool, capture_to_slabs
from cryosnap._run.capture.through import Chooser, Rates, WriteThrough, candidates
from cryosnap._run.job import END, Job
from cryosnap._run.results import CaptureTracker, PendingSave
from cryosnap._state import flatten
from cryosnap.engine.items import Batch, Piece
from cryosnap.errors import StorageError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from .rooms import CHUNK, level, version_writer

BLOB = 4 * CHUNK
FAST = Rates(copy_bps=1.0, write_bps=4.0)  # the writer 4x faster than the copy: hand over


def tree(n: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.integers(0, 255, BLOB, np.uint8) for i in range(n)}


def through_of(flat: Any, emitted: list[Batch], rates: Rates, **kw: Any) -> WriteThrough:
    return WriteThrough(flat, candidates(flat, min_bytes=1), emit=emitted.append, rates=rates, **kw)


def handed(batches: list[Batch]) -> list[int]:
    return [b.pieces[0].blob for b in batches]  # type: ignore[union-attr]


def test_blobs_go_from_the_back_at_most_two_until_one_is_written() -> None:
    flat = flatten(tree(4))
    emitted: list[Batch] = []
    through = through_of(flat, emitted, FAST, abort=lambda: None)
    through.begin()
    assert handed(emitted) == [3, 2]  # two out, none more until one is written
    piece = emitted[0].pieces[0]
    assert isinstance(piece, Piece) and piece.offset == 0 and piece.view.nbytes == BLOB
    assert through.enter(0) and through.enter(1)  # the capture copies blob 1 now
    emitted[0].release()
    assert handed(emitted) == [3, 2]  # blob 1 is the capture's: nothing more to hand over
    assert not through.enter(2) and not through.enter(3)


def test_the_capture_returns_only_once_every_handed_blob_is_written() -> None:
    flat = flatten(tree(4))
    emitted: list[Batch] = []
    through = through_of(flat, emitted, FAST, abort=lambda: None)
    through.begin()
    order: list[str] = []
    finisher = threading.Thread(target=lambda: (through.finish(), order.append("finished")))
    finisher.start()
    for batch in emitted:
        order.append(f"written {handed([batch])[0]}")
        batch.release()
    finisher.join()
    assert order == ["written 3", "written 2", "finished"]


def test_a_slow_writer_gets_nothing_and_a_stopped_or_aborted_one_nothing_more() -> None:
    flat = flatten(tree(8))
    emitted: list[Batch] = []
    # Copies 4x faster than writes: only the last blob is written before the copy gets there.
    through_of(flat, emitted, Rates(copy_bps=4.0, write_bps=1.0), abort=lambda: None).begin()
    assert handed(emitted) == [7]
    slow: list[Batch] = []
    through_of(flatten(tree(3)), slow, Rates(copy_bps=8.0, write_bps=1.0), abort=lambda: None)
    assert slow == []
    aborted: list[Batch] = []
    error = StorageError("gone")
    through_of(flat, aborted, FAST, abort=lambda: error).begin()
    assert aborted == []
    stopped: list[Batch] = []
    late = through_of(flat, stopped, FAST, abort=lambda: None)
    late.finish()
    late.begin()
    assert stopped == []


def test_only_large_host_blobs_of_the_program_are_candidates() -> None:
    flat = flatten({"big": np.zeros(BLOB, np.uint8), "small": np.zeros(8, np.uint8), "n": 3})
    assert [flat.blobs[i].key for i in candidates(flat, min_bytes=BLOB)] == [("big",)]
    assert candidates(flat, min_bytes=BLOB, skip=[0]) == []


def test_capture_skips_the_handed_blobs_and_every_byte_arrives_once() -> None:
    state = tree(6, seed=1)
    flat = flatten(state)
    live: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
    written: list[Batch] = []

    def writer() -> None:  # writes (here: keeps) each handed blob, then releases it
        while (batch := live.get()) is not None:
            written.append(batch)
            batch.release()

    thread = threading.Thread(target=writer)
    thread.start()
    tracker = CaptureTracker(len(flat.blobs))
    through = WriteThrough(
        flat,
        candidates(flat, min_bytes=1),
        emit=live.put,
        abort=lambda: None,
        rates=FAST,
        mark=tracker.mark,
    )
    through.begin()  # before the capture starts: the last two go at once
    out: list[Batch] = []
    pool = StagingPool(slab_bytes=2 * BLOB, budget_bytes=None)
    copied = capture_to_slabs(
        flat, pool, chunk_bytes=CHUNK, emit=out.append, tracker=tracker, through=through
    )
    live.put(None)
    thread.join()
    order = handed(written)
    assert order[:2] == [5, 4] and order == sorted(order, reverse=True)
    assert copied == sum(b.nbytes for b in flat.blobs) - through.handed_bytes
    got: dict[int, bytearray] = {}
    for batch in [*written, *out]:
        for p in batch.pieces:
            assert isinstance(p, Piece)
            data = got.setdefault(p.blob, bytearray())
            assert p.offset == len(data)  # a blob's pieces arrive in order, each once
            data += p.view
    for i, blob in enumerate(flat.blobs):
        assert bytes(got[i]) == state[str(blob.key[0])].tobytes()


def _job(step: int, flat: Any) -> Job:
    tracker = CaptureTracker(len(flat.blobs))
    pending = PendingSave(step, tracker, time.perf_counter(), ("persistent",), ("persistent",))
    return Job(step, flat, pending, queue.SimpleQueue())


def _write_through(tmp_path: Path, state: Any, fault: Any = None) -> tuple[Any, StagingPool]:
    """Write ``state`` as step 1 as an eager capture with write-through does: the writer
    starts first (hands over the last blobs), the capture copies the others meanwhile."""
    store = FaultyStore(LocalStore(tmp_path), **({"fault": fault} if fault else {}))
    writer = version_writer(level(store))
    flat = flatten(state)
    job = _job(1, flat)
    through = WriteThrough(
        flat,
        candidates(flat, min_bytes=1),
        emit=job.batches.put,
        abort=job.pending.abort_requested,
        rates=Rates(copy_bps=1.0, write_bps=4.0),
        mark=job.pending._tracker.mark,
    )
    job.attach(through)
    job.begin()
    result: list[Any] = []

    def write() -> None:
        try:
            result.append(writer.write(job))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    pool = StagingPool(slab_bytes=BLOB, budget_bytes=2 * BLOB)
    try:
        capture_to_slabs(
            flat,
            pool,
            chunk_bytes=CHUNK,
            emit=job.batches.put,
            tracker=job.pending._tracker,
            abort=job.pending.abort_requested,
            hold=True,
            through=through,
        )
    finally:
        job.batches.put(END)
    thread.join()
    return result[0], pool


def test_a_version_written_through_restores_and_lays_the_handed_blobs_first(
    tmp_path: Path,
) -> None:
    state = tree(5, seed=2)
    (info, part), pool = _write_through(tmp_path, state)
    got = cryosnap.load(tmp_path, step=1)
    assert all(np.array_equal(got[k], v) for k, v in state.items())
    first = {e.segments[0].offset: i for i, e in enumerate(part.manifest.blobs)}
    assert [first[o] for o in sorted(first)][:2] == [4, 3]  # written first, from the back
    assert info.written_bytes == 5 * BLOB
    assert pool.allocated_bytes <= 2 * BLOB  # bounded: the budget held


def test_a_write_failing_midway_fails_the_version_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    writes = [0]

    def fault(op: str, key: str) -> None:
        if op == "writer.write":
            writes[0] += 1
            if writes[0] == 2:
                raise StorageError(f"writing {key}: disk full")

    before = {t.ident for t in threading.enumerate()}
    error, pool = _write_through(tmp_path, tree(6, seed=3), fault)
    assert isinstance(error, StorageError) and "disk full" in str(error)
    assert {t.ident for t in threading.enumerate()} <= before  # the I/O thread joined
    assert len(pool._free) * pool.slab_bytes == pool.allocated_bytes  # every slab given back
    assert engine.list_steps(LocalStore(tmp_path)) == []  # no version visible


def _recorded(monkeypatch: Any, capturer: Any) -> list[WriteThrough]:
    """The hand-overs the captures make from now on, each starting to copy only once the
    writer began its version (which hands the first blobs over): on a loaded machine a
    capture may otherwise be done before the writer's thread wakes, and hand nothing over."""
    made: list[WriteThrough] = []

    class Recorded(WriteThrough):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.started = threading.Event()
            made.append(self)

        def begin(self) -> None:
            super().begin()
            self.started.set()

        def enter(self, blob: int) -> bool:
            assert self.started.wait(60)
            return super().enter(blob)

    monkeypatch.setattr(capturer, "WriteThrough", Recorded)
    return made


def test_a_checkpointer_on_a_direct_level_restores_what_it_saved(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from cryosnap._run.capture import capturer

    made = _recorded(monkeypatch, capturer)
    rng = np.random.default_rng(1)
    with cryosnap.Checkpointer(tmp_path, keep=2, chunk_bytes=CHUNK) as ckpt:
        ckpt._capturer.through = True  # as on a direct-I/O level (tmp may be a tmpfs)
        ckpt._capturer._rates = _Fixed()  # the writer taken for faster than the copy
        for step in range(3):  # blobs of 1 MiB: large enough to be handed over
            state = {f"w{i}": rng.integers(0, 255, 1 << 20, np.uint8) for i in range(4)}
            info = ckpt.save(step, state).result()
            assert info.written_bytes == 4 << 20
            got = ckpt.restore(step)
            assert all(np.array_equal(got[k], v) for k, v in state.items())
    # The versions the chooser had hand blobs over did (the first always tries it).
    assert made and all(t.handed_bytes >= 1 << 20 for t in made)


def _trained(layers: int) -> tuple[Any, Any, Callable[[], None]]:
    """A model of ``layers`` Linear(512, 512) (1 MiB weights: large enough to be handed
    over), its Adam optimizer after one step (its moments exist), and the training step."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters())

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()

    train()
    return model, opt, train


class _Fixed(Rates):  # the writer taken for 4x faster than the copy, whatever is measured
    ratio = 0.25

    def observe(self, attr: str, nbytes: int, seconds: float) -> None:
        pass


def test_a_lazy_save_hands_blobs_over_and_the_optimizer_step_waits_until_they_are_written(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import torch

    from cryosnap._run.capture import capturer

    made = _recorded(monkeypatch, capturer)
    model, opt, train = _trained(layers=2)
    # A slow writer: each step() below comes while the handed-over blobs are being written.
    store = FaultyStore(LocalStore(tmp_path), bytes_per_second=20e6)
    snaps = {}
    with cryosnap.Checkpointer(store, keep=3, chunk_bytes=CHUNK) as ckpt:
        ckpt._capturer.through = True  # as on a direct-I/O level (tmp may be a tmpfs)
        ckpt._capturer._lazy_rates = _Fixed()
        pendings = []
        for step in range(3):
            snaps[step] = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "exp_avg_sq": [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()],
            }
            pendings.append(ckpt.save(step, {"model": model, "opt": opt}, lazy=True))
            train()  # waits until what it mutates is captured: copied, or handed over and written
        for p in pendings:
            p.result(timeout=120)
        for step, snap in snaps.items():
            got = ckpt.restore(step)
            for k, v in snap["model"].items():
                assert torch.equal(got["model"][k], v), (step, k)
            saved = got["opt"]["state"]
            for i, v in enumerate(snap["exp_avg_sq"]):
                assert torch.equal(saved[i]["exp_avg_sq"], v), (step, i)
    # Every lazy version handed blobs over (never copied), not only its last one.
    assert len(made) == 3 and all(t.handed_bytes >= 1 << 20 for t in made)


def test_the_capture_s_wait_for_the_writer_is_not_counted_as_copying() -> None:
    now = [0.0]
    flat = flatten(tree(4))
    emitted: list[Batch] = []
    through = through_of(flat, emitted, FAST, abort=lambda: None, clock=lambda: now[0])
    through.begin()
    assert handed(emitted) == [3, 2]
    assert through.enter(0) and through.enter(1)

    def writer() -> None:  # writes the two handed blobs 5 s into the capture's wait
        while not through._stopped:
            time.sleep(0.001)
        now[0] += 5.0
        for batch in emitted:
            batch.release()

    thread = threading.Thread(target=writer)
    thread.start()
    through.finish()
    thread.join()
    assert through.waited_seconds == 5.0
    assert through.written_seconds == 5.0


def test_the_chooser_tries_both_ways_then_takes_the_one_that_stalled_less() -> None:
    chooser = Chooser()
    assert chooser.use()  # nothing measured: the hand-over first
    chooser.observe(True, 1000, 2.0)
    assert not chooser.use()  # then copying every blob
    chooser.observe(False, 1000, 1.0)
    taken = [chooser.use() for _ in range(2 * Chooser.RETRY)]
    # Copying stalled less: taken, the hand-over retried once every RETRY versions.
    assert taken.count(True) == 2
    assert taken[Chooser.RETRY - 3] and taken[2 * Chooser.RETRY - 3]  # the 8th and 16th use
    for _ in range(3):  # the machine changed: the hand-over now stalls less
        chooser.observe(True, 1000, 0.25)
    assert chooser.use()
    chooser.observe(True, 0, 1.0)  # nothing captured (or no time): no measurement
    chooser.observe(False, 1000, 0.0)
    assert chooser.use()


def test_an_eager_checkpointer_measures_both_ways_and_keeps_choosing(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from cryosnap._run.capture import capturer

    seen: list[tuple[bool, int]] = []

    class Recorded(Chooser):
        def observe(self, through: bool, nbytes: int, seconds: float) -> None:
            seen.append((through, nbytes))
            super().observe(through, nbytes, seconds)

    monkeypatch.setattr(capturer, "Chooser", Recorded)
    with cryosnap.Checkpointer(tmp_path, keep=2, chunk_bytes=CHUNK) as ckpt:
        ckpt._capturer.through = True  # as on a direct-I/O level (tmp may be a tmpfs)
        rng = np.random.default_rng(0)
        for step in range(6):  # blobs of 1 MiB: large enough to be handed over
            state = {f"w{i}": rng.integers(0, 255, 1 << 20, np.uint8) for i in range(4)}
            ckpt.save(step, state).result()
            got = ckpt.restore(step)
            assert all(np.array_equal(got[k], v) for k, v in state.items())
    # The first version allocated the staging pool: not measured. Both ways were then
    # measured, each for the whole version's bytes.
    assert {way for way, _ in seen} == {True, False}
    assert all(nbytes == 4 << 20 for _, nbytes in seen)
    assert len(seen) >= 4


def test_a_lazy_written_through_save_whose_write_fails_frees_the_optimizer_and_the_run(
    tmp_path: Path,
) -> None:
    import torch

    model, opt, train = _trained(layers=1)
    fail = threading.Event()

    def fault(op: str, key: str) -> None:
        if fail.is_set() and op == "writer.write":
            raise StorageError(f"writing {key}: disk full")

    store = FaultyStore(LocalStore(tmp_path), fault=fault, bytes_per_second=20e6)
    with cryosnap.Checkpointer(store, keep=2, chunk_bytes=CHUNK) as ckpt:
        ckpt._capturer.through = True  # as on a direct-I/O level (tmp may be a tmpfs)
        ckpt._capturer._lazy_rates = _Fixed()
        ckpt.save(0, {"model": model, "opt": opt}, lazy=True).result(timeout=60)
        train()  # every byte changes: step 1 has data to write
        fail.set()
        bad = ckpt.save(1, {"model": model, "opt": opt}, lazy=True)
        train()  # returns: a handed-over blob whose write failed is released, not awaited
        with pytest.raises(StorageError, match="disk full"):
            bad.result(timeout=60)
        fail.clear()
        snap = {k: v.clone() for k, v in model.state_dict().items()}
        info = None
        for _ in range(2):  # the failure may surface once more, in the next save's call
            try:
                info = ckpt.save(2, {"model": model, "opt": opt}, lazy=True).result(timeout=60)
                break
            except StorageError:
                continue
        assert info is not None and ckpt.steps() == [0, 2]
        got = ckpt.restore(2)
        assert all(torch.equal(got["model"][k], v) for k, v in snap.items())
