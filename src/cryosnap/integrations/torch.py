"""Exact resume for PyTorch training loops: random number generators and data order.

:class:`RNGState`, :class:`ResumableSampler` and :class:`ResumableLoader` are *stateful*
objects whose state dicts hold only what cryosnap saves without pickle.
Runs on the caller's thread. Importing this module imports torch if it is installed;
``import cryosnap`` does not import this module. docs/design/integrations.md has an example.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from cryosnap._run import ddp as _ddp
from cryosnap._validate import integer, non_negative_int, positive_int, wrong_type
from cryosnap.errors import StateMismatchError

_T_co = TypeVar("_T_co", covariant=True)
_Setter = Callable[[], object]

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

    _HAVE_TORCH: bool
else:
    try:
        import torch
        from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
    except ImportError:  # pragma: no cover - exercised in a subprocess without torch
        torch = DataLoader = Dataset = IterableDataset = None
        _HAVE_TORCH = False

        class Sampler(Generic[_T_co]):
            """Stand-in base class so this module (and RNGState) imports without torch."""

    else:
        _HAVE_TORCH = True

__all__ = [
    "RNGState",
    "ResumableLoader",
    "ResumableSampler",
    "arm_ddp_resume",
    "prepare_ddp_resume",
]

_PY_STATE_WORDS = 625  # random.getstate(): 624 Mersenne Twister words and the position


def _require_torch(what: str) -> None:
    if not _HAVE_TORCH:
        raise ImportError(f"{what} needs torch (pip install 'cryosnap[torch]')")


# ---------------------------------------------------------------------------------------------
# random number generators


class RNGState:
    """Every global random number generator of this process, as a stateful object.

    Put an instance anywhere in a checkpointed state (``{"rng": RNGState(), ...}``): saving calls
    :meth:`state_dict`, which reads the generators *at that moment*; ``restore(into=state)``
    calls :meth:`load_state_dict`, which sets them, so the next draws are those the saved run
    would have made. The instance itself holds nothing.

    Covered: Python's ``random`` module, numpy's global generator (``np.random.*``), torch's
    CPU generator and, when CUDA is available, the generator of every CUDA device. Generators
    you create yourself (``np.random.default_rng()``, ``torch.Generator()``) are not global:
    checkpoint their state explicitly.
    """

    def state_dict(self) -> dict[str, Any]:
        """The generators' states: only ints, floats, None, str, arrays and tensors."""
        version, internal, gauss_next = random.getstate()
        state: dict[str, Any] = {
            "python": {
                "version": version,
                "state": np.array(internal, dtype=np.uint32),
                "gauss_next": gauss_next,
            },
            # A dict of str / int / uint32 array / float (ints beyond 64 bits for PCG64 and
            # others, which cryosnap stores exactly).
            "numpy": np.random.get_state(legacy=False),
        }
        if _HAVE_TORCH:
            state["torch"] = torch.get_rng_state()
            state["cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set every generator from ``state``; all of them or, on error, none.

        Raises :class:`~cryosnap.StateMismatchError` when ``state`` is malformed, holds torch
        state and torch is not installed, or holds the generators of N CUDA devices and this
        process does not see exactly N. A state saved without CUDA leaves CUDA generators as
        they are; a state saved without torch leaves torch's generators as they are.
        """
        setters = _rng_setters(state)
        before = _rng_setters(self.state_dict())
        try:
            for setter in setters:
                setter()
        except Exception as exc:
            for setter in before:  # undo the part already set: all or nothing
                setter()
            raise StateMismatchError(f"RNGState: cannot restore the saved state: {exc}") from exc


def _rng_setters(state: Mapping[str, Any]) -> list[_Setter]:
    """Validate ``state`` and return the calls that set each generator from it."""
    if not isinstance(state, Mapping):
        raise StateMismatchError(f"RNGState: expected a dict, got {type(state).__name__}")
    unknown = sorted(set(state) - {"python", "numpy", "torch", "cuda"})
    missing = sorted({"python", "numpy"} - set(state))
    if unknown or missing:
        raise StateMismatchError(f"RNGState: unexpected keys {unknown}, missing keys {missing}")
    setters = [_python_setter(state["python"]), _numpy_setter(state["numpy"])]
    if "torch" in state:
        setters.append(_torch_setter(state["torch"]))
    if "cuda" in state:
        setters.extend(_cuda_setters(state["cuda"]))
    return setters


def _python_setter(saved: Any) -> _Setter:
    if not isinstance(saved, Mapping) or set(saved) != {"version", "state", "gauss_next"}:
        raise StateMismatchError("RNGState: malformed Python random state")
    words = np.asarray(saved["state"])
    gauss_next = saved["gauss_next"]
    if (
        words.shape != (_PY_STATE_WORDS,)
        or words.dtype.kind not in "iu"
        or type(saved["version"]) is not int
        or not (gauss_next is None or isinstance(gauss_next, float))
    ):
        raise StateMismatchError(
            f"RNGState: malformed Python random state (expected {_PY_STATE_WORDS} integer "
            f"words, got shape {words.shape} of {words.dtype})"
        )
    value = (saved["version"], tuple(int(w) for w in words.tolist()), gauss_next)
    return lambda: random.setstate(value)


def _numpy_setter(saved: Any) -> _Setter:
    if not isinstance(saved, Mapping) or not isinstance(saved.get("bit_generator"), str):
        raise StateMismatchError("RNGState: malformed numpy random state")
    value = dict(saved)
    return lambda: np.random.set_state(value)


def _tensor_state(saved: Any, what: str) -> Any:
    if not _HAVE_TORCH:
        raise StateMismatchError(
            f"RNGState: the checkpoint holds the {what} generator state but torch is not "
            "installed (pip install 'cryosnap[torch]')"
        )
    if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8 or saved.dim() != 1:
        raise StateMismatchError(f"RNGState: malformed {what} generator state")
    return saved.cpu()


def _torch_setter(saved: Any) -> _Setter:
    value = _tensor_state(saved, "torch CPU")
    return lambda: torch.set_rng_state(value)


def _cuda_setters(saved: Any) -> list[_Setter]:
    if not isinstance(saved, (list, tuple)):
        raise StateMismatchError("RNGState: malformed CUDA generator states")
    if not saved:
        return []  # saved without CUDA: nothing to set
    values = [_tensor_state(s, "CUDA") for s in saved]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have != len(values):
        raise StateMismatchError(
            f"RNGState: the checkpoint holds the generators of {len(values)} CUDA devices, "
            f"this process sees {have}; resume with the same devices visible "
            "(CUDA_VISIBLE_DEVICES), or drop state_dict()['cuda'] to keep the current ones"
        )
    return [lambda: torch.cuda.set_rng_state_all(values)]


# ---------------------------------------------------------------------------------------------
# data order


def _seed_words(*words: int) -> int:
    """A well-mixed 63-bit seed from a few ints (no correlation between nearby inputs)."""
    seq = np.random.SeedSequence([w % (1 << 64) for w in words])
    return int(seq.generate_state(1, np.uint64)[0]) >> 1


class ResumableSampler(Sampler[int]):
    """Indices of a map-style dataset in an order that is a pure function of (seed, epoch).

    With ``shuffle=True`` the order of epoch *e* is ``torch.randperm(n)`` drawn from a
    generator seeded with ``seed + e``: the very order of
    ``torch.utils.data.DistributedSampler``, including its sharding: with ``num_replicas``
    ranks, rank *r* gets every ``num_replicas``-th index from *r*, the tail padded by repeating
    indices (or, with ``drop_last=True``, dropped) so every rank gets ``num_samples``.
    ``num_replicas`` / ``rank`` default to the ``torch.distributed`` world if it is
    initialized, else 1 / 0.

    The sampler remembers its ``epoch`` and how many of this epoch's indices were *consumed*
    (``advance``; :class:`ResumableLoader` calls it for each batch it delivers); iterating
    yields the indices not yet consumed. Both travel in :meth:`state_dict`.

    An elastic resize keeps the position: :meth:`load_state_dict` takes the state of any rank
    of a job of another ``num_replicas`` (the ranks of a data-parallel job consume in lockstep,
    so every rank holds the same position). The epoch's global order stays the same, the
    indices the old ranks consumed are skipped, and the rest of the epoch is split over the new
    ranks (padded or dropped as ``drop_last`` says): no sample is repeated beyond that padding,
    none skipped. The next epochs are sharded as usual.
    """

    def __init__(
        self,
        data_source_or_len: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        _require_torch("ResumableSampler")
        super().__init__()
        if isinstance(data_source_or_len, int) and not isinstance(data_source_or_len, bool):
            length = data_source_or_len
        elif isinstance(data_source_or_len, Sized):
            length = len(data_source_or_len)
        else:
            wrong_type(data_source_or_len, "data_source_or_len", "a dataset with len() or an int")
        self.dataset_len = non_negative_int(length, "data_source_or_len")
        self.seed = integer(seed, "seed")
        if num_replicas is None or rank is None:
            dist = torch.distributed
            initialized = dist.is_available() and dist.is_initialized()
            if num_replicas is None:
                num_replicas = dist.get_world_size() if initialized else 1
            if rank is None:
                rank = dist.get_rank() if initialized else 0
        self.num_replicas = positive_int(num_replicas, "num_replicas")
        self.rank = integer(
            rank,
            "rank",
            minimum=0,
            maximum=self.num_replicas - 1,
            allowed=f"an int >= 0 and < num_replicas={self.num_replicas}",
        )
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.num_samples = self._shard_size(self.dataset_len)
        self._epoch = 0
        self._consumed = 0
        # Global positions of this epoch's order consumed before this sharding took over
        # (by the ranks of a job of another size); 0 unless resized mid-epoch.
        self._start = 0

    @property
    def epoch(self) -> int:
        """The current epoch (0 first)."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """How many of this epoch's ``epoch_samples`` indices the training loop has consumed."""
        return self._consumed

    @property
    def epoch_samples(self) -> int:
        """This rank's indices in the current epoch: ``num_samples``, except in an epoch
        resumed at another world size (its rest split over this job's ranks)."""
        return self._shard_size(self.dataset_len - self._start)

    def _shard_size(self, n: int) -> int:
        """Indices per rank when ``n`` indices are split over the ranks (DistributedSampler's
        rule: padded up, or with ``drop_last`` cut down, to a multiple of ``num_replicas``)."""
        replicas = self.num_replicas
        if self.drop_last and n % replicas:
            return (n - n % replicas) // replicas
        return -(-n // replicas)

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start; the current epoch itself is kept where it is.

        So the ``DistributedSampler`` habit of calling ``set_epoch(epoch)`` at the top of each
        epoch is safe after a mid-epoch resume: it does not restart the resumed epoch.
        """
        non_negative_int(epoch, "epoch")
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0
            self._start = 0

    def advance(self, num_samples: int) -> None:
        """Record that the loop consumed the next ``num_samples`` indices of this epoch."""
        non_negative_int(num_samples, "num_samples")
        total = self.epoch_samples
        if self._consumed + num_samples > total:
            raise ValueError(
                f"num_samples={num_samples}: only {total - self._consumed} of "
                f"epoch {self._epoch}'s {total} indices are left"
            )
        self._consumed += num_samples

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's whole order for ``epoch`` (default: the current one; in an epoch
        resumed at another world size, this rank's share of the rest of it)."""
        epoch = self._epoch if epoch is None else non_negative_int(epoch, "epoch")
        order = self.global_order(epoch)
        if epoch == self._epoch:
            order = order[self._start :]
        n = len(order)
        total = self._shard_size(n) * self.num_replicas
        if total > n and order:  # pad by repeating from the start, as DistributedSampler
            order += (order * math.ceil((total - n) / n))[: total - n]
        return order[self.rank : total : self.num_replicas]

    def global_order(self, epoch: int) -> list[int]:
        """Every index of ``epoch`` in the order the ranks take them (rank *r* the *r*-th of
        each ``num_replicas``), before padding: a pure function of ``(seed, epoch)``."""
        n = self.dataset_len
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + non_negative_int(epoch, "epoch"))
        order: list[int] = torch.randperm(n, generator=g).tolist()
        return order

    def __iter__(self) -> Iterator[int]:
        # Fixed when iteration starts: the DataLoader draws ahead; advance() moves the start of
        # the *next* iteration only.
        return iter(self.indices()[self._consumed :])

    def __len__(self) -> int:
        """Indices per epoch for this rank (a resumed epoch yields ``epoch_samples -
        consumed``)."""
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, start, consumed) and the settings it is valid for: the same
        on every rank of a data-parallel job (so it may be saved as ``replicated``)."""
        return {
            "epoch": self._epoch,
            "start": self._start,
            "consumed": self._consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "num_replicas": self.num_replicas,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position: this job's, or any rank's of a job of another size.

        ``dataset_len``, ``seed``, ``shuffle`` and ``drop_last`` must be the saved ones (the
        position means nothing for another dataset or order):
        :class:`~cryosnap.StateMismatchError` names every one that differs. Another
        ``num_replicas`` (an elastic resize) keeps the position: the rest of the saved epoch is
        split over this job's ranks (see the class docstring).
        """
        if not isinstance(state, Mapping):
            raise StateMismatchError(
                f"ResumableSampler: expected a dict, got {type(state).__name__}"
            )
        mine = self.state_dict()
        # A state saved before elastic resizes holds no "start" (0) and this rank's "rank".
        if (set(state) - {"rank"}) | {"start"} != set(mine):
            raise StateMismatchError(
                f"ResumableSampler: saved keys {sorted(state)}, expected {sorted(mine)}"
            )
        differ = [
            f"{k}: saved {state[k]!r}, this sampler {mine[k]!r}"
            for k in ("seed", "shuffle", "drop_last", "dataset_len")
            if state[k] != mine[k]
        ]
        if differ:
            raise StateMismatchError(
                "ResumableSampler: the checkpoint was taken with other settings ("
                + "; ".join(differ)
                + "); build the sampler with the saved ones to resume"
            )
        epoch, start, consumed = _saved_position(state, self.dataset_len)
        if state["num_replicas"] == self.num_replicas:
            self._epoch, self._start, self._consumed = epoch, start, consumed
            return
        # A resize: the old ranks consumed positions start .. start + consumed * replicas - 1
        # of the epoch's order (a finished epoch: all of it); this job splits the rest.
        saved = ResumableSampler(
            self.dataset_len,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
            num_replicas=state["num_replicas"],
            rank=0,
        )
        saved._epoch, saved._start = epoch, start
        if consumed == saved.epoch_samples:
            done = self.dataset_len
        else:
            done = min(start + consumed * saved.num_replicas, self.dataset_len)
        self._epoch, self._start, self._consumed = epoch, done, 0


