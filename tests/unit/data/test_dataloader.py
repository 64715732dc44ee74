"""The stateful prompt loader: seeded epochs, drop-last, exact resume from state_dict."""

from __future__ import annotations

import itertools
import json

import pytest

from nemo_rl.data.dataloader import StatefulPromptLoader


def _ids(loader: StatefulPromptLoader, n: int) -> list[list[int]]:
    return list(itertools.islice(iter(loader), n))


def _loader(**kw: object) -> StatefulPromptLoader:
    args = dict(dataset=list(range(10)), batch_size=3, seed=5, collate_fn=list)
    args.update(kw)
    return StatefulPromptLoader(**args)  # type: ignore[arg-type]


def test_epochs_are_seeded_permutations_with_drop_last() -> None:
    loader = _loader()
    assert len(loader) == 3
    batches = _ids(loader, 6)
    assert all(len(b) == 3 for b in batches)
    for epoch in range(2):
        seen = sum(batches[3 * epoch : 3 * epoch + 3], [])
        assert len(set(seen)) == 9  # one permutation, the 10th item dropped
        assert seen == loader.epoch_order(epoch)[:9].tolist()
    assert batches[:3] != batches[3:]  # a new order each epoch
    assert _ids(_loader(), 6) == batches
    assert _ids(_loader(seed=6), 3) != batches[:3]


def test_no_shuffle_keeps_dataset_order() -> None:
    assert _ids(_loader(shuffle=False), 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7])
def test_resume_continues_exactly(stop_after: int) -> None:
    reference = _ids(_loader(), 10)
    first = _loader()
    assert _ids(first, stop_after) == reference[:stop_after]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = _loader()
    resumed.load_state_dict(state)
    assert _ids(resumed, 10 - stop_after) == reference[stop_after:]


def test_resume_with_other_settings_is_refused() -> None:
    state = _loader().state_dict()
    with pytest.raises(ValueError, match="seed=5 but this loader has 6"):
        _loader(seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len=10 but this loader has 11"):
        _loader(dataset=list(range(11))).load_state_dict(state)


def test_dataset_smaller_than_a_batch() -> None:
    with pytest.raises(ValueError, match="num_prompts_per_step"):
        _loader(dataset=[1, 2])
