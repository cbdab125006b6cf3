"""Worker groups on a real local Ray cluster: ranks, gloo collectives, sharding, failures; and a
group's single rank in the driver's process (``in_driver``): the calls, results and errors of an
actor's rank, and the process state of a rank of its own (its variables, torch's thread count,
the random generators, torch's deterministic flag)."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch

from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.distributed import VirtualCluster, Worker, WorkerGroup
from posttrain.errors import ConfigError, ProcessDied, WorkerError

pytestmark = pytest.mark.ray

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankedWorker(Worker):
    """A worker that records its environment as __init__ saw it and can join a gloo group."""

    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag
        self.env_at_init = {key: os.environ.get(key) for key in (*RANK_VARS, "POSTTRAIN_TEST_FLAG")}

    def init_gloo(self) -> int:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return dist.get_rank()

    def all_reduce(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64) * (self.rank + 1)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def info(self) -> dict:
        from posttrain.plugins import plugin_host

        return {
            "tag": self.tag,
            "pid": os.getpid(),
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "env_at_init": self.env_at_init,
            "plugins": sorted(name for name, _ in plugin_host().pm.list_name_plugin()),
        }

    def take(self, shard, scale: int = 1):
        return (self.rank, [x * scale for x in shard])

    def fail(self, message: str):
        raise ValueError(message)

    def exit_or_reduce(self, dying_rank: int) -> list[float]:
        if self.rank == dying_rank:
            os._exit(3)
        return self.all_reduce([1.0])  # blocks: the dying rank never joins

    def ping(self) -> int:
        return self.rank

    def block(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


class GlooAtInitWorker(Worker):
    """A worker that joins its gloo group in ``__init__``, as policy backends do."""

    def __init__(self):
        super().__init__()
        import torch.distributed as dist

        dist.init_process_group("gloo")

    def port(self) -> str:
        return os.environ["MASTER_PORT"]


class BrokenWorker(Worker):
    def __init__(self):
        super().__init__()
        raise RuntimeError("no model at /nowhere")


@pytest.fixture(scope="module")
def cluster(ray_cluster):

    vc = VirtualCluster(ClusterConfig(), placement_timeout_s=60)
    yield vc
    vc.shutdown()


@pytest.fixture(scope="module")
def pair(cluster):
    """Two ranks with a private env var, already joined in one gloo group."""

    resources = WorkerResources(cpus=0.5, env_vars={"POSTTRAIN_TEST_FLAG": "on"})
    group = WorkerGroup(cluster, RankedWorker, name="pair", num_workers=2, resources=resources, args=("hello",))
    assert group.run_all(RankedWorker.init_gloo) == [0, 1]
    yield group
    group.shutdown()


def test_ranks_see_their_environment_before_init(pair):
    infos = pair.run_all(RankedWorker.info)
    assert [i["rank"] for i in infos] == [0, 1]
    assert [i["world_size"] for i in infos] == [2, 2]
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert infos[0]["pid"] != infos[1]["pid"] != os.getpid()
    assert {i["tag"] for i in infos} == {"hello"}
    for rank, info in enumerate(infos):
        env = info["env_at_init"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["POSTTRAIN_TEST_FLAG"] == "on"
    ports = {info["env_at_init"]["MASTER_PORT"] for info in infos}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536


def test_workers_load_entry_point_plugins(pair):
    from posttrain.plugins import new_plugin_host

    expected = sorted(name for name, _ in new_plugin_host().pm.list_name_plugin())
    assert "core" in expected
    assert pair.run_rank0(RankedWorker.info)["plugins"] == expected


def test_gloo_all_reduce_across_actors(pair):
    # rank r contributes (r + 1) * values; the sum over 2 ranks is 3 * values
    assert pair.run_all(RankedWorker.all_reduce, [1.0, -2.5, 10.0]) == [[3.0, -7.5, 30.0]] * 2


def test_run_sharded_gives_each_rank_its_shard(pair):
    assert pair.run_sharded(RankedWorker.take, [[1, 2], [3]], scale=10) == [(0, [10, 20]), (1, [30])]


def test_run_sharded_replicates_with_shard_of_rank(pair):
    # tensor-parallel style: both ranks belong to replica 0 and get shard 0
    assert pair.run_sharded(RankedWorker.take, [[7, 8], [9]], shard_of_rank=lambda rank: rank // 2) == [(0, [7, 8]), (1, [7, 8])]
    with pytest.raises(ValueError, match="got 3 shards for 2 ranks"):
        pair.run_sharded(RankedWorker.take, [[1], [2], [3]])
    with pytest.raises(ValueError, match=r"shard_of_rank\(1\) = 2, outside the 2 shards"):
        pair.run_sharded(RankedWorker.take, [[1], [2]], shard_of_rank=lambda rank: 2 * rank)


def test_async_calls_and_rank0(pair):
    refs = pair.run_all_async(RankedWorker.ping)
    assert pair.get(refs) == [0, 1]
    assert pair.get(pair.run_rank0_async(RankedWorker.ping)) == 0
    assert pair.run_rank0(RankedWorker.take, [2], scale=3) == (0, [6])


def test_exception_in_method_names_group_rank_and_method(pair):

    with pytest.raises(WorkerError) as info:
        pair.run_rank0(RankedWorker.fail, "bad shard 17")
    assert str(info.value) == "worker group 'pair' rank 0: fail() raised ValueError: bad shard 17"
    assert pair.run_all(RankedWorker.ping) == [0, 1]  # an exception does not kill the actor
    with pytest.raises(TypeError, match=r"e\.g\. group\.run_all\(RankedWorker\.nope\), not by the string 'nope'"):
        pair.run_all("nope")
    with pytest.raises(AttributeError, match="'BrokenWorker.__init__' is not a method of RankedWorker or of a class it"):
        pair.run_all(BrokenWorker.__init__)


def test_dead_ranks_surface_as_worker_errors_without_hanging(cluster):
    import ray

    with WorkerGroup(
        cluster, RankedWorker, name="dies", num_workers=2, resources=WorkerResources(cpus=0.5), args=("x",)
    ) as group:
        group.run_all(RankedWorker.init_gloo)
        start = time.monotonic()
        # rank 0 blocks in all_reduce waiting for rank 1, which calls os._exit: no hang
        with pytest.raises(WorkerError, match=r"^worker group 'dies' rank 1 died on node [\d.]+ \(host .+, id [0-9a-f]{12}\): "):
            group.run_all(RankedWorker.exit_or_reduce, 1)
        assert time.monotonic() - start < 30
        # rank 0 may still be stuck in the collective or may have seen it fail: either way a
        # call that is pending on it when it is killed surfaces as its death
        pending = group.run_rank0_async(RankedWorker.block, 300)
        ray.kill(group.actors[0])
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"^worker group 'dies' rank 0 died on node [\d.]+ \(host .+, id [0-9a-f]{12}\): "):
            group.get(pending)
        assert time.monotonic() - start < 30
    assert "dies" not in cluster.placement_groups()
    group.shutdown()  # a second shutdown is a no-op
    with pytest.raises(WorkerError, match="worker group 'dies' is shut down; cannot call ping"):
        group.run_all(RankedWorker.ping)


def test_failing_init_names_rank_and_releases_resources(cluster):
    with pytest.raises(
        WorkerError, match=r"worker group 'broken' rank 0: __init__\(\) raised RuntimeError: no model at /nowhere"
    ):
        WorkerGroup(cluster, BrokenWorker, name="broken", num_workers=1, resources=WorkerResources(cpus=0.5))
    assert "broken" not in cluster.placement_groups()


def test_a_rendezvous_port_taken_before_rank_0_listens_starts_the_group_again(cluster, monkeypatch):
    """The first port the driver picks is already listened on (another process took it after
    it was found free): rank 0's ``init_process_group`` fails with EADDRINUSE, and the group
    starts again with the next port instead of failing the run."""
    import socket

    from posttrain.distributed import worker_group

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ports = [port]
    real_free_port = worker_group.free_port
    monkeypatch.setattr(worker_group, "free_port", lambda: ports.pop(0) if ports else real_free_port())
    try:
        group = WorkerGroup(cluster, GlooAtInitWorker, name="retry", num_workers=1, resources=WorkerResources(cpus=0.5))
    finally:
        taken.close()
    try:
        assert group.run_all(GlooAtInitWorker.port) != [str(port)] and not ports
    finally:
        group.shutdown()


def test_placement_that_cannot_fit_fails_with_numbers(cluster, pair):
    import ray

    total_cpus = ray.cluster_resources()["CPU"]
    with pytest.raises(
        ConfigError,
        match=rf"asked for 2 x {{'CPU': {total_cpus}}} = {2 * total_cpus:g} CPU in all, but the whole Ray cluster has {total_cpus:g} CPU",
    ):
        cluster.reserve("huge", 2, WorkerResources(cpus=total_cpus))
    cluster.placement_timeout_s = 1.0
    try:
        start = time.monotonic()
        # 'pair' holds 1 CPU, so the whole cluster's CPUs do not fit now
        with pytest.raises(
            WorkerError,
            match=rf"'hog' asked for 1 x {{'CPU': {total_cpus}}} and was not placed within 1 s. Cluster total: {{'CPU': {total_cpus}}}",
        ):
            cluster.reserve("hog", 1, WorkerResources(cpus=total_cpus))
        assert time.monotonic() - start < 10
    finally:
        cluster.placement_timeout_s = 60
    assert "hog" not in cluster.placement_groups()


# ----------------------------------------------------------------------------- a rank in the driver


class SeededWorker(Worker):
    """Seeds every generator and turns deterministic algorithms on, as a policy worker does."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.use_deterministic_algorithms(True)
        self.env_at_init = {key: os.environ.get(key) for key in (*RANK_VARS, "OMP_NUM_THREADS", "POSTTRAIN_TEST_FLAG")}

    def draw(self) -> tuple:
        return (torch.rand(3).tolist(), random.random(), float(np.random.rand()), torch.get_num_threads(),
                torch.are_deterministic_algorithms_enabled())

    def where(self) -> tuple[dict, int]:
        return self.env_at_init, os.getpid()

    def take(self, shard: list[int], scale: int = 1) -> list[int]:
        return [x * scale for x in shard]

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def lose_a_peer(self) -> None:
        raise ProcessDied("weight sync: generation engine 0 failed while receiving: The actor died")


