"""Typed options of ``nemo-rl launch slurm`` and ``nemo-rl launch local``.

Each field is one command-line flag (``gpus_per_node`` is ``--gpus-per-node``) and one ``NRL_*``
setting of the shell launchers in ``launchers/``. Validation errors name the flag.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from nemo_rl.utils.config import ConfigModel

# Slurm --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
_SLURM_TIME = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_PATTERN = re.compile(r"^[A-Za-z0-9_*?\[\]]+$")
_NO_SPACE = re.compile(r"^\S+$")


class RayLaunchConfig(ConfigModel):
    """Ray options shared by both launchers: pinned ports (layout: ``launchers/ray_common.sh``),
    CPUs, session folder and time bounds."""

    ray_port_base: int | None = Field(
        default=None,
        ge=1024,
        le=65535,
        description="First port of the job's pinned range (the GCS port). None: slurm picks "
        "one in 20000-32767 by job id; the local launcher uses 20000.",
    )
    ray_worker_ports: int = Field(
        default=1000,
        ge=16,
        description="Ports per Ray node for worker processes (one per actor or task worker, "
        "idle ones included); the range must stay below the ephemeral ports (32768).",
    )
    ray_num_cpus: int | None = Field(
        default=None,
        ge=1,
        description="Logical CPUs each Ray node offers (may exceed the cores). None: slurm "
        "gives the node's allocated CPUs, locally Ray counts the cores.",
    )
    ray_temp_dir: str | None = Field(
        default=None,
        description="Ray's session folder on each node; keep it short (Unix socket paths "
        "are limited to ~107 bytes). None: /tmp/ray-<job id> on slurm, /tmp/ray locally.",
    )
    head_timeout_s: int = Field(
        default=180, ge=1, description="Seconds the Ray head may take to answer on its port."
    )
    teardown_timeout_s: int = Field(
        default=60,
        ge=1,
        description="Seconds the driver and Ray get to stop after SIGTERM before SIGKILL.",
    )

    def shell_settings(self) -> dict[str, str]:
        """The ``NRL_*`` variables of the shell launchers for these options (unset ones left out
        so the scripts' defaults apply)."""
        values = {
            "NRL_RAY_PORT_BASE": self.ray_port_base,
            "NRL_RAY_WORKER_PORTS": self.ray_worker_ports,
            "NRL_RAY_NUM_CPUS": self.ray_num_cpus,
            "NRL_RAY_TEMP_DIR": self.ray_temp_dir,
            "NRL_HEAD_TIMEOUT_S": self.head_timeout_s,
            "NRL_TEARDOWN_TIMEOUT_S": self.teardown_timeout_s,
        }
        return {name: str(value) for name, value in values.items() if value is not None}


class SlurmLaunchConfig(RayLaunchConfig):
    """``nemo-rl launch slurm``: one Ray node per slurm node, the driver on the first."""

    nodes: int | None = Field(
        default=None,
        ge=1,
        description="Slurm nodes. None: what the recipe of a `nemo-rl <algo> --config` driver "
        "command needs (required for any other command).",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=0,
        description="GPUs per node (sbatch --gpus-per-node; Ray's num_gpus). None: the "
        "recipe's cluster.gpus_per_node (0 for any other command).",
    )
    cpus_per_node: int | None = Field(
        default=None,
        ge=1,
        description="CPUs per node (sbatch --cpus-per-task of the one task per node). None: "
        "slurm's default (every CPU with --exclusive).",
    )
    partition: str | None = Field(default=None, description="Slurm partition. None: default.")
    account: str | None = Field(default=None, description="Slurm account. None: default.")
    qos: str | None = Field(default=None, description="Slurm QOS. None: default.")
    time: str | None = Field(
        default=None,
        description="Time limit in a slurm format (MM, HH:MM:SS, D-HH:MM). None: the "
        "partition's default.",
    )
    job_name: str = Field(default="nemo-rl", description="Slurm job name.")
    exclusive: bool = Field(default=True, description="Ask for whole nodes (sbatch --exclusive).")
    log_dir: str = Field(
        default="results/slurm",
        description="Folder of the slurm output (slurm-<job id>.out) and of one folder per job "
        "(<job id>/: driver.log, ray-<role>-<node>.log, attach.sh). Relative paths are "
        "taken from the submit directory.",
    )
    container_image: str | None = Field(
        default=None, description="Container image for every step (pyxis/enroot). None: none."
    )
    container_mounts: list[str] = Field(
        default_factory=list, description="Container mounts SRC:DST[:FLAGS] (needs an image)."
    )
    container_workdir: str | None = Field(
        default=None, description="Working directory inside the container. None: the image's."
    )
    env: list[str] = Field(
        default_factory=list,
        description="Environment for the Ray processes (and so every actor) beyond the base "
        "list of launchers/ray_common.sh: NAME passes the job's value, NAME=VALUE sets it for "
        "the whole job, a glob (NCCL_*, or * for everything) passes matching names. The "
        "driver always sees the whole job environment.",
    )
    sbatch_args: list[str] = Field(
        default_factory=list,
        description="Extra sbatch options written as #SBATCH lines (--mem=0, --dependency=...).",
    )
    ray_start_args: list[str] = Field(
        default_factory=list,
        description="Extra `ray start` arguments for every node (--object-store-memory=...).",
    )
    ray_dashboard: bool = Field(
        default=False, description="Start the Ray dashboard on the head (port base+2)."
    )
    python: str = Field(
        default="python3",
        description="Python (with nemo_rl and ray) that runs the node check on the head node.",
    )
    nodes_timeout_s: int = Field(
        default=600,
        ge=1,
        description="Seconds every Ray node gets to register with the head before the job "
        "fails naming the missing nodes.",
    )
    attach: bool = Field(
        default=False,
        description="Interactive job: start Ray, write attach.sh (a shell on the head node) and "
        "wait until scancel or the time limit instead of running a driver.",
    )
    stop_signal_lead_s: int | None = Field(
        default=None,
        ge=1,
        description="Seconds before the time limit at which slurm signals the job with SIGUSR1 "
        "(sbatch --signal=B:USR1@N); the job passes it to the driver, which finishes its step, "
        "saves and exits 75 (checkpointing.stop_signals). Give it more than a step, a "
        "validation, a save and the teardown. None: no early signal.",
    )
    chain_jobs: int = Field(
        default=0,
        ge=0,
        description="Follow-up jobs submitted with this one: each starts once every earlier one "
        "ended unsuccessfully (a stop, exit 75, or the time limit: "
        "--dependency=afternotok) and resumes from the last checkpoint; once one succeeds the "
        "rest are cancelled (--kill-on-invalid-dep=yes).",
    )

    requeue: bool = Field(
        default=False,
        description="Submit with sbatch --requeue and requeue the job (scontrol requeue: same "
        "job id, same options) when its run can resume: the driver exited 75 (it stopped early "
        "after saving, or a worker died or hung: docs/cluster.md, Faults) or a Ray node died "
        "under it (exit 5). The requeued job resumes from the newest checkpoint. At most "
        "max_requeues times; slurm's own requeue after a node failure counts too.",
    )
    max_requeues: int = Field(
        default=3,
        ge=1,
        description="With requeue: how many times the job may requeue itself "
        "(SLURM_RESTART_COUNT); after that it ends with the driver's exit code.",
    )

    @field_validator("time")
    @classmethod
    def _check_time(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_TIME.match(value):
            raise ValueError(
                f"{value!r} is not a slurm time: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                "D-HH:MM:SS"
            )
        return value

    @field_validator("job_name", "partition", "account", "qos", "python")
    @classmethod
    def _check_word(cls, value: str | None) -> str | None:
        if value is not None and not _NO_SPACE.match(value):
            raise ValueError(f"{value!r} must be one word (no spaces)")
        return value

    @field_validator("ray_start_args", "container_mounts")
    @classmethod
    def _check_words(cls, values: list[str]) -> list[str]:
        for value in values:
            if not _NO_SPACE.match(value):
                raise ValueError(f"{value!r} must be one word (no spaces)")
        return values

    @field_validator("env")
    @classmethod
    def _check_env(cls, values: list[str]) -> list[str]:
        for entry in values:
            name, eq, _ = entry.partition("=")
            if eq and not _ENV_NAME.match(name):
                raise ValueError(f"{entry!r}: NAME=VALUE needs a variable name before '='")
            if not eq and not _ENV_PATTERN.match(name):
                raise ValueError(
                    f"{entry!r} is not a variable name, a glob of names (NCCL_*) or NAME=VALUE"
                )
        return values

    @model_validator(mode="after")
    def _check_requeue(self) -> SlurmLaunchConfig:
        if "max_requeues" in self.model_fields_set and not self.requeue:
            raise ValueError("max_requeues needs requeue; add --requeue or drop --max-requeues")
        if self.requeue and self.attach:
            raise ValueError("requeue resumes a driver's run; an --attach job has none: drop "
                             "--requeue")
        return self

    @model_validator(mode="after")
    def _check_container(self) -> SlurmLaunchConfig:
        if self.container_image is None and (self.container_mounts or self.container_workdir):
            raise ValueError(
                "container_mounts / container_workdir need container_image; add "
                "--container-image or drop them"
            )
        return self

    def env_assignments(self) -> dict[str, str]:
        """The ``NAME=VALUE`` entries of :attr:`env`, exported for the whole job."""
        return dict(entry.split("=", 1) for entry in self.env if "=" in entry)

    def shell_settings(self) -> dict[str, str]:
        """The ``NRL_*`` variables of ``launchers/ray_on_slurm.sh`` for these options; needs
        :attr:`gpus_per_node` resolved (see :func:`nemo_rl.launch.slurm.resolve_shape`)."""
        values: dict[str, object] = {
            "NRL_LOG_DIR": str(Path(self.log_dir).resolve()),
            "NRL_GPUS_PER_NODE": self.gpus_per_node,
            "NRL_CPUS_PER_NODE": self.cpus_per_node,
            "NRL_CONTAINER_IMAGE": self.container_image,
            "NRL_CONTAINER_MOUNTS": ",".join(self.container_mounts) or None,
            "NRL_CONTAINER_WORKDIR": self.container_workdir,
            "NRL_ENV_PASSTHROUGH": " ".join(e.partition("=")[0] for e in self.env) or None,
            "NRL_RAY_START_ARGS": " ".join(self.ray_start_args) or None,
            "NRL_RAY_DASHBOARD": int(self.ray_dashboard),
            "NRL_PYTHON": self.python,
            "NRL_NODES_TIMEOUT_S": self.nodes_timeout_s,
            "NRL_ATTACH": int(self.attach),
            "NRL_REQUEUE": int(self.requeue),
            "NRL_MAX_REQUEUES": self.max_requeues if self.requeue else None,
        }
        settings = super().shell_settings()
        settings.update({k: str(v) for k, v in values.items() if v is not None})
        return settings


class LocalLaunchConfig(RayLaunchConfig):
    """``nemo-rl launch local``: a Ray head on 127.0.0.1 for the command's lifetime."""

    num_gpus: int | None = Field(
        default=None, ge=0, description="GPUs Ray offers. None: Ray counts the visible GPUs."
    )
    log_dir: str = Field(
        default="results/launch_local", description="Folder of the Ray head's output log."
    )
    head_timeout_s: int = Field(
        default=60, ge=1, description="Seconds the Ray head may take to answer on its port."
    )
    teardown_timeout_s: int = Field(
        default=30,
        ge=1,
        description="Seconds the command and Ray get to stop after a signal before SIGKILL.",
    )

    def shell_settings(self) -> dict[str, str]:
        """The ``NRL_*`` variables of ``launchers/ray_local.sh`` for these options."""
        settings = super().shell_settings()
        settings["NRL_LOG_DIR"] = self.log_dir
        if self.num_gpus is not None:
            settings["NRL_GPUS_PER_NODE"] = str(self.num_gpus)
        return settings
