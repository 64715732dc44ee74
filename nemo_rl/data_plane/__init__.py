"""Data plane: bulk per-sample tensors kept outside the driver, addressed by key.

The driver holds :class:`KVBatchMeta` (keys, lengths, small tags); producers and consumers put
and get tensors through a :class:`DataPlaneClient`. ``TransferQueueDataPlane`` (the real store)
lives in :mod:`nemo_rl.data_plane.transfer_queue_client`, imported on demand because it pulls in
``transfer_queue``.
"""

from nemo_rl.data_plane.in_process import InProcessDataPlane
from nemo_rl.data_plane.interfaces import (
    Column,
    DataPlaneClient,
    DataPlaneError,
    MissingSamplesError,
    Samples,
)
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.data_plane.preshard import shard_meta_for_dp

__all__ = [
    "Column",
    "DataPlaneClient",
    "DataPlaneError",
    "InProcessDataPlane",
    "KVBatchMeta",
    "MissingSamplesError",
    "Samples",
    "shard_meta_for_dp",
]
