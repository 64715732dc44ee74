"""``nemo-rl launch {slurm,local} [OPTIONS] -- COMMAND...``.

Options are generated from the fields of :class:`SlurmLaunchConfig` / :class:`LocalLaunchConfig`
(``gpus_per_node`` -> ``--gpus-per-node``; list fields take a repeatable singular flag:
``env`` -> ``--env``, ``sbatch_args`` -> ``--sbatch-arg``), so the field descriptions are the
help text. Everything after the first ``--`` is the command. Exit codes: 0 when a job was
submitted (slurm) or the command's own (local); 2 for bad options or a driver recipe whose
config or inputs (data files, model) fail their checks; 1 when sbatch fails.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing

from pydantic import BaseModel

from nemo_rl.launch import exit_codes
from nemo_rl.launch.config import LocalLaunchConfig, RayLaunchConfig, SlurmLaunchConfig
from nemo_rl.launch.scripts import LaunchError
from nemo_rl.utils.config import ConfigError, validate_config
from nemo_rl.utils.errors import InputError

MODELS: dict[str, type[BaseModel]] = {"slurm": SlurmLaunchConfig, "local": LocalLaunchConfig}

_USAGE = {
    "slurm": "nemo-rl launch slurm [OPTIONS] -- DRIVER COMMAND...   (or --attach, no command)",
    "local": "nemo-rl launch local [OPTIONS] -- COMMAND...",
}


def flag_name(field: str, model: type[BaseModel]) -> str:
    """The command-line flag of a config field: ``ray_start_args`` -> ``--ray-start-arg``."""
    name = field
    if typing.get_origin(model.model_fields[field].annotation) is list and name.endswith("s"):
        name = name[:-1]
    return "--" + name.replace("_", "-")


def _add_field_options(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    # The mode's own options first, the shared Ray options (RayLaunchConfig) after them.
    fields = sorted(
        model.model_fields.items(), key=lambda item: item[0] in RayLaunchConfig.model_fields
    )
    for field, info in fields:
        kind = info.annotation
        if isinstance(kind, types.UnionType):  # X | None -> X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        help_text = (info.description or "").replace("%", "%%")
        flag = flag_name(field, model)
        if kind is bool:
            parser.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag, dest=field, action="append", default=None,
                                metavar="VALUE", help=f"{help_text} (repeatable)")
        else:
            parser.add_argument(flag, dest=field, type=kind, default=None,
                                metavar=kind.__name__.upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """``nemo-rl launch`` with its ``slurm`` and ``local`` subcommands."""
    parser = argparse.ArgumentParser(
        prog="nemo-rl launch",
        description="Run a command on a Ray cluster: across slurm nodes, or on this machine.",
    )
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    slurm = modes.add_parser(
        "slurm",
        usage=_USAGE["slurm"],
        help="submit a Ray-on-slurm job running the driver command on its first node",
    )
    _add_field_options(slurm, SlurmLaunchConfig)
    slurm.add_argument(
        "--dry-run", action="store_true", help="print the job script instead of submitting it"
    )
    local = modes.add_parser(
        "local", usage=_USAGE["local"], help="run the command next to a local Ray head"
    )
    _add_field_options(local, LocalLaunchConfig)
    return parser


def _flags_in(message: str, model: type[BaseModel]) -> str:
    """Rewrite ``  - field_name: ...`` problem lines of a ConfigError to name the flag."""

    def to_flag(match: re.Match[str]) -> str:
        field = match.group(2)
        if field not in model.model_fields:
            return match.group(0)
        return f"{match.group(1)}{flag_name(field, model)}"

    return re.sub(r"^(\s+- )(\w+)(?=[.:])", to_flag, message, flags=re.M)


def main(argv: list[str]) -> int:
    """Run ``nemo-rl launch`` with ``argv`` (the arguments after ``launch``)."""
    split = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args = parser.parse_args(options)
    model = MODELS[args.mode]
    given = {f: v for f, v in vars(args).items() if f in model.model_fields and v is not None}
    prog = f"nemo-rl launch {args.mode}"
    try:
        cfg = validate_config(given, model, source="options")
        if isinstance(cfg, SlurmLaunchConfig):
            return _slurm(cfg, command, dry_run=args.dry_run)
        assert isinstance(cfg, LocalLaunchConfig)
        if not command:
            raise ConfigError("give the command to run after '--'")
        from nemo_rl.launch.local import run_local

        run_local(cfg, command)
    except ConfigError as err:
        print(f"{prog}: {_flags_in(str(err), model)}", file=sys.stderr)
        return exit_codes.USAGE
    except InputError as err:  # the driver's inputs (a model path): same exit as a config error
        print(f"{prog}: error: {err}", file=sys.stderr)
        return exit_codes.USAGE
    except LaunchError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1


def _slurm(cfg: SlurmLaunchConfig, command: list[str], dry_run: bool) -> int:
    from nemo_rl.launch.recipe import check_recipe_inputs, recipe_memory_plan
    from nemo_rl.launch.slurm import render_sbatch, resolve_shape, submit

    if cfg.attach and command:
        raise ConfigError("--attach starts an interactive job and takes no driver command")
    if not cfg.attach and not command:
        raise ConfigError("give the driver command after '--' (or use --attach)")
    cfg = resolve_shape(cfg, command)
    check_recipe_inputs(command)  # bad data is refused now, not after the wait in the queue
    plan = recipe_memory_plan(command)
    if plan is not None:  # on stderr: a dry run's stdout is the job script
        print(plan.format(), file=sys.stderr)
    script = render_sbatch(cfg, command)
    if dry_run:
        print(script, end="")
        return 0
    job = submit(cfg, script)
    print(f"submitted slurm job {job.job_id} ({cfg.nodes} node(s))")
    print(f"  job script: {job.script}")
    print(f"  output:     {job.output}")
    print(f"  logs:       {job.job_dir}/ (driver.log, ray-<role>-<node>.log, attach.sh)")
    print(f"  watch:      tail -f {job.job_dir}/driver.log    cancel: scancel {job.job_id}")
    if cfg.requeue:
        print(f"  requeue:    up to {cfg.max_requeues} time(s), when its run can resume (driver "
              "exit 75, a Ray node died)")
    if job.chained:
        print(f"  chained:    {' '.join(job.chained)} (each runs if the jobs before it stopped "
              "unsuccessfully: a stop or the time limit)")
    return 0
