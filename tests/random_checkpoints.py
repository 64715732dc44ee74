"""Random HF checkpoints whose every parameter matters for the logits."""

from __future__ import annotations

import torch


def perturb_norms_and_biases(model: torch.nn.Module, seed: int = 99) -> None:
    """Draw every norm weight from 1 + 0.3 N(0, 1) and every bias from 0.3 N(0, 1).

    transformers initialises them to exactly 1 and 0, so a converter that dropped a bias or
    swapped two norms would still match its logits.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
