"""The rollout loop with a real model behind the Generation interface.

``TransformersGeneration`` samples from the tiny Llama with ``transformers`` generate, one row
at a time (special tokens other than EOS suppressed, so decoded text re-tokenises to the same
ids). The tests check structural truths against independent computations: the chat
template's own tokenisation, the model's own logprobs, the environments' own scores.
"""

from __future__ import annotations

import pytest
import structlog.testing
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.batch import Batch
from posttrain.config.environments import CoreEnvironmentOptions
from posttrain.errors import ConfigError
from posttrain.interfaces import Environment, EnvironmentReturn, Generation
from posttrain.models.tiny import SPECIAL_TOKENS
from posttrain.run.environments import EnvironmentFailed, EnvironmentTimeout
from posttrain.run.rollout import ChatFormat, run_rollout
from posttrain_env_math.guess_number import STOP, GuessNumberEnvironment, GuessNumberOptions, guess_number_prompt
from posttrain_env_math.math_env import MathEnvironment, MathOptions
from posttrain_env_math.scoring import score_response


class TransformersGeneration(Generation):
    """transformers ``generate`` behind the Generation interface; records every input batch."""

    def __init__(self, model_path: str, max_new_tokens: int, seed: int = 0):
        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos = self.tokenizer.eos_token_id
        self.suppressed = [i for i in self.tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) if i != self.eos]
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.calls: list[Batch] = []

    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        self.calls.append(batch)
        rows = []
        for i in range(len(batch)):
            prompt = batch["input_ids"][i, : int(batch["input_lengths"][i])]
            stop = batch["stop_strings"][i] if "stop_strings" in batch else None
            torch.manual_seed(self.seed + 1000 * len(self.calls) + i)
            out = self.model.generate(
                prompt[None], max_new_tokens=self.max_new_tokens, do_sample=not greedy, temperature=1.0, top_k=0, top_p=1.0,
                output_scores=True, return_dict_in_generate=True, eos_token_id=self.eos, pad_token_id=0,
                suppress_tokens=self.suppressed, stop_strings=stop, tokenizer=self.tokenizer if stop else None,
            )
            new = out.sequences[0, len(prompt):]
            logprobs = torch.stack(out.scores, 1)[0].log_softmax(-1).gather(-1, new[:, None])[:, 0]
            text = self.tokenizer.decode(new)
            ended = int(new[-1]) == self.eos or any(text.endswith(s) for s in stop or [])
            rows.append((torch.cat([prompt, new]), torch.cat([torch.zeros(len(prompt)), logprobs]), len(new), not ended))
        width = max(len(ids) for ids, *_ in rows)
        return Batch(
            output_ids=torch.stack([torch.nn.functional.pad(ids, (0, width - len(ids))) for ids, *_ in rows]),
            logprobs=torch.stack([torch.nn.functional.pad(lp, (0, width - len(lp))) for _, lp, *_ in rows]).float(),
            generation_lengths=torch.tensor([n for *_, n, _ in rows]),
            unpadded_sequence_lengths=torch.tensor([len(ids) for ids, *_ in rows]),
            truncated=torch.tensor([t for *_, t in rows]),
        )

    def weight_endpoint(self):
        raise NotImplementedError("rollouts never refit")

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def math_env():
    env = MathEnvironment(MathOptions(timeout_s=10, num_workers=1))
    yield env
    env.shutdown()


def template_ids(tokenizer, messages, generation_prompt=False) -> list[int]:
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return list(tokenizer.apply_chat_template(plain, add_generation_prompt=generation_prompt, return_dict=True)["input_ids"])


