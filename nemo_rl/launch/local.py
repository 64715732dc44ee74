"""``nemo-rl launch local``: a Ray head on 127.0.0.1 for the lifetime of one command.

The work is done by ``launchers/ray_local.sh`` (shared with the slurm launcher through
``launchers/ray_common.sh``); this module turns the options into its ``NRL_*`` settings and
replaces the current process with it, so signals reach the launcher directly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

from nemo_rl.launch.config import LocalLaunchConfig
from nemo_rl.launch.scripts import launcher_script


def local_invocation(
    cfg: LocalLaunchConfig, command: list[str]
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment that run ``command`` under ``launchers/ray_local.sh``.

    Raises:
        ValueError: ``command`` is empty.
        LaunchError: the launchers/ folder is missing.
    """
    if not command:
        raise ValueError("give the command to run after '--'")
    argv = ["bash", str(launcher_script("ray_local.sh")), *command]
    env = {**os.environ, **cfg.shell_settings()}
    # The `ray` of this Python environment, also when it is not activated (not on PATH).
    ray = Path(sys.executable).parent / "ray"
    if ray.is_file():
        env["NRL_RAY"] = str(ray)
    return argv, env


def run_local(cfg: LocalLaunchConfig, command: list[str]) -> NoReturn:
    """Replace this process with the local launcher running ``command``; its exit code is the
    command's (see :mod:`nemo_rl.launch.exit_codes` for the launcher's own)."""
    argv, env = local_invocation(cfg, command)
    os.execvpe(argv[0], argv, env)
