"""``policy.moe`` is refused, when the config loads and before Ray starts, with a backend that
cannot record or replay routes, train the router losses or split the experts, with exact
logprobs, with a negative loss weight or an expert-parallel size the layout cannot hold, and on a
dense model: each message names the key, what is wrong, the fix, and
where it was set."""

from __future__ import annotations

import pytest

from posttrain.config import config_from_dict, load_config
from posttrain.config.schema import MoEConfig, PolicyConfig, RunConfig
from posttrain.errors import ConfigError
from posttrain.models.folder import check_model_folders

REPLAY = "policy:\n  moe:\n    routing_replay: rollout\n"
PREVIOUS = "policy:\n  moe:\n    routing_replay: previous\n"


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        (
            REPLAY + "generation:\n  backend: vllm\n",
            "policy.moe.routing_replay needs the experts each generated token went through, which the generation "
            "backend 'vllm' (posttrain-vllm 0.1.0) does not report; backends that do: hf. Set generation.backend to "
            "one of them, or policy.moe.routing_replay to its default. Where set: policy.moe.routing_replay at "
            "exp.yaml:3; generation.backend at exp.yaml:5.",
        ),
        (
            "policy:\n  backend: torch\n  moe:\n    router_agreement: true\n",
            "policy.moe.router_agreement needs a policy backend that can give its routers the experts of another pass; the "
            "policy backend 'torch' (posttrain-policy-torch 0.1.0) cannot; backends that can: dtensor, megatron. Set "
            "policy.backend to one of them, or policy.moe.router_agreement to its default. Where set: "
            "policy.moe.router_agreement at exp.yaml:4; policy.backend at exp.yaml:2.",
        ),
        (
            REPLAY + "generation:\n  exact_logprobs: true\n",
            "policy.moe.routing_replay is set with generation.exact_logprobs: true, which already has the policy "
            "route every token as the engine's rescoring did (the same arithmetic, bit for bit); the decode's routes "
            "would then differ from the ones the logprobs came from. Set policy.moe.routing_replay to its default, or "
            "generation.exact_logprobs: false. Where set: policy.moe.routing_replay at exp.yaml:3; "
            "generation.exact_logprobs at exp.yaml:5.",
        ),
        (
            "policy:\n  backend: torch\n  moe:\n    routing_replay: previous\n",
            "policy.moe.routing_replay needs a policy backend that can give its routers the experts of another pass; "
            "the policy backend 'torch' (posttrain-policy-torch 0.1.0) cannot; backends that can: dtensor, megatron. Set "
            "policy.backend to one of them, or policy.moe.routing_replay to its default. Where set: "
            "policy.moe.routing_replay at exp.yaml:4; policy.backend at exp.yaml:2.",
        ),
        (
            PREVIOUS + "    router_agreement: true\n",
            "policy.moe.router_agreement compares the engine's experts with the policy's, but "
            "policy.moe.routing_replay: previous gives the policy's training passes its own experts of the "
            "previous-logprob pass (and reports moe/router_agreement against those). Set one of them. Where set: "
            "policy.moe.router_agreement at exp.yaml:4; policy.moe.routing_replay at exp.yaml:3.",
        ),
        (
            PREVIOUS + "generation:\n  exact_logprobs: true\n",
            "policy.moe.routing_replay: previous replays the experts of the previous-logprob pass, which "
            "generation.exact_logprobs: true skips (the engine's logprobs are the trainer's, its routes too). Set "
            "policy.moe.routing_replay to its default, or generation.exact_logprobs: false. Where set: "
            "policy.moe.routing_replay at exp.yaml:3; generation.exact_logprobs at exp.yaml:5.",
        ),
        (
            "algorithm: sft\n" + REPLAY,
            "policy.moe.routing_replay needs an algorithm whose policy passes carry the experts to replay or compare "
            "(its rollouts' or its previous-logprob pass's); the algorithm 'sft' (posttrain-sft 0.1.0) has none; "
            "algorithms that do: grpo, ppo. Set algorithm to one of them, or policy.moe.routing_replay to its "
            "default. Where set: policy.moe.routing_replay at exp.yaml:4; algorithm at exp.yaml:1.",
        ),
        (
            "algorithm: grpo\n" + PREVIOUS + "grpo:\n  loss:\n    rollout_correction: bypass\n",
            "policy.moe.routing_replay: previous replays the experts of the previous-logprob pass, which "
            "grpo.loss.rollout_correction: bypass does not run (the engine's logprobs are the previous policy's). Set "
            "grpo.loss.rollout_correction: decoupled, or policy.moe.routing_replay: rollout with an engine that "
            "records the experts (hf). Where set: policy.moe.routing_replay at exp.yaml:4; "
            "grpo.loss.rollout_correction at exp.yaml:7.",
        ),
    ],
    ids=["vllm", "torch", "exact", "previous_torch", "previous_with_agreement", "previous_exact", "sft",
         "previous_bypass"],
)
def test_backends_and_settings_that_cannot_replay_are_refused(yaml_file, yaml, message):
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file(yaml))
    assert str(info.value) == message


def test_an_unknown_mode_names_the_choices(yaml_file):
    with pytest.raises(ConfigError, match=r"policy.moe.routing_replay.*'off', 'rollout', 'previous'"):
        load_config(yaml_file("policy:\n  moe:\n    routing_replay: engine\n"))


def test_previous_replay_needs_no_engine_that_records(yaml_file):
    """vLLM does not record routes; the policy records its own in ``previous`` mode."""
    config = load_config(yaml_file(PREVIOUS + "generation:\n  backend: vllm\n"))
    assert config.policy.moe.routing_replay == "previous" and not config.policy.moe.records_routes


