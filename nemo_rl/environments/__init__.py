"""Environments that judge (and answer) the policy's turns, run as Ray actors."""
