"""cryosnap.integrations.torch: RNGState, ResumableSampler and ResumableLoader."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import Dataset, DistributedSampler

import cryosnap
from cryosnap._state import flatten
from cryosnap.integrations.torch import ResumableLoader, ResumableSampler, RNGState


def _draws() -> tuple[Any, ...]:
    return (
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.standard_normal(3).tolist(),
        np.random.randint(0, 1 << 30, size=2).tolist(),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def _scramble() -> None:
    random.seed(12345)
    np.random.seed(12345)
    torch.manual_seed(12345)


@pytest.mark.parametrize("cached_gaussian", [False, True])
def test_rng_state_round_trip_restores_every_generator(
    tmp_path: Path, cached_gaussian: bool
) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    if cached_gaussian:  # Python and numpy keep the second of a pair of normal draws
        random.gauss(0.0, 1.0)
        np.random.standard_normal(1)
    cryosnap.save(tmp_path / "run", {"rng": RNGState()})  # no allow_pickle
    expected = _draws()
    _scramble()
    assert _draws() != expected
    cryosnap.load(tmp_path / "run", into={"rng": RNGState()})
    assert _draws() == expected


def test_rng_state_dict_holds_only_plain_types() -> None:
    sd = RNGState().state_dict()
    assert set(sd) == {"python", "numpy", "torch", "cuda"}
    assert sd["python"]["state"].shape == (625,)
    assert sd["torch"].dtype == torch.uint8
    assert sd["cuda"] == ([] if not torch.cuda.is_available() else sd["cuda"])
    assert flatten(sd).leaves == 9  # flatten refuses anything that would need pickle


def test_rng_state_with_other_cuda_device_count_is_refused_and_changes_nothing() -> None:
    rng = RNGState()
    sd = rng.state_dict()
    sd["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)
    _scramble()
    before = rng.state_dict()
    with pytest.raises(cryosnap.StateMismatchError, match="CUDA devices"):
        rng.load_state_dict(sd)
    after = rng.state_dict()
    assert np.array_equal(before["python"]["state"], after["python"]["state"])
    assert torch.equal(before["torch"], after["torch"])


def test_rng_state_saves_and_sets_every_cuda_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: a fake torch.cuda with two devices checks the calls RNGState makes.
    devices = [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [d.clone() for d in devices])

    def set_all(states: list[torch.Tensor]) -> None:
        devices[:] = [s.clone() for s in states]

    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    sd = RNGState().state_dict()
    assert [d.tolist() for d in sd["cuda"]] == [[1] * 16, [2] * 16]
    devices[:] = [torch.zeros(16, dtype=torch.uint8)] * 2
    RNGState().load_state_dict(sd)
    assert [d.tolist() for d in devices] == [[1] * 16, [2] * 16]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(cryosnap.StateMismatchError, match="2 CUDA devices, this process sees 1"):
        RNGState().load_state_dict(sd)


def test_rng_state_rolls_back_when_a_generator_refuses() -> None:
    rng = RNGState()
    sd = rng.state_dict()
    random.seed(7)
    np.random.seed(7)
    sd["numpy"] = {"bit_generator": "NoSuchGenerator", "state": {}}
    expected = (random.random(), np.random.random())
    random.seed(7)
    np.random.seed(7)
    with pytest.raises(cryosnap.StateMismatchError, match="cannot restore"):
        rng.load_state_dict(sd)  # Python's generator is set first, then numpy refuses
    assert (random.random(), np.random.random()) == expected


@pytest.mark.parametrize(
    "change",
    [
        lambda sd: sd.pop("python"),
        lambda sd: sd.update(extra=1),
        lambda sd: sd["python"].update(state=np.zeros(3, np.uint32)),
        lambda sd: sd.update(torch=np.zeros(3)),
    ],
)
def test_rng_state_refuses_malformed_state(change: Any) -> None:
    sd = RNGState().state_dict()
    change(sd)
    with pytest.raises(cryosnap.StateMismatchError, match="RNGState"):
        RNGState().load_state_dict(sd)


def test_rng_state_without_torch_covers_random_and_numpy() -> None:
    code = textwrap.dedent(
        """
        import random, sys
        sys.modules["torch"] = None  # import torch now raises ImportError
        import numpy as np
        from cryosnap.integrations.torch import RNGState, ResumableSampler
        sd = RNGState().state_dict()
        assert set(sd) == {"python", "numpy"}, sorted(sd)
        a = (random.random(), np.random.random())
        random.seed(5); np.random.seed(5)
        RNGState().load_state_dict(sd)
        assert (random.random(), np.random.random()) == a
        try:
            ResumableSampler(10)
        except ImportError as exc:
            assert "needs torch" in str(exc)
        else:
            raise AssertionError("ResumableSampler without torch")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------------
