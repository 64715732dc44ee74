"""Starting environments as Ray actors, and stepping them so that a failing one cannot stop a run.

:func:`safe_env_step` is what a rollout calls: an environment that raises, hangs past the
timeout, answers with the wrong shape or whose actor dies during the step scores its samples
0, ends their episodes, and is counted (``rollout/env_errors``: the rules of
``grpo.max_env_error_rate`` apply); the run goes on. An actor that dies (killed, crashed, its
node lost) is restarted by Ray, however often it dies, and a timed-out actor is killed so that
Ray restarts it; a step is never sent twice (an input that kills its environment costs its
samples, not the run). Environments keep their per-sample state in the metadata, so a fresh
actor continues where the old one was; the next step waits for it to be up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Optional, Union

import ray
import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.distributed.ray_actors import kill_actors
from nemo_rl.distributed.worker_groups import passthrough_env
from nemo_rl.environments.common import final_step_return, split_rewards
from nemo_rl.environments.config import EnvConfigs
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.environments.message_wire import pack_message_logs
from nemo_rl.utils.plugins import load_object

logger = logging.getLogger(__name__)

# Ray restarts an environment actor that died, or was killed after a timeout, every time
# (-1: no limit): the samples of the step it died in fail, and an environment that keeps
# failing stops the run by grpo.max_env_error_rate and env_error_patience.
MAX_ACTOR_RESTARTS = -1


def remote_environment(
    cls: type[EnvironmentInterface], num_cpus: float, *args: Any, **kwargs: Any
) -> Any:
    """Start ``cls(*args, **kwargs)`` as a Ray actor reserving ``num_cpus`` logical CPUs,
    with the driver's forwarded environment variables
    (:data:`~nemo_rl.distributed.worker_groups.PASSTHROUGH_ENV_VARS`).

    The actor is restarted by Ray whenever it dies (``MAX_ACTOR_RESTARTS``), so
    :func:`safe_env_step` can also replace a hung one. Ray must be initialised
    (``nemo_rl.distributed.ray_bootstrap.init_ray``).

    Returns:
        The actor handle; call ``handle.step.remote(message_logs, metadata)``.
    """
    actor_cls = ray.remote(num_cpus=num_cpus, max_restarts=MAX_ACTOR_RESTARTS)(cls)
    options = actor_cls.options(runtime_env={"env_vars": passthrough_env()})
    return options.remote(*args, **kwargs)


def create_environments(env_cfgs: Union[EnvConfigs, dict[str, Any]]) -> dict[str, Any]:
    """One environment actor per configured section of ``env``, built-in or plug-in.

    Args:
        env_cfgs: the ``env`` section, as :class:`EnvConfigs` or a plain dict of it.

    Returns:
        ``{task_name: actor handle}`` for every section that is not None.
    """
    if not isinstance(env_cfgs, EnvConfigs):
        env_cfgs = EnvConfigs.model_validate(env_cfgs)
    return {
        name: remote_environment(spec.cls, spec.num_cpus, *spec.args, **spec.kwargs)
        for name, spec in env_cfgs.specs().items()
    }


def shutdown_environments(task_to_env: dict[str, Any]) -> None:
    """Kill every environment actor of ``task_to_env`` and wait for their deaths (in-process
    environments are skipped)."""
    kill_actors([h for h in task_to_env.values() if isinstance(h, ray.actor.ActorHandle)])


def failed_step_return(size: int) -> EnvironmentReturn:
    """What a failed environment step gives its ``size`` samples: reward 0, episode over,
    an empty observation, no metadata, stop strings or answer."""
    return final_step_return(torch.zeros(size, dtype=torch.float32))


def _check_return(result: Any, size: int) -> EnvironmentReturn:
    """Raise ValueError unless ``result`` is an EnvironmentReturn with ``size`` samples (its
    rewards one ``[size]`` tensor or a dict of ``reward/<name>`` ones)."""
    if not isinstance(result, EnvironmentReturn):
        raise ValueError(f"step returned {type(result).__name__}, not EnvironmentReturn")
    lengths = {
        name: len(value) for name, value in result._asdict().items() if name != "rewards"
    }
    wrong = {name: n for name, n in lengths.items() if n != size}
    if wrong:
        raise ValueError(f"step returned fields of the wrong length for {size} samples: {wrong}")
    split_rewards(result.rewards, size)
    return result


class EnvironmentActorDied(RuntimeError):
    """The environment's actor died during the step (Ray restarts it)."""


def _wait_until_up(env: Any, deadline: float, timeout_s: float) -> None:
    """Return once the actor answers (waiting while Ray restarts it).

    Raises:
        TimeoutError: it was still restarting at ``deadline`` (``timeout_s`` after the start).
        ray.exceptions.ActorDiedError: it is dead for good.
    """
    while True:
        try:
            ray.get(env.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(), 0.0))
            return
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"its actor was still restarting after {timeout_s:g} s"
                ) from None
            time.sleep(0.2)


