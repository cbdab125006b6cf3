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
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest
import torch

from posttrain.batch import Batch
from posttrain.builtin.memory_plane import MemoryDataPlane
from posttrain.config.schema import ClusterConfig, RunConfig, WorkerResources
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
                assert group.run_rank0(ContractProbe.pid) != os.getpid()
                remote = group.run_rank0(
                    ContractProbe.step_environment,
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


class DataPlaneContract:
    """Tests for a data plane plugin: through :class:`~posttrain.interfaces.DataPlane` it
    must return what core's in-memory plane returns (values, dtypes, zero padding of ragged
    rows, Python objects, tags, key order, errors naming what is missing).

    Set ``name`` (the registered name) and, if its factory reads any, ``sections`` (plugin
    config sections by dotted path). The kit builds the plane with
    ``factory(RunConfig(run_dir=<tmp dir>, sections=sections))`` and shuts it down after
    each test. A subclass whose plane is slow to start may give its own ``data_plane``
    fixture instead (e.g. one plane per module, its partitions cleared after each test).
    """

    name: str
    sections: Mapping[str, Any] = {}

    @pytest.fixture
    def data_plane(self, posttrain_host: PluginHost, request: pytest.FixtureRequest, tmp_path: Any) -> Any:
        factory = posttrain_host.data_planes[author_value(request, "name")]
        plane = factory(RunConfig(run_dir=str(tmp_path / "run"), sections=dict(self.sections)))
        yield plane
        plane.shutdown()

    def test_registered_through_entry_points(self, posttrain_host: PluginHost, request: pytest.FixtureRequest) -> None:
        name = author_value(request, "name")
        assert name in posttrain_host.data_planes, posttrain_host.data_planes.unknown_message(name)

    def test_get_returns_selected_fields_of_selected_keys_in_key_order(self, data_plane: Any) -> None:
        fields = _grpo_like_fields(6, width=5, seed=0)
        keys = [f"uid{i}_g0" for i in range(6)]
        data_plane.put("train/0", keys, fields)
        order = [4, 1, 5, 0]
        names = ["logprobs", "input_ids", "token_mask", "rewards", "lengths"]
        out = data_plane.get("train/0", [keys[i] for i in order], names)
        check_same_batch(out, {n: fields[n][order] for n in names}, "get of 4 of 6 keys")

    def test_ragged_rows_are_right_padded_with_zeros_to_the_widest_selected(self, data_plane: Any) -> None:
        narrow = {"ids": torch.tensor([[1, 2, 3], [4, 5, 6]]), "mask": torch.tensor([[True, True, False]] * 2)}
        wide = {"ids": torch.tensor([[7, 8, 9, 10, 11]]), "mask": torch.tensor([[True] * 5])}
        data_plane.put("train/0", ["a", "b"], narrow)
        data_plane.put("train/0", ["c"], wide)
        out = data_plane.get("train/0", ["c", "a"], ["ids", "mask"])
        expected = {
            "ids": torch.tensor([[7, 8, 9, 10, 11], [1, 2, 3, 0, 0]]),
            "mask": torch.tensor([[True] * 5, [True, True, False, False, False]]),
        }
        check_same_batch(out, expected, "get across puts of widths 3 and 5")
        check_same_batch(data_plane.get("train/0", ["b", "a"], ["ids"]), {"ids": narrow["ids"][[1, 0]]}, "narrow only")

    def test_python_objects_round_trip(self, data_plane: Any) -> None:
        logs = [
            [{"role": "user", "content": "1+1?", "token_ids": torch.tensor([5, 6, 7])}],
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "token_ids": torch.tensor([9])}],
            [],
        ]
        metadata = [{"answer": "2", "turn": 0}, {"answer": None, "tags": ["a", "b"]}, {}]
        data_plane.put("train/0", ["a", "b", "c"], {"message_log": logs, "metadata": metadata, "task": ["m", "g", "m"]})
        out = data_plane.get("train/0", ["c", "a", "b"], ["message_log", "metadata", "task"])
        for name, value in (("message_log", logs), ("metadata", metadata), ("task", ["m", "g", "m"])):
            assert isinstance(out[name], list), (
                f"field '{name}' must come back as a list, got {type(out[name]).__name__}"
            )
            assert same(out[name], [value[2], value[0], value[1]]), f"field '{name}' changed: {out[name]!r}"
        data_plane.put("train/0", ["a", "b", "c"], {"idx": [7, 8, 9]})
        check_same_batch(
            data_plane.get("train/0", ["b", "c"], ["idx"]), {"idx": torch.tensor([8, 9])}, "per-sample numbers"
        )

    def test_fields_added_later_and_replaced(self, data_plane: Any) -> None:
        data_plane.put("train/0", ["a", "b"], {"x": torch.tensor([1.0, 2.0]), "log": [["q1"], ["q2"]]})
        data_plane.put("train/0", ["b", "a"], {"logprobs": torch.tensor([[0.5, 0.1], [0.25, 0.2]])})
        data_plane.put("train/0", ["a"], {"x": torch.tensor([9.0]), "log": [["q1", "a1"]]})
        out = data_plane.get("train/0", ["a", "b"], ["x", "logprobs", "log"])
        expected = {
            "x": torch.tensor([9.0, 2.0]),
            "logprobs": torch.tensor([[0.25, 0.2], [0.5, 0.1]]),
            "log": [["q1", "a1"], ["q2"]],
        }
        check_same_batch(out, expected, "fields written by three puts")

    def test_keys_in_insertion_order(self, data_plane: Any) -> None:
        data_plane.put("train/0", ["b", "a"], {"x": torch.zeros(2)})
        data_plane.put("train/0", ["c", "a"], {"x": torch.ones(2)})
        assert data_plane.keys("train/0") == ["b", "a", "c"]

    def test_tags_are_read_without_fields(self, data_plane: Any) -> None:
        keys = ["a", "b", "c"]
        lengths = torch.tensor([3, 1, 2], dtype=torch.int32)
        data_plane.put("train/0", keys, {"x": torch.zeros(3, 4)}, tags={"length": lengths})
        data_plane.put("train/0", keys, {}, tags={"keep": torch.tensor([True, False, True])})  # tags only, later
        tags = data_plane.tags("train/0")
        check_same_batch(
            Batch(tags), {"keep": torch.tensor([True, False, True]), "length": lengths}, "tags of every key"
        )
        check_same_batch(
            Batch(data_plane.tags("train/0", ["c", "a"])),
            {"keep": torch.tensor([True, True]), "length": lengths[[2, 0]]},
            "tags of two keys",
        )
        rewards = torch.rand(3, generator=torch.Generator().manual_seed(0))  # float32 values, kept exactly
        data_plane.put("train/0", keys, {}, tags={"length": torch.tensor([5, 6, 7]), "reward": rewards})
        check_same_batch(
            Batch(data_plane.tags("train/0")),
            {"keep": torch.tensor([True, False, True]), "length": torch.tensor([5, 6, 7]), "reward": rewards},
            "tags after replacing 'length' (now int64) and adding 'reward'",
        )

    def test_clear_drops_the_partition_and_only_it(self, data_plane: Any) -> None:
        data_plane.put("train/0", ["a"], {"x": torch.zeros(1)})
        data_plane.put("val/0", ["a"], {"x": torch.ones(1)})
        assert sorted(data_plane.partitions()) == ["train/0", "val/0"]
        data_plane.clear("train/0")
        data_plane.clear("train/0")  # clearing twice is fine
        data_plane.clear("never/written")
        assert data_plane.partitions() == ["val/0"]
        with pytest.raises(KeyError) as error:
            data_plane.keys("train/0")
        assert "train/0" in error.value.args[0], f"the error must name the partition: {error.value.args[0]}"
        check_same_batch(data_plane.get("val/0", ["a"], ["x"]), {"x": torch.ones(1)}, "the other partition")
        data_plane.clear("val/0")
        assert data_plane.partitions() == []

    def test_errors_name_what_is_missing(self, data_plane: Any) -> None:
        data_plane.put("train/0", ["a", "b"], {"x": torch.zeros(2)})
        data_plane.put("train/0", ["a"], {"y": torch.zeros(1)})
        cases = [
            (lambda: data_plane.get("train/0", ["a", "zz"], ["x"]), KeyError, ["train/0", "zz"]),
            (lambda: data_plane.get("train/0", ["a", "b"], ["y"]), KeyError, ["train/0", "'b'", "y"]),
            (lambda: data_plane.get("train/0", ["a"], ["nope"]), KeyError, ["train/0", "'a'", "nope"]),
            (lambda: data_plane.get("absent/1", ["a"], ["x"]), KeyError, ["absent/1"]),
            (lambda: data_plane.tags("absent/1"), KeyError, ["absent/1"]),
            (lambda: data_plane.keys("absent/1"), KeyError, ["absent/1"]),
            (lambda: data_plane.put("train/0", ["a"], {"w": torch.zeros(2)}), ValueError, ["'w'", "2 rows", "1 keys"]),
        ]
        for call, error_type, fragments in cases:
            with pytest.raises(error_type) as error:
                call()
            message = str(error.value.args[0])
            missing = [f for f in fragments if f not in message]
            assert not missing, f"{error_type.__name__} message {message!r} does not name {missing}"

    def test_a_worker_handle_reaches_the_same_partitions(self, data_plane: Any) -> None:
        """What :meth:`~posttrain.interfaces.DataPlane.worker_handle` opens (after a pickle
        round trip, as it travels to a worker) reads the driver's samples, and what it writes
        the driver reads."""
        handle = data_plane.worker_handle()
        if handle is None:
            pytest.skip("workers cannot reach this plane; policies read and write it through the driver")
        data_plane.put("train/0", ["a", "b"], {"x": torch.tensor([1.0, 2.0])})
        remote = pickle.loads(pickle.dumps(handle)).open()
        check_same_batch(remote.get("train/0", ["b", "a"], ["x"]), {"x": torch.tensor([2.0, 1.0])}, "the worker's get")
        remote.put("train/0", ["b"], {"logprobs": torch.tensor([[0.5, 0.25]])})
        check_same_batch(data_plane.get("train/0", ["b"], ["logprobs"]), {"logprobs": torch.tensor([[0.5, 0.25]])},
                         "the driver's get of what the worker wrote")
        data_plane.clear("train/0")
        assert data_plane.partitions() == []

    def test_matches_the_in_memory_plane(self, data_plane: Any) -> None:
        """A scripted run of puts, gets, tags and clears gives the reference's results."""
        if type(data_plane) is MemoryDataPlane:
            pytest.skip("the in-memory plane is the reference")
        expected = _plane_script(MemoryDataPlane())
        actual = _plane_script(data_plane)
        assert len(actual) == len(expected)
        for (what, value), (_, reference) in zip(actual, expected, strict=True):
            if isinstance(reference, Mapping):  # a get (Batch) or tags: dtypes compared too
                check_same_batch(value, reference, what)
            else:
                assert same(value, reference), f"{what}: {value!r}, the in-memory plane gives {reference!r}"


