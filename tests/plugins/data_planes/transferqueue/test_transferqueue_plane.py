"""The transferqueue data plane: the shared data-plane contract, partition hygiene (clear,
crashed writers), dynamic sampling that never moves dropped samples, Ray workers reading
their own shards, a start that fails with a message instead of hanging, and a call on a dead
controller that fails instead of waiting forever.

The first two tests must start TransferQueue themselves, so they run before the module's
shared plane exists (pytest keeps file order); the second then creates it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

pytest.importorskip("transfer_queue", reason="transferqueue is not installed (pip install posttrain-transferqueue)")

import ray  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from posttrain.config.schema import ClusterConfig, RunConfig, WorkerResources  # noqa: E402
from posttrain.distributed import VirtualCluster, Worker, WorkerGroup  # noqa: E402
from posttrain.errors import ConfigError, ProcessDied, WorkerError  # noqa: E402
from posttrain.plugins import new_plugin_host  # noqa: E402
from posttrain.testing import DataPlaneContract  # noqa: E402
from posttrain_transferqueue.config import SECTION, TransferQueueConfig  # noqa: E402
from posttrain_transferqueue.plane import TransferQueueDataPlane  # noqa: E402
from posttrain_transferqueue.runtime import STORAGE_UNIT_NAME, WATCH_S, controller_running  # noqa: E402

pytestmark = [pytest.mark.transferqueue, pytest.mark.ray]
pytest_plugins = ["posttrain.testing.pytest_plugin"]

WRITER = Path(__file__).with_name("crashing_writer.py")
CAPACITY = 256  # samples the shared plane's TransferQueue holds at once


def _new_plane(run_dir: Path, **options: Any) -> Any:
    """A run driver's plane, built by name like a run builds it."""
    config = RunConfig(run_dir=str(run_dir), sections={SECTION: TransferQueueConfig(**options)})
    return new_plugin_host().data_planes["transferqueue"](config)


def _tq_partitions(namespace: str) -> dict[str, dict[str, Any]]:
    """TransferQueue's own listing of ``namespace``: partition -> key -> tags (empty ones too)."""
    import transfer_queue as tq

    return {name: rows for name, rows in tq.kv_list().items() if name.startswith(f"{namespace}:")}


def _stored_samples() -> int:
    """Samples the storage units hold, by their own count (every partition, every plane)."""
    import transfer_queue as tq

    client = tq.get_client()
    manager = client.storage_manager
    probes = [manager._probe_storage_unit(target_storage_unit=unit) for unit in manager.storage_unit_infos]
    return sum(client._run_coroutine(probe)["active_keys"] for probe in probes)


