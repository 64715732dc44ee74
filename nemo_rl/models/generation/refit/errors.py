"""The one error type of a failed weight refit."""

from __future__ import annotations


class RefitError(RuntimeError):
    """A weight refit did not complete; the generation engines keep their previous weights.

    Raised for a missing, out-of-order or corrupt bucket, a bucket whose tensors disagree with
    the refit info, a sender or receiver that died or timed out, and a refit whose exported
    weights do not match what the engine was built with.
    """
