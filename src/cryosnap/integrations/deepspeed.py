"""DeepSpeed integration: cryosnap as the checkpoint engine of a ``DeepSpeedEngine``.

:class:`CryosnapCheckpointEngine` turns the files one ``engine.save_checkpoint`` writes (a dict
per file) into one cryosnap version, captured at the next step boundary (DeepSpeed's decoupled
commit, before the optimizer step) and written in the background, each data-parallel rank
writing 1/N of the files every rank holds alike; ``engine.load_checkpoint`` reads them back,
verified. :func:`install` puts it on an engine, :func:`register` on every engine whose config
has a ``"cryosnap"`` section. Runs on the training loop's thread of every rank (collectives on
a channel of its own); the writes run on the Checkpointer's writer thread. :func:`consolidate`
is DeepSpeed's ``zero_to_fp32`` over a version (one process, no collectives).
docs/design/integrations.md has how tags map to steps and what is not supported.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import importlib
import logging
import os
import shutil
import tempfile
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

import cryosnap
from cryosnap.checkpointer import Checkpointer, PendingSave
from cryosnap.dist import Coordinator, TorchCoordinator, agree
from cryosnap.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    CoordinationError,
    KeyNotFoundError,
    StateMismatchError,
    UnsupportedError,
    WorldSizeError,
)

__all__ = [
    "CONFIG_KEY",
    "CryosnapCheckpointEngine",
    "ENGINE_NAME",
    "consolidate",
    "install",
    "install_over",
    "register",
]

log = logging.getLogger("cryosnap")

ENGINE_NAME = "CryosnapCheckpointEngine"
# The section of a DeepSpeed config that register() looks for: Checkpointer arguments, "path"
# included (as Checkpointer.from_config takes them).
CONFIG_KEY = "cryosnap"
# The top-level key of a version that describes the DeepSpeed checkpoint it holds (_Entry).
META = "cryosnap.deepspeed"
_FORMAT = 1
# A file's owner in META["files"] for a file every rank saved alike (written 1/N by each).
_EVERY_RANK = -1
# The key of an encoded object (a torch.Size, or a DeepSpeed enum or object) in a stored dict.
_TYPE = "cryosnap.deepspeed:type"


# -- what a version holds ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    """One DeepSpeed checkpoint, as its version's META key describes it: the tag DeepSpeed
    named it by, the save directory (``""``: the run's own path), whether it was saved as the
    latest (``save_latest``), how it was saved, and which rank saved each file
    (``_EVERY_RANK``: all of them, alike)."""

    step: int
    tag: str
    directory: str
    latest: bool
    zero_stage: int
    dp_world_size: int
    files: Mapping[str, int]

    @classmethod
    def read(cls, step: int, meta: Any) -> _Entry:
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise CheckpointFormatError(
                f"step {step}: {META} is not a DeepSpeed checkpoint description of format "
                f"{_FORMAT}: {meta!r:.200}",
                step=step,
            )
        return cls(
            step=step,
            tag=str(meta["tag"]),
            directory=str(meta["save_dir"]),
            latest=bool(meta["save_latest"]),
            zero_stage=int(meta["zero_stage"]),
            dp_world_size=int(meta["dp_world_size"]),
            files={str(k): int(v) for k, v in meta["files"].items()},
        )

    def shared(self, name: str) -> bool:
        return self.files.get(name) == _EVERY_RANK

    def model_files(self) -> list[str]:
        return sorted(n for n in self.files if n.endswith("model_states.pt"))

    def part_of(self, rank: int, names: list[str]) -> list[str]:
        """Those of ``names`` that rank ``rank``'s part of the version holds."""
        return [n for n in names if self.files.get(n) in (_EVERY_RANK, rank)]


@dataclass(slots=True)
class _Collecting:
    """The files of one ``save_checkpoint`` so far, on this rank (committed together)."""

    info: CheckpointCommitInfo
    directory: str
    files: dict[str, Any] = field(default_factory=dict)
    step: int | None = None


@dataclass(slots=True)
class _Loading:
    """One ``load_checkpoint`` under way: the version, the folder DeepSpeed is shown (empty
    files named as the version's), and this rank's files of it, restored."""

    entry: _Entry
    folder: str
    files: dict[str, Any]


# -- the engine ---------------------------------------------------------------------------------


class CryosnapCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """DeepSpeed's checkpoint engine over one cryosnap :class:`~cryosnap.Checkpointer`.

    Decoupled: ``save_checkpoint`` only collects the files' dicts (no copy: DeepSpeed does not
    clone them for this engine); the version is captured and committed when DeepSpeed calls
    :meth:`commit`, at the next step boundary before the optimizer step, and is written in the
    background (the next commit waits while the one before is still being written). A version
    is saved as cryosnap step ``engine.global_steps``, its tag recorded in it. Built by
    :func:`install` (or :func:`register`), which opens the Checkpointer (collective).
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        *,
        engine: DeepSpeedEngine,
        channel: Coordinator,
        run: str,
    ) -> None:
        super().__init__(None)
        self.name = ENGINE_NAME
        self._ckpt = checkpointer
        self._engine = weakref.ref(engine)
        self._channel = channel
        self._run = run
        self._collecting: _Collecting | None = None
        self._loading: _Loading | None = None
        self._pending: PendingSave | None = None
        self._entries: dict[int, _Entry | None] = {}
        # The step a save must be above: the last one saved, or the one restored.
        self._floor: int | None = None
        self._step_given: int | None = None  # save_with's step, over the engine's
        self._closed = False

    # -- what DeepSpeed asks of an engine ------------------------------------------------------

    def is_decoupled(self) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # cryosnap stores each view's own bytes: DeepSpeed need not clone

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return True  # every rank saves the replicated files: each writes 1/N of them

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """DeepSpeed's folders, outside the run only (the HF Trainer looks for the tag folders
        in its save directories); the run's own directory holds cryosnap's files alone."""
        if "://" in path or "://" in self._run or _inside(path, self._run):
            return
        os.makedirs(path, exist_ok=exist_ok)

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The save waiting for its commit (None: none). Its ``save_latest`` is False, so
        DeepSpeed writes no ``latest`` file naming a version not yet durable: a load without
        a tag takes the newest version saved with ``save_latest`` from the run instead."""
        c = self._collecting
        return None if c is None else dataclasses.replace(c.info, save_latest=False)

    def create(self, info: CheckpointCommitInfo) -> None:
        """A save begins (every rank): a save not yet committed is committed first."""
        self._check_open()
        if self._collecting is not None:
            self.commit(self._collecting.info)  # saved twice without a step between
        self._collecting = _Collecting(info, _directory(self._run, info.save_dir))

    def save(self, state_dict: Any, path: str) -> None:
        """One file of the checkpoint: its dict joins the version under its name in the tag
        folder. A file outside the tag folder (``save_16bit_model``) is written as it is."""
        c = self._collecting
        if c is None:
            raise CheckpointError(f"{ENGINE_NAME}.save({path!r}) without create()")
        folder = os.path.join(c.info.save_dir, c.info.tag)
        name = os.path.relpath(path, folder)
        if name.startswith(os.pardir):
            _export(state_dict, path)
            return
        try:
            if c.step is None:
                c.step = self._check_step(c.info.tag)
            c.files[name] = _encode(
                state_dict, f"{c.info.tag}/{name}", allow_pickle=self._ckpt.allow_pickle
            )
        except BaseException:
            self._collecting = None
            raise

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Capture and commit the collected files as one version (every rank; collective).
        Returns once captured; the version is written in the background."""
        c, self._collecting = self._collecting, None
        if c is not None:
            self._commit(c, {})
        return True

    def _commit(self, c: _Collecting, extra: Mapping[str, Any]) -> PendingSave | None:
        """The version of ``c``'s files, ``extra``'s top-level keys beside them (None: no rank
        saved a file of a checkpoint, as ``save_16bit_model``'s commit)."""
        # The leader checks the steps and makes the table of files (it names every rank's
        # files: DeepSpeed's layout needs it on every rank, O(N) in N, as its files are).
        decided = agree(self._channel, [c.step, sorted(c.files)], _decide_files)
        if decided is None:
            return None
        if "error" in decided:
            raise CoordinationError(f"tag {c.info.tag!r}: {decided['error']}", path=self._run)
        step = int(decided["step"])
        files: dict[str, int] = decided["files"]
        meta = {
            "format": _FORMAT,
            "tag": c.info.tag,
            "save_dir": c.directory,
            "save_latest": bool(c.info.save_latest),
            "zero_stage": self._deepspeed().zero_optimization_stage(),
            "dp_world_size": self._channel.world_size,
            "files": files,
        }
        everyone = [n for n, owner in files.items() if owner == _EVERY_RANK]
        state = {META: meta, **extra, **c.files}
        self._pending = self._ckpt.save(step, state, replicated=[META, *everyone])
        self._entries[step] = _Entry.read(step, meta)
        self._floor = step
        return self._pending

    def save_with(self, step: int, extra: Mapping[str, Any]) -> PendingSave:
        """``engine.save_checkpoint(run, tag=f"step{step}")`` as version ``step``, with
        ``extra`` (top-level keys, none named like a DeepSpeed file) in the same version,
        captured before it returns and written in the background (every rank; collective).
        For a caller that keeps state of its own beside the engine's: Accelerate's
        :class:`~cryosnap.integrations.accelerate.Checkpoints`."""
        self._check_open()
        self.commit_pending()
        self._step_given = step
        try:
            self._deepspeed().save_checkpoint(self._run, tag=f"step{step}")
        finally:
            self._step_given = None
        c, self._collecting = self._collecting, None
        pending = None if c is None else self._commit(c, extra)
        if pending is None:
            raise CheckpointError(f"step {step}: DeepSpeed's save_checkpoint saved no file")
        return pending

    def load(self, path: str, map_location: Any = None) -> Any:
        """The dict of one file of a version, verified. Inside ``load_checkpoint``, from the
        version it restored; else read from the run (the persistent level)."""
        loading = self._loading
        if loading is not None:
            name = os.path.relpath(path, loading.folder)
            entry = loading.entry
            if name in loading.files:
                return _placed(loading.files[name], map_location)
        else:
            entry = self._find(os.path.dirname(os.path.dirname(path)), _tag_of(path))
            name = os.path.basename(path)
        if name not in entry.files:
            raise CheckpointNotFoundError(
                f"tag {entry.tag!r} (step {entry.step} of {self._run}) holds no file {name!r}: "
                f"it holds {sorted(entry.files)} (saved at ZeRO stage {entry.zero_stage} by "
                f"{entry.dp_world_size} data-parallel rank(s))",
                step=entry.step,
                path=self._run,
            )
        owner = max(entry.files[name], 0)
        state = cryosnap.load(
            self._ckpt.persistent,
            step=entry.step,
            keys=[name],
            rank=owner,
            allow_pickle=self._ckpt.allow_pickle,
        )
        return _placed(_decode(state[name]), map_location)

    def commit_pending(self) -> None:
        """Commit the save waiting for the next step boundary now (every rank)."""
        if self._collecting is not None:
            self.commit(self._collecting.info)

    def cleanup(self) -> None:
        """``engine.destroy()``: commit what is pending, wait until durable, release the run."""
        self.close()

    def close(self) -> None:
        """Commit the save not yet committed, wait until every version is durable, release
        the run (every rank; also at interpreter exit)."""
        if self._closed:
            return
        try:
            self.commit_pending()
        finally:
            self._closed = True
            self._ckpt.close()

    # -- what this engine adds -------------------------------------------------------------------

    @property
    def checkpointer(self) -> Checkpointer:
        """The run's Checkpointer (its steps, status, restore...)."""
        return self._ckpt

    @property
    def pending(self) -> PendingSave | None:
        """The newest version this engine committed (``.result()``: its SaveInfo once
        durable), or None."""
        return self._pending

    def tags(self, save_dir: str | os.PathLike[str] | None = None) -> dict[str, int]:
        """The versions saved with ``save_dir`` (default: the run's path), tag -> step,
        oldest first (read-only; a save not yet committed is not one)."""
        where = _directory(self._run, self._run if save_dir is None else os.fspath(save_dir))
        return {e.tag: e.step for e in self._versions() if e.directory == where}

    # -- loading ----------------------------------------------------------------------------------

    def load_checkpoint(
        self, original: Callable[..., Any], load_dir: str, tag: str | None, flags: _Flags
    ) -> tuple[str | None, Any]:
        """``engine.load_checkpoint`` (see :func:`install`): find the version, check that
        this engine can load it, restore it (collective) and let DeepSpeed read its files."""
        self._check_open()
        self.commit_pending()
        self._ckpt.wait()  # what was just saved is a version before it is looked for
        flags.refuse_unsupported(self._deepspeed(), self._run)
        entry = self._lookup(load_dir, tag)
        if entry is None:
            log.warning(
                "cryosnap: %s holds no DeepSpeed checkpoint saved with save_dir %s: nothing "
                "loaded (as DeepSpeed without a 'latest' file)",
                self._run,
                load_dir,
            )
            return None, None
        only = self._check_loadable(entry, flags)
        wanted = entry.model_files() if flags.module_only else sorted(entry.files)
        names = entry.part_of(-1 if only else self._channel.rank, wanted)
        restored = self._ckpt.restore(entry.step, keys=[META, *names], replicated_only=only)
        self._floor = entry.step
        files = {n: _decode(v) for n, v in restored.items() if n != META}
        shown = tempfile.mkdtemp(prefix="cryosnap-deepspeed-")
        try:
            folder = _placeholders(shown, entry)
            self._loading = _Loading(entry, folder, files)
            load_path, client_state = original(shown, entry.tag, **flags.keywords())
        finally:
            self._loading = None
            shutil.rmtree(shown, ignore_errors=True)
        if load_path is not None:
            load_path = os.path.join(load_dir, entry.tag, os.path.relpath(load_path, folder))
        return load_path, client_state

    def _lookup(self, load_dir: str, tag: str | None) -> _Entry | None:
        if tag is not None:
            return self._find(load_dir, str(tag))
        where = _directory(self._run, load_dir)
        found = [e for e in self._versions() if e.directory == where and e.latest]
        return found[-1] if found else None

    def _find(self, load_dir: str, tag: str) -> _Entry:
        where = _directory(self._run, load_dir)
        versions = self._versions()
        found = [e for e in versions if e.tag == tag and e.directory == where]
        if not found:
            known = [e.tag for e in versions if e.directory == where]
            raise CheckpointNotFoundError(
                f"no DeepSpeed checkpoint tagged {tag!r} in {self._run} (save_dir {load_dir}): "
                f"it holds the tags {known!r:.300}",
                path=self._run,
            )
        return found[-1]

    def _check_loadable(self, entry: _Entry, flags: _Flags) -> bool:
        """Refuse a version this engine cannot load; whether only its replicated files are
        read (another data-parallel size, where that is enough)."""
        stage = self._deepspeed().zero_optimization_stage()
        if entry.zero_stage != stage:
            raise StateMismatchError(
                f"tag {entry.tag!r} (step {entry.step} of {self._run}) was saved at ZeRO stage "
                f"{entry.zero_stage}, this engine runs stage {stage}: DeepSpeed's files differ "
                f"between stages. Load it with zero_optimization.stage = {entry.zero_stage}",
                step=entry.step,
                path=self._run,
            )
        world = self._channel.world_size
        if entry.dp_world_size == world:
            return False
        wanted = entry.model_files() if flags.module_only else list(entry.files)
        if all(entry.shared(n) for n in wanted):
            return True  # every file it needs is one every rank saved alike
        raise WorldSizeError(
            f"tag {entry.tag!r} (step {entry.step} of {self._run}) was saved by "
            f"{entry.dp_world_size} data-parallel rank(s) at ZeRO stage {entry.zero_stage}, "
            f"and {world} load it: DeepSpeed cannot re-partition ZeRO state (nor can it from "
            "its own files). Ways on: restart at "
            f"{entry.dp_world_size} ranks; load_checkpoint(..., load_module_only=True) at "
            "ZeRO stage 0-2 (the model weights, saved alike by every rank, load at any size); "
            f"or cryosnap.load({self._run!r}, step={entry.step}, rank=k) to reshard the "
            "optimizer state yourself",
            step=entry.step,
            path=self._run,
        )

    def _versions(self) -> list[_Entry]:
        """The run's DeepSpeed checkpoints, oldest first (each version's META read once)."""
        out = []
        for step in self._ckpt.steps():
            if step not in self._entries:
                self._entries[step] = self._read_entry(step)
            entry = self._entries[step]
            if entry is not None:
                out.append(entry)
        return out

    def _read_entry(self, step: int) -> _Entry | None:
        stores = [self._ckpt.store, self._ckpt.persistent]
        for store in dict.fromkeys(stores):
            try:
                meta = cryosnap.load(store, step=step, keys=[META])[META]
            except KeyNotFoundError:
                return None  # a version that is not a DeepSpeed checkpoint
            except CheckpointNotFoundError:
                continue  # not on this level (yet, or any more)
            return _Entry.read(step, meta)
        return None

    # -- saving -----------------------------------------------------------------------------------

    def _check_step(self, tag: str) -> int:
        """The step of a save of ``tag``: the engine's global step, above every step saved or
        restored before (one version per step; a new training does not mix with an old)."""
        given = self._step_given
        step = int(self._deepspeed().global_steps) if given is None else given
        if self._floor is not None and step <= self._floor:
            raise CheckpointExistsError(
                f"tag {tag!r}: global step {step} is not above step {self._floor}, which "
                f"this engine saved or loaded last in {self._run}: cryosnap keeps one version "
                "per global step (save once per step)",
                step=step,
                path=self._run,
            )
        newest = self._ckpt.latest_step() if self._floor is None else None
        if newest is not None and step <= newest:
            raise CheckpointExistsError(
                f"tag {tag!r}: {self._run} already holds checkpoints up to global step "
                f"{newest} of another training, and this one is at step {step}. To go on "
                "with that training, engine.load_checkpoint() first; to start a new one, "
                "give it a new path",
                step=step,
                path=self._run,
            )
        return step

    def _deepspeed(self) -> DeepSpeedEngine:
        engine = self._engine()
        if engine is None:
            raise CheckpointError(f"{ENGINE_NAME}: its DeepSpeed engine is gone")
        return engine

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{ENGINE_NAME} of {self._run} is closed")


@dataclass(frozen=True, slots=True)
class _Flags:
    """The keywords of one ``load_checkpoint`` call, as DeepSpeed names them."""

    module_strict: bool
    optimizer_states: bool
    lr_scheduler_states: bool
    module_only: bool
    custom_load_fn: Callable[..., Any] | None

    def keywords(self) -> dict[str, Any]:
        return {
            "load_module_strict": self.module_strict,
            "load_optimizer_states": self.optimizer_states,
            "load_lr_scheduler_states": self.lr_scheduler_states,
            "load_module_only": self.module_only,
            "custom_load_fn": self.custom_load_fn,
        }

    def refuse_unsupported(self, engine: DeepSpeedEngine, run: str) -> None:
        """The loads for which DeepSpeed reads files from the save folder itself."""
        if engine.load_universal_checkpoint():
            raise UnsupportedError(
                "a universal checkpoint (checkpoint.load_universal) is read by DeepSpeed from "
                f"its own folders, which a cryosnap run ({run}) does not hold: load the "
                "cryosnap version at the data-parallel size that saved it",
                path=run,
            )
        if engine.zero_optimization_partition_weights() and not self.optimizer_states:
            raise UnsupportedError(
                "load_optimizer_states=False at ZeRO stage 3: DeepSpeed then gathers the fp32 "
                "weights from the tag's files on disk (get_fp32_state_dict_from_zero_checkpoint), "
                f"which a cryosnap run ({run}) does not hold. Load with "
                "load_optimizer_states=True",
                path=run,
            )


# -- installing ---------------------------------------------------------------------------------


def install(
    engine: DeepSpeedEngine, path: str | os.PathLike[str], **checkpointer_options: Any
) -> CryosnapCheckpointEngine:
    """Make ``engine.save_checkpoint`` / ``engine.load_checkpoint`` go through cryosnap: after
    ``deepspeed.initialize``, on every rank (collective: it opens the run).

    ``path`` is the run (a directory or an fsspec URL); save and load with it as the
    directory (``engine.save_checkpoint(path, tag=...)``, ``engine.load_checkpoint(path)``).
    ``checkpointer_options`` go to :class:`~cryosnap.Checkpointer` (``keep``, ``scratch``,
    ``chunk_bytes``, ``allow_pickle``...); ``comm`` defaults to the torch.distributed job.
    Returns the engine it installed; ``engine.destroy()`` (or its ``close()``, or the
    interpreter's exit) commits what is pending and waits until it is durable.
    """
    run = os.fspath(path)
    options = dict(checkpointer_options)
    comm = options.pop("comm", None)

    def opened(coord: Coordinator) -> Checkpointer:
        return Checkpointer(run, comm=coord, **options)

    return _attach(engine, run, opened, comm)


def register() -> None:
    """Make every ``DeepSpeedEngine`` built after this call whose config has a ``"cryosnap"``
    section use cryosnap, as :func:`install` would (for code that builds the engine itself:
    the HF Trainer, Accelerate). The section holds the Checkpointer's arguments, ``path``
    included: ``"cryosnap": {"path": "runs/x", "keep": 3}``. Calling it again does nothing."""
    configure = DeepSpeedEngine._configure_checkpointing
    if getattr(configure, "_cryosnap", False):
        return

    def configure_checkpointing(self: DeepSpeedEngine) -> None:
        configure(self)
        section = self._config._param_dict.get(CONFIG_KEY)
        if section is not None:
            _install_from_config(self, section)

    configure_checkpointing._cryosnap = True  # type: ignore[attr-defined]
    DeepSpeedEngine._configure_checkpointing = configure_checkpointing


def install_over(
    engine: DeepSpeedEngine, path: str | os.PathLike[str], checkpointer: Checkpointer
) -> CryosnapCheckpointEngine:
    """:func:`install` over ``checkpointer``, already open on the run ``path`` (every rank):
    for a caller that saves its own state beside the engine's in the same versions
    (:meth:`CryosnapCheckpointEngine.save_with`). Closing the engine closes ``checkpointer``."""

    def opened(_coord: Coordinator) -> Checkpointer:
        return checkpointer

    return _attach(engine, os.fspath(path), opened, checkpointer.coordinator)


def _install_from_config(engine: DeepSpeedEngine, section: Any) -> None:
    if not isinstance(section, Mapping) or not isinstance(section.get("path"), str):
        raise ConfigError(
            f'the DeepSpeed config\'s "{CONFIG_KEY}" section must be a dict of Checkpointer '
            f'arguments with a "path" (a str), got {section!r:.200}'
        )
    arguments = dict(section)

    def opened(coord: Coordinator) -> Checkpointer:
        return Checkpointer.from_config(arguments, comm=coord)

    _attach(engine, arguments["path"], opened, None)


def _attach(
    engine: DeepSpeedEngine,
    run: str,
    opened: Callable[[Coordinator], Checkpointer],
    comm: Coordinator | None,
) -> CryosnapCheckpointEngine:
    """Open the run and put its engine on ``engine`` (every rank)."""
    _refuse_unsupported(engine, run)
    coord = TorchCoordinator() if comm is None else comm
    ckpt = opened(coord)
    try:
        ours = CryosnapCheckpointEngine(
            ckpt, engine=engine, channel=coord.channel("deepspeed"), run=run
        )
    except BaseException:
        ckpt.close()
        raise
    before = engine.checkpoint_engine
    if before is not None and before.is_decoupled():
        before.cleanup()
    engine.checkpoint_engine = ours
    # Every rank saves the files replicated across data-parallel ranks (1/N each), not rank 0.
    engine.save_non_zero_checkpoint = True
    # DeepSpeed copies zero_to_fp32.py into the save folder; it cannot read a cryosnap run.
    engine._copy_recovery_script = _nothing
    # The model states file holds the tied weights' names; DeepSpeed lists them on rank 0 only,
    # and the file is replicated: every rank must save the same.
    engine._get_shared_params = types.MethodType(_shared_params, engine)
    engine.load_checkpoint = _load_through(ours, engine.load_checkpoint)
    atexit.register(_close_at_exit, weakref.ref(ours))
    return ours


def _refuse_unsupported(engine: DeepSpeedEngine, run: str) -> None:
    """What this engine cannot checkpoint yet: a clear error before anything is saved."""
    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"engine must be a deepspeed DeepSpeedEngine, got {type(engine).__name__}")
    why = None
    if engine.has_moe_layers:
        why = "a model with MoE layers (expert files per expert-parallel rank)"
    elif engine.mp_world_size > 1 or type(engine).__name__ == "PipelineEngine":
        why = "tensor or pipeline parallelism (files per model-parallel rank)"
    elif engine.seq_dp_world_size != torch.distributed.get_world_size():
        why = "sequence parallelism (data-parallel ranks are not the whole job)"
    elif engine.zero_nvme_offload_optimizer():
        why = "ZeRO's NVMe offload of the optimizer (DeepSpeed copies its swap files itself)"
    if why is not None:
        raise UnsupportedError(
            f"cryosnap's DeepSpeed engine does not checkpoint {why} yet: keep DeepSpeed's own "
            "checkpoint engine for this job",
            path=run,
        )