def _saved_position(state: Mapping[str, Any], dataset_len: int) -> tuple[int, int, int]:
    """(epoch, start, consumed) of a ResumableSampler state, checked against its settings."""
    replicas, rank = state["num_replicas"], state.get("rank", 0)
    if type(replicas) is not int or replicas < 1 or type(rank) is not int:
        raise StateMismatchError(
            f"ResumableSampler: invalid saved num_replicas={replicas!r}, rank={rank!r}"
        )
    if not 0 <= rank < replicas:
        raise StateMismatchError(f"ResumableSampler: saved rank {rank} of {replicas} ranks")
    epoch, start, consumed = state["epoch"], state.get("start", 0), state["consumed"]
    if type(epoch) is not int or epoch < 0:
        raise StateMismatchError(f"ResumableSampler: invalid saved epoch {epoch!r}")
    if type(start) is not int or not 0 <= start <= dataset_len:
        raise StateMismatchError(
            f"ResumableSampler: invalid saved start={start!r} (0..{dataset_len})"
        )
    saved = ResumableSampler(
        dataset_len,
        drop_last=state["drop_last"],
        num_replicas=replicas,
        rank=rank,
    )
    saved._start = start
    if type(consumed) is not int or not 0 <= consumed <= saved.epoch_samples:
        raise StateMismatchError(
            f"ResumableSampler: invalid saved consumed={consumed!r} (0..{saved.epoch_samples})"
        )
    return epoch, start, consumed


