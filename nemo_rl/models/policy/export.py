"""``nemo-rl export CHECKPOINT HF_OUT``: a training checkpoint's policy as an HF model folder.

``CHECKPOINT`` is a run's ``checkpointing.checkpoint_dir`` (its latest step is exported), one
``step_<n>`` folder, or a policy folder itself (``step_<n>/policy``, ``sft_warmup``). The policy
folder is a megatron_bridge checkpoint (``bridge.json``, ``hf_assets/``; see
:mod:`nemo_rl.models.policy.workers.megatron.checkpointing`), so the export is
``megatron-bridge convert --from megatron --to hf``: the model tensors stream into safetensors
whatever TP/PP wrote them, next to the HF config, tokenizer, chat template and generation
config of the source model; the optimizer's tensors are skipped.

A LoRA policy's checkpoint (``lora.json``) exports as a PEFT adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``, ``megatron-bridge convert --to
peft``; ``base_model_name_or_path`` is the run's ``policy.model_name``), which the ``peft``
package loads onto the base model; ``--merged`` writes the HF model with the adapters merged
(``W + scale * B A``) instead.

A policy folder saved before checkpoints carried ``bridge.json`` is exported with the source
model given by ``--model``: its HF config and tokenizer describe the saved tensors, which must
match them.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from megatron_bridge.checkpoint import BRIDGE_FILE, read_lora_spec
from megatron_bridge.cli import CliError
from nemo_rl.utils.checkpoint import POLICY_DIR
from nemo_rl.utils.run_config import RUN_CONFIG_FILE

_STEP_DIR = re.compile(r"^step_(\d+)$")


def resolve_policy_dir(path: str | Path) -> Path:
    """The policy folder ``path`` names: itself, ``path/policy``, or the latest
    ``path/step_<n>/policy``.

    Raises:
        CliError: nothing of the three, or a missing folder.
    """
    path = Path(path)
    if not path.is_dir():
        raise CliError(f"{path} does not exist or is not a folder")
    if (path / ".metadata").is_file():
        return path
    if (path / POLICY_DIR).is_dir():
        return path / POLICY_DIR
    steps = sorted(
        (int(m.group(1)), p) for p in path.iterdir() if (m := _STEP_DIR.match(p.name))
    )
    if steps and (steps[-1][1] / POLICY_DIR).is_dir():
        return steps[-1][1] / POLICY_DIR
    raise CliError(
        f"{path} is not a training checkpoint: expected a policy folder (with .metadata), a "
        f"step_<n> folder holding {POLICY_DIR}/, or a checkpoint_dir holding step_<n> folders"
    )


def _describe_with_model(policy_dir: Path, model: str, staging: Path) -> Path:
    """A folder of links to ``policy_dir``'s files plus the ``bridge.json`` and tokenizer
    files of source model ``model`` (resolved like ``policy.model_name``); the checkpoint
    itself is not modified. Returns the folder."""
    import torch

    from megatron_bridge import BridgeConfig
    from megatron_bridge.checkpoint import write_bridge_files
    from megatron_bridge.dist_ckpt_reader import DistCheckpointReader
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.model_path import resolve_model_path

    try:
        model_path = resolve_model_path(model)
        divisible = PolicyConfig().megatron_cfg.make_vocab_size_divisible_by
        bridge = BridgeConfig.from_hf(model_path, make_vocab_size_divisible_by=divisible)
    except (OSError, ValueError) as err:
        raise CliError(f"--model {model}: {err}") from err
    for item in policy_dir.iterdir():
        (staging / item.name).symlink_to(item.resolve())
    # The parameters' dtype and padded vocabulary are those of the stored embedding.
    reader = DistCheckpointReader(staging)
    embedding = "embedding.word_embeddings.weight"
    dtype: torch.dtype = reader.metadata.state_dict_metadata[embedding].properties.dtype
    rows = reader.shape(embedding)[0]  # the vocabulary padded as the training layout did
    reader.close()
    bridge = BridgeConfig(
        bridge.hf_config, make_vocab_size_divisible_by=divisible, padded_vocab_size=rows
    )
    write_bridge_files(staging, bridge, 1, dtype, model_path)
    return staging


def _trained_model_name(policy_dir: Path) -> str | None:
    """``policy.model_name`` of the run that saved ``policy_dir`` (its ``step_<n>`` folder's
    recorded recipe), a tiny model's name as its local folder (what transformers loads); None
    when not recorded."""
    import yaml

    from nemo_rl.models.model_path import TINY_MODEL_NAMES, resolve_model_path

    recipe = policy_dir.parent / RUN_CONFIG_FILE
    if not recipe.is_file():
        return None
    name = (yaml.safe_load(recipe.read_text()) or {}).get("policy", {}).get("model_name")
    return resolve_model_path(name) if name in TINY_MODEL_NAMES else name


def export_checkpoint(
    checkpoint: str | Path,
    hf_out: str | Path,
    *,
    dtype: str | None = None,
    model: str | None = None,
    overwrite: bool = False,
    merged: bool = False,
) -> Path:
    """Write the HF folder ``hf_out`` from a training checkpoint (see the module docstring):
    a LoRA policy's adapters as a PEFT adapter folder, or with ``merged`` (and for a policy
    without adapters) the HF model.

    Args:
        checkpoint: checkpoint_dir, ``step_<n>`` or policy folder.
        hf_out: output folder (must not exist unless ``overwrite``).
        dtype: dtype of the written tensors (float32, bfloat16, float16); None: the policy's
            parameter dtype.
        model: source model of a policy folder without ``bridge.json``; for a PEFT folder,
            the base model it records (default: the run's ``policy.model_name``).

    Returns:
        The policy folder exported.

    Raises:
        CliError: a bad argument or checkpoint, with what to do.
    """
    from megatron_bridge.cli import build_parser, cmd_convert

    policy_dir = resolve_policy_dir(checkpoint)
    flags = ["--dtype", dtype] if dtype else []
    flags += ["--overwrite"] if overwrite else []
    to = "hf"
    if not merged and read_lora_spec(policy_dir) is not None:
        to = "peft"
        base_model = model or _trained_model_name(policy_dir)
        flags += ["--base-model", base_model] if base_model else []
    with tempfile.TemporaryDirectory(prefix="nemo_rl_export_") as tmp:
        source = policy_dir
        if not (policy_dir / BRIDGE_FILE).is_file():
            if not model:
                raise CliError(
                    f"{policy_dir} has no {BRIDGE_FILE} (saved before checkpoints recorded "
                    "their model): pass --model with the recipe's policy.model_name it was "
                    "trained from"
                )
            source = _describe_with_model(policy_dir, model, Path(tmp))
        args = build_parser().parse_args(
            ["convert", "--from", "megatron", "--to", to, *flags, str(source), str(hf_out)]
        )
        cmd_convert(args)
    return policy_dir


def build_parser() -> argparse.ArgumentParser:
    """``nemo-rl export``'s arguments."""
    parser = argparse.ArgumentParser(
        prog="nemo-rl export", description=__doc__.split("\n")[0].split(": ", 1)[1]
    )
    parser.add_argument("checkpoint", help="checkpoint_dir (latest step), step_<n> folder, or "
                        "policy folder")
    parser.add_argument("hf_out", help="HF folder (or PEFT adapter folder) to write")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16; default: "
                        "the policy's parameter dtype")
    parser.add_argument("--model", default=None, help="source model (policy.model_name) of a "
                        "checkpoint saved without bridge.json")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing HF_OUT")
    parser.add_argument("--merged", action="store_true", help="a LoRA policy: write the HF "
                        "model with the adapters merged instead of a PEFT adapter folder")
    return parser


def main(argv: list[str]) -> int:
    """Run ``nemo-rl export`` with ``argv`` (the arguments after ``export``); exit code 0, or
    2 for a bad argument or checkpoint (one line on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        policy_dir = export_checkpoint(
            args.checkpoint, args.hf_out, dtype=args.dtype, model=args.model,
            overwrite=args.overwrite, merged=args.merged,
        )
    except CliError as err:
        print(f"nemo-rl export: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {policy_dir} -> {args.hf_out}")
    return 0