# sampler


@given(
    n=st.integers(0, 40),
    replicas=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 5),
)
def test_sampler_order_is_distributed_samplers(
    n: int, replicas: int, shuffle: bool, drop_last: bool, seed: int, epoch: int
) -> None:
    shards = []
    for rank in range(replicas):
        ours = ResumableSampler(
            n, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        theirs = DistributedSampler(
            range(n),
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs) == ours.indices(epoch)
        assert len(ours) == len(theirs)
        shards.append(ours.indices())
    counts = Counter(i for shard in shards for i in shard)
    if n % replicas == 0 or drop_last:  # no padding: every sample at most once, across ranks
        assert all(c == 1 for c in counts.values())
    else:
        assert set(counts) == set(range(n))


def test_sampler_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a = ResumableSampler(50, seed=3)
    b = ResumableSampler(range(50), seed=3)
    a.advance(10)  # the position does not change the order
    assert a.indices(2) == b.indices(2)
    assert a.indices(2) != a.indices(3)
    assert a.indices(2) != ResumableSampler(50, seed=4).indices(2)
    assert sorted(a.indices(2)) == list(range(50))
    assert ResumableSampler(5, shuffle=False).indices(7) == [0, 1, 2, 3, 4]
    assert list(a) == a.indices(0)[10:]


def test_sampler_set_epoch_keeps_the_current_epochs_position() -> None:
    s = ResumableSampler(20)
    s.advance(8)
    s.set_epoch(0)
    assert (s.epoch, s.consumed) == (0, 8)
    s.set_epoch(1)
    assert (s.epoch, s.consumed) == (1, 0)
    with pytest.raises(ValueError, match="left"):
        s.advance(21)


def test_sampler_refuses_a_state_of_other_settings() -> None:
    sd = ResumableSampler(20, seed=1).state_dict()
    with pytest.raises(cryosnap.StateMismatchError, match="seed: saved 1"):
        ResumableSampler(20, seed=2).load_state_dict(sd)
    with pytest.raises(cryosnap.StateMismatchError, match="dataset_len: saved 20"):
        ResumableSampler(21, seed=1).load_state_dict(sd)
    with pytest.raises(cryosnap.StateMismatchError, match="consumed"):
        ResumableSampler(20, seed=1).load_state_dict({**sd, "consumed": 21})


def test_sampler_takes_a_state_saved_before_resizes_existed() -> None:
    s = ResumableSampler(20, seed=1)
    s.advance(5)
    old = {k: v for k, v in s.state_dict().items() if k != "start"} | {"rank": 0}
    assert ResumableSampler(20, seed=1, num_replicas=2, rank=1).state_dict().keys() == (
        s.state_dict().keys()
    )  # no rank: the same state on every rank, so it may be saved as replicated
    t = ResumableSampler(20, seed=1)
    t.load_state_dict(old)
    assert list(t) == list(s)
    with pytest.raises(cryosnap.StateMismatchError, match="saved rank 3 of 2"):
        t.load_state_dict({**old, "num_replicas": 2, "rank": 3})


def _samplers(n: int, replicas: int, drop_last: bool, seed: int) -> list[ResumableSampler]:
    return [
        ResumableSampler(n, num_replicas=replicas, rank=r, seed=seed, drop_last=drop_last)
        for r in range(replicas)
    ]


@given(
    n=st.integers(0, 60),
    old=st.integers(1, 5),
    new=st.integers(1, 5),
    newer=st.integers(1, 5),
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 3),
    data=st.data(),
)
def test_sampler_resized_mid_epoch_covers_exactly_the_unconsumed_samples(
    n: int,
    old: int,
    new: int,
    newer: int,
    drop_last: bool,
    seed: int,
    epoch: int,
    data: st.DataObject,
) -> None:
    """Old ranks consume c indices each; any old rank's state goes to the ranks of a job of
    another size (and from there to a third): the epoch's order is kept, what was consumed is
    skipped, the rest is split, nothing repeated beyond padding nor skipped beyond drop_last."""
    seen: list[int] = []
    ranks = _samplers(n, old, drop_last, seed)
    for job in (new, newer):
        left = ranks[0].epoch_samples - ranks[0].consumed
        consumed = data.draw(st.integers(0, left), label="consumed")
        for s in ranks:
            s.set_epoch(epoch)
            seen += list(s)[:consumed]
            s.advance(consumed)
        state = ranks[data.draw(st.integers(0, len(ranks) - 1), label="rank")].state_dict()
        ranks = _samplers(n, job, drop_last, seed)
        for s in ranks:
            s.load_state_dict(state)
            assert s.epoch == epoch
    lists = [list(s) for s in ranks]
    rest = [i for shard in lists for i in shard]
    assert all(len(shard) == len(lists[0]) for shard in lists)  # the ranks stay in lockstep
    counts = Counter(seen + rest)
    padding = (old - 1) + (new - 1) + (newer - 1)
    if drop_last:  # each sample at most once; fewer dropped than the ranks of the jobs
        assert all(c == 1 for c in counts.values())
        assert n - len(counts) < old + new + newer
    else:  # every sample at least once; repeated only to pad each job's split
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n <= padding
    if not rest:
        return
    # The rest follows the epoch's global order from where the old ranks stopped.
    order = ranks[0].global_order(epoch)
    interleaved = [shard[k] for k in range(len(lists[0])) for shard in lists]
    start = order.index(interleaved[0])
    real = min(len(interleaved), n - start)
    assert interleaved[:real] == order[start : start + real]