_REFUSED = {
    "shuffle": "pass sampler=ResumableSampler(dataset, shuffle=..., seed=...)",
    "batch_sampler": "ResumableLoader batches the ResumableSampler's indices itself",
    "generator": (
        "ResumableLoader seeds the DataLoader's generator itself, from (seed, epoch, rank), so "
        "that iterating never draws from torch's global generator"
    ),
}


class ResumableLoader:
    """A ``torch.utils.data.DataLoader`` over a :class:`ResumableSampler` that counts what the
    loop consumed.

    ``ResumableLoader(dataset, batch_size=..., sampler=..., **kwargs)`` builds the DataLoader
    (``kwargs`` are DataLoader's: ``num_workers``, ``collate_fn``, ``pin_memory``,
    ``prefetch_factor``, ``persistent_workers``...; not ``shuffle``, ``batch_sampler`` or
    ``generator``); ``sampler`` defaults to ``ResumableSampler(dataset)`` (shuffled, seed 0).

    Iterating yields the batches left in the current epoch; each batch counts as consumed as
    it is handed out, so checkpoint *after* processing it. When an epoch is exhausted the
    loader moves to the next one by itself (``epoch`` goes up by one); a loop that stops early
    (``break``) and iterates again continues where it stopped. Only the newest iterator is
    live: an older one raises ``RuntimeError``, as does one whose state was loaded meanwhile.

    Iterating never draws from torch's global generator (a plain DataLoader draws its worker
    base seed from it at every ``iter()``, which would shift dropout masks after a mid-epoch
    resume): the DataLoader's own generator is seeded from ``(seed, epoch, rank)``.
    ``state_dict()`` holds the sampler's.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int | None = 1,
        sampler: ResumableSampler | None = None,
        drop_last: bool = False,
        **dataloader_kwargs: Any,
    ) -> None:
        _require_torch("ResumableLoader")
        for name, why in _REFUSED.items():
            if name in dataloader_kwargs:
                raise TypeError(f"ResumableLoader does not take {name}=: {why}")
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "ResumableLoader needs a map-style dataset (an IterableDataset has no sampler)"
            )
        if batch_size is not None:
            positive_int(batch_size, "batch_size")
        if sampler is None:
            if not isinstance(dataset, Sized):
                raise TypeError("dataset has no len(): pass sampler=ResumableSampler(length)")
            sampler = ResumableSampler(dataset)
        elif not isinstance(sampler, ResumableSampler):
            raise TypeError(
                f"sampler must be a ResumableSampler, got {type(sampler).__name__} "
                "(its position could not be checkpointed)"
            )
        if isinstance(dataset, Sized) and len(dataset) != sampler.dataset_len:
            raise ValueError(
                f"sampler covers {sampler.dataset_len} samples, the dataset has {len(dataset)}"
            )
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self._generator = torch.Generator()
        self.dataloader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=self.drop_last,
            generator=self._generator,
            **dataloader_kwargs,
        )
        # Bumped by every iter() and load_state_dict(): only the newest iterator may count.
        self._generation = 0

    @property
    def epoch(self) -> int:
        """The current epoch (the sampler's)."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch(epoch)``: a no-op for the current epoch (see there)."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches in a whole epoch (a resumed epoch has fewer left)."""
        return len(self.dataloader)

    def _remaining_batches(self) -> int:
        left = self.sampler.epoch_samples - self.sampler.consumed
        if self.batch_size is None:
            return left
        return left // self.batch_size if self.drop_last else -(-left // self.batch_size)

    def _next_batch_samples(self) -> int:
        left = self.sampler.epoch_samples - self.sampler.consumed
        return 1 if self.batch_size is None else min(self.batch_size, left)

    def __iter__(self) -> Iterator[Any]:
        return _EpochIterator(self)

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler": sampler.state_dict()}``."""
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the sampler's position; iterators made before stop being live."""
        if not isinstance(state, Mapping) or set(state) != {"sampler"}:
            raise StateMismatchError("ResumableLoader: expected a dict with the key 'sampler'")
        self.sampler.load_state_dict(state["sampler"])
        self._generation += 1


class _EpochIterator(Iterator[Any]):
    """The rest of one epoch of a :class:`ResumableLoader`, counting delivered batches."""

    def __init__(self, loader: ResumableLoader) -> None:
        loader._generation += 1
        self._loader = loader
        self._generation = loader._generation
        self._epoch = loader.sampler.epoch
        self._finished = False
        self._batches: Iterator[Any] | None = None
        self._start()

    def _start(self) -> None:
        loader, sampler = self._loader, self._loader.sampler
        if loader._remaining_batches() > 0:  # an exhausted epoch starts no workers
            loader._generator.manual_seed(_seed_words(sampler.seed, self._epoch, sampler.rank))
            self._batches = iter(loader.dataloader)

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        loader = self._loader
        sampler = loader.sampler
        if self._batches is None and sampler.epoch > self._epoch:
            # Made on an exhausted epoch (a resume at an epoch's end), then moved on by
            # set_epoch before its first batch (Lightning does so): the next epoch's batches.
            self._epoch = sampler.epoch
            self._start()
        if loader._generation != self._generation or sampler.epoch != self._epoch:
            raise RuntimeError(
                "this ResumableLoader iterator is stale: the loader was iterated again, its "
                "state was loaded or its epoch set since it was created"
            )
        if self._batches is not None:
            try:
                batch = next(self._batches)
            except StopIteration:
                pass
            else:
                sampler.advance(loader._next_batch_samples())
                return batch
        self._finished = True
        self._batches = None
        sampler.set_epoch(self._epoch + 1)
        raise StopIteration


# ---------------------------------------------------------------------------------------------
# DistributedDataParallel


def prepare_ddp_resume(model: Any, *inputs: Any, **kwargs: Any) -> None:
    """Make a DDP model built in a fresh process reduce gradients as the run it resumes did.

    DDP reduces the first backward of a process in one bucket and then rebuilds its buckets
    in the order the gradients became ready; an uninterrupted run trains every later step with
    the rebuilt buckets, a resumed process would train its first step with the single one, and
    gloo sums a gradient over the ranks in an order that depends on where it lies in its
    bucket (results some 1e-8 off). This runs one forward on ``inputs`` (any batch of the
    right shapes: one of zeros will do) and a backward of a zero loss, so DDP rebuilds its
    buckets before the first real step; then it puts back what that touched: every random
    number generator (:class:`RNGState`), the module's buffers (BatchNorm statistics) and the
    gradients. Collective: every rank calls it, after the restore, before training.

    A restore whose ``into=`` holds the model (``ddp.module`` or ``ddp``) does the same by
    itself, on the batch of the first training step (cryosnap._run.ddp): this call is for a
    model restored otherwise, or to warm up at a moment of your choosing.
    """
    _require_torch("prepare_ddp_resume")
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        wrong_type(model, "model", "a torch.nn.parallel.DistributedDataParallel")
    _ddp.disarm(model.module)
    if getattr(model, "_has_rebuilt_buckets", False):
        return  # this process trained a step already: its buckets are the rebuilt ones
    if not _ddp.warm_up(model, inputs, kwargs):
        raise ValueError("prepare_ddp_resume: the model's output holds no tensor with grad")


def arm_ddp_resume(modules: Any) -> None:
    """What a restore does to the modules of its ``into=``, for modules whose state was restored
    otherwise (through objects of an integration's own that wrap them): arm each
    ``nn.Module`` in ``modules`` (a module, a DDP, or a dict/list/tuple of them), so that the
    first training forward a ``DistributedDataParallel`` runs it in warms DDP's gradient
    buckets up first, on that forward's inputs, as :func:`prepare_ddp_resume` does by hand.
    Does nothing unless this process is one of several ranks of torch.distributed. Call it on
    every rank after the restore."""
    _require_torch("arm_ddp_resume")
    _ddp.arm(modules)
