"""Partner placement (issue 55): whose copies each rank holds, counted per rank and per node.

The map is pure (:func:`partner_map` over the gathered node names); the last tests run it
through ``Partners.open`` and a whole save, node loss and restore with ranks as threads and
"nodes" as scratch directories, as tests/unit/run/test_dist_scratch.py does.
"""

from __future__ import annotations

import math
import shutil
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cryosnap
import cryosnap._run.redundancy.partner as _partner
from cryosnap import engine
from cryosnap._format.keys import commit_key
from cryosnap.dist import Coordinator
from cryosnap.storage import LocalStore, open_store

from ..distributed.test_coordinator import run_ranks

_NODE = threading.local()


@pytest.fixture(autouse=True)
def _nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_partner, "node_name", lambda: _NODE.name)


def loads(partners: Sequence[int]) -> list[int]:
    """How many ranks' copies each rank holds."""
    held = Counter(partners)
    return [held[r] for r in range(len(partners))]


def node_loads(nodes: Sequence[str], partners: Sequence[int]) -> dict[str, int]:
    """How many other ranks' copies each node holds."""
    held = Counter(nodes[p] for p in partners)
    return {node: held[node] for node in nodes}


def fewest_possible(nodes: Sequence[str]) -> int:
    """The most copies some rank must hold: a node's ``c`` parts go to the other ``n - c``."""
    n = len(nodes)
    return max(1, *(math.ceil(c / (n - c)) for c in Counter(nodes).values()))


def test_four_ranks_on_four_nodes_hold_one_copy_each() -> None:
    nodes = ["n0", "n1", "n2", "n3"]
    assert _partner.partner_map(nodes) == [1, 2, 3, 0]
    assert loads(_partner.partner_map(nodes)) == [1, 1, 1, 1]


def test_four_ranks_with_two_sharing_a_node_hold_one_copy_each() -> None:
    # "next rank on another node" gave [1, 2, 0, 0]: rank 0 held ranks 2's and 3's copies.
    partners = _partner.partner_map(["n0", "n1", "n2", "n2"])
    assert loads(partners) == [1, 1, 1, 1]
    assert partners[2] != 3 and partners[3] != 2


@pytest.mark.parametrize(
    "nodes",
    [
        [f"n{r // 2}" for r in range(8)],  # block: ranks 0-1 on n0, 2-3 on n1...
        [f"n{r % 4}" for r in range(8)],  # round-robin: ranks 0, 4 on n0...
    ],
)
def test_eight_ranks_on_four_nodes_of_two_form_a_ring_over_the_nodes(nodes: list[str]) -> None:
    partners = _partner.partner_map(nodes)
    assert loads(partners) == [1] * 8
    assert node_loads(nodes, partners) == {f"n{i}": 2 for i in range(4)}
    # Each node holds the parts of exactly one other node, and each node's parts are on one.
    sources = {nodes[p]: {nodes[r] for r, q in enumerate(partners) if q == p} for p in partners}
    assert all(len(s) == 1 for s in sources.values())
    assert len({nodes[p] for p in partners}) == 4


def test_block_layout_sends_each_node_to_the_next() -> None:
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert _partner.partner_map(nodes) == [2, 3, 4, 5, 6, 7, 0, 1]


@pytest.mark.parametrize(
    ("nodes", "want"),
    [
        (["a", "a", "a", "b"], [1, 0, 0, 3]),  # b must hold a's three parts
        (["a", "a", "b"], [1, 0, 2]),
        (["a", "a", "a", "b", "c", "d"], [1] * 6),  # a's three parts over b, c and d
        (["a", "a", "b", "b", "b", "c", "c", "c"], [1] * 8),
        (["a", "a", "a", "a", "a", "b", "c"], [1, 1, 0, 0, 0, 3, 2]),
    ],
)
def test_uneven_nodes_spread_as_evenly_as_the_layout_allows(
    nodes: list[str], want: list[int]
) -> None:
    partners = _partner.partner_map(nodes)
    assert loads(partners) == want
    assert all(nodes[p] != nodes[r] for r, p in enumerate(partners))


