"""The ``nemo-rl`` command: ``nemo-rl grpo --config RECIPE [overrides...] [--print-config]``.

Each recipe command (see :mod:`nemo_rl.commands` for the registry and the parser) loads and
validates its recipe against its typed schema, prints the resolved config followed by its
per-GPU memory plan (as YAML comments) and hands the validated model to the command's run
function. The commands with their own arguments
(``nemo-rl export ...``, ``nemo-rl launch ...``: ``TOOL_COMMANDS``) get the rest of the line.
Exit codes: the run function's integer result (0 when it returns None), 2 for a usage error
or bad input (:class:`~nemo_rl.utils.errors.InputError`: a config value, a data file, a model
path, a checkpoint, an environment failing on the run's rows), whether found when the recipe
loads or while the command runs. Bad input prints one message naming the problem and the fix;
``--debug`` (or ``NEMO_RL_DEBUG=1``) shows its traceback instead.
"""

from __future__ import annotations

import os
import sys

from megatron_bridge.fallback_warnings import quiet_fallback_warnings


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
    # before anything imports megatron-core, here or in the processes the run starts
    note = quiet_fallback_warnings()
    from nemo_rl.commands import (
        RECIPE_COMMANDS,
        TOOL_COMMANDS,
        load_recipe,
        memory_plan_of,
        parse_recipe_command,
    )
    from nemo_rl.utils.config import ConfigError, config_to_yaml
    from nemo_rl.utils.errors import RunFault, reported_error_of

    if argv and argv[0] in TOOL_COMMANDS:
        return TOOL_COMMANDS[argv[0]].main()(argv[1:])
    args = parse_recipe_command(argv)
    if note and not args.print_config:
        print(f"nemo-rl: {note}", file=sys.stderr)
    try:
        cfg = load_recipe(args)
    except ConfigError as exc:
        print(f"nemo-rl {args.command}: config error: {exc}", file=sys.stderr)
        return 2
    plan = memory_plan_of(cfg)
    # the plan as YAML comments: the printed config still parses
    notes = "" if plan is None else "".join(f"# {line}\n" for line in plan.format().splitlines())
    _show_yaml(config_to_yaml(cfg) + notes)
    if args.print_config:
        return 0
    try:
        result = RECIPE_COMMANDS[args.command].run_function()(cfg)
    except Exception as exc:  # bad input (exit 2) or a fault (its exit code): one message
        error = reported_error_of(exc)
        if error is None or args.debug or os.environ.get("NEMO_RL_DEBUG") == "1":
            raise
        kind = "config error" if isinstance(error, ConfigError) else "error"
        print(
            f"nemo-rl {args.command}: {kind}: {error}\n(--debug shows the traceback)",
            file=sys.stderr,
        )
        return error.exit_code if isinstance(error, RunFault) else 2
    return 0 if result is None else int(result)


if __name__ == "__main__":
    sys.exit(main())
