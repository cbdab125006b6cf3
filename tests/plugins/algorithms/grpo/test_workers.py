"""The sections GRPO starts its worker groups with: asynchronous GRPO on CPUs makes the
policy's and the engines' OpenMP threads wait passively, unless the config says otherwise;
the engines learn the most rows a generate call brings."""

from __future__ import annotations

import attrs

from posttrain.config import ClusterConfig, GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain_grpo.config import AsynchronousConfig, GRPOConfig
from posttrain_grpo.workers import with_rows_per_call, worker_sections


def config(staleness: int, *, use_gpus: bool = False, policy_env: dict[str, str] | None = None,
           engine_runtime_env: dict[str, dict[str, str]] | None = None) -> tuple[RunConfig, GRPOConfig]:
    grpo = GRPOConfig(asynchronous=AsynchronousConfig(max_staleness_steps=staleness))
    run = RunConfig(
        algorithm="grpo",
        cluster=ClusterConfig(use_gpus=use_gpus),
        policy=PolicyConfig(resources=WorkerResources(cpus=2, env_vars={"OMP_NUM_THREADS": "2", **(policy_env or {})})),
        generation=GenerationConfig(colocated=False, resources=WorkerResources(runtime_env=engine_runtime_env or {})),
        sections={"grpo": grpo},
    )
    return run, grpo


def test_asynchronous_on_cpus_waits_passively_and_keeps_the_rest(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    run, grpo = config(1)
    policy, generation = worker_sections(run, grpo)
    assert policy.resources.env_vars == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    assert generation.resources.env_vars == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert attrs.evolve(policy, resources=run.policy.resources) == run.policy
    assert attrs.evolve(generation, resources=run.generation.resources) == run.generation
    assert run.policy.resources.env_vars == {"OMP_NUM_THREADS": "2"}  # the run's config is not changed


def test_synchronous_or_on_gpus_the_sections_are_the_runs():
    for run, grpo in (config(0), config(2, use_gpus=True)):
        assert worker_sections(run, grpo) == (run.policy, run.generation)


def test_a_wait_policy_the_driver_sets_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    run, grpo = config(1)
    assert worker_sections(run, grpo) == (run.policy, run.generation)


def test_a_wait_policy_the_config_sets_is_kept(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    run, grpo = config(1, policy_env={"OMP_WAIT_POLICY": "ACTIVE"},
                       engine_runtime_env={"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}})
    policy, generation = worker_sections(run, grpo)
    assert policy.resources.env_vars["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_WAIT_POLICY" not in generation.resources.env_vars  # runtime_env's ACTIVE applies


def test_rows_per_call_is_a_steps_samples_or_the_validation_prompts_whichever_is_more():
    grpo = GRPOConfig(num_prompts_per_step=4, num_generations_per_prompt=8)
    assert with_rows_per_call(GenerationConfig(), grpo, validation_prompts=20).rows_per_call == 32
    assert with_rows_per_call(GenerationConfig(), grpo, validation_prompts=256).rows_per_call == 256
    assert with_rows_per_call(GenerationConfig(rows_per_call=8), grpo, validation_prompts=256).rows_per_call == 8