def start(cluster, place: str, name: str, worker_cls: type = SeededWorker, args: tuple = (5,), **env: str) -> WorkerGroup:
    resources = WorkerResources(cpus=1, env_vars={"POSTTRAIN_TEST_FLAG": "on", **env})
    return WorkerGroup(cluster, worker_cls, name=name, num_workers=1, resources=resources, args=args,
                       in_driver=place == "driver")


def test_a_rank_in_the_driver_draws_and_sees_what_a_rank_of_its_own_does(cluster):
    """The driver draws from its own generators between the rank's calls, as a run's driver
    does: the rank's draws equal an actor's, the driver's are those it would make alone, and
    the thread count, deterministic flag and rank variables the rank set stay with it."""
    outside = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), os.environ.get("RANK"))
    torch.manual_seed(123)
    alone = torch.rand(4).tolist()
    groups = {place: start(cluster, place, f"seeded-{place}") for place in ("actor", "driver")}
    try:
        torch.manual_seed(123)
        draws, driver = {place: [] for place in groups}, []
        for _ in range(2):
            for place, group in groups.items():
                draws[place].append(group.run_rank0(SeededWorker.draw))
            driver += torch.rand(2).tolist()
        assert draws["driver"] == draws["actor"]
        assert draws["driver"][0][3:] == (1, True)  # one thread for one CPU, the flag its __init__ set
        assert driver == alone
        assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), os.environ.get("RANK")) == outside
        (actor_env, actor_pid), (driver_env, driver_pid) = (g.run_rank0(SeededWorker.where) for g in groups.values())
        assert driver_pid == os.getpid() != actor_pid
        assert {k: v for k, v in driver_env.items() if k != "MASTER_PORT"} == \
               {k: v for k, v in actor_env.items() if k != "MASTER_PORT"} == {
                   "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "POSTTRAIN_TEST_FLAG": "on"}
        assert "POSTTRAIN_TEST_FLAG" not in os.environ
    finally:
        for group in groups.values():
            group.shutdown()


def test_calls_and_errors_read_as_an_actor_rank_s(cluster):
    said = {}
    for place in ("actor", "driver"):
        with start(cluster, place, "calls", OMP_NUM_THREADS="2") as group:
            assert group.run_rank0(SeededWorker.draw)[3] == 2  # the worker's own OMP_NUM_THREADS, over its CPUs
            assert group.run_all(SeededWorker.take, [1, 2], scale=3) == [[3, 6]]
            assert group.run_sharded(SeededWorker.take, [[4]]) == [[4]]
            assert group.get(group.run_all_async(SeededWorker.take, [5])) == [[5]]
            assert group.get(group.run_rank0_async(SeededWorker.take, [6])) == [6]
            with pytest.raises(WorkerError) as raised:
                group.run_rank0(SeededWorker.fail, "bad shard 17")
            said[place] = str(raised.value)
            assert not isinstance(raised.value, ProcessDied)
            with pytest.raises(ProcessDied) as lost:  # another process died under the call: kept as such
                group.run_rank0(SeededWorker.lose_a_peer)
            said[f"{place} peer"] = str(lost.value)
            assert group.run_rank0(SeededWorker.take, [7]) == [7]  # an exception leaves the rank usable
        with pytest.raises(WorkerError, match="worker group 'calls' is shut down; cannot call take"):
            group.run_rank0(SeededWorker.take, [8])
        with pytest.raises(WorkerError) as raised:
            start(cluster, place, "broken", BrokenWorker, ())
        said[f"{place} __init__"] = str(raised.value)
        assert "broken" not in cluster.placement_groups()
    assert said == {
        "actor": "worker group 'calls' rank 0: fail() raised ValueError: bad shard 17",
        "driver": "worker group 'calls' rank 0: fail() raised ValueError: bad shard 17",
        **{f"{place} peer": "worker group 'calls' rank 0: lose_a_peer() raised posttrain.errors.ProcessDied: weight sync: generation "
                            "engine 0 failed while receiving: The actor died" for place in ("actor", "driver")},
        "actor __init__": "worker group 'broken' rank 0: __init__() raised RuntimeError: no model at /nowhere",
        "driver __init__": "worker group 'broken' rank 0: __init__() raised RuntimeError: no model at /nowhere",
    }


def test_a_group_that_cannot_run_in_the_driver_is_refused(cluster):
    for count, resources, found in [(2, WorkerResources(), "2 workers"),
                                    (1, WorkerResources(gpus=1), "1 GPUs per worker"),
                                    (1, WorkerResources(runtime_env={"pip": ["x"]}), "runtime_env pip")]:
        with pytest.raises(ValueError) as raised:
            WorkerGroup(cluster, SeededWorker, name="many", num_workers=count, resources=resources, args=(1,),
                        in_driver=True)
        assert str(raised.value) == ("worker group 'many' cannot run in the driver's process: that takes one "
                                     f"worker with no GPU and no runtime_env but env_vars; found {found}")
