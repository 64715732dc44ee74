"""The driver never imports megatron-core: it imports the policy worker's class to start its
Ray actors, and the worker's megatron-core parts load in the worker on first use."""

from __future__ import annotations

from fresh_process import last_line_printed

DRIVER_MODULES = (
    "nemo_rl.cli",
    "nemo_rl.algorithms.grpo",
    "nemo_rl.algorithms.sft",
    "nemo_rl.algorithms.dpo",
    "nemo_rl.algorithms.rm",
    "nemo_rl.algorithms.distillation",
    "nemo_rl.models.policy.lm_policy",
    "nemo_rl.models.policy.tq_policy",
    "nemo_rl.models.policy.workers.megatron_policy_worker",
)


def test_the_driver_modules_leave_megatron_core_unimported():
    code = (
        "import importlib, sys\n"
        f"for name in {DRIVER_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker\n"
        "print(sorted(m for m in sys.modules if m.startswith('megatron.core')))\n"
    )
    assert last_line_printed(code) == "[]"


def test_the_workers_parts_load_on_first_use():
    from nemo_rl.models.policy.workers import megatron as parts

    assert parts.train_step.__name__ == "nemo_rl.models.policy.workers.megatron.train_step"
    assert callable(parts.model_setup.setup_policy_model)
