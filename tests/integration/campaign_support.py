"""Support for the crash and fault campaigns (issue #10): deterministic states, a store that fails
before or after an operation or stalls in it, the child process of the kill campaign, and the
checks made after every kill or fault (committed versions bit-exact, garbage counted).

Everything here runs on the test's thread, except :func:`child_main`, which runs in a child
process that the kill campaign SIGKILLs (at a random instant, or from inside a storage call).
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

import cryosnap
from cryosnap import engine
from cryosnap._format.keys import parse_commit_key
from cryosnap.errors import StorageError
from cryosnap.storage import LocalStore, Store
from cryosnap.storage.base import BlobWriter, BytesLike
from cryosnap.storage.striped import Tier
from cryosnap.testing import FaultyStore

try:  # the base of store wrappers, through which the lock finds a LocalStore's directory
    from cryosnap.storage import WrapperStore as _Base
except ImportError:  # a library without wrappers
    _Base = object  # type: ignore[assignment,misc]

REPO = Path(__file__).resolve().parents[2]
CHUNK = 4096
LOCK_KEY = "writer.lock"

# ---------------------------------------------------------------------------------------------
# the state of step s: a few arrays whose chunks change sparsely, and whose old content recurs
# (so a later version de-duplicates against chunks of versions that retention dropped)

_ARRAYS: dict[str, tuple[np.dtype[Any], int]] = {
    "w": (np.dtype("<f4"), 48),
    "m": (np.dtype("<f8"), 16),
    "b": (np.dtype("u1"), 8),
}
_CYCLE = 4  # a chunk's content comes back after this many changes


@lru_cache(maxsize=4096)
def _chunk(name: str, j: int, content: int) -> bytes:
    seed = (ord(name) << 20) + (j << 8) + content
    return np.random.default_rng(seed).bytes(CHUNK)


def _content(name: str, j: int, step: int) -> int:
    # Chunk j changes every `period` steps (1..7): about a quarter of the chunks per step.
    period = 1 + (j * 5 + ord(name)) % 7
    return ((step + j) // period) % _CYCLE


def state_at(step: int) -> dict[str, Any]:
    """The state saved as version ``step`` (the same in every process)."""
    state: dict[str, Any] = {"step": step, "lr": 1.0 / (step + 1)}
    for name, (dtype, chunks) in _ARRAYS.items():
        raw = b"".join(_chunk(name, j, _content(name, j, step)) for j in range(chunks))
        state[name] = np.frombuffer(raw, dtype=dtype).copy()
    return state


def same_state(expected: dict[str, Any], actual: Any) -> str | None:
    """None when ``actual`` is ``expected`` bit for bit, else what differs."""
    if not isinstance(actual, dict) or list(actual) != list(expected):
        return f"keys {list(actual) if isinstance(actual, dict) else type(actual)}"
    for k, e in expected.items():
        a = actual[k]
        if isinstance(e, np.ndarray):
            if type(a) is not np.ndarray or a.dtype != e.dtype or a.shape != e.shape:
                return f"{k}: {type(a).__name__} {getattr(a, 'dtype', '')}"
            if a.tobytes() != e.tobytes():
                return f"{k}: bytes differ"
        elif type(a) is not type(e) or a != e:
            return f"{k}: {a!r} != {e!r}"
    return None


# ---------------------------------------------------------------------------------------------
# key classes of the storage operations of a save


def key_class(key: str) -> str:
    if key == LOCK_KEY:
        return "lock"
    if key.startswith("data"):
        return "data"
    if parse_commit_key(key) is not None:
        return "commit"
    if key.startswith("versions/") and "/rank-" in key:
        return "manifest"
    return "other"


def matches(pattern: str, key: str) -> bool:
    """``pattern`` is a key class, or ``any`` (every key but the lock's)."""
    cls = key_class(key)
    return cls != "lock" if pattern == "any" else cls == pattern


# ---------------------------------------------------------------------------------------------
# a store that fails before an operation, after it took effect, or stalls in it


class InjectedError(StorageError):
    """A failure injected by the campaign (a StorageError, as a real backend's would be)."""


Decide = Callable[[str, str], str | None]  # (op, key) -> None | "before" | "after" | "stall"


class CampaignStore(_Base):
    """Wraps a store; ``decide(op, key)`` is asked before every operation.

    ``before``: raise :class:`InjectedError` without doing it; ``after``: do it, then raise (the
    caller cannot tell that it took effect); ``stall``: block until :attr:`release` is set (or
    ``stall_limit`` seconds), then do it.
    """

    def __init__(self, inner: Store, decide: Decide | None = None) -> None:
        self.inner = inner
        self.decide: Decide = decide or (lambda op, key: None)
        self.release = threading.Event()
        self.stall_limit = 60.0
        self._busy = 0  # calls in progress (a stalled one released late still counts)
        self._idle = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        # Store methods added after this file was written reach the inner store unfaulted;
        # unwrapped_ops() names them in the campaign's report.
        return getattr(self.inner, name)

    @property
    def url(self) -> str:
        return self.inner.url

    def call(self, op: str, key: str, fn: Callable[[], Any]) -> Any:
        mode = self.decide(op, key)
        if mode == "before":
            raise InjectedError(f"injected failure before {op} {key}")
        with self._idle:
            self._busy += 1
        try:
            if mode == "stall":
                self.release.wait(self.stall_limit)
            out = fn()
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
        if mode == "after":
            raise InjectedError(f"injected failure after {op} {key} took effect")
        return out

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is in progress (a released stall has finished its operation)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def read(self, key: str) -> bytes:
        data: bytes = self.call("read", key, lambda: self.inner.read(key))
        return data

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.call("read_into", key, lambda: self.inner.read_into(key, offset, buffers))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self.call("read_ranges", key, lambda: self.inner.read_ranges(key, ranges))

    def write(self, key: str, data: bytes) -> None:
        self.call("write", key, lambda: self.inner.write(key, data))

    def open_writer(self, key: str) -> BlobWriter:
        inner: BlobWriter = self.call("open_writer", key, lambda: self.inner.open_writer(key))
        return _CampaignWriter(self, inner)

    def exists(self, key: str) -> bool:
        return bool(self.call("exists", key, lambda: self.inner.exists(key)))

    def list(self, prefix: str = "") -> list[str]:
        out: list[str] = self.call("list", prefix, lambda: self.inner.list(prefix))
        return out

    def size(self, key: str) -> int:
        return int(self.call("size", key, lambda: self.inner.size(key)))

    def delete(self, key: str) -> None:
        self.call("delete", key, lambda: self.inner.delete(key))

    def remove_incomplete(self, prefix: str = "") -> builtins.list[str]:
        method = getattr(self.inner, "remove_incomplete", None)
        out: builtins.list[str] = self.call(
            "remove_incomplete", prefix, lambda: [] if method is None else method(prefix)
        )
        return out


class _CampaignWriter:
    def __init__(self, store: CampaignStore, inner: BlobWriter) -> None:
        self._store = store
        self._inner = inner
        self.key = inner.key

    def write(self, buffers: Sequence[BytesLike]) -> None:
        self._store.call("writer.write", self.key, lambda: self._inner.write(buffers))

    def tell(self) -> int:
        return self._inner.tell()

    def commit(self) -> None:
        self._store.call("writer.commit", self.key, self._inner.commit)

    def abort(self) -> None:
        self._inner.abort()


def unwrapped_ops() -> list[str]:
    """Methods of the Store protocol that CampaignStore does not inject faults into."""
    names = {n for n in vars(Store) if not n.startswith("_")} - {"url", "capabilities"}
    return sorted(n for n in names if n not in vars(CampaignStore))


@dataclass
class OneFault:
    """Injects ``mode`` at the ``nth`` operation ``op`` on a key of class ``pattern``, once."""

    op: str
    pattern: str
    nth: int
    mode: str
    armed: bool = False
    seen: int = 0
    fired: str | None = None  # the key it fired on
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, op: str, key: str) -> str | None:
        ops = (op,) if op != "read_ranges" else ("read_ranges", "read_into")
        if not self.armed or self.op not in ops or not matches(self.pattern, key):
            return None
        with self.lock:
            self.seen += 1
            if self.seen != self.nth:
                return None
            self.fired = f"{op} {key}"
        return self.mode


