"""Run Python code in a fresh interpreter (nothing this test session imported or patched leaks
into it). Importable as ``fresh_process``."""

from __future__ import annotations

import subprocess
import sys


def last_line_printed(code: str, timeout_s: float = 300) -> str:
    """The last line ``code`` prints to stdout in a fresh ``python -c`` process.

    Raises:
        subprocess.CalledProcessError: the process failed (its stderr is on the error).
    """
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=timeout_s
    )
    return out.stdout.strip().splitlines()[-1]
