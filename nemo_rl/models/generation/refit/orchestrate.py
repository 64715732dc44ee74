"""The driver's side of a refit: one call that moves the policy's weights into the engines.

The driver sends only control messages (refit info, the stream's buffer handle and version,
Ray object refs); weight bytes go from the trainer's rank 0 to the engines directly, through
shared buffers (colocated) or a broadcast group (not colocated).

Colocated sequence: ``policy.offload_before_refit`` (optimizer state and gradients off the
device), ``generation.prepare_for_generation`` (engines awake), the bucket stream, the engines'
``commit_weight_update``, ``policy.finish_weights_ipc``, ``policy.offload_after_refit``. The
verbs are those of :mod:`.interfaces`; the settings (bucket size, export dtype, timeout,
checksums) are the policy config's (``PolicyConfig.refit_settings``). The sender packs the buckets one after another into their
windows of one shared buffer of the stream's size, in one call, while the engines check each
bucket where it lies as soon as its record in that buffer says it is packed (one call per
engine; the driver is never between the two), and at commit the engines load straight from
that buffer: every byte is copied once on its way into the engine. The commit (or the abort)
is the engines' acknowledgement that the buffer may be refilled: the sender's next stream
starts only after it.

Either way the engines check every bucket before loading, and load only when every engine
has checked the whole refit (two-phase): a failure anywhere before that aborts the refit on all
engines, which keep their previous weights and version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from nemo_rl.models.generation.refit.buckets import StreamLayout
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.interfaces import RefitSettings
from nemo_rl.utils.timer import Timer

if TYPE_CHECKING:
    from nemo_rl.models.generation.vllm import VllmGeneration
    from nemo_rl.models.policy.lm_policy import Policy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefitResult:
    """What one refit did.

    Attributes:
        version: the weight version every engine now holds.
        nbytes: bytes streamed (the weights in the export dtype, plus alignment padding).
        num_buckets: buckets the stream was cut into.
        seconds: wall times: ``total_s`` (the whole call), ``stream_s`` (export + transfer,
            as the driver saw it), ``commit_s`` (engines loading); the sender's ``export_s``
            (waiting for the export), ``pack_s`` (copying and checksumming) and ``send_s``
            (its own wall time from opening the stream to the last bucket packed or sent; the
            rest of ``stream_s`` is the Ray calls and the engines' last checks); and, slowest
            engine, ``receive_s`` (receiving and checking the buckets), ``attach_s`` (mapping
            the sender's buffer, colocated: 0 when kept from the last refit) and ``load_s``
            (the engine's loader).
    """

    version: int
    nbytes: int
    num_buckets: int
    seconds: dict[str, float]


def refit_policy_generation(
    policy: Policy, generation: VllmGeneration, colocated: bool
) -> RefitResult:
    """Copy the policy's current weights into every generation engine.

    Weights are exported in the engines' precision; bucket size, timeout and checksums are the
    policy config's ``refit_*`` fields. The first call exports the refit info once and hands it
    to the engines (which check it against their checkpoint); a non-colocated first call also
    forms the broadcast group.

    Args:
        policy: the trained policy (its rank 0 sends).
        generation: the engines to update.
        colocated: True when both share devices (shared-memory / CUDA IPC buffers),
            False for a broadcast over a process group.

    Returns:
        The new version, the bytes and buckets streamed, and where the time went.

    Raises:
        RefitError: the refit failed, or the policy exports another dtype than the engines
            run; the engines keep their previous weights and version.
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
    info = policy.prepare_refit_info()
    assert info is not None  # rank 0 always exports
    if generation.refit_info != info:
        generation.prepare_refit_info(info)
    layout = StreamLayout(info, settings.bucket_bytes)
    timer = Timer()
    if colocated:
        policy.offload_before_refit()
        generation.prepare_for_generation()
        try:
            with timer.time("stream_s"):
                _stream_ipc(policy, generation, settings.timeout_s)
            with timer.time("commit_s"):
                engines = _commit(generation)
        finally:  # the engines are done with the sender's buffer (committed or aborted)
            sender = _finish_ipc(policy)
        policy.offload_after_refit()
    else:
        _ensure_group(policy, generation, settings.timeout_s)
        with timer.time("stream_s"):
            sender = _stream_collective(policy, generation, settings)
        with timer.time("commit_s"):
            engines = _commit(generation)
    seconds = {
        "total_s": time.perf_counter() - start,
        **timer.summary(),
        **{("send_s" if k == "stream_s" else k): v for k, v in sender.items()},
        "receive_s": max(float(e["receive_s"]) for e in engines),
        "attach_s": max(float(e["attach_s"]) for e in engines),
        "load_s": max(float(e["load_s"]) for e in engines),
    }
    return RefitResult(int(engines[0]["version"]), layout.total_bytes, layout.num_buckets, seconds)


def _wait(refs: Sequence[ray.ObjectRef], timeout_s: float, what: str) -> list[Any]:
    """Results of ``refs`` in their order, once all finished; raises RefitError naming every
    failure."""
    refs = list(refs)
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    failures = [f"{what} did not finish within {timeout_s:g} s"] if pending else []
    finished = set(ready)
    results = []
    for ref in refs:  # in the callers' order
        if ref not in finished:
            continue
        try:
            results.append(ray.get(ref))
        except Exception as err:  # a worker's error or its death
            failures.append(_describe(err))
    if failures:
        raise RefitError("; ".join(failures))
    return results


def _describe(err: BaseException) -> str:
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _abort(generation: VllmGeneration) -> None:
    try:
        ray.get(generation.refit("abort_weight_update"))
    except Exception as err:  # an engine that died cannot abort; the others did
        logger.warning("aborting the refit on the engines failed: %s", err)


def _stream_ipc(policy: Policy, generation: VllmGeneration, timeout_s: float) -> None:
    """Have the sender pack every bucket into its shared buffer and every engine check it;
    returns once all are checked. Raises RefitError, after aborting the engines, naming the
    first bucket that failed."""
    try:
        # One call per side for the whole stream: the sender publishes each bucket's record
        # in the shared buffer once it is packed and the engines poll those records, so no
        # bucket waits for a Ray hand-off; the engines watch the sender's future to notice
        # a sender that fails.
        stream, packed = policy.stream_weights_ipc()
        checked = generation.refit("receive_weights_ipc_stream", stream, [packed[0]], timeout_s)
        _wait(checked + packed, timeout_s * len(stream.plan), "the refit stream")
    except Exception as err:
        _abort(generation)
        if isinstance(err, RefitError):
            raise
        raise RefitError(f"the colocated refit stream failed: {_describe(err)}") from err


def _finish_ipc(policy: Policy) -> dict[str, float]:
    """End the sender's stream; its timings (empty when the sender died: its buffer is
    swept on the next create)."""
    try:
        return policy.finish_weights_ipc() or {}
    except Exception as err:
        logger.warning("closing the refit stream on the policy failed: %s", err)
        return {}


def _ensure_group(policy: Policy, generation: VllmGeneration, timeout_s: float) -> None:
    """Form the broadcast group (trainer rank 0 + every engine) unless it exists."""
    if generation.refit_group is not None and generation.refit_group == policy.refit_group:
        return
    ip, port = policy.refit_collective_address()
    world_size = 1 + generation.num_replicas
    refs = policy.init_collective(ip, port, world_size)
    refs += generation.init_collective(ip, port, world_size, timeout_s)
    try:
        _wait(refs, timeout_s + 30, "forming the refit group")
    except RefitError:
        _close_group(policy, generation)
        raise


def _close_group(policy: Policy, generation: VllmGeneration) -> None:
    for side in (policy, generation):
        try:
            side.close_collective()
        except Exception as err:  # a dead side; the live ones have left
            logger.warning("leaving the refit group failed: %s", err)


def _stream_collective(
    policy: Policy, generation: VllmGeneration, settings: RefitSettings
) -> dict[str, float]:
    """Broadcast every bucket over the refit group; the sender's timings."""
    send = policy.broadcast_weights_for_collective()
    receive = generation.refit("update_weights_from_collective", settings.bucket_bytes)
    try:
        results = _wait(send + receive, settings.timeout_s, "the refit broadcast")
    except RefitError:
        _abort(generation)
        # after a failed broadcast the group may be out of step or broken: form it anew
        _close_group(policy, generation)
        raise
    return results[0] or {}


def _commit(generation: VllmGeneration) -> list[dict[str, float | int]]:
    """Every engine loads its staged refit; all must end on the same version."""
    try:
        results = ray.get(generation.refit("commit_weight_update"))
    except Exception as err:
        _abort(generation)
        raise RefitError(f"committing the refit failed: {_describe(err)}") from err
    versions = {int(r["version"]) for r in results}
    if len(versions) != 1:
        raise RefitError(f"the engines committed different versions: {sorted(versions)}")
    return results
