"""Wall time and peak memory of HF -> Megatron -> HF conversion vs transformers load + save.

Workload (``--family``): a random Llama of about 0.45 B parameters (hidden 1024, 24 layers, 16
heads / 8 KV heads, FFN 4096, vocabulary 32,000, untied), ~0.9 GB of bf16 safetensors, or a
random Qwen3-MoE of about 0.29 B (8 layers of 16 experts of FFN 512, top 4), ~0.58 GB; written
once into ``--work-dir/<family>`` directly with safetensors (random normal weights, std 0.02,
fixed seed; the tensors are those the bridge's conversion plan names).

Phases, each in a fresh subprocess so its peak RSS is its own; every wall time includes the
interpreter start and all imports of that side (torch + transformers for the baseline, torch +
torch.distributed.checkpoint for the CLI), so both sides are measured the same way:

* ``transformers``: ``AutoModelForCausalLM.from_pretrained(dtype=bfloat16)`` + ``save_pretrained``
  (the baseline a user would otherwise run to re-save a checkpoint).
* ``hf->megatron``: ``megatron-bridge convert --from hf --to megatron --tp TP --pp PP [--ep EP]
  --dtype bfloat16``.
* ``megatron->hf``: ``megatron-bridge convert --from megatron --to hf``.

Memory: peak RSS from ``os.wait4`` on the phase's process (the CLI converts in its own
process for any TP/PP/EP; it spawns no ranks). Reported as bytes and as a multiple of the
checkpoint size on disk.

Run (under a minute on 2 cores, ~2 GB of RAM):

    PYTHONPATH=. python benchmarks/bench_megatron_bridge_convert.py [--tp 1] [--pp 1] \
        [--family qwen3_moe --ep 2]

Measured on 2 CPU cores shared with other jobs, tp=1, pp=1, 0.89 GB checkpoint, before (the
previous converter, which built a GPTModel) and after (streamed conversion) run back to back at
load average 12 -> 8 and 8 -> 6; walls vary by tens of percent with the load, so compare
ratios within one run:

    phase                   before: wall s  RSS x ckpt   after: wall s  RSS x ckpt
    transformers load+save           15.0        1.54             8.6        1.54
    hf->megatron                     15.1        1.64             6.0        0.59
    megatron->hf                      8.2        1.60             5.7        0.56
    round trip / baseline            1.56x                        1.35x

Round trip bitwise identical. Each CLI phase is now about 4 s of interpreter start and imports
(torch, torch.distributed.checkpoint) plus 2.5-4.5 s of work, and its RSS is ~0.42 GB of
imported code plus one tensor chunk; see docs/performance.md for the breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# config.json of the random checkpoint of each --family (with COMMON's fields).
FAMILIES = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=24,
                  num_key_value_heads=8, intermediate_size=4096),
    # ~0.29 B parameters, 0.58 GB bf16: 8 layers of 16 experts (top 4), 86 % of it experts.
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_hidden_layers=8, num_key_value_heads=4, intermediate_size=2048,
                      moe_intermediate_size=512, num_experts=16, num_experts_per_tok=4,
                      norm_topk_prob=True),
}
COMMON = dict(hidden_size=1024, num_attention_heads=16, head_dim=64, vocab_size=32000,
              tie_word_embeddings=False, rms_norm_eps=1e-5, dtype="bfloat16",
              max_position_embeddings=4096)


def write_random_checkpoint(
    out: Path, family: str, seed: int = 0, num_layers: int | None = None
) -> int:
    """Write config.json + bf16 safetensors shards (every tensor the bridge's plan names:
    norms 1, the rest normal with std 0.02), with ``num_layers`` decoder layers in place of
    the family's if given; returns total tensor bytes."""
    import torch
    from safetensors.torch import save_file

    from megatron_bridge import BridgeConfig

    out.mkdir(parents=True, exist_ok=True)
    config = {**FAMILIES[family], **COMMON}
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    bridge = BridgeConfig.from_hf(out)
    dims = bridge.dims(1)
    shapes = {
        name: shape
        for mapping in bridge.plan()
        for name, shape in zip(mapping.hf_names, mapping.hf_shapes(dims))
    }
    gen = torch.Generator().manual_seed(seed)
    total, shard, shard_bytes, files, weight_map = 0, {}, 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"part-{len(files)}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        t = (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02)
        t = t.to(torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        total += t.numel() * 2
        if shard_bytes > 400 * 1024**2:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def run_phase(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes (process and its waited-for children) of ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd} failed:\n{err[-3000:]}")
    return wall, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default="/tmp/bench_megatron_bridge")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size the Megatron checkpoint is written for")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="decoder layers in place of the family's (more layers, more chunks)")
    parser.add_argument("--write-checkpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_checkpoint:
        write_random_checkpoint(Path(args.write_checkpoint), args.family,
                                num_layers=args.num_layers)
        return
    layers = f"_{args.num_layers}l" if args.num_layers is not None else ""
    work = Path(args.work_dir) / f"{args.family}{layers}"
    src = work / "hf_src"
    if not (src / "model.safetensors.index.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        # In a child: a process forked from this one starts with this one's resident pages,
        # which its peak RSS (ru_maxrss) would count.
        subprocess.run([sys.executable, __file__, "--family", args.family,
                        *(["--num-layers", str(args.num_layers)] if args.num_layers else []),
                        "--write-checkpoint", str(src)], check=True)
    ckpt_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    for name in ("hf_baseline", "megatron", "hf_roundtrip"):
        shutil.rmtree(work / name, ignore_errors=True)

    py = sys.executable
    baseline = (
        "import torch, sys; from transformers import AutoModelForCausalLM; "
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16); "
        "m.save_pretrained(sys.argv[2])"
    )
    cli = [py, "-m", "megatron_bridge.cli", "convert"]
    phases = {
        "transformers load+save": [py, "-c", baseline, str(src), str(work / "hf_baseline")],
        "hf->megatron": cli + ["--from", "hf", "--to", "megatron", "--tp", str(args.tp),
                               "--pp", str(args.pp), *(["--ep", str(args.ep)] if args.ep > 1
                                                       else []),
                               "--dtype", "bfloat16", str(src), str(work / "megatron")],
        "megatron->hf": cli + ["--from", "megatron", "--to", "hf",
                               str(work / "megatron"), str(work / "hf_roundtrip")],
    }
    results = {name: run_phase(cmd) for name, cmd in phases.items()}

    from safetensors import safe_open

    mismatched = 0
    out_index = work / "hf_roundtrip" / "model.safetensors.index.json"
    if out_index.is_file():
        out_map = json.loads(out_index.read_text())["weight_map"]
    else:
        with safe_open(str(work / "hf_roundtrip" / "model.safetensors"), "pt") as single:
            out_map = {k: "model.safetensors" for k in single.keys()}
    src_index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(out_map) == sorted(src_index)
    for name, file in out_map.items():
        with safe_open(str(work / "hf_roundtrip" / file), "pt") as a, \
                safe_open(str(src / src_index[name]), "pt") as b:
            mismatched += not bool((a.get_tensor(name) == b.get_tensor(name)).all())

    print(f"{args.family} checkpoint: {ckpt_bytes / 1e9:.2f} GB bf16, tp={args.tp} "
          f"pp={args.pp} ep={args.ep}")
    print(f"{'phase':<24} {'wall s':>8} {'peak RSS GB':>12} {'x ckpt':>7}")
    for name, (wall, rss) in results.items():
        print(f"{name:<24} {wall:>8.1f} {rss / 1e9:>12.2f} {rss / ckpt_bytes:>7.2f}")
    roundtrip = results["hf->megatron"][0] + results["megatron->hf"][0]
    print(f"HF->Megatron->HF {roundtrip:.1f} s = "
          f"{roundtrip / results['transformers load+save'][0]:.2f}x transformers load+save; "
          f"round-trip tensors differing: {mismatched}")


if __name__ == "__main__":
    main()