def _load_through(
    ours: CryosnapCheckpointEngine, original: Callable[..., Any]
) -> Callable[..., tuple[str | None, Any]]:
    """``engine.load_checkpoint`` with DeepSpeed's signature, reading from cryosnap."""

    def load_checkpoint(
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, Any]:
        flags = _Flags(
            module_strict=load_module_strict,
            optimizer_states=load_optimizer_states,
            lr_scheduler_states=load_lr_scheduler_states,
            module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )
        return ours.load_checkpoint(original, os.fspath(load_dir), tag, flags)

    load_checkpoint.__doc__ = original.__doc__
    return load_checkpoint


def _close_at_exit(ref: weakref.ref[CryosnapCheckpointEngine]) -> None:
    ours = ref()
    if ours is None:
        return
    try:
        ours.close()
    except Exception as exc:  # at exit: say it, do not mask the program's own exit
        log.error("cryosnap: closing the DeepSpeed checkpoint engine at exit: %s", exc)


def _nothing(*args: Any) -> None:
    return None


def _shared_params(engine: DeepSpeedEngine) -> dict[str, str]:
    """DeepSpeed's ``_get_shared_params`` on every rank (its own answers ``{}`` on all ranks but
    0): each tied parameter's name -> the name of the parameter that holds its data, found in
    the order DeepSpeed walks the module."""
    zero3 = engine.zero_optimization_partition_weights() and any(
        hasattr(p, "ds_id") for p in engine.module.parameters()
    )
    first: dict[Any, str] = {}
    shared: dict[str, str] = {}

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, param in module.named_parameters(recurse=False):
            if param is None or (zero3 and not hasattr(param, "ds_id")):
                continue
            key = prefix + name
            identity = getattr(param, "ds_id", None) if zero3 else param.data_ptr()
            if identity in first:
                shared[key] = first[identity]
            else:
                first[identity] = key
        for name, child in module.named_children():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(engine.module, "")
    return shared


