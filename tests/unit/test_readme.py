"""README.md's code runs as written, twice in a row, as a user would run it.

Every ```python block of README.md runs in document order in one Python process (one user
session, one namespace) in a temporary working directory; every ``cryosnap ...`` line of a
```bash block runs there too, at its place in the document, as ``python -m cryosnap ...``.
Then a second session runs the same code against the runs the first one left: a user running
the same script again. Both sessions must exit 0. (``make test`` runs the first session alone,
``make test-deep`` both.)

The snippets use a few names a user's own program defines (``train_step``, ``dataset``,
``total_steps``); :data:`PRELUDE` defines them, small and real: ``train_step`` does a real
forward, backward and optimizer step on the README's ``model`` and ``opt``. Nothing in the
prelude stands in for cryosnap.

A block right after ``<!-- no-test: REASON -->`` is not run: each one is reported as a skipped
test with its line and reason (pytest's ``-ra`` summary lists it), and there may be at most
:data:`MAX_SKIPPED`. Blocks of other languages, and bash blocks without ``cryosnap`` commands
(``make demo``, ``make test``: CI runs those), are not code this test can run.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
MAX_SKIPPED = 3  # S3, several processes, DeepSpeed: each names the test that runs it
SKIP = re.compile(r"<!--\s*no-test:\s*(.*?)\s*-->")

# What the README's snippets take from the user's program. Defined before the first block.
PRELUDE = """
import torch

torch.set_num_threads(1)  # the test machine is shared; the snippets do not depend on it
dataset = torch.utils.data.TensorDataset(torch.randn(512, 1024))
total_steps = 40


def train_step(model, opt, batch=None):
    x = torch.randn(4, 1024) if batch is None else batch[0]  # a small batch: 1,000 steps run
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()
"""

# Runs in the session's process: the prelude, then each block in order. Code is compiled with
# README.md's line numbers, so a traceback points at the README line that failed.
DRIVER = """
import json, subprocess, sys

blocks = json.loads(open(sys.argv[1]).read())
ns = {"__name__": "__main__"}
exec(compile(sys.argv[2], "test_readme.PRELUDE", "exec"), ns)
for block in blocks:
    print(f"=== README.md line {block['line']}", flush=True)
    if block["lang"] == "python":
        exec(compile("\\n" * block["line"] + block["code"], "README.md", "exec"), ns)
        continue
    for argv in block["commands"]:
        print("$ cryosnap " + " ".join(argv), flush=True)
        proc = subprocess.run([sys.executable, "-m", "cryosnap", *argv])
        if proc.returncode != 0:
            sys.exit(f"README.md line {block['line']}: cryosnap {argv} exited {proc.returncode}")
"""


@dataclass(frozen=True)
class Block:
    line: int  # README line of the block's first code line
    lang: str
    code: str
    skip: str | None  # the reason of a <!-- no-test: ... --> right before it

    def commands(self) -> list[list[str]]:
        """The arguments of each ``cryosnap`` command line (comments and other lines dropped)."""
        found = []
        for text in self.code.splitlines():
            words = shlex.split(text, comments=True)
            if words and words[0] in ("cryosnap", ".venv/bin/cryosnap"):
                found.append(words[1:])
        return found


def readme_blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip(), i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        match = SKIP.search(before)
        code = "\n".join(lines[start:end]) + "\n"
        blocks.append(Block(start + 1, lang, code, match.group(1) if match else None))
        i = end + 1
    return blocks


def runnable(block: Block) -> bool:
    return block.lang == "python" or (block.lang == "bash" and bool(block.commands()))


BLOCKS = [b for b in readme_blocks() if runnable(b)]
SKIPPED = [b for b in BLOCKS if b.skip is not None]


def test_readme_has_python_and_cli_blocks_and_few_skips() -> None:
    assert sum(b.lang == "python" and b.skip is None for b in BLOCKS) >= 3
    assert any(b.lang == "bash" and b.skip is None for b in BLOCKS)
    assert len(SKIPPED) <= MAX_SKIPPED, [f"line {b.line}: {b.skip}" for b in SKIPPED]


@pytest.mark.parametrize("block", SKIPPED, ids=[f"line{b.line}" for b in SKIPPED])
def test_a_block_not_run_here_names_the_test_that_runs_it(block: Block) -> None:
    """A block left out (S3, several processes) says which test runs what it shows; that
    test exists."""
    assert block.skip is not None
    named = re.findall(r"tests/[\w/]+\.py", block.skip)
    assert named, f"README.md line {block.line}: the no-test reason names no test file"
    for path in named:
        assert (README.parent / path).is_file(), f"README.md line {block.line}: {path} is gone"


def _session(tmp_path: Path, blocks_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(blocks_file), PRELUDE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _blocks_file(tmp_path: Path) -> tuple[Path, Path, int]:
    """The user's working directory, the blocks to run (a JSON file) and how many there are."""
    work = tmp_path / "user"
    work.mkdir()
    blocks_file = tmp_path / "blocks.json"
    run = [
        {"line": b.line, "lang": b.lang, "code": b.code, "commands": b.commands()}
        for b in BLOCKS
        if b.skip is None
    ]
    blocks_file.write_text(json.dumps(run))
    return work, blocks_file, len(run)


def _run_session(work: Path, blocks_file: Path, blocks: int, session: str) -> str:
    proc = _session(work, blocks_file)
    assert proc.returncode == 0, f"{session} session:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("=== README.md line") == blocks
    return proc.stdout


@pytest.mark.slow
def test_readme_snippets_run(tmp_path: Path) -> None:
    """Every block once, in one session (make test; the second session is make test-deep's)."""
    _run_session(*_blocks_file(tmp_path), "first")


@pytest.mark.slow
@pytest.mark.deep
def test_readme_snippets_run_twice_in_a_row(tmp_path: Path) -> None:
    work, blocks_file, blocks = _blocks_file(tmp_path)
    for session in ("first", "second"):
        out = _run_session(work, blocks_file, blocks, session)
    # The second session met the one-shot save's rule instead of overwriting step 100.
    assert "step 100 already exists" in out
