"""Contract tests a plugin author subclasses to test a plugin against the real host.

Each contract is a class of pytest tests. A subclass named ``Test...`` sets what it tests
(``name`` and its inputs, as class attributes or as fixtures of the same name) and
inherits the tests. The ``posttrain_host`` and ``ray_local`` fixtures come from
:mod:`posttrain.testing.pytest_plugin`, which the test module enables with
``pytest_plugins = ["posttrain.testing.pytest_plugin"]``.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.distributed import VirtualCluster, WorkerGroup
from posttrain.interfaces.environment import EnvironmentReturn, Message
from posttrain.plugins import PluginHost
from posttrain.testing.probe import ContractProbe


@attrs.frozen
class EnvironmentCase:
    """A batch of B message logs with their metadata, and optionally the rewards the
    environment must give them."""

    message_logs: Sequence[Sequence[Message]]
    metadata: Sequence[Any]
    expected_rewards: Sequence[float] | None = None


def author_value(request: pytest.FixtureRequest, name: str) -> Any:
    """What the contract's subclass gives as ``name``: a fixture of that name, else a class
    attribute; fails the test with what to set when it gives neither."""
    try:
        return request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        pass
    value = getattr(request.instance, name, None)
    if value is None:
        pytest.fail(f"{type(request.instance).__name__} must set '{name}' (a class attribute or a fixture)")
    return value


class EnvironmentContract:
    """Tests for an environment plugin. Set ``name`` (the registered name),
    ``sample_inputs`` (an :class:`EnvironmentCase`) and, if the factory needs any,
    ``options`` (the mapping under ``environments.<name>``)."""

    name: str
    options: Mapping[str, Any] = {}

    @pytest.fixture
    def environment_case(self, request: pytest.FixtureRequest) -> EnvironmentCase:
        case = author_value(request, "sample_inputs")
        assert isinstance(case, EnvironmentCase), f"sample_inputs must be an EnvironmentCase, got {type(case).__name__}"
        assert len(case.message_logs) == len(case.metadata) > 0, "sample_inputs needs B > 0 logs and B metadata"
        return copy.deepcopy(case)  # each test gets its own, whatever a step does to it

    @pytest.fixture
    def environment(self, posttrain_host: PluginHost, request: pytest.FixtureRequest) -> Any:
        environment = posttrain_host.environments[author_value(request, "name")](dict(self.options))
        yield environment
        environment.shutdown()

    def test_registered_through_entry_points(self, posttrain_host: PluginHost, request: pytest.FixtureRequest) -> None:
        name = author_value(request, "name")
        assert name in posttrain_host.environments, posttrain_host.environments.unknown_message(name)

    def test_step_returns_one_result_per_sample(self, environment: Any, environment_case: EnvironmentCase) -> None:
        result = environment.step(environment_case.message_logs, environment_case.metadata)
        check_environment_return(result, len(environment_case.message_logs))

    def test_rewards_match_expected(self, environment: Any, environment_case: EnvironmentCase) -> None:
        if environment_case.expected_rewards is None:
            pytest.skip("sample_inputs gives no expected_rewards")
        result = environment.step(environment_case.message_logs, environment_case.metadata)
        expected = torch.tensor(list(environment_case.expected_rewards), dtype=torch.float32)
        torch.testing.assert_close(
            result.rewards, expected, msg=lambda m: f"rewards differ from sample_inputs.expected_rewards: {m}"
        )

    def test_step_leaves_inputs_unchanged(self, environment: Any, environment_case: EnvironmentCase) -> None:
        logs, metadata = (
            copy.deepcopy(list(environment_case.message_logs)),
            copy.deepcopy(list(environment_case.metadata)),
        )
        environment.step(logs, metadata)
        assert same(logs, environment_case.message_logs), "step() modified the message logs it was given"
        assert same(metadata, environment_case.metadata), "step() modified the metadata it was given"

    def test_metrics_are_floats(self, environment: Any, environment_case: EnvironmentCase) -> None:
        result = environment.step(environment_case.message_logs, environment_case.metadata)
        metrics = environment.metrics(result.rewards, result.metadata)
        check_float_metrics(metrics)

    @pytest.mark.ray
    def test_usable_by_name_in_ray_worker(
        self, ray_local: Any, environment: Any, environment_case: EnvironmentCase, request: pytest.FixtureRequest
    ) -> None:
        name = author_value(request, "name")
        local = environment.step(environment_case.message_logs, environment_case.metadata)
        cluster = VirtualCluster(ClusterConfig())
        try:
            group = WorkerGroup(
                cluster, ContractProbe, name=f"contract-{name}", num_workers=1, resources=WorkerResources(cpus=0.5)
            )
            with group:
                assert group.run_rank0("pid") != os.getpid()
                remote = group.run_rank0(
                    "step_environment",
                    name,
                    dict(self.options),
                    environment_case.message_logs,
                    environment_case.metadata,
                )
        finally:
            cluster.shutdown()
        check_environment_return(remote, len(environment_case.message_logs))
        torch.testing.assert_close(remote.rewards, local.rewards)
        assert torch.equal(remote.terminateds, local.terminateds)


class LossContract:
    """Tests for a loss plugin. Set ``name`` (the registered name), ``sample_batch`` (a
    :class:`~posttrain.batch.Batch` of B >= 2 samples with ``token_mask`` [B, S], optional
    ``sample_mask`` [B], and whatever else the loss reads) and ``options`` (what the
    factory is called with).

    The kit draws logprobs [B, S] (seeded, 0 where ``token_mask`` is 0) and the global
    valid counts ``sum(token_mask * sample_mask)`` and ``sum(sample_mask)``.
    """

    name: str
    options: Any = None

    @pytest.fixture
    def loss_fn(self, posttrain_host: PluginHost, request: pytest.FixtureRequest) -> Any:
        return posttrain_host.losses[author_value(request, "name")](self.options)

    @pytest.fixture
    def loss_inputs(self, request: pytest.FixtureRequest) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = author_value(request, "sample_batch")
        assert isinstance(batch, Batch) and len(batch) >= 2, "sample_batch must be a Batch of at least 2 samples"
        token_mask = batch["token_mask"].to(torch.float32)
        generator = torch.Generator().manual_seed(0)
        logprobs = -3.0 * torch.rand(token_mask.shape, generator=generator) * token_mask
        return batch, logprobs, _sample_mask(batch).sum(), _valid_tokens(batch).sum()

    def test_registered_through_entry_points(self, posttrain_host: PluginHost, request: pytest.FixtureRequest) -> None:
        name = author_value(request, "name")
        assert name in posttrain_host.losses, posttrain_host.losses.unknown_message(name)

    def test_returns_scalar_with_gradient_on_valid_tokens_only(self, loss_fn: Any, loss_inputs: tuple) -> None:
        batch, logprobs, valid_seqs, valid_toks = loss_inputs
        logprobs = logprobs.clone().requires_grad_(True)
        loss, _ = loss_fn(logprobs, batch, valid_seqs, valid_toks)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0, f"the loss must be a scalar tensor, got {loss!r}"
        assert loss.requires_grad, "the loss carries no gradient to the logprobs"
        assert torch.isfinite(loss), f"the loss is not finite: {loss.item()}"
        loss.backward()
        assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()
        valid = _valid_tokens(batch) > 0
        assert logprobs.grad[valid].abs().sum() > 0, "no gradient reaches the valid tokens"
        assert torch.all(logprobs.grad[~valid] == 0), "masked tokens (token_mask or sample_mask 0) receive gradient"

    def test_metrics_are_floats(self, loss_fn: Any, loss_inputs: tuple) -> None:
        batch, logprobs, valid_seqs, valid_toks = loss_inputs
        _, metrics = loss_fn(logprobs, batch, valid_seqs, valid_toks)
        check_float_metrics(metrics)

    def test_microbatches_sum_to_the_full_batch(self, loss_fn: Any, loss_inputs: tuple) -> None:
        """Normalised by the global counts, two microbatches' losses (and gradients) sum to
        the full batch's."""
        batch, logprobs, valid_seqs, valid_toks = loss_inputs
        full_lp = logprobs.clone().requires_grad_(True)
        full, _ = loss_fn(full_lp, batch, valid_seqs, valid_toks)
        full.backward()
        half = len(batch) // 2
        parts_lp = [logprobs[:half].clone().requires_grad_(True), logprobs[half:].clone().requires_grad_(True)]
        parts = [
            loss_fn(part_lp, part, valid_seqs, valid_toks)[0]
            for part_lp, part in zip(parts_lp, (batch.slice(0, half), batch.slice(half, len(batch))), strict=True)
        ]
        (parts[0] + parts[1]).backward()
        hint = "normalise by the global counts passed in, not by the microbatch's own"
        torch.testing.assert_close(
            parts[0] + parts[1],
            full,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"the two microbatches' losses do not sum to the full batch's ({hint}): {m}",
        )
        torch.testing.assert_close(
            torch.cat([p.grad for p in parts_lp]),
            full_lp.grad,
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m: f"the two microbatches' gradients differ from the full batch's ({hint}): {m}",
        )


