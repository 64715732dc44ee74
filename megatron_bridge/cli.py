"""``megatron-bridge``: convert, verify and inspect HF / Megatron-Core checkpoints.

    megatron-bridge convert --from hf --to megatron --tp 2 --pp 1 SRC DST
    megatron-bridge convert --from megatron --to hf --dtype bfloat16 SRC DST
    megatron-bridge convert --from megatron --to peft [--base-model NAME] SRC DST
    megatron-bridge verify HF_DIR [MEGATRON_DIR] --tp 2 --pp 1 [--ep 2]
    megatron-bridge info PATH

An HF checkpoint may be given as a local folder or as a Hugging Face Hub name
(``Qwen/Qwen2.5-1.5B``): a name that is not an existing path resolves to its snapshot in the hub
cache (``HF_HOME``), downloaded on first use (config, tokenizer and safetensors files only;
``HF_HUB_OFFLINE=1`` uses the cache alone). Megatron checkpoints are local folders.

``convert`` streams a model's tensors (a mixture-of-experts model's experts and routers too)
from one format into the other in the command's own process, without building a model or
starting process groups (the dist checkpoint is laid out as a ``--tp`` x ``--pp`` model would
save it, the same at every ``--ep``; it loads at any layout). ``verify`` builds the model on
``tp * pp * ep`` ranks (``--ep``: expert parallelism, over ``ep`` data-parallel ranks), spawned
(gloo on CPU, nccl with one GPU per rank); a single rank runs in the command's own process.
Every argument is checked before any work starts; the output is written to a temporary
sibling folder and renamed into place only on success.

``--to hf`` of a checkpoint with LoRA adapters (``lora.json``) writes the merged model
(``W + scale * B A``); ``--to peft`` writes its adapters alone as a PEFT adapter folder
(:mod:`megatron_bridge.peft_adapter`), which the ``peft`` package loads onto the base model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.checkpoint import (
    BRIDGE_FILE,
    HF_ASSETS_DIR,
    LORA_FILE,
    checkpoint_bridge,
    export_dtype,
    read_bridge_metadata,
    read_lora_spec,
    save_hf_checkpoint,
)
from megatron_bridge.config import BridgeConfig, dtype_from_name, dtype_name
from megatron_bridge.dist_ckpt_reader import DistCheckpointReader
from megatron_bridge.fallback_warnings import quiet_fallback_warnings
from megatron_bridge.folders import make_unique_dir
from megatron_bridge.hub import resolve_hf_checkpoint
from megatron_bridge.load import SafetensorsReader
from megatron_bridge.peft_adapter import save_peft_adapter
from megatron_bridge.tensor_check import check_hf_tensors

DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is",
    "Please solve the problem step by step.",
)


# Files one of which an HF folder with a tokenizer holds.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class CliError(Exception):
    """A user error: printed without a traceback, exit status 2."""


# ---- checkpoint inspection (main process, no torch.distributed) ------------------------------


def _checkpoint_kind(path: Path) -> str:
    """'hf' or 'megatron'; raises CliError for anything else."""
    if not path.is_dir():
        raise CliError(f"{path} does not exist or is not a folder")
    if (path / BRIDGE_FILE).is_file():
        return "megatron"
    if (path / "config.json").is_file():
        return "hf"
    if (path / ".metadata").is_file():
        raise CliError(
            f"{path} is a Megatron dist checkpoint without {BRIDGE_FILE}, so the model it holds "
            "is unknown (a nemo_rl policy checkpoint saved before they carried one: export it "
            "with `nemo-rl export CHECKPOINT HF_OUT --model MODEL`)"
        )
    raise CliError(f"{path} is neither an HF checkpoint (config.json) nor a Megatron one ({BRIDGE_FILE})")


def _hf_source(name: str) -> Path:
    """The local folder of checkpoint argument ``name``: an existing path as it is (its kind
    is checked later), else a hub model's cached snapshot
    (:func:`megatron_bridge.hub.resolve_hf_checkpoint`)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        return resolve_hf_checkpoint(name)
    except FileNotFoundError as err:
        raise CliError(str(err)) from err


