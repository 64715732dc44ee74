"""A resumable loader of prompt batches: seeded shuffle per epoch, exact resume.

Own class rather than ``torchdata``'s ``StatefulDataLoader``: the state is three integers (JSON
friendly) and the order of epoch ``e`` depends only on ``(seed, e)``, so a run resumed from
``state_dict()`` yields the same batches as one never stopped, across epoch boundaries too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from nemo_rl.data.llm_message_utils import rl_collate_fn
from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class StatefulPromptLoader:
    """Endless batches of ``batch_size`` items of ``dataset``, epoch after epoch.

    Each epoch visits a permutation of the dataset (``torch.randperm`` seeded with
    ``seed + epoch``; identity order when ``shuffle`` is False) cut into ``len // batch_size``
    full batches; the remainder of an epoch is dropped.

    Args:
        dataset: indexable items (e.g. a :class:`~nemo_rl.data.datasets.PromptDataset`).
        batch_size: items per batch (e.g. ``grpo.num_prompts_per_step``).
        seed: shuffle seed (e.g. ``grpo.seed``).
        shuffle: shuffle each epoch (``data.shuffle``).
        collate_fn: turns a list of items into a batch.
    """

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] = rl_collate_fn,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} rows, fewer than one batch of {batch_size} "
                "(grpo.num_prompts_per_step); use more data or a smaller batch"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn
        self.epoch = 0
        self.batch_in_epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        """Full batches in one epoch."""
        return len(self.dataset) // self.batch_size

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """``[len(dataset)]`` int64 dataset indices in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator)

    def next_indices(self) -> list[int]:
        """Dataset indices of the next batch; advances the position."""
        order = self.epoch_order(self.epoch)
        start = self.batch_in_epoch * self.batch_size
        indices = order[start : start + self.batch_size].tolist()
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return indices

    def __iter__(self) -> Iterator[BatchedDataDict]:
        """Batches from the current position on, without end (stop after max_num_steps)."""
        while True:
            yield self.collate_fn([self.dataset[i] for i in self.next_indices()])

    def state_dict(self) -> dict[str, int]:
        """Position and settings; :meth:`load_state_dict` continues at the next batch."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` of :meth:`state_dict`.

        Raises:
            ValueError: when the state was made with another seed, batch size or dataset size
                (the order would differ), naming the field.
        """
        for key, mine in (
            ("seed", self.seed),
            ("batch_size", self.batch_size),
            ("dataset_len", len(self.dataset)),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"loader state has {key}={state[key]} but this loader has {mine}; resume "
                    "with the settings and data of the saved run"
                )
        if not 0 <= state["batch_in_epoch"] < self.batches_per_epoch:
            raise ValueError(f"loader state batch_in_epoch={state['batch_in_epoch']} out of range")
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
