"""PPO's clipped value loss (MseValueLossFn) against a hand computation."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.algorithms.loss import LossFunction, LossInputType, MseValueLossFn
from nemo_rl.algorithms.loss.interfaces import MetricReduction
from nemo_rl.algorithms.loss.value import explained_variance

VALUES = torch.tensor([[5.0, 1.0, 0.0], [0.5, 1.6, 9.0]], dtype=torch.float64)  # the critic now
DATA = {
    "values": torch.tensor([[0.0, 0.8, 0.5], [0.5, 1.0, 0.0]], dtype=torch.float64),  # at rollout
    "returns": torch.tensor([[0.0, 0.5, 1.0], [1.0, 1.5, 0.0]], dtype=torch.float64),
    "token_mask": torch.tensor([[0, 1, 1], [1, 1, 0]]),
    "sample_mask": torch.tensor([1, 1]),
}
# Valid tokens, with cliprange 0.2 (clamp to [old - 0.2, old + 0.2]):
#   (0,1): v=1.0 old=0.8 -> v_c=1.0; (v-R)^2=0.25, (v_c-R)^2=0.25 -> 0.25
#   (0,2): v=0.0 old=0.5 -> v_c=0.3; 1.0, 0.49 -> 1.0
#   (1,0): v=0.5 old=0.5 -> v_c=0.5; 0.25, 0.25 -> 0.25
#   (1,1): v=1.6 old=1.0 -> v_c=1.2; 0.01, 0.09 -> 0.09 (clipped: the larger error)
# loss = 0.5 * scale * sum / 4 tokens.
CLIPPED_SUM, UNCLIPPED_SUM = 0.25 + 1.0 + 0.25 + 0.09, 0.25 + 1.0 + 0.25 + 0.01


def call(loss_fn: MseValueLossFn, values: torch.Tensor, data: dict, toks: float = 4.0):
    return loss_fn(data, torch.tensor(2.0), torch.tensor(toks), values=values)


def test_follows_the_loss_protocol() -> None:
    loss_fn = MseValueLossFn({"scale": 0.4, "cliprange": 0.2})
    assert isinstance(loss_fn, LossFunction) and loss_fn.input_type is LossInputType.VALUE


def test_clipped_loss_and_metrics_by_hand() -> None:
    values = VALUES.clone().requires_grad_(True)
    loss, metrics = call(MseValueLossFn({"scale": 0.4, "cliprange": 0.2}), values, DATA)
    assert loss.item() == pytest.approx(0.5 * 0.4 * CLIPPED_SUM / 4, abs=1e-12)  # 0.0795
    assert metrics["vf_clipfrac"] == pytest.approx(0.25)
    assert metrics["returns_mean"] == pytest.approx((0.5 + 1.0 + 1.0 + 1.5) / 4)
    assert metrics["values_mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 1.6) / 4)
    assert metrics["returns_sq_mean"] == pytest.approx((0.25 + 1 + 1 + 2.25) / 4)
    assert metrics["residual_sq_mean"] == pytest.approx(UNCLIPPED_SUM / 4)
    assert metrics["num_valid_samples"] == 2
    # the extremes of v over the valid tokens (5.0 and 9.0 are not valid)
    assert (metrics["values_min"], metrics["values_max"]) == (0.0, 1.6)
    # Residuals R - v: -0.5, 1, 0.5, -0.1 (mean 0.225, population variance 0.326875);
    # returns' population variance 1.125 - 1 = 0.125.
    assert explained_variance(metrics) == pytest.approx(1 - 0.326875 / 0.125)
    loss.backward()
    # The clipped token's error no longer depends on v; (0,2) unclipped: 0.2 * 2 * (0 - 1) / 4.
    assert values.grad[1, 1].item() == 0.0
    assert values.grad[0, 2].item() == pytest.approx(-0.1)
    assert values.grad[0, 0].item() == 0.0 and values.grad[1, 2].item() == 0.0  # not valid


def test_without_cliprange_it_is_half_the_mse_and_needs_no_old_values() -> None:
    data = {k: v for k, v in DATA.items() if k != "values"}
    loss, metrics = call(MseValueLossFn({"scale": 0.4}), VALUES, data)
    assert loss.item() == pytest.approx(0.5 * 0.4 * UNCLIPPED_SUM / 4, abs=1e-12)  # 0.0755
    assert metrics["vf_clipfrac"] == 0.0


def test_micro_batches_add_up_to_the_global_batch() -> None:
    loss_fn = MseValueLossFn({"scale": 0.4, "cliprange": 0.2})
    whole, whole_metrics = call(loss_fn, VALUES, DATA)
    parts = [call(loss_fn, VALUES[i : i + 1], {k: v[i : i + 1] for k, v in DATA.items()}) for i in (0, 1)]
    assert sum(p[0].item() for p in parts) == pytest.approx(whole.item(), abs=1e-12)
    for key in ("vf_clipfrac", "returns_mean", "values_mean", "residual_sq_mean"):
        assert sum(p[1][key] for p in parts) == pytest.approx(whole_metrics[key], abs=1e-12)
    # the extremes are reduced by min / max (NeMo RL's critic/values_min, values_max)
    assert loss_fn.metric_reductions == {"values_min": MetricReduction.MIN, "values_max": MetricReduction.MAX}
    assert min(p[1]["values_min"] for p in parts) == whole_metrics["values_min"] == 0.0
    assert max(p[1]["values_max"] for p in parts) == whole_metrics["values_max"] == 1.6
    assert [p[1]["values_min"] for p in parts] == [0.0, 0.5]


def test_a_micro_batch_without_valid_tokens_has_neutral_extremes() -> None:
    data = {**DATA, "token_mask": torch.zeros(2, 3, dtype=torch.long)}
    _, metrics = call(MseValueLossFn(), VALUES, data)
    assert (metrics["values_min"], metrics["values_max"]) == (float("inf"), float("-inf"))


def test_missing_returns_is_named() -> None:
    data = {k: v for k, v in DATA.items() if k != "returns"}
    with pytest.raises(ValueError, match="returns"):
        call(MseValueLossFn(), VALUES, data)
