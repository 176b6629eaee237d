"""The typer app: each command's arguments, options and help, calling the command modules.

Wiring only: every command function parses, then calls one ``cmd_*``. Imported by ``_main``
once typer is known to be installed. Runs on the caller's thread.
"""

# No ``from __future__ import annotations`` here: typer reads the annotations of the command
# functions at runtime.

from difflib import get_close_matches
from typing import Annotated, Any

import typer
import typer.core

from cryosnap.cli._bench import cmd_bench
from cryosnap.cli._demo import cmd_demo
from cryosnap.cli._diff import cmd_diff
from cryosnap.cli._export import cmd_export
from cryosnap.cli._flush import cmd_flush
from cryosnap.cli._fork import cmd_fork
from cryosnap.cli._import_dcp import cmd_import_dcp
from cryosnap.cli._inspect import cmd_inspect
from cryosnap.cli._log import cmd_log
from cryosnap.cli._ls import cmd_ls
from cryosnap.cli._memory import cmd_memory
from cryosnap.cli._plan import JobArgs, RateArgs, cmd_plan
from cryosnap.cli._remove import cmd_gc, cmd_rm
from cryosnap.cli._render import PROG, Invocation, print_line
from cryosnap.cli._verify import cmd_verify
from cryosnap.run import MAX_STEP

PATH_ARG = typer.Argument(help="The run: a directory or an fsspec URL (memory://, s3://...).")
JSON_OPT = typer.Option("--json", help="Machine-readable output (JSON) on stdout.")
RANK_OPT = typer.Option("--rank", min=0, help="Which rank's part of the version.")
DRY_RUN_OPT = typer.Option("--dry-run", help="Show what would be deleted; delete nothing.")


# Words a user may type for a command of another name: suggested instead of the nearest
# spelling ("remove" is nearer to "demo" than to "rm").
SYNONYMS = {
    "remove": "rm",
    "delete": "rm",
    "del": "rm",
    "clean": "gc",
    "prune": "gc",
    "list": "ls",
    "show": "inspect",
    "info": "inspect",
    "check": "verify",
    "compare": "diff",
    "version": "--version",
}


def _plain_flags(params: list[Any]) -> list[Any]:
    """A flag takes no value: ``--help`` shows ``--json``, not ``--json <bool>`` (recent typer
    shows every option's type, flags' too)."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


class _Command(typer.core.TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


class _Group(typer.core.TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        """An unknown command is a usage error suggesting the one meant, if any: a synonym
        (:data:`SYNONYMS`) before the nearest spelling."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            names = [*self.list_commands(ctx), *SYNONYMS]
            meant = [SYNONYMS.get(m, m) for m in get_close_matches(name, names, n=1)]
            hint = f" Did you mean {meant[0]!r}?" if meant else ""
            ctx.fail(f"No such command {name!r}.{hint}")
        return super().resolve_command(ctx, args)


