"""GPU placement, proven on CPU with Ray's logical GPUs (a cluster that declares GPUs it does
not have; Ray hands out their ids all the same).

On 1, 4 and 8 GPUs of one node and on 2 nodes of 4 (:mod:`tests.core.gpu_layouts`), for a
policy and engines colocated or not, tensor parallel 1 and 2:

- every policy rank has a GPU of its own (no two ranks of the group on one device);
- a tensor-parallel group (policy ranks, or an engine's GPUs) is inside one node, and ranks
  are ordered by node;
- a colocated engine computes on exactly the GPUs of the policy ranks it shares with
  (engine ``e`` of ``E`` on those of ranks ``e * P / E`` on), a separate one on GPUs no
  policy rank has;
- an engine of several GPUs holds none itself and starts its processes on the bundles it
  is given, each with its share of one GPU;
- a worker that asks for no GPU sees none (``CUDA_VISIBLE_DEVICES=""``);
- a tensor-parallel group wider than a node is refused, naming the sizes.

The pure parts (the layout of bundles, rank order, node hand-out) are checked without Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.distributed.cluster import in_order
from posttrain.distributed.placement import Shape, follow_nodes, layout, merged, placed
from tests.core.gpu_layouts import SCENARIOS

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = ("1x1", "1x4:actors", "1x8", "2x4")
CASES = [("1x1", "colocated-tp1"), *[(t, s[0]) for t in ("1x4", "1x8", "2x4") for s in SCENARIOS], ("1x4", "actors")]


@pytest.fixture(scope="module")
def layouts() -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "tests.core.gpu_layouts", *TOPOLOGIES], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def gpus_of(view: dict[str, Any]) -> list[tuple[str, str]]:
    """The (node, GPU id) pairs a rank computes on: its own, or those of its processes."""
    if view["spans"] is None:
        return [(view["node"], gpu) for gpu in view["gpus"]]
    return [(device["node"], gpu) for device in view["devices"] for gpu in device["gpus"]]


@pytest.mark.ray
@pytest.mark.parametrize(("topology", "scenario"), CASES, ids=[f"{t}-{s}" for t, s in CASES])
def test_each_rank_computes_on_its_own_gpus_and_colocated_engines_on_their_ranks(layouts, topology, scenario):
    seen = layouts[topology][scenario]
    assert "error" not in seen, seen["error"]
    policy, engines, (environment,) = seen["policy"], seen["generation"], seen["environment"]

    ranks = [gpus_of(view) for view in policy]
    assert all(len(gpus) == 1 for gpus in ranks), ranks
    assert len({gpu for gpus in ranks for gpu in gpus}) == len(ranks), f"policy ranks share a GPU: {ranks}"
    assert [view["visible"] for view in policy] == [gpus[0][1] for gpus in ranks]
    nodes = [view["node"] for view in policy]
    assert nodes == sorted(nodes, key=nodes.index), f"ranks not ordered by node: {nodes}"
    tp = seen["policy_tp"]
    assert all(len(set(nodes[i:i + tp])) == 1 for i in range(0, len(nodes), tp)), nodes

    spans = [gpus_of(view) for view in engines]
    assert all(len(gpus) == seen["engine_tp"] and len({node for node, _ in gpus}) == 1 for gpus in spans), spans
    assert len({gpu for gpus in spans for gpu in gpus}) == sum(map(len, spans)), f"engines share a GPU: {spans}"
    for view in engines:
        if seen["engine_tp"] > 1:  # the engine's processes take its GPUs; its own process has none
            assert (view["gpus"], view["visible"], len(view["spans"]["bundles"])) == ([], "", seen["engine_tp"])
        else:
            assert view["spans"] is None and view["visible"] == view["gpus"][0]
    if seen["colocated"]:
        for e, gpus in enumerate(spans):
            first = e * len(ranks) // len(spans)
            assert gpus == [gpu for rank in ranks[first:first + len(gpus)] for gpu in rank], (e, spans, ranks)
    else:
        assert not {gpu for gpus in spans for gpu in gpus} & {gpu for gpus in ranks for gpu in gpus}

    assert (environment["gpus"], environment["visible"]) == ([], "")


@pytest.mark.ray
def test_a_worker_computes_on_cuda_only_when_given_a_gpu_and_says_so_when_torch_sees_none(layouts):
    """Actors of real worker groups: the environment (no GPU) and the engines (their GPUs are
    their processes') would compute on the CPU; a policy rank, given a logical GPU on a machine
    without CUDA, raises instead of training on the CPU."""
    seen = layouts["1x4"]["actors"]
    assert [view["uses_cuda"] for view in seen["environment"] + seen["generation"]] == [False] * 3
    for rank, view in enumerate(seen["policy"]):
        assert view["uses_cuda"].startswith(f"this worker was given GPU(s) [{rank}] by Ray, but torch "), view
        assert "Install a torch build for that CUDA version" in view["uses_cuda"]


@pytest.mark.ray
def test_a_tensor_parallel_group_wider_than_a_node_is_refused(layouts):
    message = layouts["2x4"]["too-wide"]
    assert message.startswith("worker group 'policy' asked for 8 x {'CPU': 1.0, 'GPU': 1.0} (8 GPUs on one node), "
                              "8 GPU on one node, but the largest node has 4 GPU. The Ray cluster at "), message


def test_a_colocated_group_is_laid_out_on_its_hosts_gpus():
    """4 policy ranks in tensor-parallel pairs share their GPUs with one engine of 2 GPUs:
    one bundle per GPU, the engine's CPUs with rank 0's, the pairs and the engine each a node
    group; a 4-rank policy without a tensor-parallel group but with that engine puts ranks 0
    and 1 in one node group (the engine's), ranks 2 and 3 free."""
    plan = layout(Shape(4, 2, 0.5, ranks_per_bundle=2), Shape(1, 1, 1.0, devices_per_worker=2))
    assert plan.bundles == ({"CPU": 3, "GPU": 1}, {"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1})
    assert plan.node_groups == ((0, 1), (2, 3))
    assert plan.workers == ((0,), (1,), (2,), (3,)) and plan.guest_workers == ((0, 1),)
    assert (plan.gpus_per_device, plan.guest_gpus_per_device) == (0.5, 0.5)
    assert layout(Shape(4, 1, 0.5), Shape(1, 1, 1.0, devices_per_worker=2)).node_groups == ((0, 1), (2,), (3,))
    # engines spread over the host's GPUs: 2 engines of 1 GPU over 8 ranks sit with ranks 0 and 4
    assert layout(Shape(8, 1, 0.5), Shape(2, 1, 0.5)).guest_workers == ((0,), (4,))
    with pytest.raises(ValueError, match="exceed it"):
        layout(Shape(2, 1, 0.5), Shape(2, 1, 0.75))
    with pytest.raises(ValueError, match="a guest of 4 GPUs cannot share a host's 2"):
        layout(Shape(2, 1, 0.5), Shape(4, 1, 0.5))


def test_a_whole_gpu_worker_and_a_cpu_group():
    """A worker of 2 whole GPUs holds them in one bundle; a group without GPUs has one
    bundle per tensor-parallel group, as before."""
    assert layout(Shape(2, 1, 2.0)).bundles == ({"CPU": 1, "GPU": 2.0},) * 2
    cpu = layout(Shape(4, 1.5, 0.0, ranks_per_bundle=2))
    assert (cpu.bundles, cpu.workers) == (({"CPU": 3.0},) * 2, ((0,), (0,), (1,), (1,)))


def test_ranks_are_ordered_by_node_and_node_groups_merge_overlapping_spans():
    # bundles 0 and 2 on node b, 1 and 3 on node a: b's ranks first (its bundle comes first)
    cpu = placed(None, ["b", "a", "b", "a"], [(0,), (1,), (2,), (3,)], on_gpus=False)
    assert (cpu.bundles, cpu.nodes, cpu.devices) == ((0, 2, 1, 3), ("b", "b", "a", "a"), ())
    # two ranks per bundle (a tensor-parallel group): ranks 0-1 on bundle 0, 2-3 on bundle 1
    assert placed(None, ["b", "a"], [(0,), (0,), (1,), (1,)], on_gpus=False).bundles == (0, 0, 1, 1)
    # a worker spanning two GPUs holds none itself and is told its bundles
    engine = placed(None, ["a", "a"], [(0, 1)], on_gpus=True, gpus_per_device=0.5)
    assert (engine.actor_gpus, engine.device_env(0)) == (
        0.0, {"POSTTRAIN_DEVICE_BUNDLES": "0,1", "POSTTRAIN_GPUS_PER_DEVICE": "0.5"})
    assert placed(None, ["a"], [(0,)], on_gpus=True, gpus_per_device=0.5).actor_gpus == 0.5
    assert merged([range(0, 2), range(1, 3)], 5) == ((0, 1, 2), (3,), (4,))
    # a colocated group without GPUs follows: 2 engines over 4 ranks on nodes a, a, b, b
    assert follow_nodes(["a", "a", "b", "b"], 2) == [{"ray.io/node-id": "a"}, {"ray.io/node-id": "b"}]


def test_nodes_are_handed_out_again_in_order():
    """Ray put node groups 0 and 2 on node a, 1 and 3 on b: handed out in order, 0 and 1 go
    to a; node groups of different GPU counts that do not fit that way keep Ray's nodes."""
    two = {"CPU": 3.0, "GPU": 2.0}
    assert in_order(["a", "b", "a", "b"], [two, {"GPU": 2.0}, two, {"GPU": 2.0}]) == ["a", "a", "b", "b"]
    assert in_order(["a", "b", "a"], [{"GPU": 1.0}, {"GPU": 2.0}, {"GPU": 1.0}]) == ["a", "b", "a"]
