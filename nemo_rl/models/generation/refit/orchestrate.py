"""The driver's side of a refit: one call that moves the policy's weights into the engines.

The driver sends only control messages (refit info, ring handles, Ray object refs); weight
bytes go from the policy ranks to the engines directly, through rings of a few bucket-sized
slots on the engines' own nodes (colocated) or a broadcast group (not colocated).

Colocated sequence: ``policy.offload_before_refit`` (optimizer state and gradients off the
device), ``generation.prepare_for_generation`` (engines awake), the refit plan (:mod:`.plan`:
which policy rank writes the ring of each node, or on GPU of each device, and which engine
ranks read it), ``prepare_weights_for_ipc`` on every policy rank (the writers open their
rings), the engines' ``update_weights_from_ipc_handles`` (each loads from the ring of its own
node as the buckets arrive) while every policy rank runs ``get_weights_ipc_handles`` over the
whole plan (the export, and the writers' packing), then ``finish_weights_ipc`` and
``policy.offload_after_refit``. Not colocated: the broadcast group (formed once), then
``broadcast_weights_for_collective`` on the policy while every engine runs
``update_weights_from_collective``.

An engine takes the stream's version once it loaded all of it. A refit that fails anywhere (a
corrupt bucket, a participant that died or timed out) is started over, as a new version, up to
``policy.refit_max_retries`` times; engines whose load broke off refuse to generate meanwhile.
Past that, :class:`~.errors.RefitError` says what failed on each attempt. An engine that died
during an attempt is restarted before the next one
(:meth:`~nemo_rl.models.generation.vllm.VllmGeneration.restart_dead_engines`, bounded by
``policy.generation.max_engine_restarts``); that attempt is not counted as a retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from nemo_rl.models.generation.lora_serving import AdapterServing
from nemo_rl.models.generation.refit.buckets import StreamLayout
from nemo_rl.models.generation.refit.errors import RefitError, RefitFailed
from nemo_rl.models.generation.refit.interfaces import RefitSettings
from nemo_rl.models.generation.refit.plan import RingAssignment, engine_reads, plan_rings
from nemo_rl.distributed.memory_plan import RING_SLOTS
from nemo_rl.distributed.worker_faults import node_description
from nemo_rl.utils.errors import error_line
from nemo_rl.utils.timer import Timer

if TYPE_CHECKING:
    from nemo_rl.models.generation.vllm import VllmGeneration
    from nemo_rl.models.policy.lm_policy import Policy

logger = logging.getLogger(__name__)

# How the bound of a refit's stream follows from the config.
_STREAM_BOUND = "policy.refit_timeout_s per bucket, for each bucket and one more"


@dataclass(frozen=True)
class RefitResult:
    """What one refit did.

    Attributes:
        version: the weight version every engine now holds.
        nbytes: bytes streamed (the weights in the export dtype, plus alignment padding).
        num_buckets: buckets the stream was cut into.
        staging_bytes: bytes one ring stages (its slots), per ring.
        attempts: tries it took (1: no retry).
        seconds: wall times of the successful attempt: ``total_s`` (the whole call, retries
            included), ``stream_s`` (export, transfer and load, as the driver saw them); the
            slowest ring writer's ``export_s`` (waiting for the export), ``pack_s`` (copying
            and checksumming) and ``send_s`` (its stream, open to last bucket); the slowest
            engine's ``load_s`` (its whole load) and ``wait_s`` (of it, waiting for buckets).
        engines: per engine, ``node`` (its Ray node), ``rings`` (writer and node of the ring
            each of its ranks read) and ``path`` (how it loaded: "in_place" or "reload").
    """

    version: int
    nbytes: int
    num_buckets: int
    staging_bytes: int
    attempts: int
    seconds: dict[str, float]
    engines: list[dict[str, Any]] = field(default_factory=list)


def refit_policy_generation(
    policy: Policy, generation: VllmGeneration, colocated: bool
) -> RefitResult:
    """Copy the policy's current weights into every generation engine.

    Weights are exported in the engines' precision; bucket size, timeout, checksums and
    retries are the policy config's ``refit_*`` fields. The first call exports the refit info
    once and hands it to the engines (which check it against their checkpoint); a
    non-colocated first call also forms the broadcast group.

    Args:
        policy: the trained policy.
        generation: the engines to update.
        colocated: True when the engines run on the policy's bundles (rings per node or
            device), False for a broadcast over a process group.

    Returns:
        The new version, the bytes and buckets streamed, where the time went, and per engine
        which rings it read.

    Raises:
        RefitFailed: every attempt failed (the run stops with its one message).
        RefitError: the policy exports another dtype than the engines run, or adapters where
            the engines take weights (or the other way round, or other adapters).
    """
    start = time.perf_counter()
    settings = policy.cfg.refit_settings()
    engine_dtype = generation.config.vllm_cfg.precision
    if settings.dtype != engine_dtype:
        raise RefitError(
            f"the policy exports its weights in {settings.dtype} "
            f"(policy.generation.vllm_cfg.precision) but the engines run in {engine_dtype}: "
            "build both from the same generation config"
        )
    if policy.cfg.adapter_serving() != generation.adapters:
        raise RefitError(
            f"the policy streams {_stream_kind(policy.cfg.adapter_serving())} but the engines "
            f"serve {_stream_kind(generation.adapters)} (policy.generation.vllm_cfg.lora_refit):"
            " build the engines with adapters=policy config's adapter_serving()"
        )
    info = policy.prepare_refit_info()
    if generation.refit_info != info:
        generation.prepare_refit_info(info)
    layout = StreamLayout(info, settings.bucket_bytes)
    failures: list[str] = []
    attempt = 0
    while len(failures) <= settings.max_retries:
        attempt += 1
        timer = Timer()
        try:
            with timer.time("stream_s"):
                if colocated:
                    senders, engines = _refit_colocated(policy, generation, layout, settings)
                else:
                    senders, engines = _refit_collective(policy, generation, layout, settings)
        except RefitError as err:
            logger.warning("weight refit attempt %d failed: %s", attempt, err)
            if not generation.restart_dead_engines():
                failures.append(f"attempt {attempt}: {err}")
            continue
        versions = {int(e["version"]) for e in engines}
        if len(versions) != 1:
            raise RefitError(f"the engines loaded different versions: {sorted(versions)}")
        seconds = {
            "total_s": time.perf_counter() - start,
            **timer.summary(),
            **_slowest(senders, ("export_s", "pack_s")),
            "send_s": max((float(s.get("stream_s", 0.0)) for s in senders), default=0.0),
            **_slowest(engines, ("load_s", "wait_s")),
        }
        return RefitResult(
            versions.pop(), layout.total_bytes, layout.num_buckets,
            RING_SLOTS * layout.slot_bytes, attempt, seconds,
            [{k: e[k] for k in ("node", "rings", "path")} for e in engines],
        )
    raise RefitFailed(
        f"the weight refit failed {len(failures)} times (policy.refit_max_retries="
        f"{settings.max_retries}): " + "; ".join(failures)
    )


def _stream_kind(adapters: AdapterServing | None) -> str:
    return "every weight" if adapters is None else f"LoRA adapters ({adapters})"


def _slowest(results: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, float]:
    return {k: max((float(r.get(k, 0.0)) for r in results), default=0.0) for k in keys}


def _participants(policy: Policy, generation: VllmGeneration) -> list[str]:
    """Who answers the futures of a refit step: every engine, then every policy rank (the
    order of ``loads + sends``), each named with its node."""
    nodes = policy.worker_group.worker_places(per_device=False)
    return [generation.engine_name(e) for e in range(generation.num_replicas)] + [
        f"policy worker rank {rank} on {node_description(node)}"
        for rank, node in enumerate(nodes)
    ]


def _wait(
    refs: Sequence[ray.ObjectRef], names: Sequence[str], timeout_s: float, what: str, bound: str
) -> list[Any]:
    """Results of ``refs`` (answered by ``names``, one each) in their order, once all
    finished; raises RefitError naming every failure, and those that gave no result within
    ``timeout_s`` (``bound``: how the config sets it)."""
    refs = list(refs)
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    late = [name for name, ref in zip(names, refs) if ref in pending]
    failures = (
        [f"{what}: {'; '.join(late)} gave no result within {timeout_s:g} s ({bound})"]
        if late else []
    )
    finished = set(ready)
    results = []
    for ref in refs:  # in the callers' order
        if ref not in finished:
            continue
        try:
            results.append(ray.get(ref))
        except Exception as err:  # a worker's error or its death
            failures.append(error_line(err))
    if failures:
        raise RefitError("; ".join(dict.fromkeys(failures)))
    return results


def colocated_plan(policy: Policy, generation: VllmGeneration) -> list[RingAssignment]:
    """The rings of a colocated refit: one per node on CPU, one per GPU on GPU (:mod:`.plan`)."""
    per_device = generation.worker_group.cluster.use_gpus
    places = generation.worker_group.worker_places(per_device)
    tp = generation.layout.tensor_parallel_size
    return plan_rings(
        policy.worker_group.worker_places(per_device),
        [places[e * tp : (e + 1) * tp] for e in range(generation.num_replicas)],
    )


def _refit_colocated(
    policy: Policy, generation: VllmGeneration, layout: StreamLayout, settings: RefitSettings
) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """One colocated attempt: the writers' timings and the engines' reports."""
    policy.offload_before_refit()
    generation.prepare_for_generation()
    rings = colocated_plan(policy, generation)
    tp = generation.layout.tensor_parallel_size
    try:
        streams = policy.prepare_weights_for_ipc({r.writer: len(r.readers) for r in rings})
        loads = [
            engine.refit.remote(
                "update_weights_from_ipc_handles",
                [(streams[ring.writer], reader) for ring, reader in engine_reads(rings, e, tp)],
                settings.timeout_s,
            )
            for e, engine in enumerate(generation.engines)
        ]
        keys = [name for bucket in layout.plan() for name in bucket]
        sends = policy.refit("get_weights_ipc_handles", keys)
        results = _wait(
            loads + sends, _participants(policy, generation),
            settings.timeout_s * (layout.num_buckets + 1), "the refit stream", _STREAM_BOUND,
        )
    finally:  # the engines are done with the rings (loaded or gave up)
        _finish_ipc(policy)
    policy.offload_after_refit()
    engines, senders = results[: len(loads)], results[len(loads) :]
    return [s for s in senders if s], engines


def _finish_ipc(policy: Policy) -> None:
    try:
        policy.finish_weights_ipc()
    except Exception as err:  # a dead rank; the live ones have ended their stream
        logger.warning("ending the refit stream on the policy failed: %s", err)


def _ensure_group(policy: Policy, generation: VllmGeneration, timeout_s: float) -> None:
    """Form the broadcast group (trainer rank 0 + every engine) unless it exists."""
    if generation.refit_group is not None and generation.refit_group == policy.refit_group:
        return
    ip, port = policy.refit_collective_address()
    world_size = 1 + generation.num_replicas
    refs = policy.init_collective(ip, port, world_size)
    refs += generation.init_collective(ip, port, world_size, timeout_s)
    try:
        names = _participants(policy, generation)
        # the policy's futures come first here
        names = names[generation.num_replicas :] + names[: generation.num_replicas]
        _wait(refs, names, timeout_s + 30, "forming the refit group",
              "policy.refit_timeout_s + 30 s")
    except RefitError:
        _close_group(policy, generation)
        raise


def _close_group(policy: Policy, generation: VllmGeneration) -> None:
    for side in (policy, generation):
        try:
            side.close_collective()
        except Exception as err:  # a dead side; the live ones have left
            logger.warning("leaving the refit group failed: %s", err)


def _refit_collective(
    policy: Policy, generation: VllmGeneration, layout: StreamLayout, settings: RefitSettings
) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """One broadcast attempt: the sender's timings and the engines' reports."""
    _ensure_group(policy, generation, settings.timeout_s)
    sends = policy.broadcast_weights_for_collective()
    loads = generation.refit(
        "update_weights_from_collective", settings.bucket_bytes, settings.timeout_s
    )
    try:
        results = _wait(
            loads + sends, _participants(policy, generation),
            settings.timeout_s * (layout.num_buckets + 1), "the refit broadcast", _STREAM_BOUND,
        )
    except RefitError:
        # after a failed broadcast the group may be out of step or broken: form it anew
        _close_group(policy, generation)
        raise
    engines, senders = results[: len(loads)], results[len(loads) :]
    return [s for s in senders if s], engines
