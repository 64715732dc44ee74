"""GRPO across two Ray nodes of this machine, kept apart as two machines (tests/two_node_ray.py:
each node has its own shared-memory folder, cores and ``NEMO_RL_TEST_NODE``).

The cluster: every node's processes see their own node's settings, and a ``RayVirtualCluster``
puts its groups on distinct Ray nodes (refusing more groups than nodes).

The non-colocated run: the tiny run (its SFT warm start, then 2 GRPO steps) with
``cluster.num_nodes=2``, one CPU bundle per node, the policy at tensor-parallel size 2 (a rank
on each node, its TP all-reduces crossing nodes) and generation not colocated: one vLLM engine
per node, refit every step by the broadcast from the policy's rank 0 to both engines. Checks:
the ranks and engines really sit on both nodes (asked of their own processes); every process of
both nodes listens on loopback only; every step is on-policy (ratio 1 and vLLM's logprobs agree
with the policy's, ``token_mult_prob_error`` ~ 1: every refit reached the engine of the other
node).

PPO's critic across the nodes: a critic (the tiny Llama with the scalar head) with one
data-parallel rank on each node gives the values and, after one optimizer step on the clipped
value loss, the loss, grad norm and metrics (``values_min`` / ``values_max`` reduced by min /
max across the nodes) of the same critic as one in-process rank (1e-5).

Agents across nodes: two engines serving their OpenAI-compatible endpoint, one per node, bound
to 127.0.0.1 as every test server is (so both nodes' addresses are 127.0.0.1 here), and an agent
environment actor on node 1 running four two-turn episodes spread over both engines. Checks:
each engine's base URL is the address and port its own server on its own node is bound to; the
wildcard setting (``http_server_host: 0.0.0.0``) would advertise the address each engine's node
reports; every episode, the ones on node 0's engine included, made its requests and got its
samples trained from its engine's records.

The colocated layout on two nodes (a policy rank and an engine on each node, every engine
reading its own node's refit ring) runs the demo recipe for 30 steps in test_grpo_learns.py,
the suite's learning gate, where the reward rises on two nodes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from nemo_rl.algorithms.advantage_estimators import gae_advantages
from nemo_rl.algorithms.loss import MseValueLossFn
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster, TooFewNodesError
from nemo_rl.environments.agent_environment import AgentEnvironment
from nemo_rl.experience.agent_rollouts import run_agent_rollout
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.vllm.async_generation import vllm_generation
from nemo_rl.models.generation.vllm.http_server import advertised_host
from nemo_rl.models.policy.lm_policy import Policy

from listening import ListenerScan
from one_rank_worker import one_rank_worker, small_policy_config, token_batch
from tiny_grpo import WARMUP, run_grpo, tiny_grpo_config, train_records
from two_node_ray import TwoNodeCluster

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("two_node_ray_cluster")]

STEPS = 2


def test_each_node_sees_its_own_shared_memory_folder_and_cores(
    two_node_ray_cluster: TwoNodeCluster,
) -> None:
    nodes = two_node_ray_cluster.nodes
    assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]} & {n.node_id for n in nodes}) == 2
    assert nodes[0].shm_dir != nodes[1].shm_dir and all(n.shm_dir.is_dir() for n in nodes)
    if len(os.sched_getaffinity(0)) > 1:
        assert not nodes[0].cores & nodes[1].cores
    for node in nodes:
        seen = two_node_ray_cluster.ask_node(node)
        assert seen["node_id"] == node.node_id and seen["NEMO_RL_TEST_NODE"] == node.name
        assert seen["NEMO_RL_SHM_DIR"] == str(node.shm_dir)
        assert seen["cores"] == sorted(node.cores)


def test_virtual_cluster_puts_each_node_group_on_a_ray_node_of_its_own(
    two_node_ray_cluster: TwoNodeCluster,
) -> None:
    # each node has 8 CPUs: both groups would fit on one node, and must not share it
    cluster = RayVirtualCluster([2, 1], use_gpus=False, num_cpus_per_bundle=1.0, name="spread")
    try:
        locations = cluster.get_bundle_locations()
        assert [loc.bundle_index for loc in locations] == [0, 1, 0]
        assert locations[0].node_id == locations[1].node_id != locations[2].node_id
        assert {loc.node_id for loc in locations} == {n.node_id for n in two_node_ray_cluster.nodes}
    finally:
        cluster.shutdown()
    with pytest.raises(TooFewNodesError, match=r"needs 3 Ray nodes .* has 2 node\(s\)"):
        RayVirtualCluster([1, 1, 1], use_gpus=False, num_cpus_per_bundle=1.0, name="three")


@pytest.fixture(scope="module")
def non_colocated_run(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_path: Path,
    two_node_ray_cluster: TwoNodeCluster,
) -> dict[str, Any]:
    """The tiny run on both nodes, generation not colocated: its ``train`` metrics by step
    (``train``), where the policy ranks and the engines ran (``policy_nodes``,
    ``engine_nodes``) and the TCP sockets this process tree (both nodes' Ray processes and
    workers) listened on (``listeners``)."""
    out: dict[str, Any] = {}

    def locate(components: Any) -> None:
        nodes_of = two_node_ray_cluster.nodes_of
        out["policy_nodes"] = nodes_of(components.policy.worker_group.workers)
        out["engine_nodes"] = nodes_of(components.generation.engines)

    log_dir = tmp_path_factory.mktemp("two_node_non_colocated") / "logs"
    cfg = tiny_grpo_config(log_dir, tiny_llama_path, grpo={"max_num_steps": STEPS},
                           colocated=False, tensor_parallel=2, num_nodes=2, sft_warmup=WARMUP)
    with ListenerScan(period_s=1.0) as scan:
        run_grpo(cfg, on_setup=locate)
    out["train"] = train_records(log_dir)
    out["listeners"] = scan.seen
    return out


def test_policy_ranks_and_engines_sit_on_both_nodes(non_colocated_run: dict[str, Any]) -> None:
    policy_nodes = non_colocated_run["policy_nodes"]  # TP rank 0, rank 1
    assert sorted(policy_nodes) == sorted(non_colocated_run["engine_nodes"]) == ["node0", "node1"]


def test_both_nodes_listen_on_loopback_only(non_colocated_run: dict[str, Any]) -> None:
    seen = non_colocated_run["listeners"]
    exposed = sorted((s.ip, s.port, s.process) for s in seen if not s.loopback)
    assert exposed == [], f"listening beyond loopback: {exposed}"
    # a scan that missed the workers cannot pass: it saw the policy's rendezvous store
    assert [s for s in seen if s.rendezvous_port == s.port], seen


def test_every_step_is_on_policy_across_nodes(non_colocated_run: dict[str, Any]) -> None:
    train = non_colocated_run["train"]
    assert sorted(train) == list(range(1, STEPS + 1))
    assert abs(train[1]["probs_ratio"] - 1.0) < 1e-5
    # every step generates with the weights the cross-node broadcast refit brought (the warm
    # start's, then step 1's)
    errors = {step: m["token_mult_prob_error"] for step, m in train.items()}
    assert all(abs(e - 1.0) < 1e-3 for e in errors.values()), errors


CRITIC = {"reward_model_cfg": {"enabled": True}, "megatron_cfg": {"optimizer": {"lr": 1e-2, "min_lr": 1e-2}}}
CRITIC_LENGTHS, CRITIC_SEQ = [12, 7, 9, 5], 12


@pytest.fixture(scope="module")
def critic_runs(two_node_ray_cluster: TwoNodeCluster, tiny_llama_path: Path) -> dict[str, Any]:
    """The same critic as one in-process rank (``one``) and as two DP ranks on the two nodes
    (``two``): its values of a batch and one training step on GAE returns from the one-rank
    values; where the two ranks ran (``nodes``)."""
    rows = len(CRITIC_LENGTHS)
    batch = token_batch(CRITIC_LENGTHS, CRITIC_SEQ)
    loss_fn = MseValueLossFn({"scale": 0.4, "cliprange": 0.2})
    out: dict[str, Any] = {}
    with one_rank_worker(tiny_llama_path, rows, CRITIC_SEQ, CRITIC, seed=7) as critic:
        values = critic.get_values(batch)["values"]
        _, returns = gae_advantages(torch.tensor([1.0, -1.0, 0.5, 0.0]), values, batch["token_mask"], gamma=1.0, lam=0.95)
        batch["returns"], batch["values"] = returns, values
        out["one"] = {"values": values, "step": critic.train(batch, loss_fn)}
    cluster = RayVirtualCluster([1, 1], use_gpus=False, num_cpus_per_bundle=1.0, name="critic")
    try:
        config = small_policy_config(tiny_llama_path, rows, CRITIC_SEQ, CRITIC)
        critic = Policy(cluster, config, init_reference_model=False, seed=7, name="value")
        try:
            out["nodes"] = two_node_ray_cluster.nodes_of(critic.worker_group.workers)
            out["two"] = {"values": critic.get_values(batch)["values"], "step": critic.train(batch, loss_fn)}
        finally:
            critic.shutdown()
    finally:
        cluster.shutdown()
    return out


def test_a_ppo_critic_across_nodes_matches_one_rank(critic_runs: dict[str, Any]) -> None:
    assert sorted(critic_runs["nodes"]) == ["node0", "node1"]  # one DP rank on each node
    one, two = critic_runs["one"], critic_runs["two"]
    torch.testing.assert_close(two["values"], one["values"], rtol=0, atol=1e-5)
    for key in ("loss", "grad_norm"):
        assert two["step"][key] == pytest.approx(one["step"][key], abs=1e-5), key
    assert set(two["step"]["metrics"]) == set(one["step"]["metrics"])
    for key, value in one["step"]["metrics"].items():
        assert two["step"]["metrics"][key] == pytest.approx(value, abs=1e-5), key
    metrics = one["step"]["metrics"]
    assert metrics["values_min"][0] < metrics["values_max"][0]
def test_an_agent_on_one_node_reaches_the_engines_of_both(
    two_node_ray_cluster: TwoNodeCluster, tiny_llama_path: Path
) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from transformers import AutoTokenizer

    def served_at(worker: Any) -> dict[str, Any]:
        """Inside an engine's actor (a local function: it travels by value): its node, the
        address and port its HTTP server is bound to, what a wildcard bind advertises there."""
        ip, port = worker.http_server._server.servers[0].sockets[0].getsockname()[:2]
        return {"node": os.environ["NEMO_RL_TEST_NODE"], "bound": (ip, port),
                "wildcard": advertised_host("0.0.0.0"), "node_ip": ray.util.get_node_ip_address()}

    config = GenerationConfig(max_new_tokens=8, vllm_cfg=VllmConfig(
        max_model_len=256, kv_cache_memory_bytes=16 * 1024**2, enforce_eager=True,
        expose_http_server=True,  # http_server_host: 127.0.0.1
    ))
    cluster = RayVirtualCluster([1, 1], use_gpus=False, num_cpus_per_bundle=1.0, name="agents")
    generation = vllm_generation(cluster, config, str(tiny_llama_path), pad_token_id=0, seed=5)
    env = None
    try:
        served = ray.get([e.__ray_call__.remote(served_at) for e in generation.engines])
        # one engine a node; which bundle lands on which node is Ray's choice
        assert sorted(s["node"] for s in served) == ["node0", "node1"]
        assert generation.http_base_urls == [
            f"http://{s['bound'][0]}:{s['bound'][1]}" for s in served
        ]
        assert all(s["bound"][0] == "127.0.0.1" for s in served)
        assert all(s["wildcard"] == s["node_ip"] for s in served)

        node1 = two_node_ray_cluster.nodes[1].node_id
        env = ray.remote(AgentEnvironment).options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node1, soft=False),
            # the actor imports the agent from this test folder
            runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}},
        ).remote("agent_plugins:two_turn_agent", timeout_s=60.0)
        assert two_node_ray_cluster.nodes_of([env]) == ["node1"]
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
            add_generation_prompt=True,
        )
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        batch = BatchedDataDict(
            message_log=[[{"role": "user", "content": text, "token_ids": ids}] for _ in range(4)],
            extra_env_info=[{"prompt": "What is 2 + 3?", "answer": "5",
                             "metadata": {"name": f"episode{i}"}} for i in range(4)],
            task_name=["agent"] * 4,
        )
        # episodes 0 and 2 go to engine 0, 1 and 3 to engine 1: both nodes serve the agent
        out, metrics = run_agent_rollout(
            generation, batch, tokenizer, {"agent": env}, max_seq_len=256, max_rollout_turns=1
        )
        assert out["env_error"] == [None] * 4
        assert out["total_reward"].tolist() == [1.0] * 4
        assert metrics["agent_calls"] == 2.0 and metrics["agent_unchained_calls"] == 0.0
        for log in out["message_log"]:
            assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
    finally:
        if env is not None:
            ray.kill(env)
        generation.shutdown()
        cluster.shutdown()