def check_sequence(batch, i, tokenizer, eos, *, template_roundtrip: bool = True) -> None:
    """input_ids, token_mask and per-message token ids of sample i agree with each other and
    (``template_roundtrip``: when no special tokens were generated) with the template's
    tokenisation of the final message log."""
    n = int(batch["input_lengths"][i])
    ids = batch["input_ids"][i, :n].tolist()
    log = batch["messages"][i]
    assert (batch["input_ids"][i, n:] == tokenizer.pad_token_id).all()
    # the prompt is the template's rendering with the generation prompt
    prompt_length = int(batch["prompt_lengths"][i])
    num_prompt_messages = next(k for k, m in enumerate(log) if "token_ids" in m) if any("token_ids" in m for m in log) else len(log)
    assert ids[:prompt_length] == template_ids(tokenizer, log[:num_prompt_messages], generation_prompt=True)
    # after it, each added message's tokens in order; the mask is 1 exactly on assistant tokens
    expected_mask = [0.0] * prompt_length
    rebuilt = ids[:prompt_length]
    for message in log[num_prompt_messages:]:
        rebuilt += message["token_ids"]
        expected_mask += [1.0 if message["role"] == "assistant" else 0.0] * len(message["token_ids"])
        if message["role"] == "assistant":
            assert message["content"] == tokenizer.decode(message["token_ids"], skip_special_tokens=True)
    assert rebuilt == ids
    assert batch["token_mask"][i, :n].tolist() == expected_mask
    assert batch["token_mask"][i, n:].sum() == 0
    assert int(batch["response_lengths"][i]) == int(sum(expected_mask))
    if not template_roundtrip:
        return
    # the whole sequence is the template's tokenisation of the final log, less the closing
    # <|end|> of a last assistant turn that did not generate it
    rendered = template_ids(tokenizer, log)
    if log[-1]["role"] == "assistant" and (len(log[-1]["token_ids"]) == 0 or int(log[-1]["token_ids"][-1]) != eos):
        rendered = rendered[:-1]
    assert ids == rendered


