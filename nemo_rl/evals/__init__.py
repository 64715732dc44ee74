"""Evaluation: ``nemo-rl eval --config RECIPE`` (see :mod:`nemo_rl.evals.eval`)."""