# -- consolidating ------------------------------------------------------------------------------


def consolidate(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    tag: str | None = None,
) -> int:
    """DeepSpeed's ``zero_to_fp32`` over a cryosnap run: the full fp32 model state dict of one
    DeepSpeed version written to ``out`` (a ``.safetensors`` file); returns its step.

    The version is ``step``, else the newest tagged ``tag``, else the newest DeepSpeed
    version of the run at ``path``. Every saved rank's part is read (each chunk verified),
    DeepSpeed's files of the tag are written to a temporary folder as DeepSpeed's engine
    writes them (``torch.save``), DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``
    consolidates them, and the folder is removed. ZeRO stages 1-3; one process, no
    collectives, no lock. A version that is not a DeepSpeed checkpoint is a
    :class:`~cryosnap.CheckpointFormatError`. Tied weights are written once per name.
    """
    run, target = os.fspath(path), os.fspath(out)
    if not target.endswith(".safetensors"):
        raise ValueError(f"out must be a .safetensors file path, got {target!r}")
    entry = _entry_of(run, step, tag)
    if entry.zero_stage not in (1, 2, 3):
        raise UnsupportedError(
            f"tag {entry.tag!r} (step {entry.step} of {run}) was saved at ZeRO stage "
            f"{entry.zero_stage}: DeepSpeed consolidates ZeRO 1-3 checkpoints. At stage 0 the "
            f"model states file holds the full weights: cryosnap.load({run!r}, step="
            f'{entry.step}, keys=["mp_rank_00_model_states.pt"])',
            step=entry.step,
            path=run,
        )
    folder = tempfile.mkdtemp(prefix="cryosnap-zero-to-fp32-")
    try:
        _write_files(run, entry, os.path.join(folder, entry.tag))
        state = get_fp32_state_dict_from_zero_checkpoint(folder, tag=entry.tag)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    from safetensors.torch import save_file

    # Written beside ``out`` and renamed over it: a failure leaves no partial file there.
    partial = f"{target}.{os.getpid()}.partial"
    try:
        save_file(_unshared(state), partial, metadata={"format": "pt"})
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
    return entry.step


