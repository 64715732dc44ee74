"""Ray actors that hold one rank of a policy (see :mod:`.megatron_policy_worker`)."""