def test_one_node_has_no_partner() -> None:
    for nodes in (["n0"], ["n0", "n0", "n0"]):
        with pytest.raises(ValueError, match="partner=True needs ranks on at least two nodes"):
            _partner.partner_map(nodes)


@given(st.lists(st.integers(0, 5), min_size=2, max_size=24))
def test_any_layout_is_balanced_deterministic_and_off_node(layout: list[int]) -> None:
    nodes = [f"host-{i}" for i in layout]
    if len(set(nodes)) < 2:
        with pytest.raises(ValueError):
            _partner.partner_map(nodes)
        return
    partners = _partner.partner_map(nodes)
    assert all(nodes[p] != nodes[r] for r, p in enumerate(partners))
    # Every rank computes the same map, whatever the nodes are called.
    assert _partner.partner_map([f"other-{i}" for i in layout]) == partners
    held = loads(partners)
    assert max(held) == fewest_possible(nodes)
    big = max(Counter(nodes).values())
    if 2 * big <= len(nodes):
        assert held == [1] * len(nodes)
    else:  # one node has more than half the ranks: the others hold its parts, evenly
        crowded = Counter(nodes).most_common(1)[0][0]
        others = [h for r, h in enumerate(held) if nodes[r] != crowded]
        assert max(others) - min(others) <= 1
        assert all(h <= 1 for r, h in enumerate(held) if nodes[r] == crowded)


def test_every_rank_opens_the_copies_the_map_gives_it(tmp_path: Path) -> None:
    nodes = ["n0", "n0", "n1", "n1"]

    def body(c: Coordinator) -> tuple[int, list[int]]:
        _NODE.name = nodes[c.rank]
        root = str(tmp_path / nodes[c.rank])
        partners = _partner.Partners.open(c, root, open_store=open_store, timeout=None)
        partners.release()
        return partners.target, sorted(partners.held)

    got = run_ranks(4, body)
    assert [target for target, _ in got] == [2, 3, 0, 1]
    assert [held for _, held in got] == [[2], [3], [0], [1]]


def state_of(rank: int, step: int) -> dict[str, Any]:
    return {"own": np.full(4096, rank * 100 + step, np.int64), "step": step}


def test_a_node_lost_from_an_uneven_layout_comes_back_from_its_partners(tmp_path: Path) -> None:
    """Ranks 2 and 3 share a node; their copies are on ranks 0 and 1, one each, and come back
    from there after their node's scratch is wiped and the persistent level lacks the step."""
    run, nodes = tmp_path / "run", ["n0", "n1", "n2", "n2"]

    def scratch(rank: int) -> Path:
        return tmp_path / nodes[rank]

    def save(c: Coordinator) -> None:
        _NODE.name = nodes[c.rank]
        with cryosnap.Checkpointer(run, scratch=scratch(c.rank), comm=c, partner=True) as ckpt:
            for step in (1, 2):
                ckpt.save(step, state_of(c.rank, step)).result()

    run_ranks(4, save)
    for owner, holder in enumerate(_partner.partner_map(nodes)):
        copy = scratch(holder) / "partner" / f"rank-{owner:05d}"
        assert cryosnap.load(copy, step=2)["step"] == 2
    assert sorted(p.name for p in (scratch(0) / "partner").iterdir()) == ["rank-00002"]
    assert sorted(p.name for p in (scratch(1) / "partner").iterdir()) == ["rank-00003"]
    shutil.rmtree(scratch(2))
    (run / commit_key(2)).unlink()

    def restore(c: Coordinator) -> Any:
        _NODE.name = nodes[c.rank]
        with cryosnap.Checkpointer(run, scratch=scratch(c.rank), comm=c, partner=True) as ckpt:
            return ckpt.restore()

    for rank, restored in enumerate(run_ranks(4, restore)):
        assert restored["step"] == 2
        assert np.array_equal(restored["own"], state_of(rank, 2)["own"])
    for rank in (2, 3):
        assert engine.list_steps(LocalStore(scratch(rank) / f"rank-{rank:05d}"))[-1] == 2
