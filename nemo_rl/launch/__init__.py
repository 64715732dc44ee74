"""Launchers: Ray on slurm (``nemo-rl launch slurm``) and on one machine (``nemo-rl launch local``).

The shell side lives in ``launchers/`` at the repository root (see its README); this package
validates the options, renders and submits the slurm job script, and checks from inside a job
that every Ray node registered.
"""
