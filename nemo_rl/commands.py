"""The registry of ``nemo-rl`` commands and how a command line is parsed into a recipe.

A recipe command, ``nemo-rl <name> --config RECIPE [overrides...] [--print-config]``, loads a
YAML recipe, validates it against the command's schema and calls the command's run function with
the validated model. :data:`RECIPE_COMMANDS` lists them; :data:`TOOL_COMMANDS` lists the
commands with arguments of their own (``nemo-rl export ...``, ``nemo-rl launch ...``), each a
``main(argv) -> exit code``. Two modules read this registry and
neither imports the other for it: :mod:`nemo_rl.cli` (the ``nemo-rl`` entry point, which runs
a command) and :mod:`nemo_rl.launch.recipe` (which reads a driver command's recipe to size a
slurm job before submitting it). Nothing here imports a run function's module.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from nemo_rl.algorithms.distillation_config import DistillationMasterConfig
from nemo_rl.algorithms.dpo_config import DPOMasterConfig
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.ppo_config import PPOMasterConfig
from nemo_rl.algorithms.rm_config import RMMasterConfig
from nemo_rl.algorithms.sft_config import SFTMasterConfig
from nemo_rl.distributed.memory_plan import MemoryPlan, NoMemoryPlan
from nemo_rl.evals.config import EvalMasterConfig
from nemo_rl.utils.config import load_typed_config


@dataclass(frozen=True)
class RecipeCommand:
    """One ``nemo-rl <name> --config RECIPE`` command.

    Attributes:
        schema: the pydantic model a recipe of this command validates against.
        module, function: the run function, called with the validated ``schema`` instance; it
            returns the exit code (None means 0). Imported only when the command runs, so
            ``--print-config`` and config errors stay fast.
        check_inputs: ``"module:function"`` of the checks that read the run's inputs (data
            files, the model's tokenizer) and start nothing, called with the validated config;
            ``nemo-rl launch slurm`` runs them before the job is queued. None: no such checks.
    """

    schema: type[BaseModel]
    module: str
    function: str
    check_inputs: str | None = None

    def run_function(self) -> Callable[[Any], int | None]:
        """Import and return the run function."""
        return getattr(importlib.import_module(self.module), self.function)

    def check_inputs_function(self) -> Callable[[Any], None] | None:
        """Import and return the input checks (None when the command has none)."""
        if self.check_inputs is None:
            return None
        module, function = self.check_inputs.split(":")
        return getattr(importlib.import_module(module), function)


RECIPE_COMMANDS: dict[str, RecipeCommand] = {
    "grpo": RecipeCommand(
        GRPOMasterConfig,
        "nemo_rl.algorithms.grpo",
        "run",
        check_inputs="nemo_rl.algorithms.rollout_inputs:check_run_inputs",
    ),
    "sft": RecipeCommand(
        SFTMasterConfig,
        "nemo_rl.algorithms.sft",
        "run",
        check_inputs="nemo_rl.algorithms.sft:check_run_inputs",
    ),
    "dpo": RecipeCommand(
        DPOMasterConfig,
        "nemo_rl.algorithms.dpo",
        "run",
        check_inputs="nemo_rl.algorithms.dpo:check_preference_inputs",
    ),
    "rm": RecipeCommand(
        RMMasterConfig,
        "nemo_rl.algorithms.rm",
        "run",
        check_inputs="nemo_rl.algorithms.dpo:check_preference_inputs",
    ),
    "distillation": RecipeCommand(
        DistillationMasterConfig,
        "nemo_rl.algorithms.distillation",
        "run",
        check_inputs="nemo_rl.algorithms.rollout_inputs:check_run_inputs",
    ),
    "ppo": RecipeCommand(
        PPOMasterConfig,
        "nemo_rl.algorithms.ppo",
        "run",
        check_inputs="nemo_rl.algorithms.rollout_inputs:check_run_inputs",
    ),
    "eval": RecipeCommand(EvalMasterConfig, "nemo_rl.evals.eval", "run"),
}


@dataclass(frozen=True)
class ToolCommand:
    """One ``nemo-rl <name> ARGS...`` command that parses its own arguments.

    Attributes:
        help: one line for ``nemo-rl --help``.
        module: the module whose ``main(argv: list[str]) -> int`` runs the command with the
            arguments after ``<name>``; imported only when the command runs.
    """

    help: str
    module: str

    def main(self) -> Callable[[list[str]], int]:
        """Import and return the command's ``main``."""
        return importlib.import_module(self.module).main


