"""Fixtures of the functional tests' fault cases."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.utils import fault_injection


@pytest.fixture
def arm_faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """``arm_faults(fault, ...)`` arms the test-only faults (:mod:`nemo_rl.utils.fault_injection`)
    for the processes started from then on (the driver's loop and every worker, each fault
    firing once in the whole run); returns the shared folder, where ``fired-<i>`` appears when
    fault ``i`` fires (and ``step`` holds the step under way)."""
    folder = tmp_path / "faults"

    def arm(*faults: dict[str, Any]) -> Path:
        folder.mkdir(exist_ok=True)
        monkeypatch.setenv(fault_injection.FAULTS_ENV, json.dumps(list(faults)))
        monkeypatch.setenv(fault_injection.FAULTS_DIR_ENV, str(folder))
        fault_injection._armed.cache_clear()  # the driver read the variable before
        return folder

    yield arm
    fault_injection._armed.cache_clear()
    fault_injection._hits.clear()
