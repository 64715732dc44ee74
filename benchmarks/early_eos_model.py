"""A random Llama checkpoint that ends its responses early, for skewed response lengths.

A randomly initialised model almost never samples its EOS token (about 1 / vocabulary size
per token), so every response runs to ``max_new_tokens``. :func:`build_early_eos_model` turns
a tiny-builder Llama (untied LM head) into one whose per-token EOS probability is about
``eos_prob`` wherever it is, so response lengths are roughly geometric: most a few tokens,
a few reaching the limit. How:

1. One residual-stream channel (the last) is made constant: every token's embedding holds
   :data:`CHANNEL_VALUE` there and no attention or MLP output writes to it (their output
   projections' rows for it are zero), so it reaches the final norm unchanged in every layer.
2. The LM head reads that channel only for EOS (its column is zero for every other token), so
   EOS gets a logit bonus of ``weight * CHANNEL_VALUE / rms(final hidden state)``, nearly the
   same at every position.
3. ``weight`` is set by bisection so that the mean EOS probability over a fixed probe (the
   given prompts, each followed by uniformly random tokens drawn from a seeded generator:
   what a random model samples) is ``eos_prob``.

Everything is deterministic (seeded probe, fixed-iteration bisection), and the result is
saved once next to the base checkpoint and reused, so both frameworks of a benchmark load the
same folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

# Training moves every weight that writes into the channel (~20 k in the 40 M model) by about
# the learning rate a step (AdamW), ~0.1 of drift a step at 1e-3: the channel must stay well
# above it (at 0.1 the first step wiped it out), while the other channels still carry the model.
CHANNEL_VALUE = 1.0
PROBE_TOKENS = 64  # random tokens after each prompt in the calibration probe
PROBE_SEED = 0
BISECTION_STEPS = 50
_VERSION = 2  # bump when the construction changes, so old folders are not reused


def add_eos_channel(model: torch.nn.Module) -> int:
    """Make the model's last residual channel constant and unread by the LM head (steps 1-2
    of the module docstring; :func:`calibrate_eos_weight` then gives the EOS row a weight on
    it).

    Args:
        model: a ``LlamaForCausalLM`` with untied embeddings, changed in place.

    Returns:
        The channel's index.
    """
    if model.config.tie_word_embeddings:
        raise ValueError("add_eos_channel needs an untied LM head (the tiny builder's llama)")
    channel = model.config.hidden_size - 1
    with torch.no_grad():
        model.model.embed_tokens.weight[:, channel] = CHANNEL_VALUE
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[channel, :] = 0.0
            layer.mlp.down_proj.weight[channel, :] = 0.0
        model.lm_head.weight[:, channel] = 0.0
    return channel


def probe_ids(prompt_ids: list[list[int]], vocab_size: int) -> tuple[torch.Tensor, int]:
    """The calibration probe: the prompts of the most common length, each followed by
    :data:`PROBE_TOKENS` uniformly random tokens (seeded).

    Returns:
        ``(ids [N, L + PROBE_TOKENS], L)``: the probe and its prompts' length.
    """
    lengths = [len(p) for p in prompt_ids]
    length = max(set(lengths), key=lengths.count)
    rows = [p for p in prompt_ids if len(p) == length]
    generator = torch.Generator().manual_seed(PROBE_SEED)
    tails = torch.randint(0, vocab_size, (len(rows), PROBE_TOKENS), generator=generator)
    return torch.cat([torch.tensor(rows), tails], dim=1), length


@torch.no_grad()
def eos_probabilities(
    model: torch.nn.Module, ids: torch.Tensor, prompt_len: int, eos_id: int
) -> torch.Tensor:
    """``[N, T]`` probability of EOS as the next token at each position that predicts a
    response token (the prompt's last position onwards) of ``ids`` ``[N, prompt_len + T - 1]``."""
    logits = model(input_ids=ids).logits[:, prompt_len - 1 :].float()
    return logits.softmax(-1)[..., eos_id]


@torch.no_grad()
def calibrate_eos_weight(
    model: torch.nn.Module, ids: torch.Tensor, prompt_len: int, eos_id: int, channel: int,
    eos_prob: float,
) -> float:
    """Set the EOS row's weight on ``channel`` so that the mean EOS probability over the
    probe ``ids`` is ``eos_prob`` (bisection on [0, 1000]; the hidden states do not depend on
    the LM head, so they are computed once). Returns the weight."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, prompt_len - 1 :]
    logits = model.lm_head(hidden)
    bonus_per_weight = hidden[..., channel]
    low, high = 0.0, 1000.0
    for _ in range(BISECTION_STEPS):
        weight = (low + high) / 2
        shifted = logits.clone()
        shifted[..., eos_id] += weight * bonus_per_weight
        if shifted.softmax(-1)[..., eos_id].mean().item() < eos_prob:
            low = weight
        else:
            high = weight
    weight = (low + high) / 2
    model.lm_head.weight[eos_id, channel] = weight
    return weight


def build_early_eos_model(base: Path, eos_prob: float, prompts: list[str]) -> Path:
    """The checkpoint at ``base`` with a per-token EOS probability of about ``eos_prob``,
    built once into ``<base>-eos<eos_prob>-v<version>`` beside it (written to a temporary
    folder, then renamed, so a folder that exists is complete).

    Args:
        base: a tiny-builder Llama folder (``nemo_rl.models.tiny.build_tiny_model``).
        eos_prob: the mean per-token EOS probability to calibrate to, in (0, 1).
        prompts: the user messages the model will be prompted with (chat template applied).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not 0.0 < eos_prob < 1.0:
        raise ValueError(f"eos_prob must be in (0, 1), got {eos_prob}")
    final = base.parent / f"{base.name}-eos{eos_prob:g}-v{_VERSION}"
    if final.is_dir():
        return final
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    eos_id = tokenizer.eos_token_id
    channel = add_eos_channel(model)
    prompt_ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        for p in prompts
    ]
    ids, prompt_len = probe_ids(prompt_ids, len(tokenizer))
    calibrate_eos_weight(model, ids, prompt_len, eos_id, channel, eos_prob)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=base.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a concurrent identical build that won the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