def _bridge_for(path: Path, kind: str) -> BridgeConfig:
    return BridgeConfig.from_hf(path) if kind == "hf" else checkpoint_bridge(path)


def _check_source(path: Path, kind: str) -> BridgeConfig:
    """Validate that ``path`` is a readable checkpoint of ``kind`` whose tensors match its
    config (none missing, misshapen or left over) and return its bridge."""
    actual = _checkpoint_kind(path)
    if actual != kind:
        raise CliError(f"{path} is a {actual} checkpoint, but --from {kind} was given")
    try:
        bridge = _bridge_for(path, kind)
        if kind == "hf":
            check_hf_tensors(SafetensorsReader(path), bridge)
        elif not (path / "metadata.json").is_file():
            raise CliError(f"{path} has {BRIDGE_FILE} but no dist-checkpoint metadata.json")
        else:
            reader = DistCheckpointReader(path)
            reader.check_files()
    except (ValueError, FileNotFoundError) as err:
        raise CliError(str(err)) from err
    return bridge


def _check_parallel(bridge: BridgeConfig, tp: int, pp: int, ep: int = 1) -> None:
    try:
        bridge.validate_parallelism(tp, pp, ep)
    except ValueError as err:
        raise CliError(f"--tp {tp} --pp {pp}{f' --ep {ep}' if ep > 1 else ''}: {err}") from err


def _prepare_output(dst: Path, overwrite: bool) -> Path:
    """A fresh temporary folder next to ``dst``; refuses an existing ``dst`` without overwrite."""
    if dst.exists() and not overwrite:
        raise CliError(f"output {dst} already exists; pass --overwrite to replace it")
    return make_unique_dir(dst.parent, f".{dst.name}.partial-")


