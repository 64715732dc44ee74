"""NumberGuessEnvironment: scripted games played turn by turn."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.environments.config import NumberGuessEnvConfig
from nemo_rl.environments.number_guess_environment import NumberGuessEnvironment, extract_guess


def play(env, log, meta, reply):
    """Append ``reply`` as the assistant turn and step the environment on this one sample."""
    log.append({"role": "assistant", "content": reply, "token_ids": torch.zeros(1)})
    out = env.step([log], [meta])
    log.append({**out.observations[0], "token_ids": torch.zeros(1)})
    return out


def test_extract_guess():
    assert extract_guess("I think <guess>37</guess>") == 37
    assert extract_guess("my guess is <guess> 12") == 12  # stop string cut from the text
    assert extract_guess("maybe 5 or 8") == 8
    assert extract_guess("<guess>-3</guess>") == -3
    assert extract_guess("no idea") is None


def test_game_solved_on_third_guess():
    env = NumberGuessEnvironment(NumberGuessEnvConfig(max_turns=5, turn_penalty=0.1))
    log = [{"role": "user", "content": "Guess 1..100", "token_ids": torch.zeros(1)}]
    meta = {"secret": 37, "low": 1, "high": 100}

    out = play(env, log, meta, "<guess>50")
    assert out.observations[0] == {"role": "environment", "content": "lower"}
    assert out.rewards.tolist() == [0.0] and out.terminateds.tolist() == [False]
    assert out.next_stop_strings == [["</guess>"]]
    meta = out.metadata[0]
    assert meta == {"secret": 37, "low": 1, "high": 100, "turn": 1}

    out = play(env, log, meta, "<guess>25</guess>")
    assert out.observations[0]["content"] == "higher" and not out.terminateds[0]
    meta = out.metadata[0]

    out = play(env, log, meta, "<guess>37</guess>")
    assert out.observations[0]["content"] == "correct"
    assert out.rewards.tolist() == [pytest.approx(0.8)]
    assert out.terminateds.tolist() == [True]
    assert out.metadata == [None] and out.answers == ["37"]
    assert [m["role"] for m in log] == ["user"] + ["assistant", "environment"] * 3


def test_game_ends_unsolved_after_max_turns_and_reminds_format():
    env = NumberGuessEnvironment(NumberGuessEnvConfig(max_turns=2))
    log: list = []
    out = play(env, log, {"secret": 3, "low": 1, "high": 10}, "hmm")
    reminder = "no guess found; answer with <guess>N</guess> between 1 and 10"
    assert out.observations[0]["content"] == reminder
    assert not out.terminateds[0] and out.answers == [None]
    out = play(env, log, out.metadata[0], "<guess>9</guess>")
    assert out.observations[0]["content"] == "lower"
    assert out.terminateds.tolist() == [True] and out.rewards.tolist() == [0.0]


def test_batch_of_games_and_metrics():
    env = NumberGuessEnvironment()
    logs = [[{"role": "assistant", "content": f"<guess>{g}"}] for g in (4, 5)]
    out = env.step(logs, [{"secret": 4}, {"secret": 4}])
    assert out.rewards.tolist() == [1.0, 0.0]
    assert out.terminateds.tolist() == [True, False]
    batch = {"total_reward": torch.tensor([1.0, 0.0, 0.5, 0.0]), "idx": torch.tensor([0, 0, 1, 1])}
    assert env.global_post_process_and_metrics(batch)[1] == {"accuracy": 0.5, "pass@2": 1.0}


def test_missing_secret_names_the_sample():
    with pytest.raises(KeyError, match="sample 0.*secret"):
        NumberGuessEnvironment().step([[{"role": "assistant", "content": "1"}]], [{}])
