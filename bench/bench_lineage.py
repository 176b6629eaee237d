"""The lineage of a run (issue 56): what ``Run.history`` of one leaf, a delta
(``export(since=)`` + ``cryosnap.apply_delta``) and a fork (``Run.fork``) read and write,
against the state.

1. history: a state of ``--state-mib`` (default 256 MiB; the issue's figure is for 1 GiB:
   ``--state-mib 1024``) holding one ``--leaf-mib`` leaf (4 MiB) and float32 tensors of 16
   MiB for the rest; ``--versions`` versions (100) saved incrementally by one Checkpointer;
   the leaf changes every ``--every``-th version (10), one tensor of the rest in every
   version.
   ``Run.history("leaf")`` is read through a store that counts the bytes read from data files
   (and, apart, from manifests and commit records): against the state x versions (loading
   every version) and against the leaf x its distinct versions; checked: data read <=
   1.05 x the latter. One version loaded whole is timed beside it.
2. delta: an embedding of ``--emb-mib`` (64 MiB, rows of 128 float32) in a state with as
   much again that does not change; version B changes 1% of the embedding's rows. The delta
   file of B since A against the changed leaves' bytes, the chunks that changed (``Run.diff``)
   and the state; checked: the delta <= the changed leaves' bytes + 1 MiB. Then
   ``apply_delta`` on version A, timed, and compared with B.

3. fork: a ``--fork-mib`` version (1 GiB) forked: the bytes its creation writes (the fork's
   manifests and record, the ancestor's hold) against the version (checked < 1%), the time,
   a load of the fork beside one of the ancestor's version, and the fork's first save after
   one 16 MiB leaf changed (checked: incremental, about that leaf).

Checks print PASS / FAIL and never fail the script. Run::

    .venv/bin/python bench/bench_lineage.py                   # ~5 min on a quiet machine
    .venv/bin/python bench/bench_lineage.py --state-mib 1024  # the issue's 1 GiB
    .venv/bin/python bench/bench_lineage.py --quick           # smoke, < 1 min
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import _harness as h
import cryosnap
from cryosnap.export import export
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

MIB = 1 << 20


class CountingStore(FaultyStore):
    """A local store that counts the bytes read, from data files and from the rest."""

    def __init__(self, path: Path) -> None:
        super().__init__(LocalStore(path))
        self.data = 0
        self.meta = 0
        self._count_lock = threading.Lock()

    def _count(self, key: str, nbytes: int) -> None:
        with self._count_lock:
            if key.startswith("data/"):
                self.data += nbytes
            else:
                self.meta += nbytes

    def read(self, key: str) -> bytes:
        out = super().read(key)
        self._count(key, len(out))
        return out

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        super().read_into(key, offset, buffers)
        self._count(key, sum(b.nbytes for b in buffers))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        super().read_ranges(key, ranges)
        self._count(key, sum(v.nbytes for _o, views in ranges for v in views))


def bench_history(base: Path, args: argparse.Namespace) -> list[h.Check]:
    path = base / "history"
    rest_mib = max(1, args.state_mib - args.leaf_mib)
    sizes = [16] * (rest_mib // 16) + ([rest_mib % 16] if rest_mib % 16 else [])
    rest_tensors = len(sizes)
    gen = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        "leaf": torch.randn(args.leaf_mib * MIB // 4, generator=gen),
        "rest": {f"t{i}": torch.randn(m * MIB // 4, generator=gen) for i, m in enumerate(sizes)},
    }
    state_bytes = (args.leaf_mib + rest_mib) * MIB
    t0 = time.perf_counter()
    with cryosnap.Checkpointer(path) as ckpt:
        for v in range(args.versions):
            if v and v % args.every == 0:
                state["leaf"] = state["leaf"] + 1
            if v:
                i = v % rest_tensors
                state["rest"][f"t{i}"] = torch.randn(sizes[i] * MIB // 4, generator=gen)
            ckpt.save(v, state).result()
    saved = time.perf_counter() - t0
    distinct = len(range(0, args.versions, args.every))
    store = CountingStore(path)
    seconds, got = h.timed(
        lambda: [(s, float(v[0])) for s, v in cryosnap.Run(store).history("leaf")]
    )
    assert isinstance(got, list) and len(got) == args.versions
    load_s, _ = h.timed(lambda: cryosnap.load(path, step=args.versions - 1))
    leaf_bytes = args.leaf_mib * MIB
    rows = [
        ["state", h.format_bytes(state_bytes)],
        ["versions (saved in)", f"{args.versions} ({h.format_s(saved)})"],
        ["distinct versions of the leaf", str(distinct)],
        ["history: data read", h.format_bytes(store.data)],
        ["history: manifests and records read", h.format_bytes(store.meta)],
        ["history: time", h.format_s(seconds)],
        ["leaf x distinct versions", h.format_bytes(leaf_bytes * distinct)],
        ["state x versions (a load per version)", h.format_bytes(state_bytes * args.versions)],
        ["one whole load (time)", h.format_s(load_s)],
        ["data read / (state x versions)", f"{store.data / (state_bytes * args.versions):.5f}"],
    ]
    print(h.format_table(["history of one leaf", "figure"], rows))
    ok = store.data <= 1.05 * leaf_bytes * distinct
    detail = f"{h.format_bytes(store.data)} for {distinct} x {h.format_bytes(leaf_bytes)}"
    return [h.Check("history reads the leaf's distinct versions only", ok, detail)]


def bench_delta(base: Path, args: argparse.Namespace) -> list[h.Check]:
    path = base / "delta"
    rows_n = args.emb_mib * MIB // (128 * 4)
    gen = torch.Generator().manual_seed(1)
    emb = torch.randn(rows_n, 128, generator=gen)
    frozen = {f"w{i}": torch.randn(4 * MIB, generator=gen) for i in range(args.emb_mib // 16)}
    cryosnap.save(path, {"emb": emb, "frozen": frozen, "step": 0}, step=0)
    changed_rows = np.random.default_rng(2).choice(rows_n, rows_n // 100, replace=False)
    emb_b = emb.clone()
    emb_b[torch.from_numpy(changed_rows)] += 1.0
    cryosnap.save(path, {"emb": emb_b, "frozen": frozen, "step": 1}, step=1)
    out = base / "delta.safetensors"
    store = CountingStore(path)
    export_s, _ = h.timed(lambda: export(store, out, step=1, since=0))
    diff = cryosnap.Run(path).diff(0, 1)
    state_a = cryosnap.load(path, step=0)
    apply_s, state = h.timed(lambda: cryosnap.apply_delta(state_a, out))
    assert isinstance(state, dict) and torch.equal(state["emb"], emb_b)
    delta_bytes = out.stat().st_size
    leaf_bytes = emb.nbytes + 8  # the embedding and the step (an int)
    state_bytes = emb.nbytes + sum(t.nbytes for t in frozen.values())
    rows = [
        ["state", h.format_bytes(state_bytes)],
        ["rows changed", f"{len(changed_rows)} of {rows_n} (1%)"],
        ["changed rows' bytes", h.format_bytes(len(changed_rows) * 128 * 4)],
        ["changed chunks' bytes (Run.diff)", h.format_bytes(diff.changed_bytes)],
        ["changed leaves' bytes", h.format_bytes(leaf_bytes)],
        ["delta file", h.format_bytes(delta_bytes)],
        ["export: data read", h.format_bytes(store.data)],
        ["export: time", h.format_s(export_s)],
        ["apply_delta (checks A and B included): time", h.format_s(apply_s)],
    ]
    print(h.format_table(["delta: 1% of an embedding", "figure"], rows))
    ok = delta_bytes <= leaf_bytes + MIB
    detail = f"{h.format_bytes(delta_bytes)} against {h.format_bytes(leaf_bytes)} changed"
    return [h.Check("a delta holds about the changed leaves' bytes", ok, detail)]


def bench_fork(base: Path, args: argparse.Namespace) -> list[h.Check]:
    """Fork a ``--fork-mib`` version (two versions saved, the second incremental): bytes the
    fork's creation writes (in the fork and the ancestor's hold) against the version's, its
    time, a cold-ish restore of the fork against one of the ancestor, and the first save of
    the fork after a change of one leaf."""
    anc, dest = base / "fork-ancestor", base / "fork"
    gen = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(4 * MIB, generator=gen) for i in range(args.fork_mib // 16)}
    with cryosnap.Checkpointer(anc) as ckpt:
        ckpt.save(0, {**state, "step": 0}).result()
        state["w0"] += 1.0
        ckpt.save(1, {**state, "step": 1}).result()
    before = h.tree_bytes(anc)
    fork_s, fork = h.timed(lambda: cryosnap.Run(anc).fork(1, dest))
    written = h.tree_bytes(dest) + h.tree_bytes(anc) - before
    logical = fork.summary(1).logical_bytes
    load_fork_s, _ = h.timed(lambda: cryosnap.load(dest))
    load_anc_s, _ = h.timed(lambda: cryosnap.load(anc, step=1))
    with cryosnap.Checkpointer(dest) as ckpt:
        resumed = ckpt.restore()
        assert isinstance(resumed, dict)
        resumed["w1"] = resumed["w1"] * 2
        save_s, info = h.timed(lambda: ckpt.save(2, resumed).result())
    rows = [
        ["version", h.format_bytes(logical)],
        ["fork: bytes written (fork + hold)", h.format_bytes(written)],
        ["fork: share of the version", f"{100 * written / logical:.3f}%"],
        ["fork: time", h.format_s(fork_s)],
        [
            "load the fork / the ancestor's version",
            f"{h.format_s(load_fork_s)} / {h.format_s(load_anc_s)}",
        ],
        ["fork's first save, one 16 MiB leaf changed", h.format_bytes(info.written_bytes)],
        ["fork's first save: time", h.format_s(save_s)],
    ]
    print(h.format_table([f"fork of a {h.format_bytes(logical)} version", "figure"], rows))
    return [
        h.Check(
            "a fork writes < 1% of its version", written < logical / 100, h.format_bytes(written)
        ),
        h.Check(
            "the fork's first save writes what changed",
            info.incremental and info.written_bytes <= 16 * MIB + MIB,
            h.format_bytes(info.written_bytes),
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--leaf-mib", type=int, default=4)
    parser.add_argument("--versions", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--emb-mib", type=int, default=64)
    parser.add_argument("--fork-mib", type=int, default=1024, help="the forked version's size")
    parser.add_argument("--quick", action="store_true", help="a smoke run (small, 20 versions)")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    args = parser.parse_args(argv)
    if args.quick:
        args.state_mib, args.versions, args.emb_mib, args.fork_mib = 36, 20, 16, 64
    before = h.load_average()
    print(h.environment())
    with h.scratch_dir("cryosnap-lineage-", args.dir) as base:
        checks = bench_history(base, args) + bench_delta(base, args) + bench_fork(base, args)
    for check in checks:
        print(check.line())
    h.print_load(before)


if __name__ == "__main__":
    main()
