"""The shell launchers in the repository's ``launchers/`` folder, found from this package."""

from __future__ import annotations

from pathlib import Path

LAUNCHERS_DIR = Path(__file__).resolve().parents[2] / "launchers"


class LaunchError(RuntimeError):
    """Submitting or starting a launch failed; the message says what to do."""


def launcher_script(name: str) -> Path:
    """Path of ``launchers/<name>`` in the source checkout.

    Raises:
        LaunchError: the checkout has no such file (nemo_rl installed without its sources).
    """
    path = LAUNCHERS_DIR / name
    if not path.is_file():
        raise LaunchError(
            f"{path} not found: nemo-rl launch needs the repository's launchers/ folder next to "
            f"the nemo_rl package (install from a source checkout with pip install -e)"
        )
    return path
