"""The figures of a run: per peer and per training saver, the medians and ratios, the table
cells, the summary lines and the JSON (:class:`BenchResult`). Pure; no I/O.
"""

from __future__ import annotations

import datetime
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from cryosnap.bench._config import BenchConfig
from cryosnap.bench._probes import machine_info, median
from cryosnap.progress import human_bytes

_GB = 1e9

# A table: columns as (title, right-aligned), then rows of cells.
Table = tuple[list[tuple[str, bool]], list[list[str]]]


# ------------------------------------------------------------------------------------ results


METRICS = (
    "stall_seconds",
    "durable_seconds",
    "written_bytes",
    "restore_seconds",
    "restore_into_seconds",
    "restore_cold_seconds",
    "restore_cold_fresh_seconds",
    "cold_cached_pages",
    "cold_pages",
    "save_peak_bytes",
    "restore_peak_bytes",
    "restore_into_peak_bytes",
    "cpu_seconds",
    "background_cpu_seconds",
)


@dataclass(slots=True)
class PeerFigures:
    """Every sample of one peer (or limit), by metric name (:data:`METRICS`)."""

    key: str
    label: str
    limit: bool
    samples: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None
    note: str = ""

    def add(self, metric: str, value: float) -> None:
        self.samples.setdefault(metric, []).append(float(value))

    def median(self, metric: str) -> float:
        return median(self.samples.get(metric, []))


@dataclass(slots=True)
class TrainingFigures:
    """One checkpoint method at one interval in the training loop, over every round."""

    key: str
    label: str
    every: int
    step_seconds: list[float] = field(default_factory=list)
    save_call_seconds: list[float] = field(default_factory=list)
    durable_seconds: list[float] = field(default_factory=list)
    drain_seconds: list[float] = field(default_factory=list)
    written_bytes: list[float] = field(default_factory=list)
    cpu_seconds_per_step: list[float] = field(default_factory=list)
    saves: int = 0
    error: str | None = None

    @property
    def mean_step_seconds(self) -> float:
        return statistics.fmean(self.step_seconds) if self.step_seconds else float("nan")


