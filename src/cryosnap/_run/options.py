"""RunOptions: every ``Checkpointer`` argument, validated into one frozen value.

Pure: no I/O, no threads, no collectives; what needs the number of participants waits for
:meth:`RunOptions.check_world`, called by ``open_run`` once the coordinator is known.
Runs on the caller's thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cryosnap._run.signals as _signals
from cryosnap import _validate
from cryosnap._format.chunks import validate_chunk_bytes
from cryosnap._format.codec import require_zstd
from cryosnap._format.commit import RUN_ID_PATTERN
from cryosnap._run.capture.devdiff import DeviceDiff
from cryosnap._run.redundancy.rs import parse_rs, require_zfec
from cryosnap._units import parse_bytes
from cryosnap.dist import Coordinator
from cryosnap.policy import RetentionPolicy, SavePolicy, as_retention
from cryosnap.storage import DEFAULT_TIMEOUT_SECONDS, Store
from cryosnap.storage.striped import Device

__all__ = ["DEFAULT_KEEP_SCRATCH", "PathLike", "RunOptions"]

PathLike = str | os.PathLike[str] | Store

DEFAULT_KEEP_SCRATCH = 2
MIN_MEMORY_BYTES = 1 << 20

ScratchLike = PathLike | Device | Sequence[PathLike | Device] | None


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The arguments of :class:`~cryosnap.Checkpointer` (documented there), checked and
    normalised: ``keep`` a retention policy or None, ``scratch`` a tuple of
    :class:`~cryosnap.Device` or None, ``handle_signals`` a tuple of signal numbers,
    ``keep_scratch`` an int with scratch (None without). Validating a valid value again
    gives it back unchanged. A bad argument raises on construction, naming it."""

    path: PathLike
    scratch: ScratchLike = None
    keep: int | RetentionPolicy | None = None
    keep_scratch: int | None = None
    incremental: bool = True
    full_every: int = 16
    chunk_bytes: int = 1 << 20
    staging_bytes: int | None = None
    direct_io: bool | None = None
    max_inflight: int = 1
    allow_pickle: bool = False
    policy: SavePolicy | None = None
    handle_signals: Sequence[int] = ()
    storage_options: dict[str, Any] | None = None
    flush_retry_seconds: float = 300.0
    storage_timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS
    comm: Coordinator | None = None
    clock: Callable[[], float] = field(default=time.monotonic)
    run_id: str | None = None
    device_diff: bool | None = None
    partner: bool | str = False  # False, True, "xor" or "rs:K+M"
    stats: bool = True
    memory: int | str | None = None  # the memory level's byte budget per participant
    codec: str | None = None  # None, "zstd" or "auto": the persistent level's data files

    def __post_init__(self) -> None:
        # The order of the checks is the Checkpointer's of old: with several bad arguments,
        # the same one is reported.
        _set(self, "run_id", _run_id(self.run_id))
        chunk_bytes = validate_chunk_bytes(self.chunk_bytes)
        _set(self, "chunk_bytes", chunk_bytes)
        budget = _validate.positive_int_or_none(self.staging_bytes, "staging_bytes")
        if budget is not None and budget < chunk_bytes:
            raise ValueError(
                f"staging_bytes={budget} is smaller than one chunk (chunk_bytes={chunk_bytes})"
            )
        _set(self, "staging_bytes", budget)
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise TypeError(f"direct_io must be None, True or False, got {self.direct_io!r}")
        _set(self, "max_inflight", _validate.positive_int(self.max_inflight, "max_inflight"))
        _set(self, "keep", as_retention(self.keep))
        _set(self, "policy", _policy(self.policy))
        _set(self, "handle_signals", tuple(_signals.parse_signals(self.handle_signals)))
        self._check_scratch_retention()
        _set(
            self,
            "flush_retry_seconds",
            _validate.seconds(self.flush_retry_seconds, "flush_retry_seconds", allow_zero=True),
        )
        timeout = _validate.seconds(
            self.storage_timeout_seconds, "storage_timeout_seconds", allow_none=True
        )
        _set(self, "storage_timeout_seconds", timeout)
        if not callable(self.clock):
            raise TypeError(f"clock must be a callable returning seconds, got {self.clock!r}")
        _check_comm(self.comm)
        _set(self, "full_every", _validate.positive_int(self.full_every, "full_every"))
        _set(self, "incremental", _validate.boolean(self.incremental, "incremental"))
        _set(self, "allow_pickle", bool(self.allow_pickle))
        _set(self, "stats", _validate.boolean(self.stats, "stats"))
        self._check_partner()
        _set(self, "memory", _memory(self.memory))
        _check_codec(self.codec, self.scratch, self.memory)
        self._check_storage()
        _check_device_diff(self.device_diff, self.incremental, chunk_bytes)

    def _check_scratch_retention(self) -> None:
        keep_scratch = self.keep_scratch
        if keep_scratch is not None and self.scratch is None:
            raise ValueError(
                f"keep_scratch={keep_scratch!r} needs scratch=: without scratch tiers every "
                "version goes to the persistent tier, whose retention is keep="
            )
        if self.scratch is not None:
            n = DEFAULT_KEEP_SCRATCH if keep_scratch is None else keep_scratch
            _set(self, "keep_scratch", _validate.positive_int(n, "keep_scratch"))

    def _check_partner(self) -> None:
        partner: object = self.partner
        if isinstance(partner, str) and partner != "xor":
            k, m = parse_rs(partner)
            partner = f"rs:{k}+{m}"
        elif partner != "xor":
            partner = _validate.boolean(partner, "partner")
        _set(self, "partner", partner)
        if partner and self.scratch is None:
            raise _partner_error(partner)
        if isinstance(partner, str) and partner.startswith("rs:"):
            require_zfec(partner)

    @property
    def memory_bytes(self) -> int | None:
        """The memory level's budget per participant (None: no memory level)."""
        assert self.memory is None or isinstance(self.memory, int)
        return self.memory

    @property
    def rs(self) -> tuple[int, int] | None:
        """(K, M) of ``partner="rs:K+M"``; None with another partner."""
        partner = self.partner
        return parse_rs(partner) if isinstance(partner, str) and partner != "xor" else None

    def _check_storage(self) -> None:
        options = self.storage_options
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"storage_options must be a dict, got {type(options).__name__}")
        if options is not None:
            _set(self, "storage_options", dict(options))
        _set(self, "scratch", _scratch_devices(self.scratch))

    # -- normalised views ----------------------------------------------------------------------

    @property
    def retention(self) -> RetentionPolicy | None:
        """``keep`` as the persistent level's retention policy (None: keep all)."""
        assert self.keep is None or isinstance(self.keep, RetentionPolicy)
        return self.keep

    @property
    def scratch_devices(self) -> tuple[Device, ...]:
        """The scratch devices, fastest first (empty: no scratch level)."""
        assert self.scratch is None or isinstance(self.scratch, tuple)
        return self.scratch or ()

    @property
    def scratch_keep(self) -> int:
        """The scratch level's retention: its newest ``keep_scratch`` versions."""
        return DEFAULT_KEEP_SCRATCH if self.keep_scratch is None else self.keep_scratch

    def direct_io_of(self, device: Device) -> bool | None:
        """A scratch device's ``direct_io``: its own, else the run's."""
        return self.direct_io if device.direct_io is None else device.direct_io

    @property
    def signals(self) -> tuple[int, ...]:
        return tuple(self.handle_signals)

    def check_world(self, world_size: int) -> None:
        """What depends on the number of participants (known once the coordinator is):
        partner copies need several; several need scratch given as paths or URLs."""
        if self.partner and world_size == 1:
            raise _partner_error(self.partner)
        if self.memory is not None and world_size > 1 and not self.scratch_devices:
            raise ValueError(
                f"memory={self.memory} with several participants needs scratch=: each "
                "participant's memory holds its whole part, as node-local scratch does"
            )
        if world_size > 1:
            for tier in self.scratch_devices:
                if isinstance(tier.path, Store):
                    raise ValueError(
                        f"scratch={tier.path!r}: with several participants give scratch as a "
                        "path or URL (each rank keeps its part under <scratch>/rank-<r>), not a "
                        "Store"
                    )

    def device_diff_for(self, *, cuda: bool) -> DeviceDiff | None:
        """The change detection on the device that ``device_diff`` asks for (None: none);
        ``cuda``: whether CUDA is available (the default uses it for CUDA tensors)."""
        wanted = self.device_diff
        if wanted is None:
            if not (cuda and self.incremental and DeviceDiff.usable(self.chunk_bytes)):
                return None
        elif not wanted:
            return None
        return DeviceDiff(self.chunk_bytes, full_every=self.full_every, cpu=wanted is True)