def _grpo_like_fields(num_samples: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 100, (num_samples, width), generator=generator)
    return {
        "input_ids": input_ids,
        "logprobs": -torch.rand(num_samples, width, generator=generator),
        "token_mask": input_ids > 50,
        "rewards": torch.rand(num_samples, generator=generator, dtype=torch.float64),
        "lengths": torch.randint(1, width + 1, (num_samples,), generator=generator, dtype=torch.int32),
    }


def _plane_script(plane: Any) -> list[tuple[str, Any]]:
    """Drive ``plane`` through two GRPO-like steps; return what each read gave."""
    out: list[tuple[str, Any]] = []
    for step, width in ((0, 4), (1, 7)):
        part = f"parity/{step}"
        keys = [f"s{step}_{i}" for i in range(5)]
        fields = _grpo_like_fields(5, width, seed=step)
        logs = [[{"role": "user", "content": f"q{i}", "token_ids": torch.arange(i + 1)}] for i in range(5)]
        plane.put(part, keys[:3], {**{k: v[:3] for k, v in fields.items()}, "message_log": logs[:3]})
        short = {k: v[3:, : width - 2] if v.dim() == 2 else v[3:] for k, v in fields.items()}
        plane.put(part, keys[3:], {**short, "message_log": logs[3:], "idx": [3, 4]}, tags={"length": short["lengths"]})
        plane.put(part, keys[:3], {"idx": [0, 1, 2]}, tags={"length": fields["lengths"][:3]})
        keep_tags = {
            "keep": torch.arange(5) % 2 == 0,
            "reward": torch.rand(5, generator=torch.Generator().manual_seed(step)),
        }
        plane.put(part, keys[::-1], {"advantages": torch.linspace(-1, 1, 5)}, tags=keep_tags)
        out.append((f"{part} keys", plane.keys(part)))
        out.append((f"{part} tags", plane.tags(part)))
        kept = [k for k, keep in zip(keys, plane.tags(part)["keep"].tolist(), strict=True) if keep]
        names = ["input_ids", "logprobs", "token_mask", "rewards", "lengths", "advantages", "message_log", "idx"]
        out.append((f"{part} kept", plane.get(part, kept[::-1], names)))
        out.append((f"{part} all", plane.get(part, keys, names)))
        plane.put(part, keys[1:2], {"logprobs": torch.full((1, width), -0.5)})
        out.append((f"{part} replaced", plane.get(part, keys[:2], ["logprobs"])))
    out.append(("partitions", sorted(p for p in plane.partitions() if p.startswith("parity/"))))
    plane.clear("parity/0")
    out.append(("after clear", sorted(p for p in plane.partitions() if p.startswith("parity/"))))
    plane.clear("parity/1")
    return out


def check_same_batch(actual: Any, expected: Mapping[str, Any], what: str) -> None:
    """Assert ``actual`` (a Batch or a dict of tensors) has exactly ``expected``'s fields, in
    order, with equal dtypes, shapes and values; list fields compare with :func:`same`."""
    assert list(actual.keys()) == list(expected.keys()), (
        f"{what}: fields {list(actual.keys())}, expected {list(expected)}"
    )
    for name, want in expected.items():
        got = actual[name]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), f"{what}: field '{name}' is a {type(got).__name__}, expected a tensor"
            assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (
                f"{what}: field '{name}' is {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
            )
            assert torch.equal(got, want), f"{what}: field '{name}' is\n{got}\nexpected\n{want}"
        else:
            assert same(got, want), f"{what}: field '{name}' is {got!r}, expected {want!r}"


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