@dataclass
class RandomFaults:
    """Injects ``mode`` into each operation of ``ops`` with probability ``rate`` (seeded)."""

    ops: tuple[str, ...]
    rate: float
    mode: str
    seed: int
    armed: bool = False
    fired: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self._lock = threading.Lock()

    def __call__(self, op: str, key: str) -> str | None:
        if not self.armed or op not in self.ops or key_class(key) == "lock":
            return None
        with self._lock:
            if self._rng.random() >= self.rate:
                return None
            self.fired.append(f"{op} {key}")
        return self.mode


# ---------------------------------------------------------------------------------------------
# checks on a run directory


def visible_steps(root: Path) -> list[int]:
    return engine.list_steps(LocalStore(root)) if root.exists() else []


def check_versions(root: Path, known: set[int], keep: int | None, where: str) -> list[int]:
    """Every visible version of ``root`` loads bit-exact; every step in ``known`` (reported
    durable) is visible, unless ``keep`` newer versions are (retention dropped it legitimately).
    Returns the visible steps; raises AssertionError naming what was lost."""
    steps = visible_steps(root)
    for s in steps:
        try:
            out = cryosnap.load(root, step=s)
        except cryosnap.CheckpointError as exc:
            msg = f"{where}: committed step {s} of {root} does not load: {exc}"
            raise AssertionError(msg) from exc
        diff = same_state(state_at(s), out)
        assert diff is None, f"{where}: step {s} of {root} loads wrong data: {diff}"
    for s in sorted(known):
        newer = [v for v in steps if v > s]
        dropped_ok = keep is not None and len(newer) >= keep
        assert s in steps or dropped_ok, (
            f"{where}: step {s} was reported durable and is gone from {root}; visible: {steps}"
        )
    return steps


