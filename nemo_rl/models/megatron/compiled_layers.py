"""Regional ``torch.compile``: each transformer layer of a GPTModel stage compiled on its own
(as torchtitan does), not the whole model.

Every layer has the same structure, so inductor compiles one graph and reuses it for all of
them; it fuses the elementwise work between the matmuls (RoPE, SwiGLU, the residual adds,
casts) that eager mode runs as separate kernels. ``nn.Module.compile`` compiles the layer's
call in place: parameter names, checkpoints, refit and LoRA adapters see the same modules.
Compilation happens at the first forward of each new input shape (packed and dynamic
micro-batches of new lengths recompile, bounded by torch's recompile limit, then run eagerly).
"""

from __future__ import annotations

from typing import Any


def compile_transformer_layers(stage: Any) -> int:
    """Compile every layer of ``stage.decoder.layers`` in place; returns how many."""
    layers = list(stage.decoder.layers)
    for layer in layers:
        layer.compile(dynamic=None)
    return len(layers)
