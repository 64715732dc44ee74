"""Weight refit: stream the policy's HF-named weights into the generation engines.

Modules, one concern each:
    interfaces: the weight-sync protocol (sender and receiver verbs), its settings.
    buckets: stream layout, bucket packing (sender) and checking (receiver), checksums.
    shared_memory / cuda_ipc / ipc: the colocated transport (one shared buffer of the stream).
    collective: the non-colocated transport (a broadcast group of its own).
    sender / receiver: what a policy rank and an engine do (the workers only wire them up).
    orchestrate: the driver's sequence, :func:`refit_policy_generation`.
"""

from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.interfaces import RefitSettings
from nemo_rl.models.generation.refit.orchestrate import RefitResult, refit_policy_generation

__all__ = ["RefitError", "RefitResult", "RefitSettings", "refit_policy_generation"]