def model_logprobs(model_path, batch, suppressed=()) -> torch.Tensor:
    """log p(x_t | x_<t) at position t under the model, with the sampler's suppressed tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits.double()
    logits[..., list(suppressed)] = float("-inf")
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    out[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return torch.where(batch["token_mask"] > 0, out, 0.0)


def test_single_turn_math(tiny_model_path, tokenizer, math_env):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=12)
    questions = ["What is 2+2?", "Compute 3*3.", "Half of 1?", "What is 10-3?"]
    samples = Batch(
        messages=[[{"role": "user", "content": q}] for q in questions],
        task=["math"] * 4,
        metadata=[{"id": k} for k in range(4)],
        answer=["4", "9", "1/2", "7"],
    )
    batch, metrics = run_rollout(samples, generation, {"math": math_env}, tokenizer, max_total_length=128)

    assert len(batch) == 4 and batch["turns"].tolist() == [1, 1, 1, 1]
    for i in range(4):
        check_sequence(batch, i, tokenizer, generation.eos)
        response = batch["messages"][i][-1]
        assert [m["role"] for m in batch["messages"][i]] == ["user", "assistant"]
        assert batch["truncated"][i] == (len(response["token_ids"]) == 12 and int(response["token_ids"][-1]) != generation.eos)
        answer, correct = score_response(response["content"], samples["answer"][i])
        assert batch["rewards"][i] == float(correct)
        assert batch["metadata"][i]["answer"] == samples["answer"][i] and batch["metadata"][i]["id"] == i
        assert batch["metadata"][i]["extracted_answer"] == answer
    # generation logprobs sit at the token they score, as the model computes them
    expected = model_logprobs(tiny_model_path, batch, generation.suppressed)
    torch.testing.assert_close(batch["generation_logprobs"].double(), expected, atol=1e-4, rtol=0)
    assert (batch["generation_logprobs"][batch["token_mask"] == 0] == 0).all()
    assert metrics["rollout/mean_turns"] == 1.0
    assert metrics["rollout/generated_tokens"] == float(batch["token_mask"].sum())
    assert metrics["rollout/truncation_rate"] == float(batch["truncated"].float().mean())
    assert metrics["env/math/accuracy"] == pytest.approx(float(batch["rewards"].mean()))
    assert metrics["env/math/errors"] == 0.0 and metrics["env/math/timeouts"] == 0.0
    assert "stop_strings" not in generation.calls[0]


def test_multi_turn_guess_number_mixed_with_math(tiny_model_path, tokenizer, math_env):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=6, seed=1)
    samples = Batch(
        messages=[guess_number_prompt(1, 100), [{"role": "user", "content": "1+1?"}], guess_number_prompt(1, 9)],
        task=["guess_number", "math", "guess_number"],
        metadata=[{"target": 37, "low": 1, "high": 100}, {"answer": "2"}, {"target": 5, "low": 1, "high": 9}],
    )
    envs = {"guess_number": GuessNumberEnvironment(GuessNumberOptions(max_guesses=8)), "math": math_env}
    batch, metrics = run_rollout(samples, generation, envs, tokenizer, max_total_length=1024, max_turns=3)

    # the random model never writes a valid guess: the game goes on for every turn allowed
    assert batch["turns"].tolist() == [3, 1, 3]
    for i in (0, 2):
        check_sequence(batch, i, tokenizer, generation.eos)
        log = batch["messages"][i]
        assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        high = samples["metadata"][i]["high"]
        assert [log[k]["content"] for k in (2, 4)] == [f"Reply with <guess>N</guess>, N an integer from 1 to {high}."] * 2
        assert batch["metadata"][i]["guesses"] == 3 and batch["rewards"][i] == 0.0
    check_sequence(batch, 1, tokenizer, generation.eos)
    # turn 1 generates for all three; later turns only for the games, with the game's stop string
    assert [len(call) for call in generation.calls] == [3, 2, 2]
    assert "stop_strings" not in generation.calls[0]
    assert generation.calls[1]["stop_strings"] == [[STOP], [STOP]]
    # each generation input is the sample's sequence so far: a prefix of its final sequence
    final = batch["input_ids"]
    for call in generation.calls[1:]:
        for row, i in enumerate((0, 2)):
            n = int(call["input_lengths"][row])
            assert call["input_ids"][row, :n].tolist() == final[i, :n].tolist()
            assert final[i, n - 1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert metrics["rollout/mean_turns"] == pytest.approx(7 / 3)
    assert metrics["env/guess_number/mean_guesses"] == 3.0
    assert metrics["env/guess_number/solved"] == 0.0
    assert "env/math/accuracy" in metrics


def test_length_limits(tiny_model_path, tokenizer):
    env = {"guess_number": GuessNumberEnvironment(GuessNumberOptions())}
    prompt = guess_number_prompt(1, 100)
    prompt_length = len(template_ids(tokenizer, prompt, generation_prompt=True))
    long_prompt = [{"role": "user", "content": "x" * 200}]

    # generation cut by the total length; an observation that would leave no room is not added
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=20, seed=2)
    samples = Batch(messages=[prompt, prompt, long_prompt], task=["guess_number"] * 3, metadata=[{"target": 3}] * 3)
    batch, metrics = run_rollout(samples, generation, env, tokenizer, max_total_length=prompt_length + 5, max_turns=4)
    assert batch["input_lengths"].tolist()[:2] == [prompt_length + 5] * 2
    assert batch["truncated"].tolist() == [True, True, True]
    assert batch["turns"].tolist() == [1, 1, 0]
    assert [len(call) for call in generation.calls] == [2]
    assert batch["messages"][2] == long_prompt and batch["response_lengths"][2] == 0
    assert metrics["rollout/truncation_rate"] == 1.0
    for i in range(2):
        check_sequence(batch, i, tokenizer, generation.eos)

    # generations that fit, followed by an observation that does not
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=4, seed=3)
    batch, _ = run_rollout(samples.select([0, 1]), generation, env, tokenizer, max_total_length=prompt_length + 30, max_turns=4)
    assert batch["turns"].tolist() == [1, 1] and batch["truncated"].all()
    assert (batch["input_lengths"] <= prompt_length + 4).all()
    assert [m["role"] for m in batch["messages"][0]] == ["user", "assistant"]


@pytest.mark.ray
@pytest.mark.slow
class VersionedGeneration(TransformersGeneration):
    """Reports weights of version n on the n-th call, as if a weight sync landed before each."""

    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        out = super().generate(batch, greedy=greedy)
        out["weight_versions"] = torch.full((len(batch),), len(self.calls), dtype=torch.long)
        return out


def game_and_sum(generation: Generation, tokenizer, math_env) -> Batch:
    """A rollout of a three-turn number-guessing game and a one-turn sum."""
    samples = Batch(
        messages=[guess_number_prompt(1, 100), [{"role": "user", "content": "1+1?"}]],
        task=["guess_number", "math"],
        metadata=[{"target": 37, "low": 1, "high": 100}, {"answer": "2"}],
    )
    envs = {"guess_number": GuessNumberEnvironment(GuessNumberOptions(max_guesses=8)), "math": math_env}
    batch, _ = run_rollout(samples, generation, envs, tokenizer, max_total_length=1024, max_turns=3)
    assert batch["turns"].tolist() == [3, 1]
    return batch


def test_each_generated_token_keeps_the_version_of_the_weights_that_generated_it(tiny_model_path, tokenizer, math_env):
    batch = game_and_sum(VersionedGeneration(tiny_model_path, max_new_tokens=6, seed=1), tokenizer, math_env)
    for i in range(2):
        n = int(batch["input_lengths"][i])
        mask, versions = batch["token_mask"][i, :n].bool(), batch["generation_versions"][i, :n]
        assert (versions[~mask] == -1).all() and (batch["generation_versions"][i, n:] == -1).all()
        # the generated tokens come in one run per turn, turn k from the k-th call's weights
        runs = torch.cumsum(torch.diff(mask.int(), prepend=torch.tensor([0])) == 1, 0)
        assert versions[mask].tolist() == runs[mask].tolist()
    assert batch["generation_versions"].dtype == torch.long


def test_without_reported_versions_the_batch_has_none(tiny_model_path, tokenizer, math_env):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=4)
    samples = Batch(messages=[[{"role": "user", "content": "1+1?"}]], task=["math"], metadata=[{"answer": "2"}])
    batch, _ = run_rollout(samples, generation, {"math": math_env}, tokenizer, max_total_length=64)
    assert "generation_versions" not in batch


def test_rollout_through_the_hf_backend_and_environment_actors(ray_cluster, tiny_model_path, tokenizer):
    """The production path: the ``hf`` generation backend and environments in Ray actors."""
    from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig, WorkerResources
    from posttrain.distributed import VirtualCluster
    from posttrain.plugins import plugin_host
    from posttrain.run.environments import start_environments

    config = RunConfig(
        seed=5,
        policy=PolicyConfig(model=tiny_model_path),
        generation=GenerationConfig(backend="hf", max_new_tokens=8, resources=WorkerResources(cpus=1)),
    )
    generation = plugin_host().generation_backends["hf"](config, VirtualCluster(config.cluster))
    envs = start_environments(["math", "guess_number"], {"math": {"num_workers": 1}, "guess_number": {"max_guesses": 2}})
    try:
        samples = Batch(
            messages=[[{"role": "user", "content": "2+2?"}], guess_number_prompt(1, 9), guess_number_prompt(1, 9)],
            task=["math", "guess_number", "guess_number"],
            metadata=[{}, {"target": 4, "low": 1, "high": 9}, {"target": 6, "low": 1, "high": 9}],
            answer=["4", None, None],
        )
        batch, metrics = run_rollout(samples, generation, envs, tokenizer, max_total_length=512, max_turns=3)
    finally:
        generation.shutdown()
        for env in envs.values():
            env.shutdown()
    eos = tokenizer.eos_token_id
    for i in range(3):
        check_sequence(batch, i, tokenizer, eos, template_roundtrip=False)  # the backend may sample special tokens
    # the games end after max_guesses=2 turns unless a guess is right; math after one
    assert batch["turns"][0] == 1 and all(1 <= t <= 2 for t in batch["turns"][1:].tolist())
    for i in (1, 2):
        log = batch["messages"][i]
        assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"][: 2 * int(batch["turns"][i])]
        assert batch["metadata"][i]["guesses"] == batch["turns"][i]
    expected = model_logprobs(tiny_model_path, batch)
    torch.testing.assert_close(batch["generation_logprobs"].double(), expected, atol=1e-4, rtol=0)
    generated = batch["token_mask"].bool()
    assert (batch["generation_versions"][generated] == 0).all()  # the weights loaded from the folder
    assert (batch["generation_versions"][~generated] == -1).all()
    assert metrics["env/math/errors"] == 0.0 and metrics["env/guess_number/timeouts"] == 0.0
    assert metrics["env/guess_number/mean_guesses"] == float(batch["turns"][1:].float().mean())


class AlwaysRaises(Environment):
    def step(self, message_logs, metadata) -> EnvironmentReturn:
        raise ValueError("no scores today")


def tolerant(env: Environment, **options) -> Environment:
    """``env`` run under core options that let every sample fail (and ``options``)."""
    env.core_options = CoreEnvironmentOptions(**{"max_failed_fraction": 1.0, **options})
    return env


def test_a_rollout_whose_samples_mostly_fail_stops_naming_the_first_row(tiny_model_path, tokenizer):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=3)
    samples = Batch(messages=[[{"role": "user", "content": "hi"}]] * 2, task=["sad"] * 2, metadata=[{"k": 1}, {"k": 2}],
                    origin=["train.jsonl row 4", "train.jsonl row 9"])
    with pytest.raises(EnvironmentFailed) as info:
        run_rollout(samples, generation, {"sad": AlwaysRaises()}, tokenizer, max_total_length=64, max_turns=3)
    assert str(info.value) == (
        "environment 'sad' could not score 2 of 2 samples of a rollout, more than "
        "environments.sad.max_failed_fraction=0.5 allows (a call whose actor died or timed out was made again up to "
        "environments.sad.call_retries=2 times). The first: train.jsonl row 4: ValueError: no scores today. A sample "
        "the environment could not score is never trained on, so the run stops rather than go on with so few. Fix the "
        "environment or the rows named, or set environments.sad.max_failed_fraction: 1.0 to train on the samples it "
        "scores."
    )


def test_failed_samples_are_marked_and_left_out_of_the_reward_metrics(tiny_model_path, tokenizer):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=3)
    samples = Batch(messages=[[{"role": "user", "content": "hi"}]] * 2, task=["sad"] * 2, metadata=[{"k": 1}, {"k": 2}])
    batch, metrics = run_rollout(samples, generation, {"sad": tolerant(AlwaysRaises())}, tokenizer,
                                 max_total_length=64, max_turns=3)
    assert batch["failed"].tolist() == [True, True] and batch["turns"].tolist() == [1, 1]
    assert batch["rewards"].tolist() == [0.0, 0.0] and batch["metadata"] == [{"k": 1}, {"k": 2}]
    assert metrics["env/sad/errors"] == 2.0 and metrics["env/sad/timeouts"] == 0.0
    assert metrics["env/sad/retried"] == 2.0  # the call of 2 was split to find the failing samples
    assert metrics["rollout/mean_reward"] == 0.0  # no sample was scored


class MissingKeyRaises(GuessNumberEnvironment):
    """A game that reads ``metadata["target"]`` without checking it: a row without one makes
    its whole call raise (KeyError)."""

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        [meta["target"] for meta in metadata]
        return super().step(message_logs, metadata)


@pytest.mark.parametrize("game", [GuessNumberEnvironment, MissingKeyRaises])
def test_a_row_the_environment_cannot_score_fails_alone(tiny_model_path, tokenizer, game):
    """A guess_number row without a target, between two good ones: whether the environment
    reports it (guess_number) or raises for the whole call, only that row's samples fail;
    the neighbours play every turn as in a rollout without it, and the warning names the row."""
    def rollout(rows):
        generation = TransformersGeneration(tiny_model_path, max_new_tokens=6, seed=1)
        samples = Batch(messages=[guess_number_prompt(1, 9)] * len(rows), task=["guess_number"] * len(rows),
                        metadata=[meta for _, meta in rows], origin=[origin for origin, _ in rows])
        env = game(GuessNumberOptions(max_guesses=8))
        return run_rollout(samples.repeat_interleave(2), generation, {"guess_number": env}, tokenizer,
                           max_total_length=1024, max_turns=3, greedy=True)  # greedy: rows do not share a seed

    good = [("games.jsonl row 1", {"target": 5}), ("games.jsonl row 3", {"target": 7})]
    with_bad = [good[0], ("games.jsonl row 2", {"low": 1}), good[1]]
    with structlog.testing.capture_logs() as logs:
        batch, metrics = rollout(with_bad)
    assert batch["failed"].tolist() == [False, False, True, True, False, False]
    assert batch["turns"].tolist() == [3, 3, 1, 1, 3, 3]
    assert metrics["env/guess_number/errors"] == 2.0
    assert metrics["env/guess_number/mean_guesses"] == 3.0  # over the four games played
    warnings = [log for log in logs if log["event"] == "environment could not score samples; they are left out of the loss"]
    assert [(w["environment"], w["rows"], w["samples"], w["of"]) for w in warnings] == [
        ("guess_number", ["games.jsonl row 2"], 2, 6)
    ]
    alone, alone_metrics = rollout(good)
    neighbours = [0, 1, 4, 5]
    assert [batch["messages"][i] for i in neighbours] == alone["messages"]
    assert [batch["metadata"][i] for i in neighbours] == alone["metadata"]
    assert batch["rewards"][neighbours].tolist() == alone["rewards"].tolist()
    assert batch["input_ids"][neighbours, : alone["input_ids"].shape[1]].tolist() == alone["input_ids"].tolist()
    assert {k: v for k, v in metrics.items() if not k.startswith(("timing/", "rollout/", "env/guess_number/errors",
                                                                   "env/guess_number/retried"))} == \
        {k: v for k, v in alone_metrics.items() if not k.startswith(("timing/", "rollout/", "env/guess_number/errors",
                                                                       "env/guess_number/retried"))}


class TwoParts(Environment):
    """Two turns: each reports the reward parts "correct" (the turn number) and "format" (0.5);
    sample 1's second turn fails. A second environment reports only "format"."""

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        turn = [sum(m["role"] == "assistant" for m in log) for log in message_logs]
        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "user", "content": "again"}] * n, metadata=list(metadata),
            next_stop_strings=[None] * n, rewards=torch.ones(n), terminateds=torch.tensor([t == 2 for t in turn]),
            errors=["broken" if i == 1 and turn[i] == 2 else None for i in range(n)],
            reward_components={"correct": torch.tensor(turn, dtype=torch.float32), "format": torch.full((n,), 0.5)},
        )


