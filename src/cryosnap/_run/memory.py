"""The memory level: each participant's newest version in node RAM, in shared memory.

A version committed on the first level is copied, on the writer thread, into a private
directory under ``$CRYOSNAP_MEMORY_ROOT`` (default ``/dev/shm``), within a byte budget, and
protected across nodes as the first level is (a partner's copy, XOR or Reed-Solomon parity, in
the other nodes' memory). Shared memory outlives a killed process on the same node: the next
open of the run finds the files there, rebuilds what a lost node's memory held from the
others', and a restore reads each part from memory before any disk. A clean close removes
them; what a killed run that never reopens left is an orphan ``cryosnap memory --clean``
removes (:func:`orphans`). Runs on the caller's thread (open, close) and the writer thread
(:meth:`MemoryLevel.keep`, collective on the writer's channel). docs/design/levels.md has the
why and the life cycle.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryosnap import engine
from cryosnap._format.keys import Lineage, parse_commit_key
from cryosnap._run.lock import LOCK_KEY, RunLock, acquire_run_lock
from cryosnap._run.redundancy.partner import Partners, version_keys
from cryosnap._run.redundancy.partner import rebuild as rebuild_partner
from cryosnap._run.redundancy.rs import RSParity
from cryosnap._run.redundancy.rs_rebuild import rebuild as rebuild_rs
from cryosnap._run.redundancy.xor import Parity
from cryosnap._run.redundancy.xor_rebuild import rebuild as rebuild_xor
from cryosnap._units import human_bytes
from cryosnap.dist import Coordinator, agree
from cryosnap.dist._agree import first_errors
from cryosnap.errors import CheckpointError, CoordinationError, MemoryLevelError
from cryosnap.storage import Store
from cryosnap.storage._local import LocalStore

__all__ = [
    "MEMORY",
    "MEMORY_ROOT_ENV",
    "PARTNER_MEMORY",
    "MemoryLevel",
    "MemoryRun",
    "memory_root",
    "memory_runs",
    "orphans",
    "remove_orphans",
]

log = logging.getLogger("cryosnap")

MEMORY_ROOT_ENV = "CRYOSNAP_MEMORY_ROOT"
DEFAULT_MEMORY_ROOT = "/dev/shm"
# The level names a restore reports: this rank's memory, or its memory as rebuilt at open
# from the other nodes' memory (a partner's copy, or parity).
MEMORY, PARTNER_MEMORY = "memory", "partner-memory"
# Memory the system keeps beyond a version copied in (MemAvailable): never an OOM kill.
HEADROOM_BYTES = 256 << 20
# A run directory without any write lock is an orphan only once this old (its opener may be
# between creating it and locking it).
_UNLOCKED_GRACE_SECONDS = 60.0
_WINDOW = 64 << 20
_OWNER_FILE = "owner.json"


def memory_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where memory levels live: ``$CRYOSNAP_MEMORY_ROOT`` when set and not empty, else
    ``/dev/shm`` (POSIX shared memory on Linux)."""
    env = os.environ if environ is None else environ
    return Path(env.get(MEMORY_ROOT_ENV) or DEFAULT_MEMORY_ROOT)


def user_directory(root: Path, *, create: bool) -> Path:
    """``<root>/cryosnap-<uid>``: this user's memory levels, mode 0700, checked to be a
    directory this user owns that no one else can enter (else :class:`MemoryLevelError`);
    created (``create``) when missing."""
    if not root.is_dir():
        raise MemoryLevelError(
            f"the memory level's root {root} is missing or not a directory (give another with "
            f"${MEMORY_ROOT_ENV}, or leave memory= out)",
            path=str(root),
        )
    path = root / f"cryosnap-{os.getuid()}"
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise MemoryLevelError(
            f"{path} is not a directory of uid {os.getuid()} with mode 0700 (mode "
            f"{stat.filemode(st.st_mode)}, uid {st.st_uid}): cryosnap keeps no checkpoint in "
            "shared memory others could read or replace; remove it if it is yours",
            path=str(path),
        )
    return path


