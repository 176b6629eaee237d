"""``Checkpointer.from_config``: a TOML file, then ``CRYOSNAP_<ARGUMENT>`` variables, then
keywords; an unknown key or a wrongly typed value is a ConfigError naming key and source."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

import cryosnap
import cryosnap.policy
from cryosnap._run.config import config_arguments
from cryosnap.storage.striped import Tier


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_toml_file_opens_a_run_as_its_arguments_say(tmp_path: Path) -> None:
    config = write(
        tmp_path / "cryosnap.toml",
        f'path = "{tmp_path / "run"}"\n'
        f'scratch = ["{tmp_path / "nvme0"}"]\n'
        "keep = 2\nkeep_scratch = 1\nchunk_bytes = 65536\nincremental = false\n"
        'flush_retry_seconds = "2m"\nrun_id = "heat-1"\n',
    )
    with cryosnap.Checkpointer.from_config(config) as ckpt:
        o = ckpt.options
        assert (o.keep_scratch, o.chunk_bytes, o.incremental) == (1, 65536, False)
        assert isinstance(o.keep, cryosnap.policy.KeepLast) and o.keep.n == 2
        assert o.flush_retry_seconds == 120.0 and ckpt.run_id == "heat-1"
        for step in (1, 2, 3):
            ckpt.save(step, {"grid": np.full(64, step)}).result()
    assert cryosnap.Run(tmp_path / "run").steps() == [2, 3]
    assert cryosnap.Run(tmp_path / "nvme0").steps() == [3]


def test_environment_overrides_the_file_and_keywords_the_environment(tmp_path: Path) -> None:
    config = write(tmp_path / "c.toml", f'path = "{tmp_path / "a"}"\nkeep = 5\nfull_every = 4\n')
    env = {
        "CRYOSNAP_PATH": str(tmp_path / "b"),
        "CRYOSNAP_KEEP": "3",
        "CRYOSNAP_SCRATCH": f"{tmp_path / 's0'},{tmp_path / 's1'}",
        "CRYOSNAP_INCREMENTAL": "no",
        "CRYOSNAP_STORAGE_TIMEOUT_SECONDS": "none",
        "CRYOSNAP_HANDLE_SIGNALS": "SIGTERM,usr1",
        "CRYOSNAP_STORAGE_OPTIONS": '{"anon": true}',
        "CRYOSNAP_NODE": "n3",  # another variable of cryosnap's: not an argument, ignored
    }
    args = config_arguments(config, {"keep": 7}, env)
    assert args == {
        "path": str(tmp_path / "b"),
        "keep": 7,
        "full_every": 4,
        "scratch": [str(tmp_path / "s0"), str(tmp_path / "s1")],
        "incremental": False,
        "storage_timeout_seconds": None,
        "handle_signals": (signal.SIGTERM, signal.SIGUSR1),
        "storage_options": {"anon": True},
    }


def test_scratch_as_tables_of_tiers_and_keep_none(tmp_path: Path) -> None:
    config = write(
        tmp_path / "c.toml",
        'path = "run"\n[[scratch]]\npath = "/nvme0"\ncapacity_bytes = 1000000\n'
        '[[scratch]]\npath = "/nvme1"\n',
    )
    args = config_arguments(config, {}, {"CRYOSNAP_KEEP": "all"})
    assert args["scratch"] == [Tier("/nvme0", 1000000), Tier("/nvme1", None)]
    assert args["keep"] is None


def test_a_mapping_works_as_a_file_does(tmp_path: Path) -> None:
    with cryosnap.Checkpointer.from_config({"path": str(tmp_path / "run")}, keep=1) as ckpt:
        assert isinstance(ckpt.options.keep, cryosnap.policy.KeepLast) and ckpt.options.keep.n == 1


@pytest.mark.parametrize(
    ("text", "env", "match"),
    [
        ('path = "r"\nkepp = 3\n', {}, r"unknown key 'kepp' in .*c\.toml"),
        ('path = "r"\nkeep = "three"\n', {}, r"keep from .*c\.toml: an integer is needed"),
        ('path = "r"\nincremental = 1\n', {}, r"incremental from .*c\.toml: true or false"),
        ('path = "r"\n', {"CRYOSNAP_KEEP": "x"}, r"keep from \$CRYOSNAP_KEEP: an integer"),
        ('path = "r"\n', {"CRYOSNAP_FLUSH_RETRY_SECONDS": "soon"}, r"\$CRYOSNAP_FLUSH_RETRY"),
        ('path = "r"\n', {"CRYOSNAP_HANDLE_SIGNALS": "SIGNOPE"}, r"unknown signal"),
        ('path = "r"\npolicy = "every 10"\n', {}, r"policy in .*an object, not a value"),
        ("keep = 3\n", {}, r"no path: give it in"),
        ('path = "r"\nscratch = 5\n', {}, r"scratch from .*a path, or a list"),
        ("path = [unclosed\n", {}, r"c\.toml: "),
    ],
)
def test_bad_configurations_name_the_key_and_where_it_came_from(
    tmp_path: Path, text: str, env: dict[str, str], match: str
) -> None:
    config = write(tmp_path / "c.toml", text)
    with pytest.raises(cryosnap.ConfigError, match=match):
        config_arguments(config, {}, env)


def test_a_missing_file_and_a_wrong_source_type_are_clear(tmp_path: Path) -> None:
    with pytest.raises(cryosnap.ConfigError, match="does not exist"):
        cryosnap.Checkpointer.from_config(tmp_path / "nope.toml")
    with pytest.raises(TypeError, match="TOML file's path or a mapping"):
        cryosnap.Checkpointer.from_config(3)
    assert not (tmp_path / "nope.toml").exists()
    assert issubclass(cryosnap.ConfigError, ValueError)
