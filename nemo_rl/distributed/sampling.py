"""The distribution the engines sample from, as the trainer scores it.

vLLM samples each token from ``softmax(logits / temperature)`` truncated to the ``top_k`` most
likely tokens, then to the nucleus of mass ``top_p``, and renormalised. For the policy-gradient
ratio and the engine/trainer comparison (``token_mult_prob_error``) to be about the
distribution the samples came from, the trainer's logprobs use the same transformation:
:class:`TrainingSamplingParams` carries it to the logprob functions
(:mod:`nemo_rl.distributed.model_utils`, :mod:`nemo_rl.distributed.fused_lm_head`). NeMo RL's
name and semantics (``policy.generation.temperature`` / ``top_p`` / ``top_k``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TrainingSamplingParams:
    """Sampling settings the trainer's logprobs follow.

    Attributes:
        temperature: logits are divided by it (> 0; 1.0: unscaled).
        top_k: keep the ``top_k`` most likely tokens, renormalised; None: off.
        top_p: then keep the smallest set of most likely tokens of mass ``top_p``
            (renormalised); 1.0: off.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise ValueError(
                f"temperature must be > 0 to score tokens (0 is greedy decoding, whose "
                f"distribution has no logprobs to train on), got {self.temperature!r}"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cut the distribution (tokens outside score ``-inf``)."""
        return self.top_k is not None or self.top_p < 1.0

    @property
    def is_plain(self) -> bool:
        """Temperature 1 and no truncation: the model's own distribution."""
        return self.temperature == 1.0 and not self.truncates

    def untruncated(self) -> TrainingSamplingParams:
        """The same temperature without top-k / top-p (the reference policy's and the KL
        term's distribution: another model's truncated set would not hold the samples)."""
        return replace(self, top_k=None, top_p=1.0)


# The model's own distribution: what every logprob function computes by default.
PLAIN_SAMPLING = TrainingSamplingParams()
