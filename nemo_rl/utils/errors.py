"""The exception families the ``nemo-rl`` command reports in one line, without a traceback.

:class:`InputError` marks a failure caused by what the user gave (a config value, a data file,
a model path, a checkpoint, an environment that fails on the run's rows) rather than by a bug:
:func:`nemo_rl.cli.main` prints its message, which names the problem and the fix, and exits 2.
:class:`RunFault` marks a failure of the run's own machinery that it could not recover from
(e.g. a weight refit that failed on every retry): one message naming what failed, and the
fault's exit code (1, or 75 where rerunning resumes the run).
``nemo-rl --debug ...`` (or ``NEMO_RL_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations


class InputError(Exception):
    """Bad input found at config or run time; the message names the field or file and the fix."""


class ModelNotFoundError(InputError, FileNotFoundError):
    """A model name that is neither a tiny model, a local checkpoint folder nor a cached or
    downloadable Hugging Face Hub model."""


class RunFault(Exception):
    """A failure of the run's machinery that retries did not cure; the message names what
    failed. ``exit_code``: what ``nemo-rl`` exits with (a subclass for faults a rerun resumes
    from the newest checkpoint uses 75, the launchers' "resubmit" code)."""

    exit_code = 1


class ResumableFault(RunFault):
    """A fault the run stopped for that rerunning the same command gets past: the rerun
    resumes from the newest checkpoint. Exit code 75, the launchers' "resubmit" code (as for
    a stop signal)."""

    exit_code = 75


def reported_error_of(exc: BaseException) -> InputError | RunFault | None:
    """``exc`` when it is an :class:`InputError` or a :class:`RunFault`, or the one a Ray task
    raised (a ``RayTaskError`` keeps the remote exception as ``cause``), or the one ``exc``
    was raised from (``raise ... from``: a thread's error handed on); None otherwise."""
    kinds = (InputError, RunFault)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        cause = getattr(current, "cause", None)
        if isinstance(cause, kinds):
            return cause
        if isinstance(current, kinds):
            return current
        seen.add(id(current))
        if not isinstance(cause, BaseException):
            cause = current.__cause__
        current = cause
    return None


def error_line(err: BaseException) -> str:
    """``Type: first line of its message`` of ``err``, or of the remote error a Ray task error
    carries as its ``cause`` (a worker's own exception, not Ray's wrapping of it)."""
    cause = getattr(err, "cause", None)
    shown = cause if isinstance(cause, BaseException) else err
    lines = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {lines[0] if lines else ''}".rstrip(": ")
