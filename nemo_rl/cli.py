"""The ``nemo-rl`` command: ``nemo-rl grpo --config RECIPE [overrides...] [--print-config]``.

Each recipe command (see :mod:`nemo_rl.commands` for the registry and the parser) loads and
validates its recipe against its typed schema, prints the resolved config and hands the
validated model to the command's run function. ``nemo-rl launch ...`` goes to
:mod:`nemo_rl.launch.cli`. Exit codes: the run function's integer result (0 when it returns
None), 2 for a config or usage error, including bad input the run finds when it reads it (a
:class:`~nemo_rl.utils.config.ConfigError` such as a data file's bad line).
"""

from __future__ import annotations

import sys

from nemo_rl.commands import RECIPE_COMMANDS, load_recipe, parse_recipe_command
from nemo_rl.utils.config import ConfigError, config_to_yaml


def _show_yaml(text: str) -> None:
    """Print YAML, syntax-highlighted when stdout is a terminal (plain text otherwise)."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(text, "yaml", background_color="default"))
    else:
        print(text, end="")


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:
        from nemo_rl.launch.cli import main as launch_main

        return launch_main(argv[1:])
    args = parse_recipe_command(argv)
    try:
        cfg = load_recipe(args)
    except ConfigError as exc:
        print(f"nemo-rl {args.command}: config error: {exc}", file=sys.stderr)
        return 2
    _show_yaml(config_to_yaml(cfg))
    if args.print_config:
        return 0
    try:
        result = RECIPE_COMMANDS[args.command].run_function()(cfg)
    except ConfigError as exc:
        print(f"nemo-rl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0 if result is None else int(result)


if __name__ == "__main__":
    sys.exit(main())