def run_directory(root: Path, url: str) -> Path:
    """The directory of the run whose persistent level is ``url``, in ``root``'s user
    directory: ``run-<16 hex digits of its hash>``."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return user_directory(root, create=True) / f"run-{digest}"


def _make_run_directory(url: str) -> Path:
    """Create (if missing) the run's directory in the memory root; a user directory removed
    meanwhile by a closing run is made again."""
    for attempt in range(3):
        directory = run_directory(memory_root(), url)
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            return directory
        except FileNotFoundError:
            if attempt == 2:
                raise
            continue
        return directory
    raise AssertionError("unreachable")


def _private_store(location: str | Path, **_ignored: Any) -> LocalStore:
    """A store for a memory directory (files 0600, directories 0700, buffered: tmpfs takes
    no direct I/O), its directory made now; keyword arguments of ``open_store``
    (``timeout_seconds``) are not needed in RAM."""
    path = Path(location)
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, 0o700)
    return LocalStore(location, direct_io=False, private=True)


def _lock(store: Store) -> RunLock:
    """The write lock of a memory store, its file readable by its owner only."""
    lock = acquire_run_lock(store)
    _private_lock_file(store)
    return lock


def _private_lock_file(store: Store) -> None:
    """The write lock's file (made 0644 by lock.py) readable by its owner only."""
    root = store.capabilities.local_path
    if root is not None:
        with contextlib.suppress(OSError):
            os.chmod(root / LOCK_KEY, 0o600)