def _commit_output(tmp: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
    tmp.rename(dst)


# ---- conversion (this process) ---------------------------------------------------------------


def _progress(items: Any, total: int, description: str) -> Any:
    """Wrap an iterator with a rich progress bar."""
    from rich.progress import track

    return track(items, total=total, description=description)


def _convert(opts: dict[str, Any]) -> None:
    """Stream one checkpoint into the other format, in this process (no model is built)."""
    if opts["from"] == "hf":
        from megatron_bridge.dist_ckpt_writer import convert_hf_to_dist_checkpoint

        dtype = dtype_from_name(opts["dtype"]) if opts["dtype"] else torch.float32
        convert_hf_to_dist_checkpoint(
            opts["src"], opts["tmp"], tp=opts["tp"], pp=opts["pp"], dtype=dtype,
            sync_files=opts["fsync"],
        )
        return
    from megatron_bridge.dist_ckpt_reader import checkpoint_hf_weights, checkpoint_lora_weights

    dtype = dtype_from_name(opts["dtype"]) if opts["dtype"] else export_dtype(opts["src"])
    bridge = checkpoint_bridge(opts["src"])
    if opts["to"] == "peft":
        lora = read_lora_spec(opts["src"])
        assert lora is not None  # checked before the conversion started
        # the adapters' own dtype (policy.megatron_cfg.peft.lora_dtype) unless --dtype
        own = dtype_from_name(opts["dtype"]) if opts["dtype"] else None
        adapters = checkpoint_lora_weights(opts["src"], bridge, own)
        save_peft_adapter(adapters, lora.settings, bridge.num_layers, opts["tmp"],
                          opts["base_model"])
        return
    count = sum(len(m.hf_names) for m in bridge.plan())
    weights = _progress(checkpoint_hf_weights(opts["src"], bridge, dtype), count, "exporting")
    assets = Path(opts["src"]) / HF_ASSETS_DIR
    save_hf_checkpoint(
        weights,
        bridge,
        opts["tmp"],
        assets_dir=assets if assets.is_dir() else None,
        max_shard_bytes=opts["max_shard_bytes"],
    )


# ---- spawned ranks (verify) ------------------------------------------------------------------


def _run_ranks(fn: Any, world: int, *args: Any) -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` ranks; raise CliError on failure.

    One rank runs in this process when no process group exists here yet (spawning would
    re-import torch and megatron-core in a fresh interpreter); more ranks, or a caller that
    already has a process group, get ``world`` spawned processes.
    """
    import torch.distributed as dist

    from megatron_bridge.parallel_state import find_free_port

    if world == 1 and not dist.is_initialized():
        try:
            fn(0, 1, find_free_port(), *args)
        except (ValueError, KeyError, FileNotFoundError) as err:
            raise CliError(str(err)) from err
        except Exception as err:  # e.g. torch.load on damaged bytes: one line, as for ranks
            raise CliError(f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}") from err
        return
    import torch.multiprocessing as mp

    try:
        mp.spawn(fn, args=(world, find_free_port(), *args), nprocs=world, join=True)
    except mp.ProcessRaisedException as err:
        last = str(err).strip().splitlines()[-1]
        raise CliError(f"a rank failed: {last}") from err


def _logits_rank(rank: int, world: int, port: int, opts: dict[str, Any]) -> None:
    from megatron_bridge.checkpoint import load_megatron_checkpoint
    from megatron_bridge.forward import megatron_logits
    from megatron_bridge.load import load_hf_into_megatron
    from megatron_bridge.parallel_state import destroy_megatron_parallel, initialize_megatron_parallel

    initialize_megatron_parallel(
        rank, world, tp=opts["tp"], pp=opts["pp"], ep=opts["ep"], master_port=port
    )
    try:
        if opts["megatron"]:
            model, bridge = load_megatron_checkpoint(opts["megatron"])
        else:
            model, bridge = load_hf_into_megatron(opts["hf"])
        results = [
            megatron_logits(model, ids.unsqueeze(0), bridge.vocab_size)[0] for ids in opts["ids"]
        ]
        if rank == 0:
            torch.save(results, opts["out"])
    finally:
        destroy_megatron_parallel()


# ---- commands --------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    if args.from_ == args.to:
        raise CliError(f"--from and --to are both {args.from_!r}; nothing to convert")
    src = _hf_source(args.src) if args.from_ == "hf" else Path(args.src)
    dst = Path(args.dst)
    if args.dtype:
        try:
            dtype_from_name(args.dtype)
        except ValueError as err:
            raise CliError(f"--dtype: {err}") from err
    if args.to == "peft" and args.from_ != "megatron":
        raise CliError("--to peft writes the LoRA adapters of a Megatron checkpoint: use --from "
                       "megatron")
    if args.base_model and args.to != "peft":
        raise CliError("--base-model is recorded in a PEFT adapter folder only (--to peft)")
    if args.from_ == "megatron" and (args.tp or args.pp or args.ep):
        raise CliError(
            "--tp/--pp/--ep set the layout of a Megatron checkpoint being written (--to "
            "megatron); a Megatron checkpoint exports the same whatever layout wrote it: drop "
            "them"
        )
    args.tp, args.pp, args.ep = args.tp or 1, args.pp or 1, args.ep or 1
    bridge = _check_source(src, args.from_)
    if args.to == "peft" and read_lora_spec(src) is None:
        raise CliError(f"{src} holds no LoRA adapters (no {LORA_FILE}): convert it --to hf")
    if args.ep > 1 and not bridge.is_moe:
        raise CliError(
            f"--ep {args.ep}: expert parallelism needs a mixture-of-experts model; "
            f"{bridge.family.architecture} has no experts: drop --ep"
        )
    _check_parallel(bridge, args.tp, args.pp, args.ep)
    tmp = _prepare_output(dst, args.overwrite)
    opts = {
        "from": args.from_,
        "to": args.to,
        "base_model": args.base_model,
        "src": str(src),
        "tmp": str(tmp),
        "tp": args.tp,
        "pp": args.pp,
        "dtype": args.dtype,
        "max_shard_bytes": int(args.max_shard_gb * 1024**3),
        "fsync": args.fsync,
    }
    if args.to == "peft":
        layout = "LoRA adapters"
    elif args.from_ == "hf":
        experts = f" ep={args.ep}" if bridge.is_moe else ""
        layout = f"laid out for tp={args.tp} pp={args.pp}{experts}, {args.dtype or 'float32'}"
    else:
        layout = f"{args.dtype or dtype_name(export_dtype(src))}"
    print(f"converting {src} ({args.from_}) -> {dst} ({args.to}, {layout})")
    try:
        _convert(opts)
    except (ValueError, KeyError, FileNotFoundError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CliError(f"conversion failed: {err}") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _commit_output(tmp, dst)
    print(f"wrote {dst}")
    return 0


def _verify_inputs(hf_dir: Path, bridge: BridgeConfig, prompts: list[str] | None,
                   long_tokens: int | None) -> list[tuple[str, torch.Tensor]]:
    """``(label, token ids [seq])`` to compare logits on.

    Text prompts (the defaults, or ``prompts``) when the checkpoint has a tokenizer; then
    token ids that reach what short prompts miss: a random sequence longer than the sliding
    window and than a scaled RoPE's original context (``long_tokens`` overrides its length,
    0 leaves it out), and the highest ids of the vocabulary.
    """
    from transformers import AutoTokenizer

    tokenizer = None
    if any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        except (OSError, ValueError, TypeError) as err:
            raise CliError(f"cannot load the tokenizer of {hf_dir}: {err}") from err
    elif prompts:
        raise CliError(f"--prompt needs a tokenizer, and {hf_dir} has none ({TOKENIZER_FILES})")
    else:
        print(f"no tokenizer in {hf_dir}: comparing on token ids only")
    inputs = []
    if tokenizer is not None:
        for prompt in prompts or DEFAULT_PROMPTS:
            ids = torch.tensor(tokenizer(prompt)["input_ids"], dtype=torch.long)
            if not len(ids):
                raise CliError(f"the tokenizer of {hf_dir} turns {prompt!r} into no tokens")
            inputs.append((repr(prompt[:40]), ids))
    vocab = bridge.vocab_size
    length = _long_sequence_length(bridge) if long_tokens is None else long_tokens
    if length:
        generator = torch.Generator().manual_seed(0)
        inputs.append(("random ids (> window / RoPE context)",
                       torch.randint(0, vocab, (length,), generator=generator)))
    inputs.append(("highest ids", torch.arange(vocab - 1, max(vocab - 17, -1), -1)))
    return inputs


def _long_sequence_length(bridge: BridgeConfig) -> int:
    """Tokens of the random sequence: past the sliding window and a scaled RoPE's original
    context (where set), at least 64, at most ``max_position_embeddings``."""
    reach = [48]
    if bridge.features.window:
        reach.append(bridge.features.window)
    rope = bridge.rope_parameters()
    original = rope.get("original_max_position_embeddings")
    if rope["rope_type"] != "default" and original:
        reach.append(int(original))
    limit = int(bridge.hf_config.get("max_position_embeddings") or 1 << 30)
    return min(max(reach) + 16, limit)


def cmd_verify(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    hf_dir = _hf_source(args.hf)
    bridge = _check_source(hf_dir, "hf")
    if args.megatron:
        mg_bridge = _check_source(Path(args.megatron), "megatron")
        if mg_bridge.hf_config.get("architectures") != bridge.hf_config.get("architectures"):
            raise CliError(f"{args.megatron} and {hf_dir} hold different architectures")
        bridge = mg_bridge
    _check_parallel(bridge, args.tp, args.pp, args.ep)
    if args.megatron and args.dtype:
        saved = read_bridge_metadata(args.megatron)["dtype"]
        try:
            requested = dtype_from_name(args.dtype)
        except ValueError as err:
            raise CliError(f"--dtype: {err}") from err
        if requested != dtype_from_name(saved):
            raise CliError(
                f"dtype mismatch: {args.megatron} holds {saved} weights but --dtype "
                f"{args.dtype} was given; pass --dtype {saved} or omit it"
            )
    inputs = _verify_inputs(hf_dir, bridge, args.prompt, args.long_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.pt"
        opts = {"hf": str(hf_dir), "megatron": args.megatron, "tp": args.tp, "pp": args.pp,
                "ep": args.ep, "ids": [ids for _, ids in inputs], "out": str(out)}
        _run_ranks(_logits_rank, args.tp * args.pp * args.ep, opts)
        megatron = torch.load(out)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst = 0.0
    for (label, tokens), mg in zip(inputs, megatron):
        with torch.no_grad():
            ref = model(tokens.unsqueeze(0)).logits[0]
        diff = (ref - mg.float()).abs()
        worst = max(worst, diff.max().item())
        print(f"{len(tokens):5d} tokens  max abs diff {diff.max().item():.3e}  "
              f"mean abs diff {diff.mean().item():.3e}  {label}")
    ok = worst <= args.atol
    print(f"{'OK' if ok else 'MISMATCH'}: max abs diff {worst:.3e} (atol {args.atol:.1e})")
    return 0 if ok else 1


def _hf_summary(path: Path) -> dict[str, Any]:
    reader = SafetensorsReader(path)
    names = reader.names()
    files = reader.files()
    params = sum(torch.Size(reader.shape(n)).numel() for n in names)
    dtypes = sorted({str(reader.dtype(n)).removeprefix("torch.") for n in names})
    size = sum((path / f).stat().st_size for f in files)
    return {"tensors": len(names), "parameters": params, "dtypes": dtypes,
            "files": files, "bytes": size}


def cmd_info(args: argparse.Namespace) -> int:
    path = _hf_source(args.path)
    kind = _checkpoint_kind(path)
    try:
        bridge = _bridge_for(path, kind)
    except (ValueError, FileNotFoundError) as err:
        raise CliError(str(err)) from err
    info: dict[str, Any] = {
        "path": str(path),
        "format": kind,
        "architecture": bridge.family.architecture,
        "layers": bridge.num_layers,
        "hidden_size": bridge.hf_config["hidden_size"],
        "attention_heads": bridge.num_heads,
        "kv_heads": bridge.num_kv_heads,
        "head_dim": bridge.head_dim,
        "vocab_size": bridge.vocab_size,
        "tied_embeddings": bridge.tie_word_embeddings,
        "features": {k: v for k, v in dataclasses.asdict(bridge.features).items()
                     if v and k != "sparse_layers"},
        "valid_tp": [t for t in range(1, bridge.num_kv_heads + 1) if _fits(bridge, t, 1)],
        "valid_pp": [p for p in range(1, bridge.num_layers + 1) if bridge.num_layers % p == 0],
    }
    if bridge.is_moe:
        info.update({
            "experts": bridge.num_experts,
            "experts_per_token": int(bridge.resolved["num_experts_per_tok"]),
            "expert_ffn": bridge.moe_ffn,
            "sparse_layers": [i for i, s in enumerate(bridge.features.sparse_layers) if s],
            "valid_ep": [e for e in range(1, bridge.num_experts + 1)
                         if bridge.num_experts % e == 0],
        })
    if kind == "hf":
        try:
            summary = _hf_summary(path)
        except (ValueError, FileNotFoundError) as err:
            raise CliError(str(err)) from err
        info.update(summary)
    else:
        meta = read_bridge_metadata(path)
        shards = sorted(p.name for p in path.glob("*.distcp"))
        info.update({"dtype": meta["dtype"], "padded_vocab_size": meta["padded_vocab_size"],
                     "dist_checkpoint_files": shards,
                     "bytes": sum(p.stat().st_size for p in path.glob("*.distcp"))})
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _fits(bridge: BridgeConfig, tp: int, pp: int) -> bool:
    try:
        bridge.validate_parallelism(tp, pp)
    except ValueError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-bridge", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert between HF and Megatron checkpoints")
    convert.add_argument("--from", dest="from_", choices=("hf", "megatron"), required=True)
    convert.add_argument("--to", choices=("hf", "megatron", "peft"), required=True,
                         help="peft: the LoRA adapters of a Megatron checkpoint as a PEFT "
                              "adapter folder (hf writes the model with them merged)")
    convert.add_argument("--base-model", default=None,
                         help="--to peft: the base model (hub name or folder) recorded as "
                              "base_model_name_or_path")
    convert.add_argument("--tp", type=int, default=None,
                         help="--to megatron: tensor-parallel size the checkpoint is laid out "
                              "for (sets the vocabulary padding; it loads at any TP/PP); "
                              "default 1")
    convert.add_argument("--pp", type=int, default=None,
                         help="--to megatron: pipeline-parallel size the checkpoint is laid "
                              "out for; default 1")
    convert.add_argument("--ep", type=int, default=None,
                         help="--to megatron, mixture-of-experts models: expert-parallel size "
                              "the checkpoint is checked to fit (it is the same at every EP "
                              "and loads at any); default 1")
    convert.add_argument("--dtype", default=None,
                         help="output dtype (float32, bfloat16, float16); default: float32 for "
                              "hf->megatron; for megatron->hf the dtype of the HF checkpoint "
                              "it was converted from (a bitwise round trip), else the "
                              "checkpoint's own")
    convert.add_argument("--max-shard-gb", type=float, default=2.0,
                         help="largest HF safetensors shard, GiB")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    convert.add_argument("--fsync", action="store_true",
                         help="flush the Megatron checkpoint's files to disk before it is "
                              "renamed into place (durable against a machine crash; slower)")
    convert.add_argument("src", help="source checkpoint folder (or hub model name with --from hf)")
    convert.add_argument("dst")
    convert.set_defaults(func=cmd_convert)

    verify = sub.add_parser("verify", help="compare Megatron logits with transformers' logits")
    verify.add_argument("hf", help="HF checkpoint folder or hub model name (reference, and "
                        "tokenizer)")
    verify.add_argument("megatron", nargs="?", default=None,
                        help="Megatron checkpoint; default: load the HF folder through the bridge")
    verify.add_argument("--tp", type=int, default=1)
    verify.add_argument("--pp", type=int, default=1)
    verify.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size (expert_model_parallel_size) of a "
                             "mixture-of-experts model; spawns tp*pp*ep ranks")
    verify.add_argument("--prompt", action="append",
                        help="prompt to compare on instead of the default ones (repeatable; "
                             "needs the checkpoint's tokenizer)")
    verify.add_argument("--long-tokens", type=int, default=None,
                        help="length of the random-token sequence; default: past the sliding "
                             "window and a scaled RoPE's original context; 0 leaves it out")
    verify.add_argument("--atol", type=float, default=1e-4, help="max abs logit difference allowed")
    verify.add_argument("--dtype", default=None,
                        help="expected dtype of the Megatron checkpoint (checked, not cast)")
    verify.set_defaults(func=cmd_verify)

    info = sub.add_parser("info", help="what a checkpoint holds")
    info.add_argument("path", help="checkpoint folder, or hub model name of an HF checkpoint")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_fallback_warnings()  # conversion does not need the accelerators: no note
    try:
        return args.func(args)
    except CliError as err:
        print(f"megatron-bridge: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
