"""cryosnap.integrations._loaders: the order of a plain DataLoader's epoch, saved and resumed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from cryosnap.integrations._loaders import EpochOrder, install, why_combined_inexact, why_inexact
from cryosnap.integrations.torch import ResumableSampler

DATA = list(range(30))


def _epochs(loader: DataLoader[Any], n: int) -> list[list[int]]:
    return [[int(i) for batch in loader for i in batch] for _ in range(n)]


@pytest.mark.parametrize("generator", [None, 7])
def test_a_random_sampler_draws_what_it_draws_without_cryosnap(generator: int | None) -> None:
    def loader() -> DataLoader[Any]:
        g = None if generator is None else torch.Generator().manual_seed(generator)
        return DataLoader(DATA, batch_size=4, shuffle=True, generator=g)

    torch.manual_seed(0)
    plain, after = _epochs(loader(), 3), torch.rand(2)
    torch.manual_seed(0)
    ordered = loader()
    assert isinstance(install(ordered), EpochOrder)
    assert _epochs(ordered, 3) == plain
    assert torch.equal(torch.rand(2), after)  # the same draws from the global generator


def test_resume_at_rebuilds_the_epoch_and_skips_the_consumed_batches() -> None:
    torch.manual_seed(1)
    first = DataLoader(DATA, batch_size=4, shuffle=True, drop_last=True)
    order = install(first)
    assert order is not None and order.order is None
    epoch = _epochs(first, 1)[0]
    saved = order.order
    assert saved is not None and set(saved) == {"generator"}
    torch.manual_seed(99)  # another process: its generator is elsewhere
    again = DataLoader(DATA, batch_size=4, shuffle=True, drop_last=True)
    resumed = install(again)
    assert resumed is not None
    resumed.resume_at(saved, skip=3 * 4)
    state = torch.get_rng_state()
    assert _epochs(again, 1)[0] == epoch[12:]
    # Of the global generator, the resumed epoch took the DataLoader's base seed alone.
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(torch.get_rng_state(), after)
    assert len(_epochs(again, 1)[0]) == 28  # the next epoch is a whole one again


def test_a_distributed_and_a_stateful_sampler_resume_from_their_state() -> None:
    dist = DistributedSampler(DATA, num_replicas=2, rank=1, seed=5)
    dist.set_epoch(3)
    a = DataLoader(DATA, batch_size=2, sampler=dist)
    order = install(a)
    assert order is not None
    epoch = _epochs(a, 1)[0]
    assert order.order == {"epoch": 3}
    fresh = DistributedSampler(DATA, num_replicas=2, rank=1, seed=5)  # epoch 0
    b = DataLoader(DATA, batch_size=2, sampler=fresh)
    resumed = install(b)
    assert resumed is not None
    resumed.resume_at({"epoch": 3}, skip=4)
    assert _epochs(b, 1)[0] == epoch[4:]

    stateful = ResumableSampler(30, seed=2)
    stateful.set_epoch(4)
    c = DataLoader(DATA, batch_size=5, sampler=stateful)
    order = install(c)
    assert order is not None
    epoch = _epochs(c, 1)[0]
    assert order.order is not None and order.order["state"]["epoch"] == 4
    d = DataLoader(DATA, batch_size=5, sampler=ResumableSampler(30, seed=2))
    resumed = install(d)
    assert resumed is not None
    resumed.resume_at(order.order, skip=10)
    assert _epochs(d, 1)[0] == epoch[10:]


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(DATA)


class _Odd(torch.utils.data.Sampler[int]):
    def __iter__(self) -> Any:
        return iter(range(1, 30, 2))


def test_why_inexact_names_what_cannot_resume_and_how_to_fix_it() -> None:
    assert why_inexact(DataLoader(DATA, batch_size=4, shuffle=True)) is None
    assert why_inexact(DataLoader(DATA, batch_size=4, sampler=SequentialSampler(DATA))) is None
    assert why_inexact(DataLoader(DATA, sampler=RandomSampler(DATA, replacement=True))) is None
    stream = why_inexact(DataLoader(_Stream(), batch_size=4))
    assert stream is not None and "_Stream, is an IterableDataset" in stream
    odd = why_inexact(DataLoader(DATA, batch_size=4, sampler=_Odd()))
    assert odd is not None and "_Odd, has no state" in odd and "ResumableSampler" in odd
    custom = BatchSampler(SequentialSampler(DATA), 4, False)

    class Batches(BatchSampler):
        pass

    assert why_inexact(DataLoader(DATA, batch_sampler=custom)) is None
    mine = why_inexact(DataLoader(DATA, batch_sampler=Batches(SequentialSampler(DATA), 4, False)))
    assert mine is not None and "batch sampler (Batches)" in mine
    unbatched = why_inexact(DataLoader(DATA, batch_size=None))
    assert unbatched is not None and "batch_size=None" in unbatched
    assert why_inexact([1, 2]) is not None
    assert install(DataLoader(_Stream(), batch_size=4)) is None


def test_why_combined_inexact_names_the_shorter_loaders_and_the_way_out() -> None:
    six, three = DataLoader(DATA[:24], batch_size=4), DataLoader(DATA[:12], batch_size=4)
    assert why_combined_inexact("max_size_cycle", [six]) is None  # one loader
    assert (
        why_combined_inexact("max_size_cycle", [six, DataLoader(DATA[6:30], batch_size=4)]) is None
    )
    assert why_combined_inexact("min_size", [six, three]) is None  # every loader in lockstep
    why = why_combined_inexact("max_size_cycle", [six, three])
    assert why is not None
    assert "train dataloader 1 (3 batches) is shorter than the longest (6 batches)" in why
    assert "mode='max_size_cycle') starts it again" in why and "mode='min_size'" in why
    why = why_combined_inexact("max_size", [three, six])
    assert why is not None and "train dataloader 0 (3 batches)" in why and "runs it out" in why
    why = why_combined_inexact("sequential", [six, six])
    assert why is not None and "ConcatDataset" in why


def test_an_order_of_another_kind_of_sampler_does_not_fit() -> None:
    shuffled = install(DataLoader(DATA, batch_size=4, shuffle=True))
    assert shuffled is not None
    assert not shuffled.fits({"epoch": 1})  # a DistributedSampler's, saved at another size
    with pytest.raises(ValueError, match=r"does not fit a RandomSampler"):
        shuffled.resume_at({"epoch": 1}, 8)
    iter(shuffled).__next__()  # an iteration records its order
    assert shuffled.order is not None and shuffled.fits(shuffled.order)
