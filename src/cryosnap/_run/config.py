"""``Checkpointer.from_config``: the constructor's arguments from a TOML file (or a mapping),
overridden by ``CRYOSNAP_<ARGUMENT>`` environment variables, overridden by keywords; each value
typed and checked here, an error naming the key and where it came from.

Pure but for reading the file and the environment; runs on the caller's thread.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cryosnap.errors import ConfigError
from cryosnap.storage.striped import Device

__all__ = ["ENV_PREFIX", "config_arguments"]

ENV_PREFIX = "CRYOSNAP_"

# Arguments only a program can give (objects, not values): keywords only.
_OBJECTS = frozenset(("policy", "comm", "clock"))
_SECONDS = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h)?\s*$")
_UNIT = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def _int(value: Any, key: str, where: str) -> int:
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            pass
    elif type(value) is int:
        return value
    raise ConfigError(f"{key} from {where}: an integer is needed, got {value!r:.80}")


def _bool(value: Any, key: str, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
    raise ConfigError(f"{key} from {where}: true or false is needed, got {value!r:.80}")


def _seconds(value: Any, key: str, where: str) -> float:
    if type(value) in (int, float):
        return float(value)
    if isinstance(value, str):
        m = _SECONDS.match(value)
        if m:
            return float(m.group(1)) * _UNIT[m.group(2)]
    raise ConfigError(
        f"{key} from {where}: seconds are needed (a number, or with s, m or h), got {value!r:.80}"
    )


def _or_none(kind: Callable[[Any, str, str], Any], *words: str) -> Callable[[Any, str, str], Any]:
    """``kind``, or None for one of ``words`` (``none``, and the argument's own: ``all`` for
    ``keep``, ``auto`` for ``device_diff``) or an empty string."""
    nones = {"none", "", *words}

    def parse(value: Any, key: str, where: str) -> Any:
        if isinstance(value, str) and value.strip().lower() in nones:
            return None
        return kind(value, key, where)

    return parse


def _partner(value: Any, key: str, where: str) -> bool | str:
    if isinstance(value, str) and value.strip().lower() == "xor":
        return "xor"
    if isinstance(value, str) and value.strip().lower().startswith("rs:"):
        return value.strip().lower()  # "rs:K+M", checked by RunOptions
    return _bool(value, key, where)


def _size(value: Any, key: str, where: str) -> int | str:
    """A byte count or a size such as ``"4GiB"`` (checked by RunOptions)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip():
        text = value.strip()
        return int(text) if text.isdigit() else text
    raise ConfigError(f"{key} from {where}: a size is needed (e.g. 4GiB), got {value!r:.80}")


def _text(value: Any, key: str, where: str) -> str:
    if isinstance(value, str) and value:
        return value
    raise ConfigError(f"{key} from {where}: a string is needed, got {value!r:.80}")


def _scratch(value: Any, key: str, where: str) -> Any:
    """A path, a list of paths, or a list of tables ``{path, capacity_bytes, direct_io}`` (TOML's
    ``[[scratch]]``); from the environment, paths separated by commas."""
    if isinstance(value, str):
        items: list[Any] = [v.strip() for v in value.split(",") if v.strip()]
        return items[0] if len(items) == 1 else items
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{key} from {where}: a path, or a list of paths or tables, is needed")
    out: list[Any] = []
    for item in value:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, Mapping) and set(item) <= {"path", "capacity_bytes", "direct_io"}:
            cap = item.get("capacity_bytes")
            direct = item.get("direct_io")
            path = _text(item.get("path"), f"{key}.path", where)
            out.append(
                Device(
                    path,
                    None if cap is None else _int(cap, f"{key}.capacity_bytes", where),
                    None if direct is None else _bool(direct, f"{key}.direct_io", where),
                )
            )
        else:
            raise ConfigError(
                f"{key} from {where}: each tier is a path or a table with path, "
                f"capacity_bytes and direct_io, got {item!r:.80}"
            )
    return out


def _signals(value: Any, key: str, where: str) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ConfigError(f"{key} from {where}: a list of signals is needed, got {value!r:.80}")
    out = []
    for item in items:
        name = item.strip().upper() if isinstance(item, str) else item
        if isinstance(name, str) and not name.isdigit():
            number = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
            if not isinstance(number, int):
                raise ConfigError(f"{key} from {where}: unknown signal {item!r:.40}")
            out.append(int(number))
        else:
            out.append(_int(name, key, where))
    return tuple(out)


def _table(value: Any, key: str, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{key} from {where}: a JSON object is needed") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} from {where}: a table is needed, got {value!r:.80}")
    return dict(value)


_TYPES: dict[str, Callable[[Any, str, str], Any]] = {
    "path": _text,
    "scratch": _scratch,
    "keep": _or_none(_int, "all"),
    "keep_scratch": _or_none(_int, "all"),
    "incremental": _bool,
    "full_every": _int,
    "chunk_bytes": _int,
    "staging_bytes": _or_none(_int, "all"),
    "direct_io": _or_none(_bool, "auto"),
    "max_inflight": _int,
    "allow_pickle": _bool,
    "handle_signals": _signals,
    "storage_options": _table,
    "flush_retry_seconds": _seconds,
    "storage_timeout_seconds": _or_none(_seconds),
    "run_id": _text,
    "device_diff": _or_none(_bool, "auto"),
    "partner": _partner,
    "stats": _bool,
    "memory": _or_none(_size),
    "codec": _or_none(_text, "none"),
}


def _read(source: Any) -> tuple[Mapping[str, Any], str]:
    if isinstance(source, Mapping):
        return source, "the mapping given"
    if not isinstance(source, str | os.PathLike):
        raise TypeError(
            f"from_config takes a TOML file's path or a mapping, got {type(source).__name__}"
        )
    path = Path(source)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ConfigError("reading a TOML file needs Python 3.11 or later") from None
    try:
        with path.open("rb") as f:
            return tomllib.load(f), str(path)
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"configuration file {path}: {exc}") from exc


def config_arguments(
    source: Any, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The Checkpointer's keyword arguments: ``source``'s, then ``CRYOSNAP_<ARGUMENT>``
    variables of ``environ`` (default: the process's), then ``overrides``."""
    file, where = _read(source)
    args: dict[str, Any] = {}
    for key, value in file.items():
        if key in _OBJECTS:
            raise ConfigError(f"{key} in {where}: an object, not a value: pass it as {key}=")
        if key not in _TYPES:
            raise ConfigError(
                f"unknown key {key!r:.60} in {where}; known: {', '.join(sorted(_TYPES))}"
            )
        args[key] = _TYPES[key](value, key, where)
    env = os.environ if environ is None else environ
    for key, kind in _TYPES.items():
        name = ENV_PREFIX + key.upper()
        if name in env:
            args[key] = kind(env[name], key, f"${name}")
    args.update(overrides)
    if "path" not in args:
        raise ConfigError(
            f"no path: give it in {where}, as ${ENV_PREFIX}PATH or as path= (the persistent tier)"
        )
    return args
