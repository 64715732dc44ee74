"""megatron-core's TransformerEngine/Apex fallback warnings: silenced in this process and the
processes it starts, replaced by one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_bridge.fallback_warnings import (
    missing_accelerators,
    python_warnings_filters,
    quiet_fallback_warnings,
)

# megatron-core imported as our processes import it (its import-time torch.compile deferred on
# CPU: half the import time), then the two modules that warn.
IMPORT_MEGATRON = (
    "from megatron_bridge.cpu_compat import import_megatron_core; import_megatron_core(); "
    "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs"
)


def import_megatron_stderr(env: dict[str, str]) -> str:
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_MEGATRON], env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


@pytest.mark.skipif(
    not missing_accelerators(), reason="TransformerEngine and Apex installed: no warnings"
)
def test_child_processes_no_longer_print_the_fallback_warnings(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")
    loud = import_megatron_stderr(dict(os.environ))
    assert "not installed" in loud  # what the filter removes (the test can fail)

    note = quiet_fallback_warnings()
    assert os.environ["PYTHONWARNINGS"].split(",") == [
        "default::DeprecationWarning", *python_warnings_filters()
    ]
    quiet_fallback_warnings()  # idempotent: no duplicate entries
    assert os.environ["PYTHONWARNINGS"].count("Apex is not installed") == 1
    quiet = import_megatron_stderr(dict(os.environ))
    assert "not installed" not in quiet
    assert note is not None and " and ".join(missing_accelerators()) in note
    assert "torch fallbacks" in note