def test_sampler_resize_four_ranks_to_two_keeps_the_position() -> None:
    four = _samplers(40, 4, False, 7)
    for s in four:
        s.advance(3)  # 12 of 40 consumed
    two = _samplers(40, 2, False, 7)
    for s in two:
        s.load_state_dict(four[1].state_dict())
    order = two[0].global_order(0)
    assert sorted(i for s in two for i in s) == sorted(order[12:])
    assert list(two[0]) == order[12::2] and list(two[1]) == order[13::2]
    assert two[0].epoch_samples == 14 and len(two[0]) == 20
    two[0].advance(14)
    two[0].set_epoch(1)  # the next epoch is sharded as usual
    assert list(two[0]) == ResumableSampler(40, num_replicas=2, rank=0, seed=7).indices(1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_replicas": 2, "rank": 2}, ValueError, "rank=2 .* < num_replicas=2"),
        ({"num_replicas": 0}, ValueError, "num_replicas=0"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"rank": True}, TypeError, "rank must be"),
    ],
)
def test_sampler_validates_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ResumableSampler(10, **kwargs)


# ---------------------------------------------------------------------------------------------
# loader


class _Indices(Dataset[int]):
    """Sample i is i: the batches show which samples the loop got."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(n: int, batch_size: int, *, drop_last: bool = False, **kw: Any) -> ResumableLoader:
    return ResumableLoader(
        _Indices(n),
        batch_size=batch_size,
        drop_last=drop_last,
        sampler=ResumableSampler(n, seed=11),
        **kw,
    )


def _epochs(loader: ResumableLoader, epochs: int) -> list[list[int]]:
    """The samples of each whole epoch, from where the loader stands."""
    out = []
    while loader.epoch < epochs:
        out.append([i for batch in loader for i in batch.tolist()])
    return out


@given(
    n=st.integers(0, 30),
    batch_size=st.integers(1, 7),
    drop_last=st.booleans(),
    resume_after=st.integers(0, 12),
)
def test_loader_resumes_mid_epoch_with_every_sample_once(
    n: int, batch_size: int, drop_last: bool, resume_after: int
) -> None:
    reference = _epochs(_loader(n, batch_size, drop_last=drop_last), 2)
    first = _loader(n, batch_size, drop_last=drop_last)
    got: list[int] = []
    if resume_after:
        for k, batch in enumerate(first, 1):
            got.extend(batch.tolist())  # a batch handed out counts as consumed
            if k == resume_after:
                break
    state = first.state_dict()
    resumed = _loader(n, batch_size, drop_last=drop_last)
    resumed.load_state_dict(state)
    rest = _epochs(resumed, 2)
    epoch0 = got + rest[0] if state["sampler"]["epoch"] == 0 else got
    assert [epoch0, rest[-1]] == reference
    kept = n // batch_size * batch_size if drop_last else n
    for samples in reference:
        assert len(samples) == kept and len(set(samples)) == kept


@pytest.mark.parametrize("persistent", [False, True])
def test_loader_counts_delivered_batches_not_prefetched_ones(persistent: bool) -> None:
    kw = {"num_workers": 2, "prefetch_factor": 4, "persistent_workers": persistent}
    n, bs = 45, 4
    first = _loader(n, bs, **kw)
    got: list[int] = []
    for k, batch in enumerate(first):
        got.extend(batch.tolist())
        if k == 2:
            break
    assert first.sampler.consumed == 3 * bs  # workers have fetched far more by now
    resumed = _loader(n, bs, **kw)
    resumed.load_state_dict(first.state_dict())
    rest = [i for batch in resumed for i in batch.tolist()]
    assert got + rest == ResumableSampler(n, seed=11).indices(0)
    assert resumed.epoch == 1


def test_loader_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    loader = _loader(10, 3)
    it = iter(loader)
    next(it)
    cryosnap.save(tmp_path / "run", {"loader": loader})
    other = _loader(10, 3)
    cryosnap.load(tmp_path / "run", into={"loader": other})
    assert (other.epoch, other.sampler.consumed) == (0, 3)
    assert [i for b in other for i in b.tolist()] == [i for b in it for i in b.tolist()]


def test_loader_iteration_never_draws_from_the_global_generator() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = _loader(9, 2)
    for _ in loader:
        pass
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


def test_loader_continues_after_break_and_moves_to_the_next_epoch() -> None:
    loader = _loader(7, 2)
    order = ResumableSampler(7, seed=11)
    first = next(iter(loader)).tolist()
    rest = [i for b in loader for i in b.tolist()]
    assert first + rest == order.indices(0)
    assert (loader.epoch, loader.sampler.consumed, len(loader)) == (1, 0, 4)
    loader.set_epoch(1)  # the DistributedSampler habit: harmless
    assert [i for b in loader for i in b.tolist()] == order.indices(1)


def test_an_iterator_of_an_exhausted_epoch_follows_set_epoch_before_its_first_batch() -> None:
    """Lightning resumed at an epoch's end: iter() on the exhausted epoch, then set_epoch."""
    loader = ResumableLoader(_Indices(8), batch_size=4)
    assert len(list(loader)) == 2  # epoch 0 exhausted, the loader at epoch 1
    state = {"sampler": {**loader.state_dict()["sampler"], "epoch": 0, "consumed": 8}}
    resumed = ResumableLoader(_Indices(8), batch_size=4)
    resumed.load_state_dict(state)
    it = iter(resumed)
    resumed.set_epoch(1)
    expected = ResumableSampler(8).indices(1)
    assert [int(i) for batch in it for i in batch] == expected
    assert resumed.epoch == 2


def test_stale_iterator_raises() -> None:
    loader = _loader(10, 2)
    old = iter(loader)
    next(old)
    iter(loader)
    with pytest.raises(RuntimeError, match="stale"):
        next(old)


@pytest.mark.parametrize("kwarg", ["shuffle", "batch_sampler", "generator"])
def test_loader_refuses_dataloader_arguments_it_owns(kwarg: str) -> None:
    with pytest.raises(TypeError, match=kwarg):
        ResumableLoader(_Indices(4), **{kwarg: None})


def test_loader_refuses_a_sampler_of_another_length() -> None:
    with pytest.raises(ValueError, match="5 samples, the dataset has 4"):
        ResumableLoader(_Indices(4), sampler=ResumableSampler(5))


def test_prepare_ddp_resume_takes_a_ddp_model_only() -> None:
    from cryosnap.integrations.torch import prepare_ddp_resume

    with pytest.raises(TypeError, match="DistributedDataParallel"):
        prepare_ddp_resume(torch.nn.Linear(2, 1), torch.zeros(1, 2))