class FormatOnly(Environment):
    def step(self, message_logs, metadata) -> EnvironmentReturn:
        return EnvironmentReturn.final([2.0] * len(metadata), metadata, reward_components={"format": [0.25] * len(metadata)})


def test_named_reward_parts_are_summed_over_turns_like_rewards(tiny_model_path, tokenizer):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=2)
    samples = Batch(messages=[[{"role": "user", "content": f"hi {i}"}] for i in range(3)],
                    task=["parts", "parts", "format"], metadata=[{}] * 3)
    envs = {"parts": TwoParts(), "format": FormatOnly()}
    batch, metrics = run_rollout(samples, generation, envs, tokenizer, max_total_length=64, max_turns=3)
    assert batch["turns"].tolist() == [2, 2, 1] and metrics["env/parts/errors"] == 1.0
    assert batch["rewards"].tolist() == [2.0, 1.0, 2.0]  # a failed step scores 0, its parts too
    assert batch["reward/correct"].tolist() == [1.0 + 2.0, 1.0 + 0.0, 0.0]  # absent: 0
    assert batch["reward/format"].tolist() == [1.0, 0.5, 0.25]


def test_without_reward_parts_the_batch_has_none(tiny_model_path, tokenizer, math_env):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=2)
    samples = Batch(messages=[[{"role": "user", "content": "1+1"}]], task=["math"], metadata=[{"answer": "2"}])
    batch, _ = run_rollout(samples, generation, {"math": math_env}, tokenizer, max_total_length=64)
    assert not [name for name in batch.keys() if name.startswith("reward/")]


