"""megatron-core's "TransformerEngine / Apex are not installed" warnings, said once per run.

megatron-core warns at import time, module by module, in every process that imports it: a GRPO
run on a machine without TransformerEngine and Apex (every CPU run) prints about a dozen such
lines per process (driver, each policy worker), all meaning "torch fallbacks are used".
:func:`quiet_fallback_warnings` silences exactly those warnings in this process and in the
processes it starts afterwards (``PYTHONWARNINGS``, which the workers of a Ray cluster started
by this process inherit), and returns the one line that says it instead.
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings

# The starts of megatron-core's fallback warnings (all UserWarning).
FALLBACK_WARNING_PREFIXES = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
)


def missing_accelerators() -> list[str]:
    """The optional GPU accelerators megatron-core can use that are not importable here."""
    modules = {"TransformerEngine": "transformer_engine", "Apex": "apex"}
    return [name for name, module in modules.items() if importlib.util.find_spec(module) is None]


def python_warnings_filters() -> list[str]:
    """``PYTHONWARNINGS`` entries that ignore :data:`FALLBACK_WARNING_PREFIXES`."""
    return [f"ignore:{prefix}:UserWarning" for prefix in FALLBACK_WARNING_PREFIXES]


def quiet_fallback_warnings() -> str | None:
    """Silence megatron-core's fallback warnings here and in processes started from now on
    (appended to ``PYTHONWARNINGS``, the user's own entries kept); the one line that replaces
    them, or None when TransformerEngine and Apex are both installed."""
    for prefix in FALLBACK_WARNING_PREFIXES:
        warnings.filterwarnings("ignore", message=re.escape(prefix), category=UserWarning)
    entries = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    entries += [e for e in python_warnings_filters() if e not in entries]
    os.environ["PYTHONWARNINGS"] = ",".join(entries)
    missing = missing_accelerators()
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not installed: megatron-core uses its torch fallbacks "
        "(expected on CPU; on GPU nodes install them for speed)"
    )