def _entry_of(run: str, step: int | None, tag: str | None) -> _Entry:
    """The DeepSpeed version ``step`` (its tag ``tag`` if given), else the newest tagged
    ``tag``, else the newest DeepSpeed version of ``run``."""
    if step is not None:
        entry = _entry_at(run, step)
        if entry is None:
            raise CheckpointFormatError(
                f"step {step} of {run} is not a DeepSpeed checkpoint: it holds no {META!r} "
                "key (versions saved by cryosnap's DeepSpeed engine do)",
                step=step,
                path=run,
            )
        if tag is not None and entry.tag != tag:
            raise CheckpointNotFoundError(
                f"step {step} of {run} is the DeepSpeed tag {entry.tag!r}, not {tag!r}",
                step=step,
                path=run,
            )
        return entry
    tags = []
    for s in reversed(cryosnap.Run(run).steps()):
        found = _entry_at(run, s)
        if found is not None and (tag is None or found.tag == tag):
            return found
        if found is not None:
            tags.append(found.tag)
    if not tags:
        raise CheckpointFormatError(
            f"{run} holds no DeepSpeed checkpoint (no version has a {META!r} key)", path=run
        )
    raise CheckpointNotFoundError(
        f"no DeepSpeed checkpoint tagged {tag!r} in {run}: it holds the tags {tags[::-1]!r:.300}",
        path=run,
    )