def test_a_dense_model_is_refused_before_any_worker_starts(tiny_model_path):
    config = config_from_dict({"policy": {"model": tiny_model_path, "moe": {"routing_replay": "rollout"}}})
    with pytest.raises(ConfigError) as info:
        check_model_folders(config)
    assert str(info.value) == (
        f"policy.moe.routing_replay asks for the experts each token was routed to, but policy.model "
        f"'{tiny_model_path}' (llama) is not a mixture of experts: its config.json gives none of num_experts, "
        "num_local_experts, n_routed_experts. Set policy.moe.routing_replay to its default for a dense model"
    )


def test_a_mixture_of_experts_passes(zoo_model):
    check_model_folders(config_from_dict({"policy": {"model": zoo_model("mixtral"), "moe": {"router_agreement": True}}}))


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        (
            "policy:\n  backend: megatron\n  moe:\n    z_loss_coef: 0.001\n",
            "policy.moe.z_loss_coef needs a policy backend that adds the routers' losses to training; the policy "
            "backend 'megatron' (posttrain-megatron 0.1.0) does not; backends that do: dtensor. Set policy.backend to "
            "one of them, or policy.moe.z_loss_coef to its default. Where set: policy.moe.z_loss_coef at exp.yaml:4; "
            "policy.backend at exp.yaml:2.",
        ),
        (
            "policy:\n  moe:\n    aux_loss_coef: -0.01\n",
            "policy.moe.aux_loss_coef: expected a weight >= 0 (0: off), found -0.01. Where set: "
            "policy.moe.aux_loss_coef at exp.yaml:3.",
        ),
    ],
    ids=["megatron", "negative"],
)
def test_router_losses_a_backend_cannot_train_or_negative_are_refused(yaml_file, yaml, message):
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file(yaml))
    assert str(info.value) == message


def test_router_losses_on_a_dense_model_are_refused_before_any_worker_starts(tiny_model_path):
    config = config_from_dict({"policy": {"model": tiny_model_path, "moe": {"aux_loss_coef": 0.01}}})
    with pytest.raises(ConfigError, match=r"^policy.moe.aux_loss_coef weighs a loss of the routers, but policy.model "
                                          r"'.*' \(llama\) is not a mixture of experts: .* Set policy.moe.aux_loss_coef "
                                          r"to its default for a dense model$"):
        check_model_folders(config)


EXPERTS_SPLIT = "policy:\n  num_workers: 2\n  moe:\n    expert_parallel_size: 2\n"


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        (
            "policy:\n  backend: torch\n  num_workers: 2\n  moe:\n    expert_parallel_size: 2\n",
            "policy.moe.expert_parallel_size needs a policy backend that splits the experts over ranks; the policy "
            "backend 'torch' (posttrain-policy-torch 0.1.0) does not; backends that do: dtensor, megatron. Set "
            "policy.backend to "
            "one of them, or policy.moe.expert_parallel_size to its default. Where set: "
            "policy.moe.expert_parallel_size at exp.yaml:5; policy.backend at exp.yaml:2.",
        ),
        (
            "policy:\n  num_workers: 2\n  moe:\n    expert_parallel_size: 4\n",
            "policy.moe.expert_parallel_size=4 does not divide the policy's data-parallel size 2 (policy.num_workers=2 "
            "over the model-parallel sizes): expert-parallel groups are made of data-parallel ranks. Set "
            "policy.num_workers to a multiple of 4 times the model-parallel sizes, or policy.moe.expert_parallel_size "
            "to a divisor of 2. Where set: policy.moe.expert_parallel_size at exp.yaml:4; policy.num_workers at "
            "exp.yaml:2.",
        ),
        (
            "policy:\n  moe:\n    expert_parallel_size: 0\n",
            "policy.moe.expert_parallel_size: expected an integer >= 1 (1: no expert parallelism), found 0. Where "
            "set: policy.moe.expert_parallel_size at exp.yaml:3.",
        ),
        (
            EXPERTS_SPLIT + "generation:\n  backend: hf\n  exact_logprobs: true\n",
            "generation.exact_logprobs is true, but policy.moe.expert_parallel_size is 2: each rank's experts would "
            "run on the tokens of other ranks, which the engines' scoring does not; set "
            "policy.moe.expert_parallel_size: 1. Where set: generation.exact_logprobs at exp.yaml:7; "
            "policy.moe.expert_parallel_size at exp.yaml:4.",
        ),
    ],
    ids=["torch", "not_dividing_dp", "zero", "exact"],
)
def test_expert_parallelism_a_backend_or_layout_cannot_serve_is_refused(yaml_file, yaml, message):
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file(yaml))
    assert str(info.value) == message


def test_expert_parallelism_on_a_dense_model_is_refused_before_any_worker_starts(tiny_model_path):
    """The check for policy backends that split experts without reading the model (dtensor refuses
    the config already, from the model's own config: tests/plugins/backends/dtensor)."""
    config = RunConfig(policy=PolicyConfig(model=tiny_model_path, num_workers=2, moe=MoEConfig(expert_parallel_size=2)))
    with pytest.raises(ConfigError, match=r"^policy.moe.expert_parallel_size splits the experts over ranks, but "
                                          r"policy.model '.*' \(llama\) is not a mixture of experts: .* Set "
                                          r"policy.moe.expert_parallel_size to its default for a dense model$"):
        check_model_folders(config)
