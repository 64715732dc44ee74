"""One GRPO step, written once over a batch store (:mod:`.interfaces`).

| module | job |
|---|---|
| ``interfaces.py`` | ``BatchStore``: where a step's samples live between its phases. |
| ``in_memory.py`` | ``InMemoryBatchStore``: batches pass through the driver. |
| ``data_plane.py`` | ``DataPlaneBatchStore``: the driver holds keys, the data plane the samples. |
| ``components.py`` | ``GRPOComponents`` (what a run holds) and the engines' lazy refit. |
| ``train_fields.py`` | Per-sample advantages and loss mask of a step, from the rollout carry. |
| ``env_errors.py`` | The stop when environments fail on too many samples, steps in a row. |
| ``metrics.py`` | A step's and a validation's metrics. |
| ``step.py`` | ``grpo_step`` (generate, advantages, logprobs, train, refit) and ``validate``. |
| ``async_grpo.py`` | ``AsyncRollouts``: async GRPO's collector, generating ahead of training. |
| ``replay_buffer.py`` | The collector's batches, tagged with the weights version that made them. |
"""