class PastDeadline(Environment):
    """What a RemoteEnvironment raises when its actor does not answer within call_timeout_s."""

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        raise EnvironmentTimeout("environment 'slow' did not answer step() within 1 s")


class OneShort(Environment):
    """Returns one result too few."""

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        n = len(message_logs) - 1
        return EnvironmentReturn(
            observations=[{"role": "user", "content": "ok"}] * n, metadata=list(metadata)[:n],
            next_stop_strings=[None] * n, rewards=torch.ones(n), terminateds=torch.ones(n, dtype=torch.bool),
        )


def test_timeouts_and_wrong_length_results_are_counted_per_environment(tiny_model_path, tokenizer):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=3)
    samples = Batch(
        messages=[[{"role": "user", "content": f"hi {i}"}] for i in range(5)],
        task=["slow", "short", "slow", "short", "short"], metadata=[{}] * 5,
    )
    envs = {"slow": tolerant(PastDeadline(), call_retries=1), "short": tolerant(OneShort())}
    batch, metrics = run_rollout(samples, generation, envs, tokenizer, max_total_length=64, max_turns=3)
    assert batch["rewards"].tolist() == [0.0] * 5 and batch["turns"].tolist() == [1] * 5
    assert batch["failed"].tolist() == [True] * 5
    assert (metrics["env/slow/timeouts"], metrics["env/slow/errors"], metrics["env/slow/retried"]) == (2.0, 0.0, 2.0)
    assert (metrics["env/short/timeouts"], metrics["env/short/errors"]) == (0.0, 3.0)


