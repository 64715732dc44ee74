"""Fixtures shared by the unit and functional suites."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from held_across_tests import hold, release_unused
from nemo_rl.models.tiny import build_tiny_model

if TYPE_CHECKING:
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
def warm_colocated_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    """The folder (``logs``, ``ckpt`` with every step) of one tiny colocated GRPO run of
    ``tiny_grpo.WARM_RUN_STEPS`` steps after the SFT warm start, saving every step: the default
    loss's run for test_grpo.py and the uninterrupted run test_checkpoint_survival.py resumes
    against, run once for both. It runs in the held ``local_ray_8cpu`` cluster, which the
    tests asking for it use too."""
    from tiny_grpo import WARM_RUN_STEPS, run_grpo, warm_started_config

    hold_local_ray_8cpu()
    root = tmp_path_factory.mktemp("warm_colocated_run")
    run_grpo(warm_started_config(root, tiny_llama_path, WARM_RUN_STEPS, save_period=1))
    return root


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests that use ``local_ray_8cpu`` one after another so that one Ray serves them
    all: first the modules whose every test uses it, then those where some do (those tests
    first), then the rest; otherwise the collected order (modules stay contiguous, so
    module-scoped fixtures are set up once). The block comes first so that its Ray stops long
    before the interpreter exits (a Ray stopped just before exit crashed it on the way out)."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)

    def uses_ray(item: pytest.Item) -> bool:
        return "local_ray_8cpu" in getattr(item, "fixturenames", ())

    def module_rank(tests: list[pytest.Item]) -> int:
        users = sum(map(uses_ray, tests))
        return 0 if users == len(tests) else 1 if users else 2

    modules = sorted(by_module.values(), key=module_rank)
    items[:] = [item for tests in modules for item in sorted(tests, key=lambda t: not uses_ray(t))]


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
