"""pass@k and maj@k: the unbiased estimator against the binomial closed form, majority votes
and their documented tie-break, k larger than the completions drawn, and the ``eval``
section's checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain_eval.evaluate import evaluate
from posttrain_eval.metrics import maj_at_k, majority_vote, pass_at_k, score_prompts


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_equals_the_closed_form_on_every_small_case():
    for n in range(1, 13):
        for c, k in itertools.product(range(n + 1), range(1, n + 1)):
            assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_on_hand_computed_cases():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0
    # large n: the product form stays exact where the binomials would be huge
    assert pass_at_k(200, 3, 50) == pytest.approx(closed_form(200, 3, 50), rel=1e-12)


def test_pass_at_1_is_the_share_of_correct_completions():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.5]]
    answers = [[None] * 4] * 3
    scores = score_prompts(rewards, answers, [1, 2, 4], correct_reward=1.0)
    assert scores["pass_at_1"] == pytest.approx((2 / 4 + 0 + 3 / 4) / 3)
    assert scores["pass_at_2"] == pytest.approx((closed_form(4, 2, 2) + 0 + closed_form(4, 3, 2)) / 3)
    assert scores["pass_at_4"] == pytest.approx(2 / 3)
    # with a lower threshold the 0.5 reward counts as correct
    assert score_prompts(rewards, answers, [1], correct_reward=0.5)["pass_at_1"] == pytest.approx((2 / 4 + 0 + 1) / 3)


def test_majority_vote_counts_answers_and_breaks_ties_by_first_appearance():
    # "7" has two votes against one: the vote is right when "7" is
    assert majority_vote(["7", "8", "7"], [True, False, True])
    assert not majority_vote(["8", "7", "8"], [False, True, False])
    # a tie ("8" and "7" once each, then twice each): the answer given first wins
    assert not majority_vote(["8", "7"], [False, True])
    assert majority_vote(["7", "8"], [True, False])
    assert majority_vote(["7", "8", "8", "7"], [True, False, False, True])
    # completions without an answer do not vote; a block without any answer is wrong
    assert majority_vote([None, None, "7"], [False, False, True])
    assert not majority_vote([None, None], [True, True])


def test_maj_at_k_averages_disjoint_blocks_of_k():
    answers = ["7", "7", "8", "9", "8", "8", "7"]  # blocks of 3: (7,7,8) and (9,8,8); the 7th is left out
    correct = [a == "7" for a in answers]
    assert maj_at_k(answers, correct, 3) == 0.5
    assert maj_at_k(answers, correct, 1) == pytest.approx(3 / 7)
    assert maj_at_k(answers, correct, 7) == 1.0  # 7: 3 votes, 8: 3 votes, 7 came first


def test_k_larger_than_the_completions_drawn_is_refused():
    with pytest.raises(ValueError, match=r"pass@5 needs at least 5 completions per prompt, got 4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match=r"maj@3 needs at least 3 completions per prompt, got 2"):
        maj_at_k(["1", "2"], [True, False], 3)

    def never_called(prompts, *, greedy, repeats):
        raise AssertionError("nothing is generated when k is too large")

    prompts = Batch(messages=[[{"role": "user", "content": "q"}]])
    with pytest.raises(ValueError, match=r"k=8 need at least 8 completions per prompt, but 4 are drawn"):
        evaluate(prompts, never_called, num_samples=4, ks=[1, 8])


def test_evaluate_groups_each_prompts_completions():
    """Rows come out of the rollout prompt by prompt; the scores use the right rows."""
    def rollout(prompts, *, greedy, repeats):
        assert (greedy, repeats) == (False, 3)
        return Batch(
            rewards=torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
            response_lengths=torch.tensor([2, 4, 6, 8, 10, 12]),
            answers=["1", "2", "2", "3", None, "3"],
        ), {"rollout/mean_turns": 1.0}

    result = evaluate(Batch(messages=[[], []]), rollout, num_samples=3, ks=[1, 3])
    assert result.metrics == {
        "mean_reward": pytest.approx(1 / 6),
        "mean_response_length": 7.0,
        "pass_at_1": pytest.approx((1 / 3 + 0) / 2),
        "maj_at_1": pytest.approx((1 / 3 + 0) / 2),
        "pass_at_3": 0.5,
        "maj_at_3": 0.0,  # prompt 0 votes "2" (wrong); prompt 1 votes "3" (wrong)
    }
    assert result.rollout_metrics == {"rollout/mean_turns": 1.0}


def eval_config(**options):
    return config_from_dict({"algorithm": "eval", "eval": options}, source="test.yaml")


def test_the_eval_section_refuses_k_above_num_samples_naming_both_keys():
    with pytest.raises(ConfigError) as info:
        eval_config(num_samples=4, k=[1, 8])
    assert str(info.value) == (
        "eval.k: pass@8 and maj@8 need at least 8 completions per prompt, but eval.num_samples is 4; raise "
        "eval.num_samples to 8 or leave k=8 out. Where set: eval.k at test.yaml; eval.num_samples at test.yaml."
    )


def test_the_eval_section_refuses_several_greedy_completions():
    with pytest.raises(ConfigError, match=r"eval.num_samples: greedy decoding gives one completion per prompt, found "
                                          r"num_samples=2; set eval.greedy=false"):
        eval_config(num_samples=2, k=[1], greedy=True)
    eval_config(num_samples=1, k=[1], greedy=True)
    eval_config(num_samples=8, k=[1, 4, 8])
