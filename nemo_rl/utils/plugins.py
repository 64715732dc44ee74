"""Plug-ins named in a recipe by import path, ``"package.module:attribute"``.

A recipe names user code (an environment class, a reward function, a data processor) by the
module that defines it and the attribute inside it. :func:`load_object` imports it and
:func:`check_callable` checks that it can be called the way the framework will call it, so a
wrong path or a wrong signature is reported when the recipe is validated, naming the recipe
field, not when the first sample reaches the plug-in inside a Ray actor.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable


class PluginError(ValueError):
    """A plug-in path that does not resolve, or an object of the wrong shape; the message
    names the recipe field and the fix."""


def load_object(path: str, field: str) -> Any:
    """The object at import path ``path`` (``"package.module:attribute"``; the attribute may
    be dotted, ``"module:Class.method"``).

    Args:
        path: the import path.
        field: the recipe field holding ``path`` (named in errors), e.g. ``env.my_task.cls``.

    Raises:
        PluginError: the path is malformed, the module does not import or lacks the attribute.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise PluginError(
            f"{field}={path!r} is not an import path; write 'package.module:name' (the module "
            "must be importable: on PYTHONPATH or installed)"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(
            f"{field}={path!r}: cannot import module {module_name!r} ({err}); put its folder on "
            "PYTHONPATH or install its package"
        ) from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise PluginError(
                f"{field}={path!r}: {module_name!r} has no attribute {attribute!r} "
                f"(it defines: {', '.join(public[:20]) or 'nothing public'})"
            )
        obj = getattr(obj, part)
    return obj


def check_callable(obj: Any, num_args: int, field: str, path: str, signature: str) -> None:
    """Raise unless ``obj`` can be called with ``num_args`` positional arguments.

    Args:
        obj: the loaded object.
        num_args: positional arguments the framework passes.
        field, path: the recipe field and its value, for the message.
        signature: the expected call, shown in the message, e.g. ``"fn(prompt, response,
            answer, metadata) -> float"``.

    Raises:
        PluginError: ``obj`` is not callable or does not accept ``num_args`` arguments.
    """
    if not callable(obj):
        raise PluginError(
            f"{field}={path!r} is a {type(obj).__name__}, not a function; expected {signature}"
        )
    try:
        inspect.signature(obj).bind(*range(num_args))
    except TypeError as err:
        raise PluginError(
            f"{field}={path!r} cannot be called as {signature}: {err}"
        ) from None
    except ValueError:  # builtins without a signature: accept, the call will tell
        return


def load_function(path: str, num_args: int, field: str, signature: str) -> Callable[..., Any]:
    """:func:`load_object` then :func:`check_callable`: a function to call with ``num_args``
    positional arguments."""
    obj = load_object(path, field)
    check_callable(obj, num_args, field, path, signature)
    return obj
