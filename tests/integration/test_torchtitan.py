"""cryosnap's torchtitan checkpoint manager with the real torchtitan (0.3.0) on CPU: built from
its ``Config`` as torchtitan builds it, driven as torchtitan's ``Trainer`` drives it.

In this process (a world of one): the configuration refused (``keep_latest_k=1``,
``last_save_in_hf``, ``create_seed_checkpoint``), a resume into a different model, a missing
``load_step``, and ``initial_load_path`` from a DCP checkpoint written by torchtitan's own
manager. On 2 gloo ranks (torchtitan_job.py beside this file): FSDP2 on a CPU mesh and
torchtitan's DDP (FSDP2 over ``dp_replicate``), the bytes each rank writes (replicated state
1/N, the second save only what changed), and SIGKILL mid-training then resume, bit-exact
against an uninterrupted run (``deep``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.integration import ranks

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="torchtitan is not installed (pip install -r requirements-dev.txt)",
    ),
    pytest.mark.timeout(400),
]

JOB = Path(__file__).resolve().parent / "torchtitan_job.py"
CHUNK = 4096


def _launch(tmp_path: Path, name: str, *args: str, **options: Any) -> list[dict[str, Any]]:
    return ranks.launch(JOB, "train", 2, tmp_path / name, *args, **options)


def _train(run: Path, mode: str, steps: int, kill_at: int = -1) -> tuple[str, ...]:
    return (str(run), mode, str(steps), "2", str(kill_at), str(CHUNK))


# -- on 2 gloo ranks ------------------------------------------------------------------------------


def test_ddp_ranks_write_half_of_the_replicated_state_and_then_only_what_changed(
    tmp_path: Path,
) -> None:
    results = _launch(tmp_path, "out", *_train(tmp_path / "run", "ddp", 4))
    frozen = 512 * 64 * 4  # the embedding's bytes: in the first version only
    for got in results:
        assert got["resumed_at"] == 0 and got["steps"] == [2, 4]
    first = [got["saves"]["2"]["written"] for got in results]
    second = [got["saves"]["4"]["written"] for got in results]
    replicated = sum(results[0]["local_param_bytes"].values())  # the whole model, every rank
    trainable = replicated - frozen
    # Replicated: the model (and AdamW's two moments of its trainable part), 1/2 each.
    whole = replicated + 2 * trainable
    for written in first:
        assert whole // 2 - 2 * CHUNK <= written <= whole // 2 + 2 * CHUNK, (first, whole)
    # The second save: the trainable parameters and moments changed, the embedding did not.
    changed = 3 * trainable
    assert sum(second) <= changed + 4 * CHUNK, (second, changed)
    assert sum(second) >= changed - 4 * CHUNK
    assert results[0]["final"] == results[1]["final"]  # replicated: the same everywhere


def test_fsdp_ranks_write_their_own_shards(tmp_path: Path) -> None:
    results = _launch(tmp_path, "out", *_train(tmp_path / "run", "fsdp", 4))
    for got in results:
        local = sum(got["local_param_bytes"].values())  # this rank's shards
        frozen = 512 * 64 * 4 // 2
        trainable = local - frozen
        assert got["saves"]["2"]["written"] >= local + 2 * trainable - CHUNK
        assert got["saves"]["2"]["written"] <= local + 2 * trainable + 4 * CHUNK
        assert got["saves"]["4"]["written"] <= 3 * trainable + 4 * CHUNK
    assert results[0]["final"] != results[1]["final"]  # each rank's own shards


@pytest.mark.deep
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_sigkill_mid_training_then_resume_is_bit_exact(tmp_path: Path, mode: str) -> None:
    whole = _launch(tmp_path, "whole", *_train(tmp_path / "whole-run", mode, 8))
    run = tmp_path / "run"
    _launch(tmp_path, "killed", *_train(run, mode, 8, kill_at=5), killed=frozenset({0, 1}))
    resumed = _launch(tmp_path, "resumed", *_train(run, mode, 8))
    for got, ref in zip(resumed, whole, strict=True):
        assert got["resumed_at"] in (2, 4)  # the newest version committed before the kill
        assert got["final"] == ref["final"]
        assert got["steps"] == [2, 4, 6, 8]
