"""Timer: nested phases, accumulation, reset, listeners."""

import pytest

from nemo_rl.utils.timer import Timer


def test_nested_phases_are_separate_entries_and_outer_includes_inner():
    timer = Timer()
    with timer.time("step"):
        assert timer.active_phases == ["step"]
        with timer.time("generation"):
            assert timer.active_phases == ["step", "generation"]
        with timer.time("training"):
            pass
    summary = timer.summary()
    assert list(summary) == ["generation", "training", "step"]
    assert summary["step"] >= summary["generation"] + summary["training"]
    assert timer.active_phases == []


def test_repeated_phase_accumulates_and_reset_clears():
    timer = Timer()
    with timer.time("env"):
        pass
    first = timer.summary()["env"]
    with timer.time("env"):
        pass
    assert timer.summary()["env"] >= first
    timer.reset()
    assert timer.summary() == {}


def test_phase_recorded_when_body_raises():
    timer = Timer()
    with pytest.raises(RuntimeError), timer.time("generation"):
        raise RuntimeError("boom")
    assert "generation" in timer.summary()
    assert timer.active_phases == []


def test_same_name_cannot_nest():
    timer = Timer()
    with timer.time("a"), pytest.raises(ValueError, match="'a' is already running"):
        with timer.time("a"):
            pass


def test_listeners_see_start_and_stop():
    timer = Timer()
    events = []

    def listener(event, name, seconds):
        events.append((event, name))

    timer.add_listener(listener)
    with timer.time("outer"), timer.time("inner"):
        pass
    timer.remove_listener(listener)
    with timer.time("ignored"):
        pass
    assert events == [
        ("start", "outer"),
        ("start", "inner"),
        ("stop", "inner"),
        ("stop", "outer"),
    ]