def _entry_at(run: str, step: int) -> _Entry | None:
    """Version ``step``'s DeepSpeed description (None: not a DeepSpeed version)."""
    try:
        meta = cryosnap.load(run, step=step, keys=[META])[META]
    except KeyNotFoundError:
        return None
    return _Entry.read(step, meta)


def _write_files(run: str, entry: _Entry, folder: str) -> None:
    """DeepSpeed's files of ``entry`` in ``folder``, as its engine's ``torch.save`` writes
    them: each rank's part read in turn (a file every rank saved alike, from part 0)."""
    os.makedirs(folder)
    for rank in range(entry.dp_world_size):
        names = [n for n, owner in entry.files.items() if max(owner, 0) == rank]
        if not names:
            continue
        state = cryosnap.load(run, step=entry.step, keys=names, rank=rank)
        for name in names:
            target = os.path.join(folder, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            torch.save(_decode(state.pop(name)), target)


def _unshared(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as safetensors takes it: contiguous tensors, none sharing memory with
    another (tied weights, ZeRO 1-2's views of one flat buffer): all but the first copied."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and ptr in storages:
            t = t.clone()
        storages.add(ptr)
        out[name] = t
    return out


# -- files and folders --------------------------------------------------------------------------


def _directory(run: str, save_dir: str | os.PathLike[str]) -> str:
    """How a version records its save directory: ``""`` for the run's own path (so that a
    moved run still loads), else the directory, absolute."""
    return "" if _normal(save_dir) == _normal(run) else _normal(save_dir)


def _normal(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text.rstrip("/") if "://" in text else os.path.abspath(text)


def _inside(path: str, run: str) -> bool:
    """Whether local ``path`` is ``run`` or a folder inside it."""
    inner, outer = _normal(path), _normal(run)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _tag_of(path: str) -> str:
    return os.path.basename(os.path.dirname(path))


def _decide_files(told: list[list[Any]]) -> dict[str, Any] | None:
    """The leader's decision over every rank's ``[step, file names]``: None when no rank saved
    a file, an error when the ranks saved at different steps, else the step and the owners."""
    steps = {s for s, names in told if names}
    if not steps:
        return None
    if len(steps) != 1 or None in steps:
        return {"error": f"the ranks saved it at different global steps {told!r:.200}"}
    return {"step": steps.pop(), "files": _owners([names for _s, names in told])}


def _owners(names: list[list[str]]) -> dict[str, int]:
    """Each file's owner: ``_EVERY_RANK`` for a name every rank saved, else its rank."""
    everyone = set(names[0]).intersection(*names[1:])
    owners = {n: _EVERY_RANK for n in sorted(everyone)}
    for rank, mine in enumerate(names):
        for n in mine:
            owners.setdefault(n, rank)
    return owners


def _placeholders(root: str, entry: _Entry) -> str:
    """``root/<tag>/`` with an empty file per file of the version: DeepSpeed looks the files
    up on disk (glob, exists) before it asks the engine for them."""
    folder = os.path.join(root, entry.tag)
    os.makedirs(folder, exist_ok=True)
    for name in entry.files:
        target = os.path.join(folder, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb"):
            pass
    return folder


def _export(state_dict: Any, path: str) -> None:
    """A file outside a checkpoint (``save_16bit_model``): written as DeepSpeed writes it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(clone_tensors_for_torch_save(state_dict), path)


def _placed(value: Any, map_location: Any) -> Any:
    """``value`` with its tensors on ``map_location`` where that names a device (restored
    tensors are on the CPU; DeepSpeed asks for the CPU or passes an identity function)."""
    if not isinstance(map_location, (str, torch.device)):
        return value
    device = torch.device(map_location)
    if device.type == "cpu":
        return value
    return _tree_map(value, lambda t: t.to(device))


def _tree_map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        items = [(k, _tree_map(v, fn)) for k, v in value.items()]
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if type(value) in (list, tuple):
        values = [_tree_map(v, fn) for v in value]
        return values if type(value) is list else tuple(values)
    return value


# -- what DeepSpeed stores besides plain data ---------------------------------------------------

_SCALARS = (int, float, str, bool, bytes, type(None))


def _encode(obj: Any, where: str, *, allow_pickle: bool) -> Any:
    """``obj`` (a file's dict) as cryosnap stores it without pickle: ``torch.Size``, dtypes,
    devices and DeepSpeed's own enums and objects (its loss scaler, fragment addresses)
    become tagged dicts :func:`_decode` rebuilds. Any other object is refused with a
    ``TypeError`` naming its path (cryosnap pickles it with ``allow_pickle``). Tensors are not
    copied."""
    if type(obj) in _SCALARS or isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return obj
    if type(obj) is torch.Size:
        return {_TYPE: "torch.Size", "value": list(obj)}
    if isinstance(obj, (torch.dtype, torch.device)):
        return {_TYPE: f"torch.{type(obj).__name__}", "value": str(obj)}
    if isinstance(obj, dict):
        items = [(k, _encode(v, f"{where}/{k}", allow_pickle=allow_pickle)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if type(obj) in (list, tuple):
        values = [_encode(v, f"{where}/{i}", allow_pickle=allow_pickle) for i, v in enumerate(obj)]
        return values if type(obj) is list else tuple(values)
    cls = type(obj)
    if _is_deepspeed(cls.__module__):
        if isinstance(obj, enum.Enum):
            return {_TYPE: "enum", "class": _class_name(cls), "value": obj.value}
        if getattr(obj, "__dict__", None) is not None:
            state = _encode(vars(obj), where, allow_pickle=allow_pickle)
            return {_TYPE: "object", "class": _class_name(cls), "state": state}
    if allow_pickle:
        return obj
    raise TypeError(
        f"cannot checkpoint {where} without pickle: {cls.__module__}.{cls.__qualname__}. "
        "Put plain data (tensors, numbers, str, lists, dicts) in client_state, or pass "
        "allow_pickle=True to cryosnap"
    )


def _decode(obj: Any) -> Any:
    """The inverse of :func:`_encode`: a stored file's dict as DeepSpeed saved it."""
    if isinstance(obj, dict):
        if _TYPE in obj:
            return _rebuild(obj)
        items = [(k, _decode(v)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if type(obj) in (list, tuple):
        values = [_decode(v) for v in obj]
        return values if type(obj) is list else tuple(values)
    return obj


def _rebuild(obj: dict[str, Any]) -> Any:
    kind = obj[_TYPE]
    if kind == "torch.Size":
        return torch.Size(obj["value"])
    if kind == "torch.dtype":
        dtype = getattr(torch, str(obj["value"]).removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    if kind == "torch.device":
        return torch.device(obj["value"])
    if kind == "enum":
        return _class(obj["class"])(obj["value"])
    if kind == "object":
        cls: Any = _class(obj["class"])
        out = cls.__new__(cls)
        out.__dict__.update(_decode(obj["state"]))
        return out
    raise CheckpointFormatError(f"an encoded DeepSpeed value of unknown kind: {obj!r:.200}")


def _is_deepspeed(module: str) -> bool:
    return module == "deepspeed" or module.startswith("deepspeed.")


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _class(name: Any) -> type[Any]:
    """A DeepSpeed class named by :func:`_class_name`; any other name is refused (a stored
    name never imports a module outside DeepSpeed)."""
    module, _colon, qualname = str(name).partition(":")
    if not _is_deepspeed(module) or not qualname:
        raise CheckpointFormatError(f"a stored DeepSpeed object names the class {name!r}")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise CheckpointFormatError(f"a stored DeepSpeed object names {name!r}: not a class")
    return found
