"""A random Llama checkpoint whose responses end early, for skewed response lengths.

A randomly initialised model almost never samples its EOS token (about 1 / vocabulary size
per token), so every response runs to ``max_new_tokens``. :func:`build_early_stop_model` makes
a copy of a checkpoint whose generation config stops at a set of tokens (EOS and the "stop
tokens") that together take about ``stop_prob`` of the model's next-token probability, so
response lengths are roughly geometric: most a few tokens, a few reaching the limit.

The weights are not touched. A random model's next-token distribution is nearly flat (logits
of standard deviation ~0.5), so the stop set's share is the sum of many small probabilities:
a training step that moves the weights by about the learning rate moves that sum a little,
where a mechanism built into the weights (one residual channel carrying an EOS bonus, the
first version of this module) made the bonus scale with the inverse RMS of the hidden state,
which every step moves, and the lengths swung from step to step.

How the stop set is chosen: the candidates are the ordinary tokens whose text holds no digit
(the skewed case's reward asks for a leading digit: a digit that also ended the response would
reward ending at once); they are shuffled with a fixed seed and taken in that order until the
mean probability of the set over a fixed probe (the given prompts, each followed by uniformly
random tokens drawn from a seeded generator: what a random model samples) reaches ``stop_prob``.

Both frameworks read the stop set from the folder's ``generation_config.json``
(``eos_token_id``: EOS first, then the stop tokens): transformers ``generate`` and TRL's
completion mask use every id there, and vLLM adds them to each request's stop tokens. The
folder is built once next to the base checkpoint and reused, so both load the same one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

PROBE_TOKENS = 64  # random tokens after each prompt in the calibration probe
PROBE_SEED = 0
ORDER_SEED = 0  # the order in which candidates join the stop set
_VERSION = 3  # bump when the construction changes, so old folders are not reused


def stop_candidates(tokenizer) -> list[int]:
    """Ids of the tokens that may end a response: not special, and no digit in their text."""
    special = set(tokenizer.all_special_ids)
    return [
        i for i in range(len(tokenizer))
        if i not in special and not re.search(r"\d", tokenizer.decode([i]))
    ]


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
def next_token_probs(model: torch.nn.Module, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``[N, T, vocab]`` next-token probabilities at each position that predicts a response
    token (the prompt's last position onwards) of ``ids`` ``[N, prompt_len + T - 1]``."""
    return model(input_ids=ids).logits[:, prompt_len - 1 :].float().softmax(-1)


def choose_stop_tokens(
    mean_probs: torch.Tensor, candidates: list[int], stop_prob: float, eos_prob: float
) -> list[int]:
    """The shortest prefix of ``candidates`` (in a fixed shuffled order) whose mean
    probabilities ``mean_probs`` ``[vocab]``, with EOS's ``eos_prob``, sum to ``stop_prob``."""
    order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(ORDER_SEED))
    chosen: list[int] = []
    total = eos_prob
    for index in order.tolist():
        if total >= stop_prob:
            break
        chosen.append(candidates[index])
        total += mean_probs[candidates[index]].item()
    if total < stop_prob:
        raise ValueError(
            f"the candidates hold only {total:.3f} of the probability, not {stop_prob}"
        )
    return chosen


def build_early_stop_model(base: Path, stop_prob: float, prompts: list[str]) -> Path:
    """The checkpoint at ``base`` stopping with a per-token probability of about ``stop_prob``,
    built once into ``<base>-stop<stop_prob>-v<version>`` beside it (weights hard-linked where
    the file system allows, written to a temporary folder, then renamed, so a folder that
    exists is complete).

    Args:
        base: a tiny-builder Llama folder (``nemo_rl.models.tiny.build_tiny_model``).
        stop_prob: the mean per-token probability of the stop set to calibrate to, in (0, 1).
        prompts: the user messages the model will be prompted with (chat template applied).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not 0.0 < stop_prob < 1.0:
        raise ValueError(f"stop_prob must be in (0, 1), got {stop_prob}")
    final = base.parent / f"{base.name}-stop{stop_prob:g}-v{_VERSION}"
    if final.is_dir():
        return final
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompt_ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        for p in prompts
    ]
    ids, prompt_len = probe_ids(prompt_ids, len(tokenizer))
    mean_probs = next_token_probs(model, ids, prompt_len).mean(dim=(0, 1))
    eos = tokenizer.eos_token_id
    stops = choose_stop_tokens(mean_probs, stop_candidates(tokenizer), stop_prob,
                               mean_probs[eos].item())
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=base.parent))
    try:
        shutil.copytree(base, tmp, dirs_exist_ok=True, copy_function=_link_or_copy)
        config_file = tmp / "generation_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        config_file.unlink(missing_ok=True)  # a hard link to the base's: write a new file
        config_file.write_text(json.dumps({**config, "eos_token_id": [eos, *stops]}, indent=2))
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a concurrent identical build that won the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
