"""megatron-core integration of the policy: layer specs and context-parallel attention.

The CPU accommodations and parallel-state set-up live below nemo_rl, in
:mod:`megatron_bridge.cpu_compat` and :mod:`megatron_bridge.parallel_state`.
"""
