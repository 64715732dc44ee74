"""Start-up of a run's processes: the driver's imports and a policy worker's start, each in a
fresh interpreter, against ``import torch`` (the floor every one of them pays) in the same run.

    PYTHONPATH=. python benchmarks/bench_startup.py [--repeats 3]

Measures, alternating, the median of ``--repeats`` fresh processes each:

- ``import torch``: the baseline;
- the driver: the modules ``nemo-rl grpo`` imports before it starts Ray (CLI, GRPO, the
  policy's driver side), and whether megatron-core came with them;
- ``import megatron.core`` alone: what a driver that imported it would pay on top;
- a policy worker: its model set-up imported, then a TP=1 ``MegatronPolicyWorker`` built on the
  tiny Llama (process group, model, optimizer, reference copy), and whether inductor came with
  it (megatron-core's import-time ``torch.compile`` calls deferred on CPU).

Prints seconds and each one's ratio to ``import torch``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

IMPORT_TORCH = "import torch"
DRIVER = """
import importlib
for name in ("nemo_rl.cli", "nemo_rl.algorithms.grpo", "nemo_rl.models.policy.lm_policy"):
    importlib.import_module(name)
"""
MEGATRON = "import megatron.core"
WORKER = """
import os
from megatron_bridge.parallel_state import find_free_port
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker
from nemo_rl.models.tiny import build_tiny_model
path = str(build_tiny_model("llama"))
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(find_free_port()))
cfg = PolicyConfig(model_name=path, train_global_batch_size=8, train_micro_batch_size=4,
                   max_total_sequence_length=64)
worker = MegatronPolicyWorker(cfg, path, init_reference_model=True)
"""
REPORT = """
import json, sys, time
print("STARTUP " + json.dumps({"s": time.perf_counter() - _t0,
    "megatron_core": "megatron.core" in sys.modules,
    "inductor": "torch._inductor.compile_fx" in sys.modules}))
"""
CASES = {"import torch": IMPORT_TORCH, "driver": DRIVER, "import megatron.core": MEGATRON,
         "policy worker start": WORKER}


def timed_run(body: str) -> dict[str, float | bool]:
    """Seconds from interpreter start-up done to the end of ``body``, in a fresh process."""
    code = f"import time\n_t0 = time.perf_counter()\n{body}\n{REPORT}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("STARTUP ")][-1]
    return json.loads(line.removeprefix("STARTUP "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float | bool]]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, body in CASES.items():
            runs[name].append(timed_run(body))
    floor = statistics.median(r["s"] for r in runs["import torch"])
    print(f"{'process':<24}{'median s':>10}{'x torch':>9}  imports megatron.core / inductor")
    for name, results in runs.items():
        seconds = statistics.median(r["s"] for r in results)
        print(f"{name:<24}{seconds:>10.2f}{seconds / floor:>9.2f}  "
              f"{results[-1]['megatron_core']} / {results[-1]['inductor']}")


if __name__ == "__main__":
    main()