def _size_of(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(eq=False)
class MemoryLevel:
    """This participant's memory level: its store, the copies and parity it holds for the
    others, its byte budget, and the steps its open rebuilt from the other nodes."""

    budget: int
    directory: Path  # the run's, shared by the ranks of this node
    store: LocalStore  # this rank's own versions
    coord: Coordinator  # the writer's channel: keep() is collective on it
    partners: Partners | None = None
    parity: Parity | RSParity | None = None
    locks: list[RunLock] = field(default_factory=list)
    rebuilt: set[int] = field(default_factory=set)
    skipped: set[int] = field(default_factory=set)
    _warned: set[str] = field(default_factory=set)

    # -- open -----------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        coord: Coordinator,
        url: str,
        budget: int,
        *,
        partner: bool | str,
        rs: tuple[int, int] | None,
    ) -> MemoryLevel:
        """Collective: every participant opens its directory (a failure on any one is a
        :class:`MemoryLevelError` on all), takes its write lock, agrees on the redundancy
        and gets back from the other nodes' memory what its own lost."""
        writer = coord.channel("writer")
        problem = ""
        directory: Path | None = None
        try:
            directory = _make_run_directory(url)
            _check_room(directory, budget)
        except (MemoryLevelError, OSError) as exc:
            problem = str(exc)
        bad = agree(coord, problem, first_errors)
        if bad:
            raise MemoryLevelError(
                "memory=: " + "; ".join(f"rank {r}: {p}" for r, p in bad), path=url
            )
        assert directory is not None
        own = _private_store(directory / f"rank-{coord.rank:05d}")
        level = cls(budget, directory, own, writer)
        try:
            level.locks.append(_lock(own))
            _write_owner(directory, url)
            own.remove_incomplete()  # what a killed copy left
            level._open_redundancy(coord, partner, rs)
        except BaseException:
            level.release()
            raise
        return level

    def _open_redundancy(
        self, coord: Coordinator, partner: bool | str, rs: tuple[int, int] | None
    ) -> None:
        root = str(self.directory)
        steps: list[int] = []
        if partner is True:
            self.partners = Partners.open(coord, root, open_store=_private_store, timeout=None)
            self.locks.extend(self.partners.locks)
            self.partners.locks = []
            for store in self.partners.held.values():
                _private_lock_file(store)
            steps = self._rebuild(
                lambda: rebuild_partner(coord, self.store, self.partners, level=MEMORY)
            )
        elif rs is not None:
            self.parity = RSParity.open(
                coord, root, k=rs[0], m=rs[1], open_store=_private_store, timeout=None
            )
            sets = self.parity
            steps = self._rebuild(lambda: rebuild_rs(coord, self.store, sets, level=MEMORY))
        elif partner == "xor":
            self.parity = Parity.open(coord, root, open_store=_private_store, timeout=None)
            xor = self.parity
            steps = self._rebuild(lambda: rebuild_xor(coord, self.store, xor, level=MEMORY))
        self.rebuilt = set(steps)

    def _rebuild(self, rebuild: Any) -> list[int]:
        """Run ``rebuild()`` (collective); its failure leaves this rank's memory without those
        versions (the disks below hold them), logged."""
        try:
            steps: list[int] = rebuild()
        except CoordinationError:
            raise
        except CheckpointError as exc:
            log.warning("the memory level was not rebuilt from the other nodes: %s", exc)
            return []
        return steps

    # -- the writer thread: one version into memory ----------------------------------------------

    def keep(self, src: Store, step: int, part: engine.PartResult, lineage: Lineage | None) -> bool:
        """Copy version ``step`` of the first level (``src``) into memory, with its partner
        copy or parity (collective on the writer's channel; every rank calls it once per
        committed version). A version that does not fit some rank's budget, or the free
        memory, is skipped on every rank with a warning; whether it is in memory now."""
        mine = _describe_version(src, step)
        told = self._describe_to_neighbours(mine)
        problem = mine.get("error") or self._room_problem(step, told)
        bad = agree(self.coord, problem, first_errors)
        if bad:
            self.skipped.add(step)
            self._warn(step, bad)
            return False
        keys: list[str] = mine["keys"]
        record_key: str = mine["record"]
        self._drop_except(self.store, {*keys, record_key, *self._parity_files()})
        if self.partners is not None:
            for owner, store in self.partners.held.items():
                self._drop_except(store, set(told[owner]["keys"]))
        errors: list[str] = []
        body: bytes | None = None
        try:
            body = src.read(record_key)
            _copy(src, self.store, keys)
        except CheckpointError as exc:
            errors.append(str(exc))
            body = None
        errors += self._protect(src, step, part, lineage, keys, body)
        if body is not None and not errors:
            try:
                self.store.write(record_key, body)
            except CheckpointError as exc:
                errors.append(str(exc))
        failed = agree(self.coord, "; ".join(errors), first_errors)
        if failed:
            self._take_back(record_key)
            self.skipped.add(step)
            self._warn(step, failed)
            return False
        self.rebuilt.discard(step)
        if self.parity is not None:
            # Once the version's record is in memory: the parity of what it no longer reads
            # goes (that of the versions it inherits files from stays).
            try:
                self.parity.retire(self.store)
            except CheckpointError as exc:
                log.warning("retention of the memory level's parity failed: %s", exc)
        log.debug("step %d in memory (%s)", step, self.store.url)
        return True

    def _protect(
        self,
        src: Store,
        step: int,
        part: engine.PartResult,
        lineage: Lineage | None,
        keys: list[str],
        body: bytes | None,
    ) -> list[str]:
        """The version's copy on the partner's memory, or its parity (collective)."""
        errors: list[str] = []
        if self.partners is not None:
            try:
                self.partners.copy_files(self.coord, src, step, keys if body is not None else [])
            except CheckpointError as exc:
                errors.append(str(exc))
            errors += self.partners.copy_record(self.coord, step, body if not errors else None)
        elif self.parity is not None:
            got = self.parity.encode(self.coord, self.store, part, lineage, body)
            errors += [f"parity: {e}" for e in got]
        return errors

    def _parity_files(self) -> set[str]:
        """This rank's files that the parity it and its set hold still covers: a lost
        member's file is decoded from the others' files of the same version, so they stay
        while that parity does (xor.retire keeps it while some member's newest version reads
        a file it covers)."""
        if self.parity is None:
            return set()
        me = self.coord.rank
        try:
            indexes = [self.parity.read_index(k) for k in self.parity.store.list("index")]
        except CheckpointError as exc:
            log.warning("the memory level keeps its older files: %s", exc)
            return {k for k in self.store.list() if parse_commit_key(k) is None}
        return {f for idx in indexes if me in idx.members for f, _ in idx.members[me].files}

    def _describe_to_neighbours(self, mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """This rank's description of a version to the ranks that hold its copies or share
        its parity set, theirs back (one exchange: O(1) payloads per rank in N); by rank,
        this rank's own included."""
        me = self.coord.rank
        body = json.dumps(mine).encode()
        if self.partners is not None:
            to = [self.partners.target]
        elif self.parity is not None:
            to = [r for r in self.parity.ranks if r != me]
        else:
            to = []
        got = self.coord.exchange({r: body for r in to if r != me})
        told = {src: json.loads(raw) for src, raw in got.items()}
        told[me] = mine
        return told

    def _room_problem(self, step: int, told: dict[int, dict[str, Any]]) -> str:
        """Why version ``step`` does not fit this rank's memory ('' when it does): its part,
        the copies this rank holds for others and its parity, against the budget, the free
        space of the file system and the system's available memory."""
        own = int(told[self.coord.rank]["total"])
        held = 0
        if self.partners is not None:
            held = sum(int(told[o]["total"]) for o in self.partners.held)
        elif self.parity is not None:
            ranks = self.parity.ranks
            m = self.parity.m if isinstance(self.parity, RSParity) else 1
            k = max(1, len(ranks) - m)
            held = -(-max(int(told[r]["total"]) for r in ranks) * m // k)
        need = own + held
        if need > self.budget:
            what = f"its part ({human_bytes(own)})"
            if held:
                what += f" and what it holds for others ({human_bytes(held)})"
            verb = "need" if held else "needs"
            return f"{what} {verb} {human_bytes(need)}, more than memory={human_bytes(self.budget)}"
        present = _size_of(self.directory / f"rank-{self.coord.rank:05d}")
        new = max(0, need - present)
        try:
            vfs = os.statvfs(self.store.root if self.store.root.exists() else self.directory)
            free = vfs.f_bavail * vfs.f_frsize
        except OSError as exc:
            return f"{self.directory}: {exc.strerror}"
        if new > free:
            return f"{self.directory} has {human_bytes(free)} free, {human_bytes(new)} needed"
        available = _mem_available()
        if available is not None and new + HEADROOM_BYTES > available:
            return (
                f"the system has {human_bytes(available)} of memory available, "
                f"{human_bytes(new)} needed and {human_bytes(HEADROOM_BYTES)} kept free"
            )
        return ""

    def _warn(self, step: int, bad: list[tuple[int, str]]) -> None:
        text = "; ".join(f"rank {r}: {p}" for r, p in bad)
        message = (
            f"cryosnap: step {step} is not kept in the memory level ({text}); the levels "
            "below hold it"
        )
        log.warning("%s", message)
        key = bad[0][1].split(" ")[0]
        if key not in self._warned:  # once per kind of reason, not at every save
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _drop_except(self, store: Store, keep: set[str]) -> None:
        """Delete every file of ``store`` but ``keep`` (and the write lock): commit records
        first, so no version is ever visible without its files."""
        try:
            names = [k for k in store.list() if k != LOCK_KEY and not k.startswith(LOCK_KEY)]
            names.sort(key=lambda k: parse_commit_key(k) is None)
            for key in names:
                if key not in keep or parse_commit_key(key) is not None:
                    store.delete(key)
        except CheckpointError as exc:
            log.warning("removing older versions from %s failed: %s", store.url, exc)

    def _take_back(self, record_key: str) -> None:
        stores: list[Store] = [self.store]
        if self.partners is not None:
            stores += list(self.partners.held.values())
        for store in stores:
            with contextlib.suppress(CheckpointError):
                if store.exists(record_key):
                    store.delete(record_key)

    # -- restore, close ---------------------------------------------------------------------------

    def level_of(self, step: int) -> str:
        """The name a restore of ``step`` from this level reports."""
        return PARTNER_MEMORY if step in self.rebuilt else MEMORY

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks.clear()

    def close(self) -> None:
        """Remove what this rank keeps in memory (its versions, the copies and parity it
        holds), then the run's directory once no rank of this node uses it."""
        self.release()
        paths = [self.store.root]
        if self.partners is not None:
            paths += [Path(str(s.url)) for s in self.partners.held.values()]
        if self.parity is not None:
            paths.append(Path(str(self.parity.store.url)))
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        for sub in ("partner", "xor", "rs"):
            with contextlib.suppress(OSError):
                os.rmdir(self.directory / sub)
        if not any(p.name.startswith("rank-") for p in _entries(self.directory)):
            shutil.rmtree(self.directory, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(self.directory.parent)  # the user's, once it holds no run


def _entries(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []


def _describe_version(src: Store, step: int) -> dict[str, Any]:
    """This rank's version ``step`` on ``src``: its files, commit record and bytes in all."""
    try:
        record = engine.read_commit(src, step)
        keys = version_keys(src, step)
        total = sum(src.size(k) for k in keys) + src.size(record.key)
    except CheckpointError as exc:
        return {"error": f"reading step {step} on {src.url}: {exc}", "keys": [], "total": 0}
    return {"keys": keys, "record": record.key, "total": total}


def _copy(src: Store, dst: Store, keys: list[str]) -> None:
    """Copy ``keys`` of ``src`` to ``dst`` (those ``dst`` holds at the same size stay)."""
    for key in keys:
        nbytes = src.size(key)
        if dst.exists(key) and dst.size(key) == nbytes:
            continue
        writer = dst.open_writer(key)
        try:
            buf = bytearray(min(_WINDOW, nbytes))
            view = memoryview(buf)
            offset = 0
            while offset < nbytes:
                n = min(_WINDOW, nbytes - offset)
                src.read_into(key, offset, [view[:n]])
                writer.write([view[:n]])
                offset += n
            writer.commit()
        except BaseException:
            writer.abort()
            raise


def _check_room(directory: Path, budget: int) -> None:
    """Warn at open when the budget exceeds what the file system could ever hold."""
    try:
        vfs = os.statvfs(directory)
    except OSError as exc:
        raise MemoryLevelError(f"{directory}: {exc.strerror}", path=str(directory)) from exc
    size = vfs.f_blocks * vfs.f_frsize
    if budget > size:
        message = (
            f"cryosnap: memory={human_bytes(budget)} is more than {directory.parent.parent} "
            f"holds ({human_bytes(size)}): versions that do not fit are kept on the levels "
            "below only"
        )
        log.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _write_owner(directory: Path, url: str) -> None:
    """Say whose run a memory directory is (for ``cryosnap memory``): the persistent level's
    url. The write locks in it say which processes hold it."""
    path = directory / _OWNER_FILE
    if path.exists():
        return
    tmp = directory / f".{_OWNER_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps({"run": url, "host": socket.gethostname()}).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


# -- orphans --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRun:
    """A memory level in this user's memory root: its directory, the run it belongs to (its
    persistent level's url, '' if unknown), its bytes, the live processes holding it, and
    whether it is an orphan (no live holder: left by a run killed and never opened again,
    whose next open would have taken it over)."""

    path: Path
    run: str
    nbytes: int
    holders: tuple[int, ...]
    orphan: bool


def memory_runs(root: Path | None = None) -> list[MemoryRun]:
    """This user's memory levels under ``root`` (default :func:`memory_root`)."""
    base = memory_root() if root is None else root
    try:
        user = user_directory(base, create=False)
    except (MemoryLevelError, FileNotFoundError):
        return []
    out: list[MemoryRun] = []
    for path in sorted(_entries(user)):
        if not path.name.startswith("run-") or not path.is_dir():
            continue
        try:
            run = str(json.loads((path / _OWNER_FILE).read_text()).get("run", ""))
        except (OSError, ValueError, AttributeError):
            run = ""
        holders = _holders(path)
        out.append(MemoryRun(path, run, _size_of(path), holders, not holders and _left(path)))
    return out


def _left(path: Path) -> bool:
    """Whether a run directory without a live holder was left (not just being opened: one
    without any write lock is young for a while)."""
    if any(path.rglob(LOCK_KEY)):
        return True
    try:
        return time.time() - path.stat().st_mtime > _UNLOCKED_GRACE_SECONDS
    except OSError:
        return False


def _holders(path: Path) -> tuple[int, ...]:
    """The live processes of this host whose write locks are in ``path`` (a lock whose
    owner is unknown, or of another host, counts as live: it is not ours to judge)."""
    host = socket.gethostname()
    live: list[int] = []
    for lock in path.rglob(LOCK_KEY):
        try:
            info = json.loads(lock.read_bytes())
            pid, owner = int(info["pid"]), info.get("host")
        except (OSError, ValueError, KeyError, TypeError):
            live.append(-1)
            continue
        if owner != host or _alive(pid):
            live.append(pid)
    return tuple(live)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


def orphans(root: Path | None = None) -> list[MemoryRun]:
    """The memory levels no live process holds (:attr:`MemoryRun.orphan`)."""
    return [run for run in memory_runs(root) if run.orphan]


def remove_orphans(root: Path | None = None) -> list[MemoryRun]:
    """Delete :func:`orphans`; the ones removed."""
    removed = []
    for run in orphans(root):
        shutil.rmtree(run.path, ignore_errors=True)
        if not run.path.exists():
            removed.append(run)
    return removed
