# The two Quick start commands. Each installs what it needs first (idempotent).
VENV ?= .venv
export NEMO_RL_VENV := $(VENV)

.PHONY: install bytecode demo test

install:
	bash scripts/setup_env.sh

# The project's own .pyc files (the installed packages get theirs at install). Where
# PYTHONDONTWRITEBYTECODE is set (CI machines) Python writes none itself, so every new process
# (Ray workers, vLLM engines, spawned ranks) would compile the project's modules again.
bytecode: install
	$(VENV)/bin/python -m compileall -q nemo_rl megatron_bridge tests benchmarks

demo: bytecode
	$(VENV)/bin/nemo-rl grpo --config configs/grpo_tiny_cpu.yaml

test: bytecode
	bash scripts/setup_slurm.sh
	$(VENV)/bin/python -m pytest tests
