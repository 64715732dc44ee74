"""Python function calls and torch calls of one ``MegatronPolicyWorker.train`` step: a
load-independent measure of a step's work, to compare two versions of the code where wall-clock
pairs on a shared machine are noisier than the difference sought.

The workload is :mod:`bench_megatron_worker_train`'s uniform one (37 M Llama, 8 x 256 tokens,
micro-batches of 2, fp32, single rank); one warm-up step, then one step under ``cProfile``.
Prints the total and primitive call counts and the 40 most frequent functions (their counts,
and the torch calls as the CPU compatibility layer's ``__torch_function__`` count).

Run in each version's checkout (about 1 minute):

    PYTHONPATH=. python benchmarks/count_train_step_calls.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_megatron_worker_train as bench  # noqa: E402

from megatron_bridge.parallel_state import find_free_port  # noqa: E402
from nemo_rl.algorithms.loss import NLLLoss  # noqa: E402
from nemo_rl.models.policy.config import PolicyConfig  # noqa: E402
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker  # noqa: E402


def main() -> None:
    os.environ.update(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port())
    )
    path = bench.model_path()
    batch = bench.make_batch((bench.UNIFORM_LEN,) * bench.UNIFORM_ROWS, bench.UNIFORM_LEN)
    mbs = bench.UNIFORM_MBS
    config = PolicyConfig(
        model_name=path,
        train_global_batch_size=batch.size,
        train_micro_batch_size=mbs,
        max_total_sequence_length=batch["input_ids"].shape[1],
        megatron_cfg={
            "optimizer": {"lr": bench.LR, "min_lr": bench.LR, "weight_decay": 0.01, "clip_grad": 1.0}
        },
    )
    torch.manual_seed(0)
    try:
        worker = MegatronPolicyWorker(config, path, init_reference_model=False)
    except TypeError:  # versions before the consolidation took the config as a dict
        worker = MegatronPolicyWorker(config.model_dump(), path, init_reference_model=False)
    try:
        worker.train(batch, NLLLoss(), gbs=batch.size, mbs=mbs)
        profile = cProfile.Profile()
        profile.enable()
        worker.train(batch, NLLLoss(), gbs=batch.size, mbs=mbs)
        profile.disable()
    finally:
        worker.shutdown()
    stats = pstats.Stats(profile)
    print(f"python calls: {stats.total_calls}  primitive: {stats.prim_calls}")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("ncalls").print_stats(40)
    print(text.getvalue())


if __name__ == "__main__":
    main()
