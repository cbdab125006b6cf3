"""The conformance kit: it passes a correct plugin, fails each broken one on the contract
it breaks, and (with the example plugin installed) runs its Ray check for real."""

from __future__ import annotations

import importlib.metadata
import textwrap

import pytest

# pytester's inline run drops the modules its inner session imported, and torch refuses to
# import this one twice (torch.testing.assert_close imports it lazily): import it up front.
import torch.distributed.tensor  # noqa: F401

from posttrain.testing import EnvironmentCase, EnvironmentContract

pytest_plugins = ["pytester", "posttrain.testing.pytest_plugin"]

SELFTEST = textwrap.dedent(
    '''
    import types

    import pytest
    import torch

    from posttrain import hookimpl
    from posttrain.batch import Batch
    from posttrain.interfaces import Environment, EnvironmentReturn, LossFunction
    from posttrain.plugins import new_plugin_host
    from posttrain.testing import EnvironmentCase, EnvironmentContract, LossContract

    pytest_plugins = ["posttrain.testing.pytest_plugin"]


    class TokenLoss(LossFunction):
        """-A * logp, summed over valid tokens and divided by the global token count."""

        def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
            mask = batch["token_mask"] * batch["sample_mask"][:, None]
            loss = -(logprobs * batch["advantages"][:, None] * mask).sum() / global_valid_toks
            return loss, {"loss": float(loss.detach()), "tokens": float(mask.sum() / global_valid_toks)}


    class LocalMeanLoss(TokenLoss):
        def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
            mask = batch["token_mask"] * batch["sample_mask"][:, None]
            return super().__call__(logprobs, batch, global_valid_seqs, mask.sum())


    class IgnoresMaskLoss(TokenLoss):
        def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
            return -(logprobs * batch["advantages"][:, None]).sum() / global_valid_toks, {}


    class TensorMetricLoss(TokenLoss):
        def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
            loss, _ = super().__call__(logprobs, batch, global_valid_seqs, global_valid_toks)
            return loss, {"loss": loss.detach()}


    class ExactMatch(Environment):
        def step(self, message_logs, metadata):
            rewards = [float(log[-1]["content"] == meta["answer"]) for log, meta in zip(message_logs, metadata)]
            n = len(message_logs)
            return EnvironmentReturn(
                observations=[{"role": "environment", "content": ""}] * n,
                metadata=list(metadata),
                next_stop_strings=[None] * n,
                rewards=torch.tensor(rewards, dtype=torch.float32),
                terminateds=torch.ones(n, dtype=torch.bool),
            )


    class DropsLast(ExactMatch):
        def step(self, message_logs, metadata):
            result = super().step(message_logs, metadata)
            return EnvironmentReturn(result.observations[:-1], result.metadata, result.next_stop_strings,
                                     result.rewards, result.terminateds)


    class Float64Rewards(ExactMatch):
        def step(self, message_logs, metadata):
            result = super().step(message_logs, metadata)
            return EnvironmentReturn(result.observations, result.metadata, result.next_stop_strings,
                                     result.rewards.double(), result.terminateds)


    class Mutates(ExactMatch):
        def step(self, message_logs, metadata):
            result = super().step(message_logs, metadata)
            for log in message_logs:
                log.append({"role": "environment", "content": "seen"})
            return result


    LOSSES = {"token": TokenLoss, "local_mean": LocalMeanLoss, "ignores_mask": IgnoresMaskLoss,
              "tensor_metric": TensorMetricLoss}
    ENVIRONMENTS = {"exact": ExactMatch, "drops_last": DropsLast, "float64": Float64Rewards, "mutates": Mutates}


    @pytest.fixture
    def posttrain_host():
        host = new_plugin_host(load_entry_points=False)
        host.register(types.SimpleNamespace(
            posttrain_losses=hookimpl(lambda: {k: (lambda options, c=c: c()) for k, c in LOSSES.items()}),
            posttrain_environments=hookimpl(lambda: {k: (lambda options, c=c: c()) for k, c in ENVIRONMENTS.items()}),
        ), name="kit-selftest")
        return host


    BATCH = Batch(
        token_mask=torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 0], [0, 1, 1, 1]]),
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        advantages=torch.tensor([0.5, -1.0, 2.0, 1.5]),
    )
    CASE = EnvironmentCase(
        message_logs=[[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]],
        metadata=[{"answer": "4"}, {"answer": "4"}],
        expected_rewards=[1.0, 0.0],
    )


    class TestToken(LossContract):
        name = "token"
        sample_batch = BATCH


    class TestLocalMean(TestToken):
        name = "local_mean"


    class TestIgnoresMask(TestToken):
        name = "ignores_mask"


    class TestTensorMetric(TestToken):
        name = "tensor_metric"


    class TestNotRegistered(TestToken):
        name = "tokn"


    class TestExact(EnvironmentContract):
        name = "exact"

        @pytest.fixture
        def sample_inputs(self):
            return CASE


    class TestDropsLast(EnvironmentContract):
        name = "drops_last"
        sample_inputs = CASE


    class TestFloat64(TestDropsLast):
        name = "float64"


    class TestMutates(TestDropsLast):
        name = "mutates"


    class TestWrongExpectation(TestDropsLast):
        name = "exact"
        sample_inputs = EnvironmentCase(CASE.message_logs, CASE.metadata, expected_rewards=[1.0, 1.0])
    '''
)