def _actor_step(
    env: Any,
    message_logs: list[LLMMessageLogType],
    metadata: list[dict[str, Any]],
    timeout_s: float,
) -> Any:
    """``env.step`` on a Ray actor within ``timeout_s``, sent once the actor is up.

    Raises:
        ray.exceptions.GetTimeoutError: the step ran past ``timeout_s``.
        TimeoutError: the actor was still restarting when ``timeout_s`` had passed.
        EnvironmentActorDied: the actor died during the step.
    """
    deadline = time.monotonic() + timeout_s
    packed = pack_message_logs(message_logs)  # tensors pickle ~20x slower than numpy arrays
    _wait_until_up(env, deadline, timeout_s)
    ref = env.step_packed.remote(packed, metadata)
    try:
        return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
    except ray.exceptions.RayActorError as err:
        lines = str(err).strip().splitlines()
        raise EnvironmentActorDied(
            f"its actor died during the step (Ray restarts it): {lines[0] if lines else ''}"
        ) from None


def safe_env_step(
    env: Any,
    message_logs: list[LLMMessageLogType],
    metadata: list[Optional[dict[str, Any]]],
    timeout_s: float,
) -> tuple[EnvironmentReturn, Optional[str]]:
    """Step an environment, turning its failures into zero-reward, terminated samples.

    Args:
        env: a Ray actor handle of an environment, or an in-process
            :class:`EnvironmentInterface` (then no timeout applies).
        message_logs: B conversations, each ending with an assistant turn.
        metadata: B per-sample metadata dicts.
        timeout_s: seconds to wait for a Ray actor's answer.

    Returns:
        ``(env_return, error)``: the environment's answer and None, or, when it raised, timed
        out, answered with the wrong shape or its actor died during the step,
        :func:`failed_step_return` and what went wrong in one line (every sample of the call
        failed). A timed-out actor is killed so that Ray restarts it; a call that finds the
        actor restarting waits for it until ``timeout_s`` has passed.
    """
    size = len(message_logs)
    if size == 0:
        return failed_step_return(0), None
    metadata = [dict(m or {}) for m in metadata]
    is_actor = isinstance(env, ray.actor.ActorHandle)
    try:
        if is_actor:
            result = _actor_step(env, message_logs, metadata, timeout_s)
        else:
            result = env.step(message_logs, metadata)
        return _check_return(result, size), None
    except ray.exceptions.GetTimeoutError:
        error = f"no answer within {timeout_s:g} s"
        logger.error(
            "environment %r did not answer %d samples within %g s; scoring them 0 and "
            "restarting the actor", env, size, timeout_s,
        )
        ray.kill(env, no_restart=False)
    except EnvironmentActorDied as err:
        error = str(err)
        logger.error("environment %r: %s; scoring its %d samples 0", env, error, size)
    except Exception as err:  # noqa: BLE001 - any environment failure must not stop the run
        # a Ray actor's exception arrives wrapped, with the remote traceback in its text
        error = repr(getattr(err, "cause", None) or err)
        logger.error("environment %r failed on %d samples: %s; scoring them 0", env, size, error)
    return failed_step_return(size), error


def tasks_with_metrics(env_cfgs: EnvConfigs) -> set[str]:
    """Tasks whose environment class keeps counts (overrides
    :meth:`~EnvironmentInterface.take_metrics`): the only ones :func:`environment_metrics`
    asks, so environments without counts cost no call."""
    tasks = set()
    for task, section in env_cfgs.sections().items():
        path, key, _, _ = section.environment_call()
        cls = load_object(path, f"env.{task}.{key}" if key else f"env.{task}")
        if getattr(cls, "take_metrics", None) is not EnvironmentInterface.take_metrics:
            tasks.add(task)
    return tasks


def environment_metrics(
    task_to_env: dict[str, Any], tasks: Iterable[str], timeout_s: float = 10.0
) -> dict[str, float]:
    """The :meth:`~EnvironmentInterface.take_metrics` of the environments of ``tasks`` as
    ``{"env/<task>/<name>": value}``. An actor that does not answer within ``timeout_s`` (busy
    with a step, restarting, dead) or fails is left out with a warning: its counts of this call
    are lost, the run goes on."""
    metrics: dict[str, float] = {}
    for task in tasks:
        env = task_to_env.get(task)
        if env is None:
            continue
        try:
            if isinstance(env, ray.actor.ActorHandle):
                values = ray.get(env.take_metrics.remote(), timeout=timeout_s)
            else:
                values = env.take_metrics()
        except Exception as err:  # noqa: BLE001 - counts are best effort, never stop the run
            logger.warning("environment %r: no metrics this step (%r)", task, err)
            continue
        metrics.update({f"env/{task}/{name}": float(v) for name, v in values.items()})
    return metrics