@dataclass(slots=True)
class BenchResult:
    """What one ``cryosnap bench`` run measured (:meth:`to_json` is the ``--json`` document)."""

    config: BenchConfig
    machine: dict[str, Any]
    date: str
    command: str
    state_bytes: int
    tensors: int
    title: str
    memory_method: str
    cold: str
    peers: list[PeerFigures] = field(default_factory=list)
    training: list[TrainingFigures] = field(default_factory=list)
    training_setup: dict[str, Any] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    load_average: tuple[float, float] = (float("nan"), float("nan"))
    elapsed_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    # ---- the limits measured in the same run

    def _limit(self, key: str, metric: str) -> float:
        for peer in self.peers:
            if peer.key == key and peer.error is None:
                return peer.median(metric)
        return float("nan")

    @property
    def limits(self) -> dict[str, float]:
        return {
            "memcpy_seconds": self._limit("memcpy", "stall_seconds"),
            "write_fsync_seconds": self._limit("raw", "durable_seconds"),
            "read_warm_seconds": self._limit("raw", "restore_into_seconds"),
            "read_cold_seconds": self._limit("raw", "restore_cold_seconds"),
            "direct_write_fsync_seconds": self._limit("raw_direct", "durable_seconds"),
            "direct_read_seconds": self._limit("raw_direct", "restore_into_seconds"),
        }

    def ratios(self, peer: PeerFigures) -> dict[str, float]:
        """Medians against the limits: stall / memcpy, durable / raw write+fsync, restores /
        raw readinto (warm), cold restores / the raw O_DIRECT read (the disk's own limit)."""
        limits = self.limits
        against = {
            "stall_seconds": limits["memcpy_seconds"],
            "durable_seconds": limits["write_fsync_seconds"],
            "restore_seconds": limits["read_warm_seconds"],
            "restore_into_seconds": limits["read_warm_seconds"],
            "restore_cold_seconds": limits["direct_read_seconds"],
            "restore_cold_fresh_seconds": limits["direct_read_seconds"],
        }
        return {m: _ratio(peer.median(m), ref) for m, ref in against.items()}

    def overhead_percent(self, figures: TrainingFigures) -> float:
        """Mean step time with checkpoints against the same interval's baseline, minus 1."""
        base = next(
            (f for f in self.training if f.key == "none" and f.every == figures.every), None
        )
        if base is None or not figures.step_seconds:
            return float("nan")
        return (figures.mean_step_seconds / base.mean_step_seconds - 1.0) * 100.0

    # ---- output

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "cryosnap_bench": 1,
            "date": self.date,
            "command": self.command,
            "machine": self.machine,
            "config": {
                "workload": self.config.workload,
                "size_bytes": self.config.state_bytes,
                "repeat": self.config.repeat,
                "warmup": self.config.warmup,
                "directory": str(self.config.directory) if self.config.directory else None,
                "tensors": self.config.tensors,
                "steps": self.config.steps,
                "step_seconds": self.config.step_seconds,
                "cold": self.config.cold,
            },
            "state": {"title": self.title, "bytes": self.state_bytes, "tensors": self.tensors},
            "memory_method": self.memory_method,
            "cold": self.cold,
            "missing_peers": self.missing,
            "load_average": list(self.load_average),
            "elapsed_seconds": self.elapsed_seconds,
            "notes": self.notes,
        }
        if self.config.workload == "training":
            doc["training"] = {
                **self.training_setup,
                "methods": [self._training_json(f) for f in self.training],
            }
            return _finite_doc(doc)
        doc["limits"] = self.limits
        doc["peers"] = [
            {
                "key": p.key,
                "label": p.label,
                "limit": p.limit,
                "error": p.error,
                "note": p.note,
                "samples": p.samples,
                "medians": {m: p.median(m) for m in METRICS if m in p.samples},
                "ratios": {k: v for k, v in self.ratios(p).items() if not math.isnan(v)},
                "cpu_seconds_per_gb": p.median("cpu_seconds") / (self.state_bytes / _GB),
                "background_cpu_seconds_per_gb": p.median("background_cpu_seconds")
                / (self.state_bytes / _GB),
            }
            for p in self.peers
        ]
        return _finite_doc(doc)

    def _training_json(self, f: TrainingFigures) -> dict[str, Any]:
        return {
            "key": f.key,
            "label": f.label,
            "every": f.every,
            "error": f.error,
            "saves": f.saves,
            "mean_step_seconds": f.mean_step_seconds,
            "overhead_percent": self.overhead_percent(f) if f.key != "none" else 0.0,
            "samples": {
                "step_seconds": f.step_seconds,
                "save_call_seconds": f.save_call_seconds,
                "durable_seconds": f.durable_seconds,
                "drain_seconds": f.drain_seconds,
                "written_bytes": f.written_bytes,
                "cpu_seconds_per_step": f.cpu_seconds_per_step,
            },
            "medians": {
                "step_seconds": median(f.step_seconds),
                "save_call_seconds": median(f.save_call_seconds),
                "durable_seconds": median(f.durable_seconds),
                "written_bytes": median(f.written_bytes),
            },
        }

    def tables(self, *, wide: bool = False) -> list[Table]:
        """The results tables, each (columns as (title, right-aligned), rows of cells): two
        within 100 columns, peers by key (saving: stall, durable, written, peak memory, CPU;
        restoring: warm, into, cold), or ``wide``: the one :meth:`table` of every figure."""
        if wide or self.config.workload == "training":
            return [self.table()]
        return [self._save_table(), self._restore_table()]

    def table(self) -> Table:
        """(columns as (title, right-aligned), rows of cells) of the results table."""
        if self.config.workload == "training":
            return self._training_table()  # within 100 columns as it is
        cold = any("restore_cold_seconds" in p.samples for p in self.peers)
        columns = [
            ("peer", False),
            ("stall", True),
            ("durable", True),
            ("written", True),
            ("restore", True),
            ("restore into", True),
            *([("restore cold", True), ("cold fresh", True)] if cold else []),
            ("peak mem save/restore/into", True),
            ("CPU s/GB (bg)", True),
        ]
        rows = []
        gb = self.state_bytes / _GB
        for p in self.peers:
            if p.error is not None:
                rows.append([p.label, "error", *[""] * (len(columns) - 2)])
                continue
            ratio = self.ratios(p)

            def cell(metric: str, p: PeerFigures = p, ratio: dict[str, float] = ratio) -> str:
                return _seconds_cell(p.median(metric), ratio[metric])

            cpu, bg = p.median("cpu_seconds") / gb, p.median("background_cpu_seconds") / gb
            rows.append(
                [
                    p.label,
                    cell("stall_seconds"),
                    cell("durable_seconds"),
                    _bytes_cell(p.median("written_bytes")),
                    cell("restore_seconds"),
                    cell("restore_into_seconds"),
                    *(
                        [cell("restore_cold_seconds"), cell("restore_cold_fresh_seconds")]
                        if cold
                        else []
                    ),
                    f"{_bytes_cell(p.median('save_peak_bytes'))} / "
                    f"{_bytes_cell(p.median('restore_peak_bytes'))} / "
                    f"{_bytes_cell(p.median('restore_into_peak_bytes'))}",
                    "-" if math.isnan(cpu) else f"{cpu:.2f} ({bg:.2f})",
                ]
            )
        return columns, rows

    def _save_table(self) -> Table:
        columns = [
            ("peer", False),
            ("stall", True),
            ("durable", True),
            ("written", True),
            ("peak mem", True),
            ("CPU s/GB (bg)", True),
        ]
        rows = []
        gb = self.state_bytes / _GB
        for p in self.peers:
            if p.error is not None:
                rows.append([p.key, "error", *[""] * (len(columns) - 2)])
                continue
            ratio = self.ratios(p)
            cpu, bg = p.median("cpu_seconds") / gb, p.median("background_cpu_seconds") / gb
            rows.append(
                [
                    p.key,
                    _short_seconds_cell(p.median("stall_seconds"), ratio["stall_seconds"]),
                    _short_seconds_cell(p.median("durable_seconds"), ratio["durable_seconds"]),
                    _bytes_cell(p.median("written_bytes")),
                    _bytes_cell(p.median("save_peak_bytes")),
                    "-" if math.isnan(cpu) else f"{cpu:.2f} ({bg:.2f})",
                ]
            )
        return columns, rows

    def _restore_table(self) -> Table:
        """The peers that restore (or read, the limits), warm, into and cold."""
        metrics = [m for m in _RESTORES if any(m in p.samples for p in self.peers)]
        columns = [("peer", False), *[(_RESTORES[m], True) for m in metrics]]
        rows = []
        for p in self.peers:
            if p.error is None and not any(m in p.samples for m in metrics):
                continue  # saves only (DCP async_save, the lazy Checkpointer), or memcpy
            if p.error is not None:
                rows.append([p.key, "error", *[""] * (len(columns) - 2)])
                continue
            ratio = self.ratios(p)
            rows.append([p.key, *[_short_seconds_cell(p.median(m), ratio[m]) for m in metrics]])
        return columns, rows

    def _training_table(self) -> Table:
        columns = [
            ("method", False),
            ("every", True),
            ("step (mean)", True),
            ("overhead", True),
            ("save call", True),
            ("durable", True),
            ("written/save", True),
        ]
        rows = []
        for f in self.training:
            if f.error is not None:
                rows.append([f.label, str(f.every), "error", *[""] * 4])
                continue
            step = _seconds_cell(f.mean_step_seconds)
            if f.key == "none":
                rows.append([f.label, str(f.every), step, "baseline", "-", "-", "-"])
                continue
            call = statistics.fmean(f.save_call_seconds) if f.save_call_seconds else math.nan
            rows.append(
                [
                    f.label,
                    str(f.every),
                    step,
                    _percent_cell(self.overhead_percent(f)),
                    _seconds_cell(call),
                    _seconds_cell(median(f.durable_seconds)),
                    _bytes_cell(median(f.written_bytes)),
                ]
            )
        return columns, rows

    def summary(self) -> list[str]:
        """The lines printed around the table: what was measured, how, and how busy it was."""
        c = self.config
        lines = [
            f"cryosnap bench: {c.workload}, {self.title}; {self.machine.get('cpus')} CPUs, "
            f"{self.machine.get('platform')}, python {self.machine.get('python')}, torch "
            f"{self.machine.get('torch')}; {self.date}",
        ]
        if c.workload == "training":
            setup = self.training_setup
            lines.append(
                f"{setup.get('steps')} timed steps per method and interval in each of "
                f"{c.repeat} round(s), after a drained warm-up save; batch {setup.get('batch')} "
                f"(~{c.step_seconds} s/step); overhead: mean step time against the same "
                "interval's no-checkpoint runs"
            )
        else:
            limits = self.limits
            lines.append(
                f"medians of {c.repeat} after {c.warmup} warm-up round(s), peers round-robin; "
                f"ratios: stall x memcpy ({_seconds_cell(limits['memcpy_seconds'])}), durable x "
                f"raw write+fsync ({_seconds_cell(limits['write_fsync_seconds'])}), restore x "
                f"raw readinto warm ({_seconds_cell(limits['read_warm_seconds'])}); the disk "
                f"without the page cache: O_DIRECT write+fsync "
                f"{_seconds_cell(limits['direct_write_fsync_seconds'])}, read "
                f"{_seconds_cell(limits['direct_read_seconds'])}; a cold buffered readinto "
                f"{_seconds_cell(limits['read_cold_seconds'])}"
            )
            lines.append(f"cold: {self.cold}")
            lines.append(f"peak memory: {self.memory_method}")
            lines.append(
                "CPU s/GB: process CPU seconds from the save call until durable, per GB of "
                "state; (bg): without the stall's own"
            )
        lines += self.notes
        return lines