LOSS_TESTS = (
    "test_registered_through_entry_points",
    "test_returns_scalar_with_gradient_on_valid_tokens_only",
    "test_metrics_are_floats",
    "test_microbatches_sum_to_the_full_batch",
)
ENV_TESTS = (
    "test_registered_through_entry_points",
    "test_step_returns_one_result_per_sample",
    "test_rewards_match_expected",
    "test_step_leaves_inputs_unchanged",
    "test_metrics_are_floats",
)

ENV_CLASSES = {"TestExact", "TestDropsLast", "TestFloat64", "TestMutates", "TestWrongExpectation"}

# class -> {test: the assertion message it must fail with}; every other contract test passes
EXPECTED_FAILURES = {
    "TestToken": {},
    "TestLocalMean": {
        "test_microbatches_sum_to_the_full_batch": "the two microbatches' losses do not sum to the full batch's"
    },
    "TestIgnoresMask": {
        "test_returns_scalar_with_gradient_on_valid_tokens_only": "masked tokens (token_mask or sample_mask 0) receive gradient"
    },
    "TestTensorMetric": {"test_metrics_are_floats": "metric 'loss' must be a finite float, got tensor("},
    "TestNotRegistered": {
        test: "unknown loss 'tokn'; installed: token, local_mean, ignores_mask, tensor_metric (from kit-selftest). "
        "Did you mean 'token'?"
        for test in LOSS_TESTS
    },
    "TestExact": {},
    "TestDropsLast": {"test_step_returns_one_result_per_sample": "step() returned 1 observations for 2 message logs"},
    "TestFloat64": {
        "test_step_returns_one_result_per_sample": "rewards must be float32 [2], got torch.float64 (2,)",
        "test_rewards_match_expected": "rewards differ from sample_inputs.expected_rewards",
    },
    "TestMutates": {"test_step_leaves_inputs_unchanged": "step() modified the message logs it was given"},
    "TestWrongExpectation": {"test_rewards_match_expected": "rewards differ from sample_inputs.expected_rewards"},
}


def test_kit_passes_a_good_plugin_and_fails_each_broken_contract(pytester):
    pytester.makepyfile(test_kit_selftest=SELFTEST)
    recorder = pytester.inline_run("-q", "-m", "not ray", "-p", "no:cacheprovider")
    outcomes = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        if report.when == "call" or report.outcome != "passed":
            cls, test = report.nodeid.split("::")[1:]
            outcomes[(cls, test)] = (report.outcome, str(report.longrepr or ""))
    expected = {(cls, test) for cls in EXPECTED_FAILURES for test in (ENV_TESTS if cls in ENV_CLASSES else LOSS_TESTS)}
    assert set(outcomes) == expected  # every contract test ran once (the Ray one is deselected)
    for (cls, test), (outcome, text) in sorted(outcomes.items()):
        failure = EXPECTED_FAILURES[cls].get(test)
        if failure is None:
            assert outcome == "passed", f"{cls}::{test} should pass:\n{text}"
        else:
            assert outcome == "failed", f"{cls}::{test} should fail"
            assert failure in text, f"{cls}::{test} failed for another reason:\n{text}"


REVERSE_INSTALLED = any(dist.metadata["Name"] == "posttrain-env-reverse" for dist in importlib.metadata.distributions())


@pytest.fixture(scope="session")
def ray_local(ray_cluster):
    """The kit's Ray fixture on the suite's shared cluster."""
    return ray_cluster


@pytest.mark.skipif(
    not REVERSE_INSTALLED,
    reason="posttrain-env-reverse is not installed (pip install --no-deps -e examples/plugins/posttrain-env-reverse)",
)
class TestExamplePluginThroughTheKit(EnvironmentContract):
    """The example third-party plugin, found through its entry point, passes every
    contract, including being built and stepped by name inside a Ray worker."""

    name = "reverse"
    sample_inputs = EnvironmentCase(
        message_logs=[
            [{"role": "user", "content": "Reverse: stressed"}, {"role": "assistant", "content": "desserts"}],
            [{"role": "user", "content": "Reverse: ab"}, {"role": "assistant", "content": "ab"}],
        ],
        metadata=[{"text": "stressed"}, {"text": "ab"}],
        expected_rewards=[1.0, 0.0],
    )
