"""Exact mid-epoch resume of the plain ``torch.utils.data.DataLoader`` a user already has.

:class:`EpochOrder` goes between a DataLoader's ``BatchSampler`` and its sampler: it records
what decides the order of the current iteration (a ``RandomSampler``'s generator state when
the iteration starts, a ``DistributedSampler``'s epoch, a stateful sampler's ``state_dict``)
and starts one iteration at a saved position, skipping the consumed indices without loading
them. :func:`why_inexact` says why a loader cannot be made exact, :func:`why_combined_inexact`
why several loaders together cannot. Runs on the training loop's
thread; no framework imported here. docs/design/integrations.md has the rules.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

__all__ = ["EpochOrder", "install", "why_combined_inexact", "why_inexact"]


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def why_inexact(loader: object) -> str | None:
    """Why ``loader`` cannot resume mid-epoch exactly (None: it can, by itself or through an
    :class:`EpochOrder`), with how to make it exact."""
    if _stateful(loader):
        return None  # the framework saves and restores its position itself
    if not isinstance(loader, DataLoader):
        return (
            f"a {type(loader).__name__} without state_dict/load_state_dict: give it both, or "
            "use a torch DataLoader over a map-style dataset"
        )
    if isinstance(loader.dataset, IterableDataset):
        return (
            f"its dataset, a {type(loader.dataset).__name__}, is an IterableDataset: its "
            "position is in its iterators; use a map-style dataset, or torchdata's "
            "StatefulDataLoader over a dataset with state_dict/load_state_dict"
        )
    batches = loader.batch_sampler
    if batches is None:
        return "it has batch_size=None: its sampler is out of reach; give it a batch_size"
    if type(batches) is not BatchSampler:
        return (
            f"its batch sampler ({type(batches).__name__}) has no state: give it "
            "state_dict/load_state_dict, or pass sampler= and batch_size= instead"
        )
    sampler = batches.sampler
    if isinstance(sampler, EpochOrder) or _order_kind(sampler) is not None:
        return None
    return (
        f"its sampler, a {type(sampler).__name__}, has no state: give it state_dict/"
        "load_state_dict (the state at the start of an epoch must decide its order), or use "
        "cryosnap.integrations.torch.ResumableSampler"
    )


def why_combined_inexact(mode: str, loaders: list[Any]) -> str | None:
    """Why the train loaders that Lightning's ``CombinedLoader`` iterates in ``mode`` cannot
    resume mid-epoch together (None: one loader, or loaders in lockstep). The position saved is
    the batches the loop consumed in the epoch, the same count for every loader: right for
    loaders of one length, and in ``min_size`` mode (every loader starts its epoch together
    and the shortest ends it), wrong for a loader started again or exhausted within the epoch.
    """
    if len(loaders) < 2:
        return None
    if mode == "sequential":
        return (
            f"CombinedLoader(mode='sequential') iterates its {len(loaders)} loaders one after "
            "another, and the position saved counts the batches of all of them; give the "
            "Trainer one train dataloader (over a torch.utils.data.ConcatDataset)"
        )
    if mode == "min_size":
        return None
    lengths = [_length(loader) for loader in loaders]
    longest = max((n for n in lengths if n is not None), default=None)
    shorter = [
        f"train dataloader {i} ({n} batches)"
        for i, n in enumerate(lengths)
        if n is not None and longest is not None and n < longest
    ]
    if not shorter:
        return None
    within = _WITHIN.get(mode, "iterates it otherwise")
    return (
        f"{', '.join(shorter)} is shorter than the longest ({longest} batches), and "
        f"CombinedLoader(mode={mode!r}) {within} within the epoch; the position "
        "saved is the batches the loop consumed, right only for loaders of one length. Give "
        "every train dataloader the same number of batches, or combine them with "
        "CombinedLoader(..., mode='min_size')"
    )


_WITHIN = {"max_size_cycle": "starts it again", "max_size": "runs it out"}


def _length(loader: object) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _order_kind(sampler: object) -> str | None:
    if type(sampler) is RandomSampler:
        return "random"
    if type(sampler) is SequentialSampler:
        return "sequential"
    if type(sampler) is DistributedSampler:
        return "distributed"
    if _stateful(sampler):
        return "stateful"
    return None


class EpochOrder(Sampler[int]):
    """A sampler's indices, with what decided the current iteration's order.

    ``order`` is that (a dict of tensors and ints); :meth:`resume_at` makes the next iteration
    follow a saved ``order`` and skip its first ``skip`` indices. The order of every other
    iteration is the sampler's own, drawn when torch would draw it (a ``RandomSampler``
    without a generator draws its seed from torch's global generator as the iteration starts).
    """

    def __init__(self, sampler: Iterable[int]) -> None:
        kind = _order_kind(sampler)
        if kind is None:
            raise TypeError(f"{type(sampler).__name__} has no state that decides its order")
        super().__init__()
        self.sampler: Any = sampler
        self.kind = kind
        self.order: dict[str, Any] | None = None  # None: no iteration started yet
        self._resume: tuple[Mapping[str, Any], int] | None = None

    def __len__(self) -> int:
        size: int = len(self.sampler)
        return size

    def fits(self, order: Mapping[str, Any]) -> bool:
        """Whether ``order`` was recorded by a sampler of this kind (a version saved by a job
        of another world size may hold a DistributedSampler's order for a RandomSampler)."""
        return set(order) == _ORDER_KEYS[self.kind]

    def resume_at(self, order: Mapping[str, Any], skip: int) -> None:
        """The next iteration follows ``order`` and starts after its first ``skip`` indices."""
        if not self.fits(order):
            raise ValueError(
                f"an order {sorted(order)} does not fit a {type(self.sampler).__name__} "
                f"(it records {sorted(_ORDER_KEYS[self.kind])})"
            )
        self._resume = (order, skip)

    def __iter__(self) -> Iterator[int]:
        # A generator: the body runs at the first index, as the samplers' own do.
        resume, self._resume = self._resume, None
        order, skip = resume if resume is not None else (None, 0)
        indices = self._begin(order)
        yield from itertools.islice(indices, skip, None)

    def _begin(self, order: Mapping[str, Any] | None) -> Iterator[int]:
        sampler = self.sampler
        if self.kind == "random":
            assert isinstance(sampler, RandomSampler)
            g = sampler.generator
            if g is None:
                g = torch.Generator()
                if order is None:  # what RandomSampler.__iter__ does without a generator
                    g.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            if order is not None:
                g.set_state(order["generator"])
            self.order = {"generator": g.get_state()}
            clone = copy.copy(sampler)
            clone.generator = g
            return iter(clone)
        if self.kind == "distributed":
            assert isinstance(sampler, DistributedSampler)
            if order is not None:
                sampler.set_epoch(int(order["epoch"]))
            self.order = {"epoch": sampler.epoch}
            return iter(sampler)
        if self.kind == "stateful":
            if order is not None:
                sampler.load_state_dict(order["state"])
            self.order = {"state": sampler.state_dict()}
            return iter(sampler)
        self.order = {}
        return iter(sampler)


# What each kind of sampler records of an iteration's order (EpochOrder._begin).
_ORDER_KEYS = {
    "random": {"generator"},
    "distributed": {"epoch"},
    "stateful": {"state"},
    "sequential": set(),
}


def install(loader: object) -> EpochOrder | None:
    """Put an :class:`EpochOrder` under ``loader``'s batch sampler (None: the loader saves
    its own position, or cannot be made exact: :func:`why_inexact`)."""
    if _stateful(loader) or why_inexact(loader) is not None:
        return None
    assert isinstance(loader, DataLoader)
    batches = loader.batch_sampler
    assert isinstance(batches, BatchSampler)
    if not isinstance(batches.sampler, EpochOrder):
        batches.sampler = EpochOrder(batches.sampler)
    return batches.sampler