def _finite_doc(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = _finite(doc)
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN: a figure that was not measured is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _ratio(value: float, reference: float) -> float:
    if math.isnan(value) or math.isnan(reference) or reference <= 0:
        return float("nan")
    return value / reference


def _seconds_cell(seconds: float, ratio: float = float("nan")) -> str:
    if math.isnan(seconds):
        return "-"
    text = f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds:.3f} s"
    return text if math.isnan(ratio) else f"{text} ({ratio:.2f}x)"


# The restore metrics of the narrow restore table, and their column titles.
_RESTORES = {
    "restore_seconds": "restore",
    "restore_into_seconds": "restore into",
    "restore_cold_seconds": "restore cold",
    "restore_cold_fresh_seconds": "cold fresh",
}


def _short_seconds_cell(seconds: float, ratio: float = float("nan")) -> str:
    """A narrow table's cell: the time and its ratio to the limit, to about three digits."""
    if math.isnan(seconds):
        return "-"
    if seconds < 0.1:
        text = f"{seconds * 1e3:.1f} ms"
    else:
        text = f"{seconds:.{2 if seconds < 10 else 1 if seconds < 100 else 0}f} s"
    if math.isnan(ratio):
        return text
    digits = 2 if ratio < 10 else 1 if ratio < 100 else 0
    return f"{text} ({ratio:.{digits}f}x)"


def _bytes_cell(nbytes: float) -> str:
    return "-" if math.isnan(nbytes) else human_bytes(nbytes)


def _percent_cell(percent: float) -> str:
    return "-" if math.isnan(percent) else f"{percent:+.1f}%"


def new_result(
    config: BenchConfig, command: str, state_bytes: int, tensors: int, title: str
) -> BenchResult:
    return BenchResult(
        config=config,
        machine=machine_info(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command,
        state_bytes=state_bytes,
        tensors=tensors,
        title=title,
        memory_method="",
        cold="",
    )
