"""How an ``env`` section becomes a runnable environment: one mechanism for built-ins and plug-ins.

Every section names its environment class by import path (a built-in section through its
config class's ``environment_class``, a plug-in through ``cls``, a reward function through the
built-in :class:`~nemo_rl.environments.reward_fn_environment.RewardFnEnvironment`).
:func:`resolve_environment` imports the class, checks its shape, and resolves the data
processor of the task's rows (the section's ``processor``, else the class's
``default_processor``) and the row fields the class declares (``required_fields``). The recipe
validation calls it for every section, so a wrong path fails before Ray starts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nemo_rl.data.interfaces import TaskDataProcessFnCallable
from nemo_rl.data.processors import get_processor
from nemo_rl.environments.interfaces import EnvironmentInterface
from nemo_rl.utils.plugins import PluginError, load_object

if TYPE_CHECKING:
    from nemo_rl.environments.config import EnvActorConfig


@dataclass(frozen=True)
class EnvironmentSpec:
    """One task's environment, resolved.

    Attributes:
        task_name: the section's name (rows with this ``task_name`` go to this environment).
        cls: the environment class.
        args, kwargs: what the class is called with.
        num_cpus: logical Ray CPUs of its actor.
        processor: turns the task's rows into prompts.
        required_fields: fields every row of the task must have (canonical names: ``prompt``,
            ``answer`` after the ``data.prompt_key``/``answer_key`` mapping).
        returns_answers: the environment returns the answers it extracts (what maj@k votes
            over; :meth:`EnvironmentInterface.returns_answers_with`).
        reward_components: the ``reward/<name>`` keys of its several rewards, () for one
            reward, None when unknown before it runs
            (:meth:`EnvironmentInterface.reward_components_with`).
    """

    task_name: str
    cls: type[EnvironmentInterface]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_cpus: float = 0.25
    processor: TaskDataProcessFnCallable | None = None
    required_fields: tuple[str, ...] = ()
    returns_answers: bool = False
    reward_components: tuple[str, ...] | None = ()


def _check_environment_class(obj: Any, where: str, path: str, args: tuple, kwargs: dict) -> None:
    """Raise PluginError unless ``obj`` is an EnvironmentInterface class taking the call."""
    if not (inspect.isclass(obj) and issubclass(obj, EnvironmentInterface)):
        raise PluginError(
            f"{where}={path!r} is not a subclass of "
            "nemo_rl.environments.interfaces.EnvironmentInterface; subclass it and implement "
            "step() and global_post_process_and_metrics()"
        )
    if inspect.isabstract(obj):
        missing = sorted(getattr(obj, "__abstractmethods__", ()))
        raise PluginError(f"{where}={path!r} leaves abstract methods unimplemented: {missing}")
    try:
        inspect.signature(obj).bind(*args, **kwargs)
    except TypeError as err:
        keys = ", ".join(sorted(kwargs)) or "none"
        raise PluginError(
            f"{where}={path!r} cannot be started with the section's keys ({keys}): {err}; "
            "fix the keys or the class's __init__"
        ) from None


def resolve_environment(task_name: str, section: EnvActorConfig) -> EnvironmentSpec:
    """The environment, processor and required row fields of section ``env.<task_name>``.

    Raises:
        PluginError: a path does not import, the class is not an EnvironmentInterface or does
            not take the section's keys, or the processor does not resolve (each message names
            the recipe field).
    """
    path, key, args, kwargs = section.environment_call()
    where = f"env.{task_name}.{key}" if key else f"env.{task_name}"
    cls = load_object(path, where)
    _check_environment_class(cls, where, path, args, kwargs)
    cls.check_arguments(where, *args, **kwargs)
    processor_name = section.processor or cls.default_processor
    processor_field = f"env.{task_name}.processor"
    try:
        processor = get_processor(processor_name, processor_field)
    except KeyError as err:
        raise PluginError(err.args[0]) from None
    return EnvironmentSpec(
        task_name=task_name,
        cls=cls,
        args=args,
        kwargs=kwargs,
        num_cpus=section.num_cpus,
        processor=processor,
        required_fields=tuple(cls.required_fields),
        returns_answers=cls.returns_answers_with(*args, **kwargs),
        reward_components=cls.reward_components_with(*args, **kwargs),
    )
