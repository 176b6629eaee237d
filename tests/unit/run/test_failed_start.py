"""A save that fails after its job was made but before its capture began (docs/design/
threads-and-locks.md, the two defects found ordering the locks): the writer waited forever
for the job's batches, the in-flight permit stayed taken, and the next ``save()``, ``wait()``
and ``close()`` hung. Now the failure reaches the caller once, and the run goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap._run.capture.capturer import Capturer
from cryosnap._run.writer import VersionWriter

pytestmark = pytest.mark.timeout(60)  # the defect was a hang


def state(step: int) -> dict[str, Any]:
    return {"x": np.full(4096, step, np.float32), "step": step}


class Injected(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["lazy", "eager"])
def test_a_capture_that_never_began_fails_once_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    calls = {"n": 0}
    real = Capturer._begin

    def begin(self: Capturer, job: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second save's capture cannot begin
            raise Injected("injected before the capture")
        real(self, job)

    monkeypatch.setattr(Capturer, "_begin", begin)
    lazy = where == "lazy"
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, state(1), lazy=lazy).result()
        with pytest.raises(Injected):
            ckpt.save(2, state(2), lazy=lazy)
        ckpt.save(3, state(3), lazy=lazy).result()  # the permit came back, the writer too
        ckpt.wait()  # the failure was the caller's already: not raised again
        assert ckpt.steps() == [1, 3]
    assert cryosnap.load(tmp_path / "run")["step"] == 3


def test_a_job_that_cannot_be_made_gives_its_permit_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real = VersionWriter.plan

    def plan(self: VersionWriter, flat: Any, keys: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise Injected("injected while planning the replicated state")
        return real(self, flat, keys)

    monkeypatch.setattr(VersionWriter, "plan", plan)
    with cryosnap.Checkpointer(tmp_path / "run", max_inflight=1) as ckpt:
        ckpt.save(1, state(1)).result()
        with pytest.raises(Injected):
            ckpt.save(2, state(2))
        ckpt.save(3, state(3)).result()  # max_inflight=1: blocked forever before the fix
        assert ckpt.steps() == [1, 3]
