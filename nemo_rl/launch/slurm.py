"""``nemo-rl launch slurm``: render the Ray-on-slurm job script and submit it with sbatch.

The script is self-contained (slurm copies it at submission): the ``#SBATCH`` header and the
``NRL_*`` settings of :class:`SlurmLaunchConfig`, the driver command, then
``launchers/ray_common.sh`` and ``launchers/ray_on_slurm.sh`` inlined.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_rl.launch.config import SlurmLaunchConfig
from nemo_rl.launch.recipe import recipe_shape
from nemo_rl.launch.scripts import LaunchError, launcher_script
from nemo_rl.utils.config import ConfigError

SBATCH_TIMEOUT_S = 120


def resolve_shape(cfg: SlurmLaunchConfig, command: list[str]) -> SlurmLaunchConfig:
    """``cfg`` with ``nodes`` and ``gpus_per_node`` filled in from the driver's recipe (for a
    ``nemo-rl <algorithm> --config`` command) or checked against it.

    Raises:
        ConfigError: the recipe does not load, disagrees with ``--nodes``/``--gpus-per-node``,
            or ``--nodes`` is missing for a command without a recipe.
    """
    shape = recipe_shape(command)
    if shape is None:
        if cfg.nodes is None:
            raise ConfigError(
                "--nodes is required: the driver command is not `nemo-rl <algorithm> --config "
                "RECIPE`, whose cluster section would give it"
            )
        return cfg.model_copy(update={"gpus_per_node": cfg.gpus_per_node or 0})
    if cfg.nodes is not None and cfg.nodes != shape.nodes:
        raise ConfigError(
            f"--nodes {cfg.nodes} does not match the recipe, which needs {shape.nodes} nodes "
            f"({shape.reason}); drop --nodes or change the recipe"
        )
    if cfg.gpus_per_node is not None and cfg.gpus_per_node != shape.gpus_per_node:
        raise ConfigError(
            f"--gpus-per-node {cfg.gpus_per_node} does not match the recipe's "
            f"cluster.gpus_per_node={shape.gpus_per_node}; drop --gpus-per-node or change the "
            f"recipe"
        )
    return cfg.model_copy(update={"nodes": shape.nodes, "gpus_per_node": shape.gpus_per_node})


def _sbatch_header(cfg: SlurmLaunchConfig) -> list[str]:
    options: list[str | None] = [
        f"--job-name={cfg.job_name}",
        f"--nodes={cfg.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cfg.cpus_per_node}" if cfg.cpus_per_node else None,
        f"--gpus-per-node={cfg.gpus_per_node}" if cfg.gpus_per_node else None,
        f"--partition={cfg.partition}" if cfg.partition else None,
        f"--account={cfg.account}" if cfg.account else None,
        f"--qos={cfg.qos}" if cfg.qos else None,
        f"--time={cfg.time}" if cfg.time else None,
        "--exclusive" if cfg.exclusive else None,
        f"--output={Path(cfg.log_dir).resolve() / 'slurm-%j.out'}",
        f"--signal=B:USR1@{cfg.stop_signal_lead_s}" if cfg.stop_signal_lead_s else None,
        # a requeued job appends to its output instead of overwriting the earlier runs'
        *(["--requeue", "--open-mode=append"] if cfg.requeue else []),
        *cfg.sbatch_args,
    ]
    return [f"#SBATCH {option}" for option in options if option is not None]


def render_sbatch(cfg: SlurmLaunchConfig, command: list[str]) -> str:
    """The job script for ``cfg`` running ``command`` (empty in attach mode).

    Args:
        cfg: options with ``nodes`` and ``gpus_per_node`` resolved (:func:`resolve_shape`).
        command: the driver command line, run on the first node with ``RAY_ADDRESS`` set.

    Raises:
        ValueError: ``nodes``/``gpus_per_node`` unresolved, or the command does not fit the
            mode (a command with ``attach``, none without).
    """
    if cfg.nodes is None or cfg.gpus_per_node is None:
        raise ValueError("resolve nodes and gpus_per_node first (see resolve_shape)")
    if cfg.attach and command:
        raise ValueError("--attach starts an interactive job and takes no driver command")
    if not cfg.attach and not command:
        raise ValueError("give the driver command after '--' (or use --attach)")
    lines = ["#!/bin/bash", *_sbatch_header(cfg)]
    lines += [
        "# Rendered by `nemo-rl launch slurm`: Ray on slurm (launchers/ray_on_slurm.sh).",
        "# Settings (NRL_* variables; launchers/README.md):",
    ]
    lines += [f"{name}={shlex.quote(value)}" for name, value in cfg.shell_settings().items()]
    assignments = cfg.env_assignments()
    if assignments:
        lines.append("# Environment set for the whole job (--env NAME=VALUE):")
        lines += [f"export {name}={shlex.quote(value)}" for name, value in assignments.items()]
    lines.append("# Driver command:")
    lines.append(shlex.join(["set", "--", *command]))
    for name in ("ray_common.sh", "ray_on_slurm.sh"):
        lines += ["", f"# ---- launchers/{name} " + "-" * 60]
        lines.append(launcher_script(name).read_text().rstrip("\n"))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SubmittedJob:
    """A submitted job: its id, the rendered script, where its logs will appear, and the ids
    of its follow-up jobs (``--chain-jobs``)."""

    job_id: str
    script: Path
    output: Path
    job_dir: Path
    chained: tuple[str, ...] = ()


def _sbatch(sbatch: str, options: list[str], path: Path) -> str:
    """Submit ``path`` with ``options``; the job id."""
    try:
        proc = subprocess.run(
            [sbatch, "--parsable", *options, str(path)],
            capture_output=True,
            text=True,
            timeout=SBATCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"sbatch did not answer within {SBATCH_TIMEOUT_S} s (is slurmctld up?); the job "
            f"script is {path}"
        ) from None
    if proc.returncode != 0:
        raise LaunchError(
            f"sbatch refused the job (exit code {proc.returncode}): {proc.stderr.strip()}; the "
            f"job script is {path}"
        )
    return proc.stdout.strip().split(";")[0]


def submit(cfg: SlurmLaunchConfig, script: str) -> SubmittedJob:
    """Write ``script`` under ``cfg.log_dir`` and submit it with ``sbatch --parsable``, then its
    ``cfg.chain_jobs`` follow-ups: follow-up n waits for every earlier job to end unsuccessfully
    (``afternotok`` on all their ids), so the chain stops at the first job that succeeds.

    Raises:
        LaunchError: no ``sbatch`` on PATH, or sbatch refused a job (its message included).
    """
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise LaunchError(
            "sbatch not found on PATH: run this on a slurm login node (or use --dry-run to "
            "print the job script)"
        )
    log_dir = Path(cfg.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{cfg.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(script)
    ids = [_sbatch(sbatch, [], path)]
    for _ in range(cfg.chain_jobs):
        after = ":".join(ids)
        ids.append(_sbatch(sbatch, [f"--dependency=afternotok:{after}",
                                    "--kill-on-invalid-dep=yes"], path))
    return SubmittedJob(
        job_id=ids[0],
        script=path,
        output=log_dir / f"slurm-{ids[0]}.out",
        job_dir=log_dir / ids[0],
        chained=tuple(ids[1:]),
    )