def _sample_mask(batch: Batch) -> torch.Tensor:
    return batch["sample_mask"].to(torch.float32) if "sample_mask" in batch else torch.ones(len(batch))


def _valid_tokens(batch: Batch) -> torch.Tensor:
    """[B, S] float: ``token_mask * sample_mask``, the tokens a loss may use."""
    return batch["token_mask"].to(torch.float32) * _sample_mask(batch)[:, None]


def check_environment_return(result: Any, batch_size: int) -> None:
    """Assert that ``result`` is a well-formed :class:`EnvironmentReturn` for B samples."""
    assert isinstance(result, EnvironmentReturn), (
        f"step() must return an EnvironmentReturn, got {type(result).__name__}"
    )
    for field in ("observations", "metadata", "next_stop_strings"):
        found = len(getattr(result, field))
        assert found == batch_size, f"step() returned {found} {field} for {batch_size} message logs"
    for observation in result.observations:
        assert isinstance(observation.get("role"), str) and isinstance(observation.get("content"), str), (
            f"an observation must have str 'role' and 'content', got {observation!r}"
        )
    for stops in result.next_stop_strings:
        assert stops is None or all(isinstance(s, str) for s in stops), f"bad next_stop_strings entry {stops!r}"
    assert result.rewards.dtype == torch.float32 and tuple(result.rewards.shape) == (batch_size,), (
        f"rewards must be float32 [{batch_size}], got {result.rewards.dtype} {tuple(result.rewards.shape)}"
    )
    assert torch.isfinite(result.rewards).all(), f"rewards must be finite, got {result.rewards}"
    assert result.terminateds.dtype == torch.bool and tuple(result.terminateds.shape) == (batch_size,), (
        f"terminateds must be bool [{batch_size}], got {result.terminateds.dtype} {tuple(result.terminateds.shape)}"
    )
    assert len(result.answers) in (0, batch_size), f"answers must be empty or one per log, got {len(result.answers)}"


def check_float_metrics(metrics: Any) -> None:
    """Assert ``metrics`` maps str to finite Python floats."""
    assert isinstance(metrics, Mapping), f"metrics must be a mapping, got {type(metrics).__name__}"
    for key, value in metrics.items():
        assert isinstance(key, str), f"metric name {key!r} is not a str"
        assert isinstance(value, float) and math.isfinite(value), (
            f"metric '{key}' must be a finite float, got {value!r}"
        )


def same(a: Any, b: Any) -> bool:
    """Deep equality that compares tensors by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
