"""LoRA (``policy.megatron_cfg.peft``) against full training of ``MegatronPolicyWorker`` on CPU.

Workload: the CPU benchmark model of ``bench_megatron_worker_train.py`` (a random 37 M-parameter
Llama, fp32) on its uniform batch (8 rows of 256 tokens, micro-batches of 2), Adam. Each phase
runs in a fresh spawned process (so its peak resident memory is its own) and reports:

* trainable parameters (those with ``requires_grad``) and all parameters;
* optimizer state bytes, measured after the steps (every tensor in the optimizer's state);
* gradient buffer bytes (megatron's DDP buffers);
* peak resident memory of the process (``ru_maxrss``; model, buffers, optimizer, activations);
* the fastest of ``--steps`` optimizer steps after one warm-up step.

Phases: ``full`` (every weight trains: the baseline), ``lora8`` and ``lora32`` (adapters of rank
8 and 32, alpha = rank, on every linear of the decoder). Ratios are to ``full`` in the same run.

Run (about 2 minutes on 2 cores):

    PYTHONPATH=. python benchmarks/bench_lora_train.py [--steps 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
from typing import Any

from benchmarks.bench_megatron_worker_train import (
    LR,
    make_batch,
    model_path,
    timed_train_steps,
    workload,
)

PHASES: dict[str, int | None] = {"full": None, "lora8": 8, "lora32": 32}


def measure(path: str, rank: int | None, steps: int) -> dict[str, Any]:
    """Parameters, optimizer and gradient bytes, peak memory and step times of one phase."""
    import torch

    from megatron_bridge.parallel_state import find_free_port
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.workers.megatron.model_setup import optimizer_states
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

    os.environ.update(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port())
    )
    lengths, seq, mbs = workload("uniform")
    batch = make_batch(lengths, seq)
    peft = {} if rank is None else {"enabled": True, "dim": rank, "alpha": rank}
    config = PolicyConfig(
        model_name=path,
        train_global_batch_size=batch.size,
        train_micro_batch_size=mbs,
        logprob_batch_size=mbs,
        max_total_sequence_length=seq,
        megatron_cfg={
            "optimizer": {"lr": LR, "min_lr": LR, "weight_decay": 0.01, "clip_grad": 1.0},
            "peft": peft,
        },
    )
    torch.manual_seed(0)
    worker = MegatronPolicyWorker(config, path, init_reference_model=False)
    try:
        times = timed_train_steps(worker, batch, batch.size, mbs, steps)
        params = list(worker.policy.model.module.parameters())
        return {
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "params": sum(p.numel() for p in params),
            "optimizer_bytes": sum(
                t.numel() * t.element_size()
                for state in optimizer_states(worker.policy.optimizer)
                for t in state.values()
                if isinstance(t, torch.Tensor)
            ),
            "grad_bytes": sum(
                b.grad_data.numel() * b.grad_data.element_size()
                for b in worker.policy.model.buffers
            ),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "best_step_s": min(times),
        }
    finally:
        worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per phase")
    steps = parser.parse_args().steps
    path = model_path()
    results = {}
    for name, rank in PHASES.items():
        with multiprocessing.get_context("spawn").Pool(1) as pool:  # a fresh process a phase
            results[name] = pool.apply(measure, (path, rank, steps))
    mib = 1024**2
    print(f"{'phase':<8} {'trainable':>11} {'of all':>7} {'optim MiB':>10} {'grads MiB':>10} "
          f"{'peak MiB':>9} {'step s':>7}")
    for name, r in results.items():
        print(f"{name:<8} {r['trainable']:>11,} {r['trainable'] / r['params']:>7.2%} "
              f"{r['optimizer_bytes'] / mib:>10.1f} {r['grad_bytes'] / mib:>10.1f} "
              f"{r['peak_rss_bytes'] / mib:>9.0f} {r['best_step_s']:>7.2f}")
    full = results["full"]
    for name in ("lora8", "lora32"):
        r = results[name]
        print(f"{name} / full: optimizer state {r['optimizer_bytes'] / full['optimizer_bytes']:.4f}, "
              f"peak memory {r['peak_rss_bytes'] / full['peak_rss_bytes']:.2f}, "
              f"step time {r['best_step_s'] / full['best_step_s']:.2f}")


if __name__ == "__main__":
    main()
