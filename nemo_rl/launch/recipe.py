"""What machines a ``nemo-rl <algorithm> --config RECIPE [overrides]`` driver command needs.

Lets ``nemo-rl launch slurm`` take the node and GPU counts from the recipe, refuse a
mismatch, run the recipe's input checks (data files, the model's tokenizer) and show its
per-GPU memory plan before the job waits in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.loop_config import SupervisedMasterConfig
from nemo_rl.commands import RECIPE_COMMANDS, load_recipe, memory_plan_of, parse_recipe_command
from nemo_rl.distributed.memory_plan import MemoryPlan, NoMemoryPlan
from nemo_rl.evals.config import EvalMasterConfig
from nemo_rl.utils.config import ConfigError


@dataclass(frozen=True)
class RecipeShape:
    """Machines a recipe runs on.

    Attributes:
        nodes: Ray nodes (one per slurm node) the run places workers on.
        gpus_per_node: GPUs used on each node (0: CPU only).
        reason: how ``nodes`` follows from the recipe, for error messages.
    """

    nodes: int
    gpus_per_node: int
    reason: str


def grpo_shape(cfg: GRPOMasterConfig) -> RecipeShape:
    """Nodes of a GRPO run: ``cluster.num_nodes``, twice that when generation is not colocated
    on GPUs (``nemo_rl.algorithms.rollout_run.start_rollout_run`` then gives the vLLM engines a
    cluster of the same shape of their own, whose bundles take every GPU of their nodes). On CPU
    the two clusters share the nodes: each node's logical CPUs are split between them."""
    nodes = cfg.cluster.num_nodes
    reason = f"cluster.num_nodes={nodes}"
    if not cfg.policy.generation.colocated.enabled and cfg.cluster.gpus_per_node > 0:
        nodes *= 2
        reason += " x 2 for policy.generation.colocated.enabled=false"
    return RecipeShape(nodes=nodes, gpus_per_node=cfg.cluster.gpus_per_node, reason=reason)


def _load_driver_recipe(command: list[str]) -> tuple[str, BaseModel] | None:
    """``(algorithm, validated config)`` of ``nemo-rl <algorithm> --config RECIPE ...``; None
    for any other command.

    Raises:
        ConfigError: the command does not parse, or its recipe does not load or validate.
    """
    is_nemo_rl = len(command) >= 2 and Path(command[0]).name == "nemo-rl"
    if not is_nemo_rl or command[1] not in RECIPE_COMMANDS:
        return None
    try:
        args = parse_recipe_command(command[1:])
    except SystemExit:
        raise ConfigError(
            f"cannot parse the driver command {' '.join(command)!r} (see the usage above)"
        ) from None
    return args.command, load_recipe(args)


def check_recipe_inputs(command: list[str]) -> None:
    """Run the input checks of a driver command's recipe
    (:attr:`~nemo_rl.commands.RecipeCommand.check_inputs`: data files, the model's tokenizer)
    on this machine, before a job is queued; nothing for other commands.

    Raises:
        InputError: what the driver would hit when it loads its inputs on the cluster.
    """
    loaded = _load_driver_recipe(command)
    if loaded is None:
        return
    name, cfg = loaded
    check = RECIPE_COMMANDS[name].check_inputs_function()
    if check is not None:
        check(cfg)


def recipe_memory_plan(command: list[str]) -> MemoryPlan | NoMemoryPlan | None:
    """The per-GPU memory plan of a driver command's recipe
    (:func:`~nemo_rl.commands.memory_plan_of`); None for other commands and for recipes
    without one.

    Raises:
        ConfigError: the recipe does not load or validate (a plan that does not fit included).
    """
    loaded = _load_driver_recipe(command)
    return None if loaded is None else memory_plan_of(loaded[1])


def recipe_shape(command: list[str]) -> RecipeShape | None:
    """The machines ``command`` needs when it is ``nemo-rl <algorithm> --config RECIPE ...``;
    None for any other command.

    Raises:
        ConfigError: the recipe or its overrides do not load or validate (the same error the
            driver would hit on the cluster).
    """
    loaded = _load_driver_recipe(command)
    if loaded is None:
        return None
    name, cfg = loaded
    if isinstance(cfg, GRPOMasterConfig):
        return grpo_shape(cfg)
    if isinstance(cfg, (EvalMasterConfig, SupervisedMasterConfig)):  # one cluster
        nodes = cfg.cluster.num_nodes
        return RecipeShape(nodes, cfg.cluster.gpus_per_node, f"cluster.num_nodes={nodes}")
    raise ConfigError(f"nemo-rl launch does not know the machines of a {name!r} recipe")