TOOL_COMMANDS: dict[str, ToolCommand] = {
    "export": ToolCommand(
        "write an HF model folder from a training checkpoint", "nemo_rl.models.policy.export"
    ),
    "launch": ToolCommand(
        "run a command on Ray across slurm nodes or locally", "nemo_rl.launch.cli"
    ),
}

_OVERRIDE_HELP = (
    "dotted overrides applied after the recipe: key.sub=VALUE sets an existing key (VALUE is "
    "YAML: 2, 1e-5, true, null, [1, 2]), +key.sub=VALUE adds a new key, ~key.sub deletes one"
)


def build_parser() -> argparse.ArgumentParser:
    """The ``nemo-rl`` argument parser: one subcommand per entry of :data:`RECIPE_COMMANDS`,
    and those of :data:`TOOL_COMMANDS` (listed for ``--help``; :func:`nemo_rl.cli.main` hands
    them their arguments before parsing)."""
    parser = argparse.ArgumentParser(prog="nemo-rl", description="RL post-training of LLMs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in RECIPE_COMMANDS:
        sub = commands.add_parser(name, help=f"run {name.upper()} from a YAML recipe")
        sub.add_argument("--config", required=True, metavar="PATH", help="YAML recipe")
        sub.add_argument(
            "--print-config", action="store_true", help="print the resolved config and exit"
        )
        sub.add_argument(
            "--debug",
            action="store_true",
            help="show the traceback of a bad-input error instead of its one-line message "
            "(also NEMO_RL_DEBUG=1)",
        )
        sub.add_argument("overrides", nargs="*", metavar="OVERRIDE", help=_OVERRIDE_HELP)
    for name, tool in TOOL_COMMANDS.items():
        commands.add_parser(name, help=tool.help)
    return parser


def parse_recipe_command(argv: list[str]) -> argparse.Namespace:
    """Parse the arguments of a recipe command (``argv`` without the program name).

    Returns:
        ``command`` (a key of :data:`RECIPE_COMMANDS`), ``config`` (the recipe path),
        ``overrides`` (in command-line order, also those after ``--print-config``),
        ``print_config`` and ``debug``.

    Raises:
        SystemExit: (code 2, usage printed to stderr) for a usage error, an unknown flag or a
            command that is not a recipe command.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow or precede --print-config; argparse leaves trailing ones in `extra`.
    stray = [a for a in extra if a.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if args.command not in RECIPE_COMMANDS:
        parser.error(f"{args.command!r} is not a recipe command")
    args.overrides = [*args.overrides, *extra]
    return args


def load_recipe(args: argparse.Namespace) -> BaseModel:
    """The validated config of parsed recipe command ``args`` (see :func:`parse_recipe_command`).

    Raises:
        ConfigError: the recipe or an override does not load or validate.
    """
    return load_typed_config(args.config, args.overrides, RECIPE_COMMANDS[args.command].schema)


def memory_plan_of(cfg: BaseModel) -> MemoryPlan | NoMemoryPlan | None:
    """The per-GPU memory plan of a validated recipe (its config's ``memory_plan()``: GRPO and
    the supervised algorithms); None for a command whose config has none (eval, distillation, ppo).
    Validation has already refused a plan that does not fit."""
    memory_plan = getattr(cfg, "memory_plan", None)
    return None if memory_plan is None else memory_plan()