def _set(options: RunOptions, name: str, value: object) -> None:
    object.__setattr__(options, name, value)  # normalising a frozen value in __post_init__


def _partner_error(partner: bool | str) -> ValueError:
    what = (
        "copies"
        if partner is True
        else "protects with XOR parity on other nodes"
        if partner == "xor"
        else "protects with Reed-Solomon parity on other nodes"
    )
    return ValueError(
        f"partner={partner!r} {what} each participant's scratch: it needs "
        "scratch= and several participants (comm=)"
    )


def _memory(memory: object) -> int | None:
    """The memory level's budget in bytes: an int, or a size such as ``"4GiB"``; at least
    one chunk's worth makes no sense below 1 MiB, so less is refused."""
    if memory is None:
        return None
    if isinstance(memory, bool) or not isinstance(memory, int | str):
        raise TypeError(
            f"memory must be None, a number of bytes or a size like '4GiB', got {memory!r}"
        )
    nbytes = parse_bytes(memory) if isinstance(memory, str) else memory
    if nbytes is None:
        raise ValueError(
            f"memory={memory!r} is not a size (a number and a unit: B, KiB, MiB, GiB, TiB, "
            "or KB, MB, GB, TB; e.g. '4GiB')"
        )
    if nbytes < MIN_MEMORY_BYTES:
        raise ValueError(
            f"memory={memory!r} is below the smallest memory level, 1 MiB (None: no memory level)"
        )
    return nbytes


