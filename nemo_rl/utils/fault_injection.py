"""Test-only fault injection: named points in the code where a test can make a fault happen.

A test arms faults through the environment variable ``NEMO_RL_FAULTS`` (forwarded from the
driver to every Ray worker, ``nemo_rl.distributed.worker_groups.PASSTHROUGH_ENV_VARS``): a JSON
list of objects, each with a ``point`` (e.g. ``"refit.pack"``), an ``action`` the code at that
point knows (e.g. ``"corrupt"``) and any further keys the point's context must match, e.g.::

    NEMO_RL_FAULTS='[{"point": "refit.pack", "bucket": 1, "action": "corrupt"}]'

Each armed fault fires at most once per process. Unset (production), :func:`fault_at` costs one
dictionary lookup.

Besides its own context, every point is matched on ``hit``: how many times this process has
reached the point, this time included (1: the first). With ``NEMO_RL_FAULTS_DIR`` also set (a
folder every process of the run can write: one machine), two more things hold:

- each armed fault fires once across all the processes, not once per process (its marker file
  ``fired-<index>`` in the folder is created exclusively), so an actor restarted after the
  fault killed it does not fire it again;
- every point is also matched on ``step``: the training step under way, as the driver's
  training loop announced it (:func:`enter_step`; 0 before the first step).

Points and their actions:
    ``refit.pack`` (context ``version``, ``bucket``, ``rank``): ``corrupt`` flips a byte of the
    packed bucket after its checksum was taken; ``stop`` makes the ring writer give up on the
    stream before publishing the bucket, as one that failed mid-stream.
    ``generation.generate`` (context ``replica``: the engine's index), on the engine's actor
    before it generates: ``kill`` ends the actor's process with SIGKILL (an operator's
    ``kill -9`` of it); ``stop`` stops it with SIGSTOP (a hung engine: it neither answers nor
    dies).
    ``refit.load`` (context ``bucket``, ``rank``: the engine's rank), in an engine's rank
    process once it received a bucket of a refit, before loading it: ``kill`` or ``stop`` as
    above (with one rank, the engine's actor; with several, that rank's vLLM process).
    ``environment.step`` (context ``env``: the environment's class name), on the environment's
    actor before it steps: ``kill`` as above.
    ``policy.train``, ``policy.logprobs``, ``policy.save`` (context ``rank``: the policy
    worker's rank), on the policy worker's actor before it trains, computes logprobs (the
    policy's or the reference policy's) or saves a checkpoint; ``policy.refit`` (context
    ``rank``, ``verb``) before it runs a weight-sync verb: ``kill`` as above; ``stop`` stops
    the process with SIGSTOP (a hung rank: it neither answers nor dies).
"""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

FAULTS_ENV = "NEMO_RL_FAULTS"
FAULTS_DIR_ENV = "NEMO_RL_FAULTS_DIR"

# The file of FAULTS_DIR_ENV holding the training step under way.
_STEP_FILE = "step"


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
    for index, fault in enumerate(faults):
        fault["_index"] = index
    return faults


# Arrivals at each point in this process (counted while faults are armed).
_hits: dict[str, int] = {}


def _shared_dir() -> Path | None:
    folder = os.environ.get(FAULTS_DIR_ENV)
    return Path(folder) if folder else None


def enter_step(step: int) -> None:
    """The driver's training loop: step ``step`` (1-based) starts. With faults armed and
    ``NEMO_RL_FAULTS_DIR`` set, every process's points see it as ``step``."""
    folder = _shared_dir()
    if not _armed() or folder is None:
        return
    tmp = folder / f"{_STEP_FILE}.{os.getpid()}"
    tmp.write_text(str(step))
    os.replace(tmp, folder / _STEP_FILE)


def _current_step(folder: Path) -> int:
    try:
        return int((folder / _STEP_FILE).read_text())
    except FileNotFoundError:
        return 0


def _claim(fault: dict[str, Any], folder: Path | None) -> bool:
    """Mark ``fault`` fired; False if it had fired already (here, or in any process sharing
    ``folder``)."""
    fault["_fired"] = True
    if folder is None:
        return True
    try:
        os.close(os.open(folder / f"fired-{fault['_index']}", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def fault_at(point: str, **context: Any) -> str | None:
    """The action of the first unfired fault armed for ``point`` whose keys match ``context``
    (plus ``hit`` and, with the shared folder, ``step``; see the module docstring), marked
    fired; else None."""
    faults = _armed()
    if not faults:
        return None
    _hits[point] = _hits.get(point, 0) + 1
    folder = _shared_dir()
    context = {**context, "hit": _hits[point]}
    if folder is not None:
        context["step"] = _current_step(folder)
    for fault in faults:
        if fault["point"] != point or fault.get("_fired"):
            continue
        keys = {k: v for k, v in fault.items() if k not in ("point", "action", "_index")}
        if all(context.get(k) == v for k, v in keys.items()) and _claim(fault, folder):
            return str(fault["action"])
    return None


def process_fault_at(point: str, **context: Any) -> None:
    """A point whose actions are the process's own fault: a ``kill`` (:func:`kill_this_process`)
    or ``stop`` (:func:`stop_this_process`) armed for ``point`` and ``context`` (as
    :func:`fault_at`) ends or stops this process here."""
    action = fault_at(point, **context)
    if action == "kill":
        kill_this_process()
    elif action == "stop":
        stop_this_process()


def kill_this_process() -> None:
    """End this process at once with SIGKILL (what ``kill -9`` of it does): no cleanup, no
    exception, no exit handlers."""
    os.kill(os.getpid(), signal.SIGKILL)


def stop_this_process() -> None:
    """Stop this process with SIGSTOP (a hung process: alive, answering nothing) until it is
    sent SIGCONT or killed."""
    os.kill(os.getpid(), signal.SIGSTOP)