def test_unknown_task_is_refused_before_generating(tiny_model_path, tokenizer):
    generation = TransformersGeneration(tiny_model_path, max_new_tokens=3)
    samples = Batch(messages=[[{"role": "user", "content": "hi"}]], task=["mth"], metadata=[{}])
    with pytest.raises(ConfigError, match=r"sample 0 has task 'mth', but no environment of that name was started; started: sad"):
        run_rollout(samples, generation, {"sad": AlwaysRaises()}, tokenizer, max_total_length=64)
    assert generation.calls == []


# ----------------------------------------------------------------------------- chat format


def test_end_of_turn_tokens_the_model_did_not_generate(tokenizer):
    chat = ChatFormat(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert chat.end_of_turn == [end]
    a = tokenizer.convert_tokens_to_ids("a")
    log = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    header = tokenizer.convert_tokens_to_ids(["<|user|>"])
    obs = {"role": "user", "content": "a"}
    tail = [*header, a, end, tokenizer.convert_tokens_to_ids("<|assistant|>")]
    assert chat.bridge_ids(log, [a, end], [obs]) == tail  # the model wrote <|end|> itself
    assert chat.bridge_ids(log, [a], [obs]) == [end, *tail]  # cut or stopped: the template's <|end|> is added
    assert chat.bridge_ids(log, [a, end], []) == [tail[-1]]  # no observation: a new assistant turn


def test_multi_token_end_of_turn_is_completed(tokenizer):
    template = tokenizer.chat_template.replace("'<|end|>'", "'<|end|>\\n'")
    chat = ChatFormat(tokenizer, template)
    end, newline = tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.convert_tokens_to_ids("\n")
    a = tokenizer.convert_tokens_to_ids("a")
    assert chat.end_of_turn == [end, newline]
    assert chat._missing_end_of_turn([a, end]) == [newline]
    assert chat._missing_end_of_turn([a, end, newline]) == []
    assert chat._missing_end_of_turn([a]) == [end, newline]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    template = "{{ messages | length }}" + tokenizer.chat_template  # the count changes with every message
    chat = ChatFormat(tokenizer, template)
    log = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ConfigError, match="renders a conversation differently once a message is added"):
        chat.bridge_ids(log, [5], [{"role": "user", "content": "more"}])


