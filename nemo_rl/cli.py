"""The ``nemo-rl`` command: ``nemo-rl grpo --config RECIPE [overrides...] [--print-config]``.

Each subcommand loads and validates its recipe against its typed schema, prints the resolved
config and hands the validated model to the run function named in :data:`ENTRY_POINTS`
(imported only then, so ``--print-config`` and config errors stay fast). Exit codes: the run
function's integer result (0 when it returns None), 2 for a config or usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.utils.config import ConfigError, config_to_yaml, load_typed_config

# Subcommand -> (module, function) called with the validated config.
ENTRY_POINTS: dict[str, tuple[str, str]] = {"grpo": ("nemo_rl.algorithms.grpo", "run")}

SCHEMAS: dict[str, type[BaseModel]] = {"grpo": GRPOMasterConfig}

_OVERRIDE_HELP = (
    "dotted overrides applied after the recipe: key.sub=VALUE sets an existing key (VALUE is "
    "YAML: 2, 1e-5, true, null, [1, 2]), +key.sub=VALUE adds a new key, ~key.sub deletes one"
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subparser per entry in :data:`ENTRY_POINTS`."""
    parser = argparse.ArgumentParser(prog="nemo-rl", description="RL post-training of LLMs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in ENTRY_POINTS:
        sub = commands.add_parser(name, help=f"run {name.upper()} from a YAML recipe")
        sub.add_argument("--config", required=True, metavar="PATH", help="YAML recipe")
        sub.add_argument(
            "--print-config", action="store_true", help="print the resolved config and exit"
        )
        sub.add_argument("overrides", nargs="*", metavar="OVERRIDE", help=_OVERRIDE_HELP)
    # Listed for --help; main() hands `launch ...` to nemo_rl.launch.cli before parsing.
    commands.add_parser("launch", help="run a command on Ray across slurm nodes or locally")
    return parser


def _show_yaml(text: str) -> None:
    """Print YAML, syntax-highlighted when stdout is a terminal (plain text otherwise)."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(text, "yaml", background_color="default"))
    else:
        print(text, end="")


def _entry_point(command: str) -> Callable[[Any], int | None]:
    module_name, function_name = ENTRY_POINTS[command]
    return getattr(importlib.import_module(module_name), function_name)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:
        from nemo_rl.launch.cli import main as launch_main

        return launch_main(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow or precede --print-config; argparse leaves trailing ones in `extra`.
    stray = [a for a in extra if a.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    overrides = [*args.overrides, *extra]
    try:
        cfg = load_typed_config(args.config, overrides, SCHEMAS[args.command])
    except ConfigError as exc:
        print(f"nemo-rl {args.command}: config error: {exc}", file=sys.stderr)
        return 2
    _show_yaml(config_to_yaml(cfg))
    if args.print_config:
        return 0
    result = _entry_point(args.command)(cfg)
    return 0 if result is None else int(result)


if __name__ == "__main__":
    sys.exit(main())
