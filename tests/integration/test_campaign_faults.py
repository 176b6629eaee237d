"""Storage-fault campaign (issue #10): every storage operation fails, fails after taking effect,
or stalls, at several occurrences, while a Checkpointer saves; nothing committed may be lost.

Each case: a run with two versions is reopened on stores that inject one fault (into the
persistent tier without scratch, or into the persistent or the scratch tier of a tiered run) at
the n-th occurrence of one operation; six more versions are saved. Then:

- every failure surfaced as a ``CheckpointError`` subclass (from ``save``, ``result``, ``close``);
- every version whose ``result()`` returned loads bit-exact with ``cryosnap.load(path, step=s)``,
  unless ``keep`` newer versions are visible (retention dropped it legitimately), and every
  visible version loads bit-exact;
- a fresh Checkpointer saves one more version (retention resumes) and all of that still holds.

Counts (faults injected per operation and mode, failures) are appended to a JSON-lines file and
printed (``-s``) after the module's campaign tests. ``make test`` runs a slice of the campaign
over layouts and operations (:data:`SLICE`), ``make test-deep`` all of it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap.storage import LocalStore, TimeoutStore
from cryosnap.storage.striped import Tier

from .campaign_support import (
    CHUNK,
    CampaignStore,
    OneFault,
    RandomFaults,
    check_versions,
    garbage,
    state_at,
    unwrapped_ops,
)

OPS = [
    "read",
    "read_into",
    "read_ranges",
    "write",
    "open_writer",
    "writer.write",
    "writer.commit",
    "exists",
    "list",
    "size",
    "delete",
    "remove_incomplete",
]
# Operations every layout uses while saving: a fault campaign that never injects into one of
# them does not test what it claims.
CORE_OPS = {"write", "open_writer", "writer.write", "writer.commit", "exists", "list", "delete"}
# Stalls are bounded by the library's TimeoutStore (a Store passed to the Checkpointer is used
# as it is: the campaign wraps its stores itself, as the documentation says to).
STALL_TIMEOUT = 1.0
LAYOUTS = {
    # name: (scratch tier?, tier the fault goes to, keep)
    "plain": (False, "persistent", 2),
    "plain-keep1": (False, "persistent", 1),
    "tiered-persistent": (True, "persistent", 2),
    "tiered-scratch": (True, "scratch", 2),
}
SAVES = 6
# Occurrences of each operation the slow campaign injects into (1st to N-th).
NTHS = int(os.environ.get("CRYOSNAP_CAMPAIGN_FAULTS", "3"))


@dataclass
class Case:
    layout: str
    op: str
    mode: str
    nth: int
    fired: str | None = None
    ok: list[int] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    garbage_bytes: int = 0

    def label(self) -> str:
        return f"layout={self.layout} op={self.op} mode={self.mode} nth={self.nth}"


def _store(path: Path, fault: Any, stall: bool) -> tuple[CampaignStore, Any]:
    campaign = CampaignStore(LocalStore(path), fault)
    if stall:
        return campaign, TimeoutStore(campaign, STALL_TIMEOUT)
    return campaign, campaign


def _open(root: Path, case: Case, fault: Any) -> tuple[cryosnap.Checkpointer, list[CampaignStore]]:
    """A Checkpointer on CampaignStores (the same kind of store in every session of the run)."""
    scratch, role, keep = LAYOUTS[case.layout]
    stall = fault is not None and case.mode == "stall"
    cp, p = _store(root / "p", fault if role == "persistent" else None, stall)
    stores, tier = [cp], None
    if scratch:
        cs, s = _store(root / "s", fault if role == "scratch" else None, stall)
        stores.append(cs)
        tier = Tier(s)
    opts: dict[str, Any] = {"keep": keep, "chunk_bytes": CHUNK, "full_every": 4}
    if scratch:
        opts["keep_scratch"] = 1
    ckpt = cryosnap.Checkpointer(p, scratch=tier, flush_retry_seconds=2.0, **opts)
    return ckpt, stores


def _guard(case: Case, what: str, fn: Any) -> Any:
    """Run ``fn``; a CheckpointError is a surfaced failure, anything else a problem."""
    try:
        return fn()
    except cryosnap.CheckpointError as exc:
        case.failed.append(f"{what}: {type(exc).__name__}: {exc}")
    except Exception as exc:
        case.problems.append(f"{what} raised {type(exc).__name__} (not a CheckpointError): {exc}")
    return None


def _save(case: Case, ckpt: cryosnap.Checkpointer, step: int) -> None:
    def go() -> int:
        ckpt.save(step, state_at(step)).result()
        return step

    if _guard(case, f"step {step}", go) is not None:
        case.ok.append(step)


def _settle(stores: list[CampaignStore]) -> None:
    # Let stalled calls go on (and finish) before the run is checked.
    for s in stores:
        s.release.set()
    for s in stores:
        s.wait_idle(30.0)


def _check(case: Case, root: Path, known: set[int], when: str) -> None:
    keep = LAYOUTS[case.layout][2]
    try:
        check_versions(root / "p", known, keep, f"{case.label()} {when}")
        if (root / "s").exists():
            check_versions(root / "s", set(), None, f"{case.label()} {when} (scratch)")
    except AssertionError as exc:
        case.problems.append(str(exc))


def _prepare(root: Path, layout: str) -> None:
    """Versions 0 and 1 of a run of ``layout``, saved without faults (in place: a scratch tier
    remembers its device paths, a copied run would not open)."""
    ckpt, _ = _open(root, Case(layout, "", "", 0), None)
    with ckpt:
        for step in (0, 1):
            ckpt.save(step, state_at(step)).result()


def _resume(case: Case, root: Path) -> None:
    # Without faults: one more version, and retention runs again.
    ckpt, _ = _open(root, case, None)
    with ckpt:
        step = (ckpt.latest_step() or 0) + 1
        _save(case, ckpt, step)


def run_case(root: Path, case: Case) -> Case:
    _prepare(root, case.layout)
    fault = OneFault(case.op, "any", case.nth, case.mode)
    opened = _guard(case, "open", lambda: _open(root, case, fault))
    if opened is not None:
        ckpt, stores = opened
        fault.armed = True
        for step in range(2, 2 + SAVES):
            _save(case, ckpt, step)
        _guard(case, "close", ckpt.close)
        fault.armed = False
        _settle(stores)
    case.fired = fault.fired
    _check(case, root, set(case.ok), "after the faults")
    _guard(case, "resume", lambda: _resume(case, root))
    _check(case, root, set(case.ok), "after one more version")
    case.garbage_bytes = sum(garbage(root / "p").values()) + sum(garbage(root / "s").values())
    return case


# The cases of the campaign tests of this module, since the summary last printed them.
_CASES: list[Case] = []


@pytest.fixture(scope="module", autouse=True)
def _campaign_summary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the module's tests (those of them this process ran, in whatever order): the
    counts of the cases they ran, printed (``-s``), appended to ``campaign_faults.jsonl`` in
    the session's base temp directory, and checked (every core operation tried was injected).
    """
    _CASES.clear()
    yield
    cases = [asdict(c) for c in _CASES]
    _CASES.clear()
    if not cases:
        return
    with (tmp_path_factory.getbasetemp() / "campaign_faults.jsonl").open("a") as f:
        f.writelines(json.dumps(c) + "\n" for c in cases)
    doc = summary(cases)
    print("\nfault campaign: " + json.dumps(doc, indent=1))
    assert not doc["never_injected"], f"never injected: {doc['never_injected']}"


def summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts of a list of cases (``asdict(Case)``)."""
    injected = Counter(f"{c['op']}/{c['mode']}" for c in cases if c["fired"])
    missed = Counter(f"{c['layout']}:{c['op']}" for c in cases if not c["fired"])
    fired_ops = {c["op"] for c in cases if c["fired"]}
    tried = CORE_OPS & {c["op"] for c in cases}
    return {
        "cases": len(cases),
        "faults_injected": sum(injected.values()),
        "per_op_and_mode": dict(sorted(injected.items())),
        "failures_surfaced": sum(len(c["failed"]) for c in cases),
        "problems": sum(len(c["problems"]) for c in cases),
        "problem_cases": [
            f"{c['layout']}:{c['op']}:{c['mode']}#{c['nth']}" for c in cases if c["problems"]
        ],
        "not_reached": dict(sorted(missed.items())),
        "never_injected": sorted(tried - fired_ops),
        "garbage_bytes_after_resume": sum(c["garbage_bytes"] for c in cases),
        "ops_not_wrapped": unwrapped_ops(),
    }


def _campaign(tmp_path: Path, layout: str, op: str, modes: list[str], nths: list[int]) -> None:
    cases: list[Case] = []
    for mode in modes:
        for nth in nths:
            root = tmp_path / f"{mode}-{nth}"
            cases.append(run_case(root, Case(layout, op, mode, nth)))
            if cases[-1].fired is None:
                break  # the operation does not come that often here
    _CASES.extend(cases)
    problems = [f"{c.label()} (fired at {c.fired}): {p}" for c in cases for p in c.problems]
    assert not problems, "\n".join(problems)
    if op in CORE_OPS:
        # Every save does this operation: a campaign that never injected it tested nothing.
        assert any(c.fired for c in cases), f"{layout}: no {op} fault fired: {cases[0].failed}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", OPS)
def test_fault_campaign_fast(tmp_path: Path, op: str) -> None:
    """Without scratch: the first occurrence of each operation fails (before, after)."""
    _campaign(tmp_path, "plain", op, ["before", "after"], [1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["write", "writer.commit", "delete"])
def test_stall_campaign_fast(tmp_path: Path, op: str) -> None:
    """Without scratch: the 1st and 2nd manifest/commit write, data commit, retention delete
    stall past the storage timeout, then complete late (after close)."""
    _campaign(tmp_path, "plain", op, ["stall"], [1, 2])


# The slice of the layouts x operations below that make test runs: every layout three times,
# every operation once; make test-deep runs the other 36 as well.
SLICE = {
    ("plain", "list"),
    ("plain", "exists"),
    ("plain", "size"),
    ("plain-keep1", "delete"),
    ("plain-keep1", "remove_incomplete"),
    ("plain-keep1", "read"),
    ("tiered-persistent", "writer.commit"),
    ("tiered-persistent", "write"),
    ("tiered-persistent", "open_writer"),
    ("tiered-scratch", "read_into"),
    ("tiered-scratch", "writer.write"),
    ("tiered-scratch", "read_ranges"),
}
_LAYOUT_OPS = [
    pytest.param(layout, op, marks=() if (layout, op) in SLICE else pytest.mark.deep)
    for layout in LAYOUTS
    for op in OPS
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("layout", "op"), _LAYOUT_OPS)
def test_fault_campaign(tmp_path: Path, layout: str, op: str) -> None:
    """Every layout, operation and mode, at the 1st to ``CRYOSNAP_CAMPAIGN_FAULTS``-th (3)
    occurrence (stalls at the first only)."""
    nths = list(range(1, NTHS + 1))
    if layout == "plain":
        nths = nths[1:] or [1]  # the fast campaign did the first
    _campaign(tmp_path / "fail", layout, op, ["before", "after"], nths)
    # A stall costs its timeout: once per operation and layout.
    _campaign(tmp_path / "stall", layout, op, ["stall"], nths[:1])


# ---------------------------------------------------------------------------------------------
# the reported bug: a retention pass that fails part-way, then old content saved again


def _chunks(seeds: tuple[int, ...]) -> dict[str, Any]:
    raw = b"".join(np.random.default_rng(s).bytes(CHUNK) for s in seeds)
    return {"x": np.frombuffer(raw, dtype="<u8").copy()}


# Chunk contents of steps 0-4 (found by a seeded search on the main of issue #10): after step 3
# retention deletes step 0's data file, then fails on step 1's; step 4 brings back content that
# lay in step 0's file.
_REGRESSION = [(2, 2, 2), (2, 0, 2), (1, 4, 5), (3, 1, 4), (4, 0, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["before", "after"])
def test_failed_retention_delete_then_old_content_again(tmp_path: Path, mode: str) -> None:
    """keep=1; the second data-file delete of retention fails; content of a deleted file is
    saved again: the new version must load ("the next version de-duplicates against a file
    that is already gone")."""
    fault = OneFault("delete", "data", 2, mode)
    store = CampaignStore(LocalStore(tmp_path / "run"), fault)
    with cryosnap.Checkpointer(store, keep=1, chunk_bytes=CHUNK) as ckpt:
        fault.armed = True
        for step, seeds in enumerate(_REGRESSION):
            ckpt.save(step, _chunks(seeds)).result()
    assert fault.fired is not None, "retention never deleted two data files"
    last = len(_REGRESSION) - 1
    out = cryosnap.load(tmp_path / "run", step=last)
    assert out["x"].tobytes() == _chunks(_REGRESSION[last])["x"].tobytes(), fault.fired


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("ops", "rate", "mode"),
    [
        (("delete",), 0.2, "before"),
        (("delete", "list"), 0.1, "after"),
        (tuple(OPS), 0.03, "before"),
        (tuple(OPS), 0.03, "after"),
    ],
)
def test_random_faults(tmp_path: Path, ops: tuple[str, ...], rate: float, mode: str) -> None:
    """keep=1, 80 versions of 4 chunks drawn from 6 contents (content comes back often), a
    share of the operations failing (seeded); each version whose ``result()`` returned must
    load right then."""
    seed = 1000 + int(rate * 100) + len(ops)
    fault = RandomFaults(ops, rate, mode, seed)
    store = CampaignStore(LocalStore(tmp_path / "run"), fault)
    ok, problems, lost = 0, [], []
    with cryosnap.Checkpointer(store, keep=1, chunk_bytes=CHUNK, full_every=8) as ckpt:
        for step in range(80):
            seeds = tuple(int(x) for x in np.random.default_rng(seed + step).integers(0, 6, 4))
            fault.armed = True
            try:
                ckpt.save(step, _chunks(seeds)).result()
            except cryosnap.CheckpointError:
                continue
            except Exception as exc:
                problems.append(f"step {step}: {type(exc).__name__}: {exc}")
                continue
            finally:
                fault.armed = False
            ok += 1
            try:
                out = cryosnap.load(tmp_path / "run", step=step)
                assert out["x"].tobytes() == _chunks(seeds)["x"].tobytes(), "wrong bytes"
            except (cryosnap.CheckpointError, AssertionError) as exc:
                lost.append(f"step {step}: {exc}")
    print(f"\nrandom faults seed={seed} {mode} {ops}: {len(fault.fired)} injected, {ok}/80 ok")
    assert not problems, f"seed={seed}: {problems}"
    assert not lost, f"seed={seed} {mode} {ops}: {len(lost)} of {ok} durable versions lost: {lost}"


def test_fault_campaign_summary() -> None:
    """The summary counts what the cases say (it is printed after the module's campaign tests,
    whichever ran in this process, in whatever order)."""
    cases = [
        Case("plain", "write", "before", 1, fired="write k", failed=["step 2: x"]),
        Case("plain", "write", "after", 1, fired="write k", problems=["lost"], garbage_bytes=3),
        Case("tiered-scratch", "list", "before", 1),
        Case("plain", "size", "stall", 1),
    ]
    doc = summary([asdict(c) for c in cases])
    assert doc["cases"] == 4 and doc["faults_injected"] == 2
    assert doc["per_op_and_mode"] == {"write/after": 1, "write/before": 1}
    assert doc["failures_surfaced"] == 1 and doc["problems"] == 1
    assert doc["problem_cases"] == ["plain:write:after#1"]
    assert doc["not_reached"] == {"plain:size": 1, "tiered-scratch:list": 1}
    assert doc["never_injected"] == ["list"]  # a core operation; size is not one
    assert doc["garbage_bytes_after_resume"] == 3
    assert doc["ops_not_wrapped"] == unwrapped_ops()
