# The two Quick start commands. Each installs what it needs first (idempotent).
VENV ?= .venv
export NEMO_RL_VENV := $(VENV)

.PHONY: install demo test

install:
	bash scripts/setup_env.sh

demo: install
	$(VENV)/bin/nemo-rl grpo --config configs/grpo_tiny_cpu.yaml

test: install
	bash scripts/setup_slurm.sh
	$(VENV)/bin/python -m pytest tests
