"""StopGuard: a stop signal is caught once (a second one exits at once), handlers are restored,
and the save-by estimate stops when another step and a save would pass the limit."""

import os
import signal

import pytest

from nemo_rl.utils.run_stop import RESUMABLE_EXIT_CODE, RunStopped, StopGuard


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_signal_requests_a_stop_and_a_second_one_exits_now():
    before = signal.getsignal(signal.SIGUSR1)
    with StopGuard(["SIGUSR1"], None) as guard:
        assert guard.stop_reason() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # handled before the next bytecode
        assert guard.stop_reason() == "received SIGUSR1"
        with pytest.raises(SystemExit) as second:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert second.value.code == 128 + signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before


def test_save_by_stops_when_a_step_and_a_save_no_longer_fit():
    clock = FakeClock()
    with StopGuard([], must_save_by_s=100, clock=clock) as guard:
        clock.now += 30
        guard.step_finished(30)
        # no save timed yet: a save is guessed as long as the longest step
        assert guard.stop_reason() is None  # 30 + 30 + 30 <= 100
        clock.now += 11
        guard.step_finished(11)
        assert "another step (30 s) and a save (30 s)" in guard.stop_reason()  # 41 + 60 > 100
    clock = FakeClock()
    with StopGuard([], must_save_by_s=100, clock=clock) as guard:
        clock.now += 30
        guard.step_finished(30)
        guard.save_finished(5)
        clock.now += 5
        assert guard.stop_reason() is None  # 35 + 30 + 5 <= 100
        clock.now += 31
        assert guard.stop_reason() is not None  # 66 + 30 + 5 > 100


def test_run_stopped_is_a_resumable_exit():
    stop = RunStopped("received SIGTERM", 7)
    assert isinstance(stop, SystemExit) and stop.code == RESUMABLE_EXIT_CODE == 75
    assert "stopped after step 7 (received SIGTERM)" in str(stop)
