"""docs/python-api.md's example runs as written: rollout against a custom environment, a custom
loss equal to the built-in NLL, training, and the one-call refit into the engine."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "python-api.md"

pytestmark = pytest.mark.slow


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def printed(output: str, label: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(label + " ")]
    assert len(lines) == 1, f"expected one line starting with {label!r} in:\n{output}"
    return lines[0][len(label) + 1 :]


def test_the_guides_example_runs_and_does_what_it_says(tmp_path: Path, tiny_llama_path: Path):
    blocks = python_blocks(GUIDE.read_text())
    assert len(blocks) == 1, "the guide holds one runnable example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    # tiny_llama_path: the example's build_tiny_model finds the model the session built
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout

    rewards = ast.literal_eval(printed(out, "rewards").split(" turns ")[0])
    assert len(rewards) == 4 and set(rewards) <= {0.0, 1.0}

    mine, builtin = re.fullmatch(r"(\[.*\]) built-in (\[.*\])", printed(out, "custom loss")).groups()
    mine, builtin = ast.literal_eval(mine), ast.literal_eval(builtin)
    assert len(mine) == len(builtin) == 1 and abs(mine[0] - builtin[0]) <= 1e-6 * abs(builtin[0])

    version = re.fullmatch(r"(\d+) bytes (\d+)", printed(out, "engine weights version"))
    assert version is not None and int(version.group(1)) == 1 and int(version.group(2)) > 0
