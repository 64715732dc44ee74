"""Exit codes of the launchers besides the driver's own (``launchers/ray_common.sh`` holds the
same numbers). A job that ran its driver exits with the driver's code; a signal N gives 128+N."""

USAGE = 2  # bad options or command line (also `nemo-rl` config errors)
HEAD_FAILED = 3  # the Ray head did not start or answer in time
NODES_MISSING = 4  # not every Ray node registered with the head in time
NODE_DIED = 5  # a Ray node ended while the job was running
