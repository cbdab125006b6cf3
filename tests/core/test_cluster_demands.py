"""What a run's parts hold of the Ray cluster, added up (:mod:`posttrain.config.demands`):
the bundles each part asks for, as the cluster would place them, and the refusal when they
do not fit together (before Ray starts: tests/core/test_validation_before_ray.py)."""

from __future__ import annotations

import pytest

from posttrain.config import load_config
from posttrain.config.demands import Demand, check_demands_fit, run_demands, started_cluster_size
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain.run.context import RunContext

EXAMPLE = "examples/configs/grpo_math_tiny.yaml"
GPUS = ["cluster.use_gpus=true", "policy.resources.gpus=0.5", "generation.resources.gpus=0.5",
        "generation.weight_transport=gloo"]


def demands(*overrides: str) -> dict[str, list[dict[str, float]]]:
    config = load_config(EXAMPLE, ["algorithm=grpo", *overrides])
    return {d.part: [dict(b) for b in d.bundles] for d in run_demands(config, plugin_host())}


def test_engines_inside_the_policy_workers_hold_nothing_of_their_own():
    assert demands() == {"worker group 'policy'": [{"CPU": 1.0}]}
    assert demands("generation.in_policy_workers=false") == {
        "worker group 'policy'": [{"CPU": 1.0}], "worker group 'generation'": [{"CPU": 1.0}]}


def test_colocated_engines_on_gpus_add_their_cpus_to_the_policy_gpus():
    """Two policy ranks of half a GPU each reserve a whole GPU each (a bundle per device);
    the engines on those GPUs add their CPUs only."""
    assert demands("policy.num_workers=2", "generation.num_workers=2", *GPUS) == {
        "worker group 'policy'": [{"CPU": 1.0, "GPU": 1.0}] * 2,
        "worker group 'generation'": [{"CPU": 1.0}] * 2,
    }
    apart = demands("policy.num_workers=2", "generation.colocated=false", "cluster.use_gpus=true",
                    "policy.resources.gpus=1", "generation.resources.gpus=2", "generation.tensor_parallel_size=2",
                    "generation.backend=vllm")
    assert apart["worker group 'generation'"] == [{"CPU": 1.0, "GPU": 1.0}, {"GPU": 1.0}]  # one engine on 2 GPUs


def test_a_second_model_and_a_data_plane_are_counted_only_where_the_run_has_them():
    assert demands("algorithm=sft") == {"worker group 'policy'": [{"CPU": 1.0}]}
    assert "worker group 'critic'" in demands("algorithm=ppo", "ppo.critic.resources.cpus=2")
    assert demands("algorithm=ppo", "ppo.critic.resources.cpus=2")["worker group 'critic'"] == [{"CPU": 2.0}]
    assert demands("algorithm=eval") == {"worker group 'generation'": [{"CPU": 1.0}]}  # beside no policy
    assert demands("algorithm=eval", "eval.checkpoint=ckpt/step_3") == {
        "worker group 'generation'": [{"CPU": 1.0}], "worker group 'policy'": [{"CPU": 1.0}]}
    assert demands("data_plane.backend=transferqueue", "data_plane.transferqueue.num_storage_units=3")[
        "TransferQueue"] == [{"CPU": 1.0}] * 4


def test_gpus_are_checked_before_ray_only_when_the_config_says_how_many():
    config = load_config(EXAMPLE, ["algorithm=grpo", "policy.num_workers=2", "generation.num_workers=2", *GPUS])
    parts = run_demands(config, plugin_host())
    assert started_cluster_size(config) == {"CPU": 4.0}  # cluster.num_gpus null: Ray detects them
    check_demands_fit(config, parts, started_cluster_size(config))
    one_gpu = load_config(EXAMPLE, ["algorithm=grpo", "policy.num_workers=2", "generation.num_workers=2", *GPUS, "cluster.num_gpus=1"])
    with pytest.raises(ConfigError, match=r"ask Ray for 2 GPUs in all, but the Ray cluster the run starts has 1 "
                                          r"\(cluster.num_gpus\): worker group 'policy' 2 x \{CPU: 1, GPU: 1\}\. "):
        check_demands_fit(one_gpu, run_demands(one_gpu, plugin_host()), started_cluster_size(one_gpu))