def _wait_until(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def _full_cycle(plane: Any, partition: str) -> None:
    """Put, read back, clear: the plane works and leaves nothing in TransferQueue."""
    keys = [f"fresh{i}" for i in range(4)]
    ids = torch.arange(40).reshape(4, 10)
    keep = torch.tensor([True, False, True, True])
    plane.put(partition, keys, {"input_ids": ids, "message_log": [[{"role": "user", "content": k}] for k in keys]})
    plane.put(partition, keys, {}, tags={"keep": keep})
    assert plane.keys(partition) == keys
    assert torch.equal(plane.tags(partition)["keep"], keep)
    out = plane.get(partition, keys[::-1], ["input_ids", "message_log"])
    assert torch.equal(out["input_ids"], ids.flip(0))
    assert out["message_log"] == [[{"role": "user", "content": k}] for k in keys[::-1]]
    plane.clear(partition)
    assert plane.partitions() == []
    assert _tq_partitions(plane.namespace) == {}


class _Writer:
    def __init__(self, process: subprocess.Popen, namespace: str):
        self.process, self.namespace = process, namespace

    def crash(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        assert self.process.wait(timeout=60) == 1


@contextmanager
def crashing_writer(run_dir: Path, partition: str, log_path: Path) -> Iterator[_Writer]:
    """Start ``crashing_writer.py`` in this Ray cluster and wait until it has written."""
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(WRITER), str(run_dir), partition],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        try:
            ready, _, _ = select.select([process.stdout], [], [], 240)
            line = process.stdout.readline() if ready else ""
            assert line.startswith("PUT_DONE"), f"the writer did not write: {line!r}\n{log_path.read_text()[-3000:]}"
            yield _Writer(process, line.split()[1])
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


# ---------------------------------------------------------------- tests that start TransferQueue


def test_start_fails_naming_what_it_asked_for_instead_of_hanging(ray_cluster: Any) -> None:
    if controller_running():
        pytest.skip("a TransferQueue controller already runs in this Ray cluster; this test must start one")
    total = ray.cluster_resources()["CPU"]
    with pytest.raises(ConfigError, match=rf"needs 10 Ray CPUs .* whole Ray cluster has {total:g}\. Lower "
                                          r"data_plane\.transferqueue\.num_storage_units or start Ray with more logical CPUs "
                                          r"\(cluster\.num_cpus\)\.$"):
        TransferQueueDataPlane(TransferQueueConfig(num_storage_units=9), "never")
    # a run that joined a cluster cannot size it: cluster.num_cpus is not the fix there
    with pytest.raises(ConfigError, match=r"Lower data_plane\.transferqueue\.num_storage_units or add nodes with more CPUs to the "
                                          r"Ray cluster at 10\.0\.0\.1:6379 \(cluster\.num_cpus only sizes a cluster "
                                          r"the run starts itself\)\.$"):
        TransferQueueDataPlane(TransferQueueConfig(num_storage_units=9), "never", joined="10.0.0.1:6379")

    holder = placement_group([{"CPU": total - 1}])  # leave 1 CPU: the controller fits, the storage unit waits
    ray.get(holder.ready(), timeout=120)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError) as error:
            TransferQueueDataPlane(TransferQueueConfig(init_timeout_s=5), "never")
        elapsed = time.monotonic() - started
    finally:
        remove_placement_group(holder)
    message = error.value.args[0]
    for fragment in ("did not start within 5 s", "init_timeout_s", "asked Ray for 2 CPUs", f"has {total:g} CPUs"):
        assert fragment in message, f"{fragment!r} missing from: {message}"
    assert elapsed < 5 + 35, f"giving up took {elapsed:.0f} s"
    assert _wait_until(lambda: not controller_running(), 30), "the half-started controller was left running"
    with pytest.raises(ValueError):
        ray.get_actor(STORAGE_UNIT_NAME.format(rank=0))