def _run_id(run_id: object) -> str | None:
    if run_id is None:
        return None
    if not isinstance(run_id, str):
        raise TypeError(f"run_id must be a str or None, got {type(run_id).__name__}")
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(
            f"run_id={run_id!r:.160} is invalid: allowed are 1 to 128 of A-Z a-z 0-9 . _ : -"
        )
    return run_id


def _policy(policy: object) -> SavePolicy | None:
    if policy is not None and not isinstance(policy, SavePolicy):
        raise TypeError(
            f"policy must be a save policy (cryosnap.policy.EveryNSteps, EveryNSeconds, "
            f"Adaptive or an object with should_save/saved/durable), got {policy!r}"
        )
    return policy


def _check_comm(comm: object) -> None:
    if comm is not None and not isinstance(comm, Coordinator):
        raise TypeError(
            f"comm must be None or a cryosnap.dist.Coordinator (e.g. a rank of "
            f"cryosnap.dist.InProcessGroup), got {comm!r}"
        )


def _scratch_devices(scratch: object) -> tuple[Device, ...] | None:
    if scratch is None:
        return None
    items = list(scratch) if isinstance(scratch, (list, tuple)) else [scratch]
    if not items:
        raise ValueError("scratch=[] is invalid: give None or at least one path or Device")
    return tuple(t if isinstance(t, Device) else Device(t) for t in items)  # type: ignore[arg-type]


def _check_codec(codec: object, scratch: object, memory: object) -> None:
    if codec is None:
        return
    if codec not in ("zstd", "auto"):
        raise ValueError(f"codec={codec!r} is invalid: allowed are None, 'zstd' and 'auto'")
    if scratch is None and memory is not None:
        # The memory level copies the first level's files as they are (memory.py): without
        # scratch that is the persistent level, whose files the codec stores coded, and a
        # memory level is never coded (a restore from it maps its files).
        raise ValueError(
            f"codec={codec!r} with memory= needs scratch=: the memory level copies "
            "the first level's data files, and without scratch that is the persistent level, "
            "whose files the codec compresses (never the memory level's). Give scratch= or "
            "codec=None"
        )
    require_zstd(f"codec={codec!r}")


def _check_device_diff(wanted: object, incremental: bool, chunk_bytes: int) -> None:
    if wanted is not None and not isinstance(wanted, bool):
        raise TypeError(f"device_diff must be None, True or False, got {wanted!r}")
    if not wanted:
        return
    if not incremental:
        raise ValueError("device_diff=True needs incremental=True (it skips unchanged chunks)")
    if not DeviceDiff.usable(chunk_bytes):
        raise ValueError(
            f"device_diff=True needs chunk_bytes of whole 32-bit words, got {chunk_bytes}"
        )
