"""Fixtures shared by the unit and functional suites."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, ContextManager

import pytest

from held_across_tests import hold, release_unused
from nemo_rl.models.tiny import build_tiny_model

if TYPE_CHECKING:
    import grpo_stack
    import two_node_ray


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    """Tiny random Llama checkpoint (untied embeddings, GQA), built once and cached."""
    return build_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path() -> Path:
    """Tiny random Qwen2 checkpoint (tied embeddings, QKV bias, GQA), built once and cached."""
    return build_tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_reward_model_path(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as a reward model's HF folder (what ``nemo-rl export`` writes of a
    ``nemo-rl rm`` checkpoint: a one-label ``LlamaForSequenceClassification`` with a pad token
    and the tokenizer): every decoder weight moved off the tiny Llama's (noise of std 0.02, so
    a model loading only the head is told apart) and a random score head of std 1."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification.from_pretrained(
        tiny_llama_path, num_labels=1, pad_token_id=0, torch_dtype=torch.float32
    )
    with torch.no_grad():
        for param in model.model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    out = tmp_path_factory.mktemp("rm_hf")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def warm_colocated_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    """The folder (``logs``, ``ckpt`` with every step) of one tiny colocated GRPO run of
    ``tiny_grpo.WARM_RUN_STEPS`` steps after the SFT warm start, saving every step: the default
    loss's run for test_grpo.py and the uninterrupted run test_checkpoint_survival.py resumes
    against, run once for both, on the held ``tiny_colocated_stack``."""
    from grpo_stack import run_grpo_on
    from tiny_grpo import WARM_RUN_STEPS, warm_started_config

    stack = hold_tiny_colocated_stack(tmp_path_factory, tiny_llama_path)
    root = tmp_path_factory.mktemp("warm_colocated_run")
    run_grpo_on(stack, warm_started_config(root, tiny_llama_path, WARM_RUN_STEPS, save_period=1))
    return root


@pytest.fixture(scope="session")
def sft_warm_tiny_llama(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    """The HF folder (``nemo-rl export``) of the tiny Llama after the full-parameter SFT warm
    start of configs/ppo_tiny_cpu.yaml and grpo_lora_tiny_cpu.yaml: configs/sft_tiny_cpu.yaml
    for 150 steps of 32 replies (about 25 s on 2 cores), which leaves it right about a quarter
    of the time when sampling the synthetic task. Trained once, in the held local Ray."""
    from nemo_rl.algorithms import sft
    from nemo_rl.algorithms.sft_config import SFTMasterConfig
    from nemo_rl.models.policy import export
    from nemo_rl.utils.config import load_typed_config

    root = tmp_path_factory.mktemp("sft_warm_tiny_llama")
    steps = 150
    cfg = load_typed_config(
        Path(__file__).resolve().parents[1] / "configs" / "sft_tiny_cpu.yaml",
        [f"policy.model_name={tiny_llama_path}", f"sft.max_num_steps={steps}",
         "sft.max_num_epochs=100", "sft.val_period=0", "sft.val_at_start=false",
         f"checkpointing.checkpoint_dir={root / 'ckpt'}", f"checkpointing.save_period={steps}",
         "checkpointing.keep_top_k=null", f"logger.log_dir={root / 'logs'}",
         "logger.console_enabled=false"],
        SFTMasterConfig,
    )
    hold_local_ray_8cpu()
    assert sft.run(cfg) is None
    assert export.main([str(root / "ckpt"), str(root / "model")]) == 0
    return root / "model"


@pytest.fixture(scope="module")
def tiny_colocated_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path
) -> grpo_stack.GRPOStack:
    """The stack (policy workers and vLLM engine, tests/grpo_stack.py) of the tiny colocated
    warm-started GRPO run of ``tiny_grpo.warm_started_config`` (``WARM_RUN_STEPS`` steps), in
    the held ``local_ray_8cpu`` cluster: ``grpo_stack.run_grpo_on`` runs such a run on it
    (``warm_colocated_run`` and the resumed and stopped runs of test_checkpoint_survival.py).
    Held across consecutive tests that use it, like ``local_ray_8cpu``, and stopped once the
    next test does not use it (its bundle holds half the cluster's CPUs)."""
    return hold_tiny_colocated_stack(tmp_path_factory, tiny_llama_path)


def hold_tiny_colocated_stack(
    tmp_path_factory: pytest.TempPathFactory, model: Path
) -> grpo_stack.GRPOStack:
    """Start (unless held) the stack ``tiny_colocated_stack`` holds."""
    import grpo_stack
    from tiny_grpo import WARM_RUN_STEPS, warm_started_config

    def start() -> ContextManager[grpo_stack.GRPOStack]:
        root = tmp_path_factory.mktemp("tiny_colocated_stack")
        cfg = warm_started_config(root, model, WARM_RUN_STEPS, enabled=False)
        return grpo_stack.start(cfg, root / "initial")

    hold_local_ray_8cpu()
    return hold("tiny_colocated_stack", start)


@pytest.fixture(scope="module")
def local_ray_8cpu() -> None:
    """A local 8-CPU Ray cluster kept across consecutive tests that use this fixture: runs in
    it (``tiny_grpo.run_grpo``, ``ray_cluster(num_cpus=8)`` blocks) reuse it instead of each
    starting and stopping their own; stopped once the next test does not use it."""
    hold_local_ray_8cpu()


def hold_local_ray_8cpu() -> None:
    """Start (unless held) the cluster ``local_ray_8cpu`` holds."""
    from nemo_rl.distributed.ray_bootstrap import ray_cluster

    hold("local_ray_8cpu", lambda: ray_cluster(num_cpus=8))


@pytest.fixture(scope="module")
def two_node_ray_cluster() -> two_node_ray.TwoNodeCluster:
    """A Ray cluster of two nodes on this machine, kept apart as two machines
    (``two_node_ray``: own address, ``NEMO_RL_SHM_DIR``, cores and ``NEMO_RL_TEST_NODE`` per
    node), 8 logical CPUs each; held across consecutive tests that use it, like
    ``local_ray_8cpu`` (one cluster serves every two-node test), stopped once the next test
    does not use it. Runs inside it (``tiny_grpo.run_grpo``) reuse its connection."""
    import two_node_ray

    return hold("two_node_ray_cluster", two_node_ray.two_node_ray)


# Fixtures whose resource is held across consecutive tests that use it (held_across_tests),
# each inside the one after it where both are used (the stack runs in the local Ray).
HELD_FIXTURES = ("tiny_colocated_stack", "local_ray_8cpu", "two_node_ray_cluster")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests that use a held fixture (HELD_FIXTURES) one after another so that one
    resource serves them all. Modules are ordered by the first held fixture their tests use,
    those where every test uses it before those where some do; the modules using none come
    last, and within a module the tests follow the same order (those using the stack, then
    the local Ray, then the two nodes, then the rest). Otherwise the collected order is kept
    (modules stay contiguous, so module-scoped fixtures are set up once). The local Ray's block
    comes first so that its Ray stops long before the interpreter exits (a Ray stopped just
    before exit crashed it on the way out)."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)

    def first_held(item: pytest.Item) -> int:
        names = getattr(item, "fixturenames", ())
        return next((i for i, name in enumerate(HELD_FIXTURES) if name in names), len(HELD_FIXTURES))

    def module_rank(tests: list[pytest.Item]) -> int:
        first = min(map(first_held, tests))
        return 2 * first + (0 if all(first_held(t) == first for t in tests) else 1)

    modules = sorted(by_module.values(), key=module_rank)
    items[:] = [item for tests in modules for item in sorted(tests, key=first_held)]


@pytest.hookimpl(trylast=True)  # after the finished test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop what ``held_across_tests`` holds for fixtures the next test does not use."""
    release_unused(None if nextitem is None else nextitem.fixturenames)


def pytest_sessionfinish() -> None:
    """Stop whatever is still held when a session is cut short (``-x``, an interrupt)."""
    release_unused(None)


@pytest.fixture
def offline_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face hub cache in offline mode (no hub lookups, failures at once)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def hub_tiny_llama(offline_hub_cache: Path, tiny_llama_path: Path) -> tuple[str, Path]:
    """The tiny Llama as hub model "nemo-rl-test/tiny-llama" in the offline cache, laid out as
    a huggingface_hub download leaves it (refs/main -> snapshots/<commit>/): (name, snapshot)."""
    repo = offline_hub_cache / "models--nemo-rl-test--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_llama_path, snapshot)
    return "nemo-rl-test/tiny-llama", snapshot
