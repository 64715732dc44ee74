"""The error types of a failed weight refit."""

from __future__ import annotations

from nemo_rl.utils.errors import RunFault


class RefitError(RuntimeError):
    """A weight refit did not complete (engines that loaded part of it refuse to generate
    until a refit completes; the others keep their previous weights).

    Raised for a missing, out-of-order or corrupt bucket, a bucket whose tensors disagree with
    the refit info, a sender or receiver that died or timed out, and a refit whose exported
    weights do not match what the engine was built with.
    """


class RefitFailed(RefitError, RunFault):
    """Every attempt of a refit failed (``policy.refit_max_retries``); the run cannot go on."""
