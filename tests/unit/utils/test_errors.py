"""Which failures the ``nemo-rl`` command reports in one line, and with which exit code."""

from __future__ import annotations

from nemo_rl.utils.errors import InputError, ResumableFault, RunFault, reported_error_of


class _RayTaskError(RuntimeError):
    """Stands for Ray's wrapper of a remote error, which keeps it as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"remote traceback ... {cause}")
        self.cause = cause


def test_faults_carry_their_exit_code() -> None:
    assert RunFault.exit_code == 1 and ResumableFault.exit_code == 75
    assert issubclass(ResumableFault, RunFault)


def test_the_reported_error_is_found_through_ray_and_through_raise_from() -> None:
    fault = ResumableFault("vLLM engine 0 died")
    assert reported_error_of(fault) is fault
    assert reported_error_of(_RayTaskError(fault)) is fault
    # a thread's error handed on by ``raise ... from`` (async GRPO's collector)
    try:
        try:
            raise fault
        except ResumableFault as err:
            raise RuntimeError("the rollout collector failed") from err
    except RuntimeError as handed_on:
        assert reported_error_of(handed_on) is fault
    bad_input = InputError("row 3 has no prompt")
    assert reported_error_of(_RayTaskError(_RayTaskError(bad_input))) is bad_input
    assert reported_error_of(RuntimeError("a bug")) is None
    try:
        try:
            raise KeyError("x")
        except KeyError as err:
            raise ValueError("still a bug") from err
    except ValueError as bug:
        assert reported_error_of(bug) is None
