"""One GRPO step, written once over a batch store (:mod:`.interfaces`).

| module | job |
|---|---|
| ``interfaces.py`` | ``BatchStore``: where a step's samples live between its phases. |
| ``in_memory.py`` | ``InMemoryBatchStore``: batches pass through the driver. |
| ``data_plane.py`` | ``DataPlaneBatchStore``: the driver holds keys, the data plane the samples. |
| ``components.py`` | ``GRPOComponents`` (what a run holds) and the engines' lazy refit. |
| ``train_fields.py`` | Per-sample advantages and loss mask of a step, from the rollout carry. |
| ``metrics.py`` | A step's and a validation's metrics. |
| ``step.py`` | ``grpo_step`` (generate, advantages, logprobs, train, refit) and ``validate``. |
"""