class RoutedGeneration(TransformersGeneration):
    """Reports ``routed_experts`` as an engine that records routes does: every token it ran
    (all but the last generated), here ``(call number, token id % 7)`` for its two layers."""

    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        out = super().generate(batch, greedy=greedy)
        ids = out["output_ids"]
        routes = torch.stack([torch.full_like(ids, len(self.calls)), ids % 7], -1)[:, :, None, :].expand(-1, -1, 2, -1)
        ran = torch.arange(ids.shape[1])[None, :] < out["unpadded_sequence_lengths"][:, None] - 1
        out["routed_experts"] = torch.where(ran[..., None, None], routes, -1).to(torch.int16)
        return out


def test_each_token_keeps_the_experts_of_the_last_engine_forward_over_it(tiny_model_path, tokenizer, math_env):
    batch = game_and_sum(RoutedGeneration(tiny_model_path, max_new_tokens=6, seed=1), tokenizer, math_env)
    routes = batch["routed_experts"]
    assert routes.dtype == torch.int16 and routes.shape == (*batch["input_ids"].shape, 2, 2)
    for i, last_call in ((0, 3), (1, 1)):
        n = int(batch["input_lengths"][i])
        ids = batch["input_ids"][i, :n - 1]
        expected = torch.stack([torch.full_like(ids, last_call), ids % 7], -1)[:, None, :].expand(-1, 2, -1)
        assert torch.equal(routes[i, :n - 1].long(), expected)
        assert routes[i, n - 1:].eq(-1).all()  # the last generated token and the padding: never run
    assert "routed_experts" not in game_and_sum(TransformersGeneration(tiny_model_path, max_new_tokens=2), tokenizer, math_env)