def referenced(root: Path) -> set[str]:
    """Keys that the committed versions of ``root`` need (commit records, manifests of their
    chains, data files) plus the lock file."""
    store = LocalStore(root)
    keys = {LOCK_KEY}
    for s, lineage in engine.list_versions(store).items():
        record = engine.read_commit(store, s, lineage)
        keys.add(record.key)
        keys.update(m.key for m in record.manifests)
        for ref in record.manifests:
            manifest, _ = engine.read_manifest(store, record, ref.rank)
            chain = engine.chain_manifests(store, manifest, ref.key, ref.xxh3)
            keys.update(key for _m, key, _h in chain)
        keys.update(record.data_files)
    return keys


def garbage(root: Path) -> dict[str, int]:
    """Files under ``root``'s ``data/`` and ``versions/`` that no committed version references,
    and ``.partial`` and temporary files anywhere, with their sizes."""
    if not root.exists():
        return {}
    needed = referenced(root)
    out: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            key = path.relative_to(root).as_posix()
            leftover = name.endswith(".partial") or (name.startswith(".") and name.endswith(".tmp"))
            # Top-level files other than those are the run's own metadata (the lock, the
            # scratch tier's device map), not garbage.
            if leftover or (key.split("/")[0] in ("data", "versions") and key not in needed):
                out[key] = path.lstat().st_size
    return out


# ---------------------------------------------------------------------------------------------
# the kill campaign's child process and the parent's side of a round


@dataclass(frozen=True)
class KillAt:
    """SIGKILL the child at the ``nth`` ``op`` on a key of class ``pattern`` of tier ``role``."""

    role: str  # "persistent" | "scratch"
    op: str
    pattern: str
    nth: int

    def label(self) -> str:
        return f"{self.role}:{self.op}:{self.pattern}#{self.nth}"


CKPT_OPTIONS: dict[str, Any] = {
    "keep": 2,
    "incremental": True,
    "full_every": 4,
    "chunk_bytes": CHUNK,
    "flush_retry_seconds": 5.0,
}


def tier_store(path: Path, wrap: bool, fault: Callable[[str, str], None] | None = None) -> Any:
    """The store a campaign opens for a tier: the plain path (flock lock), or a FaultyStore
    around LocalStore (object lock, faults) when ``wrap``."""
    if not wrap:
        return str(path)
    if fault is None:
        return FaultyStore(LocalStore(path))
    return FaultyStore(LocalStore(path), fault=fault)


def open_checkpointer(
    run: Path, scratch: Path | None, wrap: bool, faults: dict[str, Any] | None = None
) -> cryosnap.Checkpointer:
    faults = faults or {}
    persistent = tier_store(run, wrap, faults.get("persistent"))
    if scratch is None:
        return cryosnap.Checkpointer(persistent, **CKPT_OPTIONS)
    tier = Tier(tier_store(scratch, wrap, faults.get("scratch")))
    return cryosnap.Checkpointer(persistent, scratch=tier, keep_scratch=1, **CKPT_OPTIONS)


def child_main() -> None:
    """Entry point of the kill campaign's child: save step after step, print each durable one."""
    cfg = json.loads(sys.argv[1])
    run, scratch = Path(cfg["run"]), cfg["scratch"] and Path(cfg["scratch"])
    kill = KillAt(**cfg["kill"]) if cfg["kill"] else None
    seen = [0]
    lock = threading.Lock()

    def fault_for(role: str) -> Callable[[str, str], None]:
        def fault(op: str, key: str) -> None:
            if kill is None or role != kill.role or op != kill.op:
                return
            if not matches(kill.pattern, key):
                return
            with lock:
                seen[0] += 1
                if seen[0] == kill.nth:
                    os.kill(os.getpid(), signal.SIGKILL)

        return fault

    faults = {"persistent": fault_for("persistent"), "scratch": fault_for("scratch")}
    ckpt = open_checkpointer(run, scratch, cfg["wrap"], faults)
    print("open", flush=True)
    latest = ckpt.latest_step()
    start = 0 if latest is None else latest + 1
    for step in range(start, start + cfg["steps"]):
        ckpt.save(step, state_at(step)).result()
        print(f"durable {step}", flush=True)
    ckpt.close()
    print("closed", flush=True)


@dataclass
class Round:
    killed: bool
    reported: list[int]
    output: str


def run_child(cfg: dict[str, Any], delay: float | None, timeout: float = 120.0) -> Round:
    """Run the child; SIGKILL it ``delay`` seconds after it opened the run (None: it kills
    itself from a fault, or ends)."""
    # The repository first (for this module), then whatever the parent's path already had.
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    code = "from tests.integration.campaign_support import child_main; child_main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    first = ""
    if delay is not None:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"child hung ({cfg}): {out[-2000:]} {err[-4000:]}") from None
    out = first + out
    reported = [int(line.split()[1]) for line in out.splitlines() if line.startswith("durable ")]
    killed = proc.returncode == -signal.SIGKILL
    if not killed and proc.returncode != 0:
        raise AssertionError(f"child failed, rc {proc.returncode} ({cfg}):\n{out}\n{err[-6000:]}")
    return Round(killed, reported, out + err[-4000:])
