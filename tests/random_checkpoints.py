"""Random HF checkpoints whose every parameter matters for the logits, and altered copies of
checkpoints for the checks that must refuse them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def copy_with_another_vocab_size(src: Path, dst: Path, extra: int = 128) -> Path:
    """``dst``: a copy of the HF folder ``src`` whose config.json claims ``extra`` more
    vocabulary entries (a model whose token ids do not match ``src``'s tokenizer)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] += extra
    (dst / "config.json").write_text(json.dumps(config))
    return dst