def test_a_crashed_run_that_started_transferqueue_takes_it_along(
    ray_cluster: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    import transfer_queue as tq

    if controller_running():
        pytest.skip("a TransferQueue controller already runs in this Ray cluster; the writer must start one")
    # What the session's longer-lived fixtures hold is theirs; TransferQueue must give back what it took.
    before = ray.available_resources().get("CPU", 0)
    with crashing_writer(tmp_path / "run", "train/0", tmp_path / "writer.log") as writer:
        assert controller_running(), "the writer should have started TransferQueue"
        assert list(_tq_partitions(writer.namespace)) == [f"{writer.namespace}:train/0"]  # attaches this process
        writer.crash()
    assert _wait_until(lambda: not controller_running(), 60), "TransferQueue outlived the crashed run that started it"
    freed = _wait_until(lambda: ray.available_resources().get("CPU", 0) >= before, 60)
    assert freed, f"TransferQueue's storage units still hold CPUs: {ray.available_resources()}"
    plane = request.getfixturevalue("shared_plane")  # the next run (this process held a client of the dead queue)
    assert tq.kv_list() == {}, "the new TransferQueue holds partitions"
    _full_cycle(plane, "train/0")


# ---------------------------------------------------------------- one plane for the rest of the module


@pytest.fixture(scope="module")
def shared_plane(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    plane = _new_plane(tmp_path_factory.mktemp("tq_run"), storage_capacity=CAPACITY)
    yield plane
    plane.shutdown()


class TestTransferQueueContract(DataPlaneContract):
    name = "transferqueue"

    @pytest.fixture
    def data_plane(self, shared_plane: Any) -> Iterator[Any]:
        yield shared_plane
        for partition in shared_plane.partitions():
            shared_plane.clear(partition)

    def test_a_dtype_change_is_refused_by_name(self, data_plane: Any) -> None:
        """TransferQueue fixes a field's dtype per partition; the plane says so instead of
        letting the controller drop the write's metadata."""
        data_plane.put("train/0", ["a"], {"x": torch.zeros(1)})
        with pytest.raises(TypeError, match=r"field 'x' of partition 'train/0' holds torch.float32, got torch.int64"):
            data_plane.put("train/0", ["a"], {"x": torch.zeros(1, dtype=torch.int64)})


def test_clear_leaves_nothing_of_the_partition_in_transferqueue(shared_plane: Any) -> None:
    import transfer_queue as tq

    before = _stored_samples()
    keys = [f"k{i}" for i in range(6)]
    shared_plane.put("train/7", keys, {"input_ids": torch.ones(6, 32, dtype=torch.long), "log": [["m"]] * 6})
    shared_plane.put("val/7", keys[:2], {"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    assert _stored_samples() == before + 8
    shared_plane.clear("train/7")
    qualified = f"{shared_plane.namespace}:train/7"
    assert list(_tq_partitions(shared_plane.namespace)) == [f"{shared_plane.namespace}:val/7"]
    assert qualified not in tq.get_client().get_partition_list()
    assert tq.get_client().kv_retrieve_meta(keys=keys, partition_id=qualified, create=False).size == 0
    assert _stored_samples() == before + 2, "the storage units still hold the cleared samples"
    shared_plane.clear("val/7")
    assert _stored_samples() == before


def test_a_put_past_the_storage_capacity_names_the_option(shared_plane: Any) -> None:
    shared_plane.put("train/8", [f"k{i}" for i in range(CAPACITY - 1)], {"x": torch.zeros(CAPACITY - 1)})
    with pytest.raises(WorkerError, match=rf"{SECTION}.storage_capacity={CAPACITY} samples"):
        shared_plane.put("train/9", ["one", "two"], {"x": torch.zeros(2)})
    shared_plane.clear("train/8")
    shared_plane.clear("train/9")
    shared_plane.put("train/9", ["one", "two"], {"x": torch.ones(2)})  # room again
    assert shared_plane.get("train/9", ["two"], ["x"])["x"].tolist() == [1.0]
    shared_plane.clear("train/9")


def test_a_crashed_writer_leaves_nothing_that_blocks_the_next_run(shared_plane: Any, tmp_path: Path) -> None:
    shared_plane.put("train/3", ["mine"], {"x": torch.ones(1)})  # another run's step, in another namespace
    with crashing_writer(tmp_path / "run", "train/3", tmp_path / "writer.log") as writer:
        writer.crash()
    stale = _tq_partitions(writer.namespace)
    assert {name: sorted(rows) for name, rows in stale.items()} == {
        f"{writer.namespace}:train/3": ["stale0", "stale1", "stale2", "stale3"]
    }, "the crashed writer's step should still be in TransferQueue (its controller lives on)"
    plane = _new_plane(tmp_path / "run")  # the same run restarted
    try:
        assert plane.namespace == writer.namespace
        assert _tq_partitions(plane.namespace) == {}, "the restarted run did not clear the crashed one's partitions"
        _full_cycle(plane, "train/3")
    finally:
        plane.shutdown()
    assert controller_running(), "a plane that attached must not stop TransferQueue"
    assert shared_plane.get("train/3", ["mine"], ["x"])["x"].tolist() == [1.0], "another namespace was touched"
    shared_plane.clear("train/3")


def test_dynamic_sampling_never_moves_dropped_samples(shared_plane: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read ``keep`` tags, get only kept keys: the storage units send the kept rows and
    nothing of the dropped ones (recorded where TransferQueue's client receives them)."""
    import transfer_queue as tq

    n, width = 12, 512
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (n, width), generator=generator)
    logprobs = -torch.rand(n, width, generator=generator)
    keep = torch.tensor([i % 3 != 1 for i in range(n)])
    keys = [f"p{i // 4}_g{i % 4}" for i in range(n)]
    shared_plane.put(
        "train/6",
        keys,
        {"input_ids": ids, "logprobs": logprobs, "message_log": [[{"role": "user", "content": k}] for k in keys]},
        tags={"keep": keep},
    )

    manager = tq.get_client().storage_manager
    receive = manager._get_from_single_storage_unit
    received: list[tuple[list[int], int]] = []  # (global indexes asked for, tensor bytes that came back)

    async def recording_receive(global_indexes: list[int], fields: list[str], **kwargs: Any) -> Any:
        names, data = await receive(global_indexes, fields, **kwargs)
        received.append((list(global_indexes), sum(row.nbytes for name in names for row in data[name])))
        return names, data

    monkeypatch.setattr(manager, "_get_from_single_storage_unit", recording_receive)
    flags = shared_plane.tags("train/6")["keep"].tolist()
    assert received == [], "reading tags fetched sample data"
    kept = [key for key, flag in zip(keys, flags, strict=True) if flag]
    dropped = [key for key, flag in zip(keys, flags, strict=True) if not flag]
    out = shared_plane.get("train/6", kept, ["input_ids", "logprobs"])
    monkeypatch.undo()

    qualified = f"{shared_plane.namespace}:train/6"
    index_of = lambda some: tq.get_client().kv_retrieve_meta(keys=some, partition_id=qualified).global_indexes  # noqa: E731
    fetched = [index for indexes, _ in received for index in indexes]
    assert sorted(fetched) == sorted(index_of(kept))
    assert not set(fetched) & set(index_of(dropped))
    assert sum(size for _, size in received) == len(kept) * width * (8 + 4)  # int64 ids + float32 logprobs
    rows = [keys.index(key) for key in kept]
    assert torch.equal(out["input_ids"], ids[rows]) and torch.equal(out["logprobs"], logprobs[rows])
    shared_plane.clear("train/6")


class ShardReader(Worker):
    """A policy-like worker: attaches to the driver's TransferQueue, reads its shard and
    writes a result column back."""

    def __init__(self, namespace: str):
        super().__init__()
        self.plane = TransferQueueDataPlane(TransferQueueConfig(), namespace, exclusive=False)

    def read(self, keys: list[str], partition: str) -> tuple[torch.Tensor, list[Any], int]:
        batch = self.plane.get(partition, keys, ["input_ids", "message_log"])
        self.plane.put(partition, keys, {"rank": torch.full((len(keys),), self.rank)})
        return batch["input_ids"], batch["message_log"], os.getpid()


def test_ray_workers_attach_and_read_their_own_shards(shared_plane: Any) -> None:
    keys = [f"k{i}" for i in range(8)]
    ids = torch.arange(48).reshape(8, 6)
    logs = [[{"role": "user", "content": str(i)}] for i in range(8)]
    shared_plane.put("train/5", keys, {"input_ids": ids, "message_log": logs})
    shards = [keys[0::2], keys[1::2]]
    cluster = VirtualCluster(ClusterConfig())
    try:
        with WorkerGroup(
            cluster,
            ShardReader,
            name="tq-readers",
            num_workers=2,
            resources=WorkerResources(cpus=0.5),
            args=(shared_plane.namespace,),
        ) as group:
            results = group.run_sharded(ShardReader.read, shards, "train/5")
    finally:
        cluster.shutdown()
    for shard, (shard_ids, shard_logs, pid) in zip(shards, results, strict=True):
        rows = [keys.index(key) for key in shard]
        assert pid != os.getpid()
        assert torch.equal(shard_ids, ids[rows])
        assert shard_logs == [logs[row] for row in rows]
    assert shared_plane.get("train/5", keys, ["rank"])["rank"].tolist() == [0, 1] * 4
    assert controller_running(), "a worker's plane must not stop TransferQueue"
    shared_plane.clear("train/5")


def test_a_call_on_a_dead_controller_fails_as_a_process_death_instead_of_waiting(shared_plane: Any) -> None:
    """TransferQueue's client waits forever on a controller that died; the plane's call fails
    within seconds, as a death the run restarts from. Last in the module: it kills the shared
    plane's controller (the next plane to start finds it dead and starts another)."""
    from transfer_queue import interface as tq_state

    shared_plane.put("train/9", ["a", "b"], {"input_ids": torch.ones(2, 4, dtype=torch.long)})
    pid = ray.get(tq_state._TQ_CONTROLLER.__ray_call__.remote(lambda _: os.getpid()))
    os.kill(pid, signal.SIGKILL)  # as a crash or the OOM killer would
    assert _wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30)
    started = time.monotonic()
    with pytest.raises(ProcessDied, match=r"^TransferQueue's TransferQueueController actor died during a data-plane "
                                          r"call: the samples it held are lost\. The run restarts"):
        shared_plane.keys("train/9")
    assert time.monotonic() - started < WATCH_S + 10