def test_a_joined_cluster_is_told_to_grow_not_to_set_num_cpus():
    config = load_config(EXAMPLE)
    parts = [Demand("worker group 'policy'", ({"CPU": 1.0},) * 3, ("policy.num_workers", "policy.resources.cpus"))]
    with pytest.raises(ConfigError) as info:
        check_demands_fit(config, parts, {"CPU": 2.0}, joined="10.0.0.7:6379")
    assert str(info.value) == (
        "The run's parts ask Ray for 3 CPUs in all, but the Ray cluster at 10.0.0.7:6379 has 2: worker group 'policy' "
        "3 x {CPU: 1}. They are held together for the whole run, so the last to ask would wait for a placement that "
        "never comes; no worker was started. Add nodes with more CPUs to that cluster, or lower what the parts ask "
        "for (policy.num_workers, policy.resources.cpus). Where set: policy.resources.cpus at "
        "examples/configs/grpo_math_tiny.yaml:33."
    )


def test_a_cluster_running_before_the_run_is_checked_once_connected(ray_cluster, tmp_path):
    """This process's Ray is already up, so the check before Ray is skipped; the run checks
    its parts against that cluster as soon as it connects, before any worker starts. Each
    part alone fits (a critic of all its CPUs), so the cluster's own check would pass each."""
    total = int(ray_cluster.cluster_resources()["CPU"])
    config = load_config(EXAMPLE, ["algorithm=ppo", f"ppo.critic.resources.cpus={total}", f"run_dir={tmp_path}"])
    context = RunContext(config)
    try:
        with pytest.raises(ConfigError, match=rf"^The run's parts ask Ray for {total + 1} CPUs in all, but the Ray "
                                              rf"cluster at \S+ has {total}: worker group 'policy' 1 x \{{CPU: 1\}}; "
                                              rf"worker group 'critic' 1 x \{{CPU: {total}\}}\. "):
            context.start_cluster()
    finally:
        context.close()
    assert ray_cluster.available_resources().get("CPU") == total  # nothing was placed


def test_gpus_ray_did_not_find_on_a_cluster_the_run_started_are_named_as_missing(ray_cluster, tmp_path, monkeypatch):
    """A run that started its own cluster (here: Ray reports it started it) with
    ``cluster.num_gpus`` null has the GPUs Ray found; asking for more is refused once Ray is
    up, naming this machine, not a cluster to grow."""
    import ray

    import posttrain.distributed.cluster as cluster

    config = load_config(EXAMPLE, ["algorithm=sft", "policy.resources.gpus=1", "cluster.use_gpus=true",
                                   f"run_dir={tmp_path}"])
    starts = []

    def init_ray(config) -> bool:  # as if the first call had started this cluster
        starts.append(config)
        return len(starts) == 1

    monkeypatch.setattr(ray, "is_initialized", lambda: bool(starts))
    monkeypatch.setattr(cluster, "init_ray", init_ray)
    context = RunContext(config)
    try:
        with pytest.raises(ConfigError) as info:
            context.start_cluster()
    finally:
        context.close()
    assert str(info.value).startswith(
        "The run's parts ask Ray for 1 GPUs in all, but Ray found 0 on this machine (cluster.num_gpus: null): worker "
        "group 'policy' 1 x {CPU: 1, GPU: 1}. They are held together for the whole run, so the last to ask would wait "
        "for a placement that never comes; no worker was started. Run it on a machine with 1 GPUs, or lower what the "
        "parts ask for (policy.num_workers, policy.resources.cpus, policy.resources.gpus)."
    )