def build_app(invocation: Invocation) -> typer.Typer:
    """The app with every command, in the order ``--help`` lists them."""
    app = typer.Typer(
        cls=_Group,
        name=PROG,
        help="List, inspect, verify, diff, log, export, remove, garbage-collect and flush cryosnap "
        "checkpoints; clean shared memory; plan intervals; benchmark against the peers.",
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    _add_root(app)
    _add_read_commands(app)
    _add_export_command(app)
    _add_diff_command(app)
    _add_log_command(app)
    _add_fork_command(app)
    _add_remove_commands(app)
    _add_flush_command(app)
    _add_memory_command(app)
    _add_demo_command(app)
    _add_plan_command(app)
    _add_bench_command(app, invocation)
    _add_import_dcp_command(app)
    for command in app.registered_commands:
        if command.cls in (None, typer.core.TyperCommand):
            command.cls = _Command
    return app


def _show_version(value: bool) -> None:
    if value:
        from cryosnap import __version__

        print_line(f"{PROG} {__version__}")
        raise typer.Exit(0)


def _add_root(app: typer.Typer) -> None:
    @app.callback()
    def root(
        version: Annotated[
            bool,
            typer.Option(
                "--version", is_eager=True, callback=_show_version, help="Print the version."
            ),
        ] = False,
    ) -> None:
        """List, inspect, verify, diff, export, remove and garbage-collect cryosnap checkpoints."""


def _add_read_commands(app: typer.Typer) -> None:
    @app.command("ls")
    def ls_command(
        path: Annotated[str, PATH_ARG],
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """List the committed versions of a run."""
        cmd_ls(path, as_json=json_output)

    @app.command("inspect")
    def inspect_command(
        path: Annotated[str, PATH_ARG],
        step: Annotated[
            int | None,
            typer.Option("--step", min=0, max=MAX_STEP, help="The version (default: latest)."),
        ] = None,
        rank: Annotated[int, RANK_OPT] = 0,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Show the leaves of a version (paths, dtypes, shapes, sizes) without reading data."""
        cmd_inspect(path, step=step, rank=rank, as_json=json_output)

    @app.command("verify")
    def verify_command(
        path: Annotated[str, PATH_ARG],
        step: Annotated[
            int | None,
            typer.Option(
                "--step", min=0, max=MAX_STEP, help="The version (default: every version)."
            ),
        ] = None,
        scratch: Annotated[
            list[str] | None,
            typer.Option(
                "--scratch",
                metavar="DIR",
                help="The run's scratch devices, as given to the Checkpointer (repeat per device): "
                "verify every level, each rank's scratch part found under DIR included, and "
                "name the damaged level. PATH is then the persistent tier.",
            ),
        ] = None,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Read every chunk of every rank and check its hash; exit 1 if anything is damaged."""
        code = cmd_verify(path, step=step, as_json=json_output, scratch=scratch)
        if code:
            raise typer.Exit(code)


def _add_export_command(app: typer.Typer) -> None:
    @app.command("export")
    def export_command(
        path: Annotated[str, PATH_ARG],
        out: Annotated[str, typer.Argument(help="Output file: .pt, .safetensors or .npz.")],
        step: Annotated[
            int | None,
            typer.Option("--step", min=0, max=MAX_STEP, help="The version (default: latest)."),
        ] = None,
        rank: Annotated[int, RANK_OPT] = 0,
        since: Annotated[
            int | None,
            typer.Option(
                "--since",
                min=0,
                max=MAX_STEP,
                help="Write a delta: only the leaves changed since this step (.safetensors or "
                ".npz), with the roots cryosnap.apply_delta checks.",
            ),
        ] = None,
        force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
        allow_pickle: Annotated[
            bool,
            typer.Option(
                "--allow-pickle",
                help="Load pickled leaves too. Unpickling runs code from the checkpoint: only "
                "for a run you trust.",
            ),
        ] = False,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Write one version as a .pt, .safetensors or .npz file (--since: a delta)."""
        cmd_export(
            path,
            out,
            step=step,
            rank=rank,
            since=since,
            force=force,
            as_json=json_output,
            allow_pickle=allow_pickle,
        )


def _add_diff_command(app: typer.Typer) -> None:
    @app.command("diff")
    def diff_command(
        path: Annotated[str, PATH_ARG],
        a: Annotated[int, typer.Argument(min=0, max=MAX_STEP, help="The older step.")],
        b: Annotated[int, typer.Argument(min=0, max=MAX_STEP, help="The newer step.")],
        rank: Annotated[int, RANK_OPT] = 0,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Which leaves changed between two versions, and how many bytes (reads no data)."""
        cmd_diff(path, a, b, rank=rank, as_json=json_output)


def _add_fork_command(app: typer.Typer) -> None:
    @app.command("fork")
    def fork_command(
        path: Annotated[str, PATH_ARG],
        dest: Annotated[str, typer.Argument(help="The new run: a new or empty directory or URL.")],
        step: Annotated[
            int | None,
            typer.Option("--step", min=0, max=MAX_STEP, help="The version (default: latest)."),
        ] = None,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Make DEST a new run whose first version is a version of PATH: its data files shared
        on one file system (PATH's retention keeps what DEST reads), else copied once."""
        cmd_fork(path, dest, step=step, as_json=json_output)


def _add_log_command(app: typer.Typer) -> None:
    @app.command("log")
    def log_command(
        path: Annotated[str, PATH_ARG],
        leaf: Annotated[
            str | None,
            typer.Option(
                "--leaf", metavar="LEAF", help="A leaf path as `inspect` prints it: its stats."
            ),
        ] = None,
        json_output: Annotated[bool, JSON_OPT] = False,
        plot: Annotated[
            str | None,
            typer.Option(
                "--plot",
                metavar="FILE.png",
                help="Draw the leaf's norm and changed fraction (needs matplotlib).",
            ),
        ] = None,
    ) -> None:
        """Per version: step and marks; with --leaf, its statistics and changed fraction."""
        cmd_log(path, leaf=leaf, as_json=json_output, plot=plot)


def _add_remove_commands(app: typer.Typer) -> None:
    @app.command("gc")
    def gc_command(
        path: Annotated[str, PATH_ARG],
        keep: Annotated[
            int, typer.Option("--keep", min=1, help="How many of the newest versions to keep.")
        ],
        dry_run: Annotated[bool, DRY_RUN_OPT] = False,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Delete all but the newest K versions and every file no kept version needs."""
        cmd_gc(path, keep=keep, dry_run=dry_run, as_json=json_output)

    @app.command("rm")
    def rm_command(
        path: Annotated[str, PATH_ARG],
        step: Annotated[
            int, typer.Option("--step", min=0, max=MAX_STEP, help="The version to delete.")
        ],
        dry_run: Annotated[bool, DRY_RUN_OPT] = False,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Delete one version and every file no remaining version needs (a later version
        built on it still restores)."""
        cmd_rm(path, step=step, dry_run=dry_run, as_json=json_output)


def _add_memory_command(app: typer.Typer) -> None:
    @app.command("memory")
    def memory_command(
        clean: Annotated[
            bool,
            typer.Option(
                "--clean",
                help="Remove the memory levels no live process holds (a killed run's, never "
                "opened again).",
            ),
        ] = False,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """This user's memory levels in shared memory ($CRYOSNAP_MEMORY_ROOT, default
        /dev/shm) on this node: run, bytes, holders; --clean removes the orphans."""
        cmd_memory(clean=clean, as_json=json_output)


def _add_flush_command(app: typer.Typer) -> None:
    @app.command("flush")
    def flush_command(
        path: Annotated[str, typer.Argument(help="The run's persistent tier (directory or URL).")],
        scratch: Annotated[
            list[str],
            typer.Option(
                "--scratch",
                metavar="DIR",
                help="The run's scratch devices, as given to the Checkpointer; repeat per device. "
                "Distributed: one process per rank (mpiexec -n N, torchrun).",
            ),
        ],
        retry_seconds: Annotated[
            float,
            typer.Option(
                "--retry-seconds",
                metavar="S",
                help="How long the copies are retried in all when the persistent tier fails "
                "(default 300; 0: one attempt): what is not flushed stays on scratch, exit 1.",
            ),
        ] = 300.0,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Finish the flush of a run whose program died: copy every version on scratch and not
        yet persistent, verified, commit record last (a job epilogue's scavenge)."""
        code = cmd_flush(path, scratch=scratch, as_json=json_output, retry_seconds=retry_seconds)
        if code:
            raise typer.Exit(code)


def _add_demo_command(app: typer.Typer) -> None:
    @app.command("demo")
    def demo_command(
        directory: Annotated[
            str,
            typer.Option(
                "--dir",
                help="Work directory: new, empty or an earlier demo run's (another non-empty "
                "directory is refused, exit 2).",
            ),
        ] = "demo-run",
        steps: Annotated[
            int, typer.Option("--steps", min=1, help="Training steps (at least 2 * every + 2).")
        ] = 200,
        every: Annotated[
            int, typer.Option("--every", min=1, help="Checkpoint every N steps.")
        ] = 20,
        seed: Annotated[
            int | None, typer.Option("--seed", help="Seed of the random kill step.")
        ] = None,
        json_output: Annotated[
            bool,
            typer.Option("--json", help="Progress on stderr, the summary as JSON on stdout."),
        ] = False,
    ) -> None:
        """Train, SIGKILL, resume, check bit-exact against an uninterrupted run (needs torch)."""
        code = cmd_demo(directory, steps=steps, every=every, seed=seed, as_json=json_output)
        if code:
            raise typer.Exit(code)


def _text(name: str, metavar: str, help_text: str) -> Any:
    return typer.Option(name, metavar=metavar, help=help_text)


# cryosnap plan's options, one alias each (the command has many).
_PlanPairs = list[str] | None
_PlanCost = Annotated[
    _PlanPairs,
    _text("--cost", "LEVEL=SECONDS", "Save cost of a level; repeat per level, fastest first."),
]
_PlanMtbf = Annotated[
    _PlanPairs,
    _text(
        "--mtbf",
        "CLASS=SECONDS:LEVEL",
        "A failure class: mean time between failures and the lowest level that survives it; "
        "repeat per class.",
    ),
]
_PlanRestart = Annotated[
    _PlanPairs,
    _text(
        "--restart",
        "LEVEL=SECONDS",
        "Restart cost from a level (default: its save cost, or the predicted one).",
    ),
]
_PlanWeibull = Annotated[
    _PlanPairs,
    _text("--weibull", "CLASS=SHAPE", "Weibull inter-arrival times for a class (default: exp)."),
]
_PlanRanks = Annotated[
    int | None, typer.Option("--ranks", min=1, help="The job's shape: ranks in all (no --cost).")
]
_PlanPerNode = Annotated[
    int | None, typer.Option("--ranks-per-node", min=1, help="Ranks on each node.")
]
_PlanState = Annotated[
    str | None, _text("--state-bytes", "SIZE", "Each rank's own (sharded) state, e.g. 4GiB.")
]
_PlanReplicated = Annotated[
    str | None,
    _text("--replicated-bytes", "SIZE", "State identical on every rank (default 0)."),
]
_PlanMemcpy = Annotated[
    str | None, _text("--memcpy-bandwidth", "RATE", "One rank's capture copy, e.g. 20GB/s.")
]
_PlanHash = Annotated[str | None, _text("--hash-bandwidth", "RATE", "One thread's xxh3 rate.")]
_PlanLocal = Annotated[
    str | None, _text("--local-bandwidth", "RATE", "One node's scratch write with fsync.")
]
_PlanLocalRead = Annotated[
    str | None,
    _text("--local-read-bandwidth", "RATE", "One node's scratch read (default: as its write)."),
]
_PlanPfs = Annotated[
    str | None, _text("--pfs-bandwidth", "RATE", "The shared level's aggregate write rate.")
]
_PlanNode = Annotated[
    str | None,
    _text("--node-bandwidth", "RATE", "One node's injection bandwidth (default: no limit)."),
]
_PlanLatency = Annotated[
    str | None, _text("--latency", "DURATION", "One stage of a collective, e.g. 5us.")
]
_PlanCores = Annotated[
    int | None,
    typer.Option("--cores-per-node", min=1, help="Cores for the ranks' copies and hashing."),
]
_PlanMeasure = Annotated[
    str | None,
    _text(
        "--measure",
        "DIR",
        "Measure the rates not given on this machine: the copy, the hashing, and the disk "
        "under DIR (for both levels).",
    ),
]
_PlanNoScratch = Annotated[
    bool, typer.Option("--no-scratch", help="Save straight to the shared level.")
]
_PlanPartner = Annotated[
    str | None, _text("--partner", "copy|xor|rs:K+M", "Redundancy across nodes on scratch.")
]
_PlanMethod = Annotated[
    str, typer.Option("--method", help="auto (analytic where it applies), analytic or search.")
]
_PlanSeed = Annotated[
    int, typer.Option("--seed", min=0, help="Seed of the simulated failure traces.")
]
_PlanPlot = Annotated[str | None, _text("--plot", "OUT.png", "Plot waste against the intervals.")]


def _add_plan_command(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        cost: _PlanCost = None,
        mtbf: _PlanMtbf = None,
        restart: _PlanRestart = None,
        weibull: _PlanWeibull = None,
        ranks: _PlanRanks = None,
        ranks_per_node: _PlanPerNode = None,
        state_bytes: _PlanState = None,
        replicated_bytes: _PlanReplicated = None,
        memcpy_bandwidth: _PlanMemcpy = None,
        hash_bandwidth: _PlanHash = None,
        local_bandwidth: _PlanLocal = None,
        local_read_bandwidth: _PlanLocalRead = None,
        pfs_bandwidth: _PlanPfs = None,
        node_bandwidth: _PlanNode = None,
        latency: _PlanLatency = None,
        cores_per_node: _PlanCores = None,
        measure: _PlanMeasure = None,
        no_scratch: _PlanNoScratch = False,
        partner: _PlanPartner = None,
        method: _PlanMethod = "auto",
        seed: _PlanSeed = 0,
        plot: _PlanPlot = None,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Per-level checkpoint intervals that minimise the expected waste (SECONDS may end in
        s, m, h or d); from each level's --cost, or from the job's shape (--ranks ...), which
        also prints the predicted stall and time to durable per level."""
        cmd_plan(
            cost or [],
            mtbf or [],
            restart or [],
            weibull or [],
            job=JobArgs(
                ranks, ranks_per_node, state_bytes, replicated_bytes, not no_scratch, partner
            ),
            rates=RateArgs(
                memcpy_bandwidth,
                hash_bandwidth,
                local_bandwidth,
                pfs_bandwidth,
                node_bandwidth,
                latency,
                cores_per_node,
                local_read_bandwidth,
                measure,
            ),
            method=method,
            seed=seed,
            plot=plot,
            as_json=json_output,
        )


def _add_bench_command(app: typer.Typer, invocation: Invocation) -> None:
    @app.command("bench")
    def bench_command(
        size: Annotated[
            str | None,
            typer.Option(
                "--size",
                metavar="SIZE",
                help="State size, e.g. 512MiB, 1GiB, 300MB (default 1GiB; training 288MiB).",
            ),
        ] = None,
        workload: Annotated[
            str,
            typer.Option(
                "--workload",
                help="dense, many-small, sparse, training, or scale (coordination of N "
                "simulated ranks).",
            ),
        ] = "dense",
        repeat: Annotated[
            int, typer.Option("--repeat", help="Timed rounds; tables show medians.")
        ] = 3,
        warmup: Annotated[
            int, typer.Option("--warmup", help="Untimed rounds before the timed ones.")
        ] = 1,
        json_file: Annotated[
            str | None,
            typer.Option(
                "--json",
                metavar="FILE",
                help="Write machine, command, every sample to FILE (scale: without FILE, print "
                "the JSON alone).",
            ),
        ] = None,
        plot: Annotated[
            str | None,
            typer.Option("--plot", metavar="OUT.png", help="Draw a bar chart (needs matplotlib)."),
        ] = None,
        directory: Annotated[
            str | None,
            typer.Option(
                "--dir",
                metavar="PATH",
                help="Where to write: a temporary folder inside it, deleted at the end "
                "(default: the system temp dir).",
            ),
        ] = None,
        tensors: Annotated[
            int, typer.Option("--tensors", help="many-small: how many tensors.")
        ] = 20_000,
        steps: Annotated[
            int, typer.Option("--steps", help="training: timed steps per method and interval.")
        ] = 20,
        step_seconds: Annotated[
            float,
            typer.Option("--step-seconds", help="training: the batch is tuned for this step time."),
        ] = 1.0,
        ranks: Annotated[
            str | None,
            typer.Option(
                "--ranks",
                metavar="N,N,...",
                help="scale: the world sizes to simulate (default 64,512,4096).",
            ),
        ] = None,
        cold: Annotated[
            bool,
            typer.Option(
                "--cold/--no-cold",
                help="Also restore cold: each peer's own files dropped from the page cache first.",
            ),
        ] = True,
        wide: Annotated[
            bool,
            typer.Option(
                "--wide",
                help="Every column of the table, peers by name (over 200 columns); without "
                "it the table fits in 100.",
            ),
        ] = False,
    ) -> None:
        """Measure cryosnap against torch.save, safetensors, DCP (and torchsnapshot,
        torch_checkpointing where installed) on the same state, beside this machine's limits
        (memcpy, raw write+fsync, raw read); every reader timed warm and cold."""
        cmd_bench(
            size=size,
            workload=workload,
            repeat=repeat,
            warmup=warmup,
            json_file=json_file,
            plot=plot,
            directory=directory,
            tensors=tensors,
            steps=steps,
            step_seconds=step_seconds,
            cold=cold,
            wide=wide,
            ranks=ranks,
            command=invocation.command(),
        )


def _add_import_dcp_command(app: typer.Typer) -> None:
    @app.command("import-dcp")
    def import_dcp_command(
        directory: Annotated[
            str, typer.Argument(help="A torch.distributed.checkpoint directory (FileSystemWriter).")
        ],
        path: Annotated[str, typer.Argument(help="The run to save it in (a directory or URL).")],
        step: Annotated[
            int | None,
            typer.Option(
                "--step", min=0, max=MAX_STEP, help="The version (default: after the newest)."
            ),
        ] = None,
        json_output: Annotated[bool, JSON_OPT] = False,
    ) -> None:
        """Save a torch.distributed.checkpoint directory as one version of a run."""
        cmd_import_dcp(directory, path, step=step, as_json=json_output)
