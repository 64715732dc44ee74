"""Test-only fault injection: named points in the code where a test can make a fault happen.

A test arms faults through the environment variable ``NEMO_RL_FAULTS`` (forwarded from the
driver to every Ray worker, ``nemo_rl.distributed.worker_groups.PASSTHROUGH_ENV_VARS``): a JSON
list of objects, each with a ``point`` (e.g. ``"refit.pack"``), an ``action`` the code at that
point knows (e.g. ``"corrupt"``) and any further keys the point's context must match, e.g.::

    NEMO_RL_FAULTS='[{"point": "refit.pack", "bucket": 1, "action": "corrupt"}]'

Each armed fault fires at most once per process. Unset (production), :func:`fault_at` costs one
dictionary lookup.

Points and their actions:
    ``refit.pack`` (context ``version``, ``bucket``, ``rank``): ``corrupt`` flips a byte of the
    packed bucket after its checksum was taken; ``stop`` makes the ring writer give up on the
    stream before publishing the bucket, as one that failed mid-stream.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

FAULTS_ENV = "NEMO_RL_FAULTS"


@functools.cache
def _armed() -> list[dict[str, Any]]:
    text = os.environ.get(FAULTS_ENV)
    if not text:
        return []
    faults = json.loads(text)
    if not isinstance(faults, list) or not all(
        isinstance(f, dict) and "point" in f and "action" in f for f in faults
    ):
        raise ValueError(
            f"{FAULTS_ENV} must be a JSON list of objects with 'point' and 'action', got {text!r}"
        )
    return faults


def fault_at(point: str, **context: Any) -> str | None:
    """The action of the first unfired fault armed for ``point`` whose keys match ``context``
    (marked fired), else None."""
    for fault in _armed():
        if fault["point"] != point or fault.get("_fired"):
            continue
        if all(context.get(k) == v for k, v in fault.items() if k not in ("point", "action")):
            fault["_fired"] = True
            return str(fault["action"])
    return None
