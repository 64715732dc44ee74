"""tests/held_across_tests.py: a held context starts once, is reused while the next tests use its
fixture, and exits (newest first) once the next test does not, or when no test follows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import held_across_tests
from held_across_tests import hold, release_unused


def test_held_context_is_reused_while_used_then_exited(monkeypatch) -> None:
    monkeypatch.setattr(held_across_tests, "_held", {})
    events: list[str] = []

    @contextlib.contextmanager
    def resource(name: str) -> Iterator[str]:
        events.append(f"start {name}")
        yield name
        events.append(f"stop {name}")

    assert hold("ray", lambda: resource("ray")) == "ray"
    assert hold("engine", lambda: resource("engine")) == "engine"
    release_unused(["ray", "engine", "tmp_path"])  # the next test uses both: both stay
    assert hold("ray", lambda: resource("ray again")) == "ray"
    assert events == ["start ray", "start engine"]

    release_unused(["ray"])
    assert events == ["start ray", "start engine", "stop engine"]
    release_unused(None)
    assert events == ["start ray", "start engine", "stop engine", "stop ray"]
    assert hold("ray", lambda: resource("ray")) == "ray"  # started afresh after its release
    assert events[-1] == "start ray"
    release_unused([])
    assert events[-1] == "stop ray"


def test_release_newest_first_when_no_test_follows(monkeypatch) -> None:
    monkeypatch.setattr(held_across_tests, "_held", {})
    events: list[str] = []

    @contextlib.contextmanager
    def resource(name: str) -> Iterator[None]:
        yield
        events.append(name)

    hold("cluster", lambda: resource("cluster"))
    hold("engine_on_it", lambda: resource("engine_on_it"))
    release_unused(None)
    assert events == ["engine_on_it", "cluster"]
