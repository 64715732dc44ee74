"""GAE (PPO's advantage estimator) against advantages worked out by hand."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.algorithms.advantage_estimators import gae_advantages, length_adaptive_lambda

# Row 0: prompt token, three response tokens, one padding token; reward 1.
# Row 1: two response tokens, an unmasked tool turn (value 5, must be skipped), one more
# response token; reward 2.
REWARDS = torch.tensor([1.0, 2.0], dtype=torch.float64)
VALUES = torch.tensor([[9.0, 0.5, 0.25, 1.0, 7.0], [0.2, 0.4, 5.0, 0.1, 3.0]], dtype=torch.float64)
MASK = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 0]])


def test_gamma_09_lambda_05_by_hand() -> None:
    adv, ret = gae_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.5, normalize_advantages=False)
    # Row 0, backwards (gamma * lam = 0.45):
    #   t=3: delta = 1 + 0.9*0 - 1.0 = 0;             A3 = 0
    #   t=2: delta = 0 + 0.9*1.0 - 0.25 = 0.65;       A2 = 0.65 + 0.45*0 = 0.65
    #   t=1: delta = 0 + 0.9*0.25 - 0.5 = -0.275;     A1 = -0.275 + 0.45*0.65 = 0.0175
    # Row 1 (t=2 is skipped: the next state of t=1 is t=3):
    #   t=3: delta = 2 - 0.1 = 1.9;                   A3 = 1.9
    #   t=1: delta = 0.9*0.1 - 0.4 = -0.31;           A1 = -0.31 + 0.45*1.9 = 0.545
    #   t=0: delta = 0.9*0.4 - 0.2 = 0.16;            A0 = 0.16 + 0.45*0.545 = 0.40525
    expected_adv = [[0, 0.0175, 0.65, 0, 0], [0.40525, 0.545, 0, 1.9, 0]]
    expected_ret = [[0, 0.5175, 0.9, 1.0, 0], [0.60525, 0.945, 0, 2.0, 0]]  # A + V on the mask
    torch.testing.assert_close(adv, torch.tensor(expected_adv, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(expected_ret, dtype=torch.float64), rtol=0, atol=1e-12)


def test_gamma_1_lambda_1_is_reward_minus_value() -> None:
    adv, ret = gae_advantages(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0, normalize_advantages=False)
    on = MASK.bool()
    torch.testing.assert_close(adv[on], (REWARDS[:, None] - VALUES)[on], rtol=0, atol=1e-12)
    # Every return is the sample's reward (Monte Carlo).
    torch.testing.assert_close(ret[on], REWARDS[:, None].expand_as(VALUES)[on], rtol=0, atol=1e-12)
    assert torch.all(adv[~on] == 0) and torch.all(ret[~on] == 0)


def test_whitening_uses_the_sample_variance_over_masked_tokens() -> None:
    rewards, values = REWARDS[:1], VALUES[:1]
    mask = MASK[:1]
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, normalize_advantages=True)
    # Raw advantages 1 - V on t=1..3: 0.5, 0.75, 0; mean 5/12; squared deviations
    # 1/144, 16/144, 25/144 sum to 42/144; sample variance 21/144; std sqrt(21)/12.
    std = (21 / 144 + 1e-8) ** 0.5
    expected = [0.0, (0.5 - 5 / 12) / std, (0.75 - 5 / 12) / std, (0 - 5 / 12) / std, 0.0]
    torch.testing.assert_close(adv[0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-9)
    assert ret[0].tolist() == pytest.approx([0, 1.0, 1.0, 1.0, 0])  # returns are not whitened


def test_a_row_without_response_tokens_gets_zeros() -> None:
    mask = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 0, 1, 0]])
    adv, ret = gae_advantages(REWARDS, VALUES, mask, gamma=1.0, lam=0.95, normalize_advantages=False)
    assert torch.all(adv[0] == 0) and torch.all(ret[0] == 0)
    assert not torch.isnan(adv).any()


def test_values_of_the_wrong_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="values"):
        gae_advantages(REWARDS, VALUES[:, :3], MASK, gamma=1.0, lam=1.0)


# gamma 0.9, lambda 1 (Monte Carlo), by hand: returns are the discounted rewards.
#   Row 0: A3 = 0; A2 = 0.65; A1 = -0.275 + 0.9*0.65 = 0.31 -> returns 0.81, 0.9, 1.0
#   Row 1: A3 = 1.9; A1 = -0.31 + 0.9*1.9 = 1.4; A0 = 0.16 + 0.9*1.4 = 1.42
#          -> returns 1.62, 1.8, 2.0
MC_ADV = [[0, 0.31, 0.65, 0, 0], [1.42, 1.4, 0, 1.9, 0]]
MC_RET = [[0, 0.81, 0.9, 1.0, 0], [1.62, 1.8, 0, 2.0, 0]]
LAMBDA_05_ADV = [[0, 0.0175, 0.65, 0, 0], [0.40525, 0.545, 0, 1.9, 0]]


def test_decoupled_value_lambda_gives_the_returns_and_lambda_the_advantages() -> None:
    """VAPO (``gae_lambda_value``): returns with lambda 1, advantages with lambda 0.5."""
    adv, ret = gae_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.5, normalize_advantages=False, value_lam=1.0)
    torch.testing.assert_close(adv, torch.tensor(LAMBDA_05_ADV, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(MC_RET, dtype=torch.float64), rtol=0, atol=1e-12)


def test_a_lambda_per_sample() -> None:
    adv, ret = gae_advantages(
        REWARDS, VALUES, MASK, gamma=0.9, lam=torch.tensor([0.5, 1.0]), normalize_advantages=False
    )
    expected = [LAMBDA_05_ADV[0], MC_ADV[1]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, adv + VALUES * MASK, rtol=0, atol=1e-12)


def test_length_adaptive_lambda_by_hand() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])
    # alpha 0.5: alpha * l = 2, 0.5, 0, 1.5 -> 1 - 1/max(., 1) = 0.5, 0, 0, 1/3
    torch.testing.assert_close(
        length_adaptive_lambda(mask, 0.5), torch.tensor([0.5, 0.0, 0.0, 1 / 3]), rtol=0, atol=1e-7
    )
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(mask, 0.0)


def test_ppo_resolves_the_lambdas_as_nemo_rl() -> None:
    """``length_adaptive_alpha`` over ``gae_lambda_policy`` over ``gae_lambda`` for the
    advantages; ``gae_lambda_value`` over ``gae_lambda`` for the returns."""
    from nemo_rl.algorithms.ppo import gae_lambdas
    from nemo_rl.algorithms.ppo_config import PPOAdvEstimatorConfig as Est

    assert gae_lambdas(Est(gae_lambda=0.9), MASK) == (0.9, None)  # one GAE pass
    assert gae_lambdas(Est(gae_lambda=0.9, gae_lambda_value=1.0), MASK) == (0.9, 1.0)
    assert gae_lambdas(Est(gae_lambda=0.9, gae_lambda_policy=0.5), MASK) == (0.5, 0.9)
    policy, value = gae_lambdas(Est(gae_lambda=0.9, gae_lambda_policy=0.5, length_adaptive_alpha=0.5), MASK)
    torch.testing.assert_close(policy, torch.tensor([1 / 3, 1 / 3]), rtol=0, atol=1e-7)  # 3 tokens each
    assert value == 0.9


def test_ppo_advantage_metrics_by_hand() -> None:
    """NeMo RL's ``advantages/mean|max|min`` over the loss's tokens only."""
    from nemo_rl.algorithms.ppo import advantage_metrics

    advantages = torch.tensor([[9.0, 0.5, -1.5, 0.0], [2.0, 4.0, -7.0, 1.0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    # tokens 0.5, -1.5, 0.0, 2.0, 4.0: mean 5/5 = 1.0 (9 and -7 are not the loss's)
    assert advantage_metrics(advantages, mask) == {"advantages/mean": 1.0, "advantages/max": 4.0, "advantages/min": -1.5}
    assert advantage_metrics(advantages, torch.zeros_like(mask)) == dict.fromkeys(
        ("advantages/mean", "advantages/max", "advantages/min"), 0.0
    )
