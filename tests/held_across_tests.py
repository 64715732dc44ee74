"""Expensive test resources (a local Ray cluster, a vLLM engine) kept across consecutive tests.

A fixture that calls :func:`hold` starts its resource with the first test that uses it and keeps
it while the following tests use that fixture too (across modules); the root conftest's
``pytest_runtest_teardown`` calls :func:`release_unused`, which stops it as soon as the next test
does not use the fixture, so no other test sees it. Importable as ``held_across_tests``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ContextManager

_held: dict[str, tuple[contextlib.ExitStack, Any]] = {}


def hold(fixture_name: str, start: Callable[[], ContextManager[Any]]) -> Any:
    """The value of the running ``start()`` context held for ``fixture_name``, entering it first
    if none is held."""
    if fixture_name not in _held:
        stack = contextlib.ExitStack()
        _held[fixture_name] = (stack, stack.enter_context(start()))
    return _held[fixture_name][1]


def release_unused(next_fixture_names: list[str] | None) -> None:
    """Exit, newest first, the held contexts whose fixture the next test (``None``: no next test)
    does not use."""
    for name in reversed(list(_held)):
        if next_fixture_names is None or name not in next_fixture_names:
            _held.pop(name)[0].close()
