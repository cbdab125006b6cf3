"""``posttrain launch``: the sbatch script and the KubeRay manifest that the commands of
docs/clusters.md write are the example files (golden files), the script passes ``bash -n``,
submitting goes through ``sbatch``, a command that is not a run is refused, and the wait
for a cluster's nodes gives up naming the node that did not join (or the head that did not
answer)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess

import pytest
import yaml

from posttrain import cli
from posttrain.distributed.placement import follow_nodes, rank_order
from tests.docs.commands import command_lines
from tests.docs.pages import REPO, blocks

SCRIPT = REPO / "examples" / "slurm" / "grpo_2nodes.sbatch"
MANIFEST = REPO / "examples" / "kubernetes" / "grpo_rayjob.yaml"


def docs_launch(launcher: str) -> list[str]:
    """The arguments of the one ``posttrain launch LAUNCHER`` command of docs/clusters.md."""
    (words,) = [
        words for block in blocks("clusters.md") if block.language == "bash"
        for words in command_lines(block.text) if words[:3] == ["posttrain", "launch", launcher]
    ]
    return words[1:]


def launch(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_docs_slurm_command_prints_the_example_script(capsys, tmp_path):
    code, script, _ = launch(docs_launch("slurm"), capsys)
    assert code == 0
    assert script == SCRIPT.read_text()
    written = tmp_path / "job.sbatch"
    written.write_text(script)
    checked = subprocess.run(["bash", "-n", str(written)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    lines = script.splitlines()
    # the run is the script's last command, after the wait, with the node count added
    wait = lines.index('posttrain launch wait --address "$RAY_ADDRESS" --nodes "${NODES[@]}" --timeout-s "$NODE_WAIT_S"')
    run = lines.index("posttrain run grpo --config examples/configs/grpo_math_1b_gpu.yaml \\")
    assert wait < run and lines[-1] == "  cluster.num_nodes=2"
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --gpus-per-node=8" in lines


def test_the_docs_kuberay_command_prints_the_example_manifest(capsys):
    import ray

    code, manifest, _ = launch(docs_launch("kuberay"), capsys)
    assert code == 0
    assert manifest == MANIFEST.read_text()
    job = yaml.safe_load(manifest)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["entrypoint"].startswith("cd /shared/posttrain && posttrain run grpo ")
    assert spec["entrypoint"].endswith(" cluster.num_nodes=2")
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 1
    for pod in (cluster["headGroupSpec"]["template"], workers["template"]):
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"] == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": 8}
        assert container["volumeMounts"] == [{"name": "shared", "mountPath": "/shared"}]
        assert pod["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "posttrain-shared"}


def test_launch_refuses_a_command_that_is_not_a_run(capsys):
    code, _, err = launch(["launch", "slurm", "--nodes", "2", "--dry-run", "--", "python", "train.py"], capsys)
    assert code == 2
    assert err == (
        "error: posttrain launch: give the run after --, e.g. `-- posttrain run grpo --config exp.yaml`; "
        "found python train.py\n"
    )


def test_launch_slurm_writes_the_script_and_submits_it_with_sbatch(capsys, tmp_path, monkeypatch):
    """Slurm cannot run here: a stand-in ``sbatch`` on PATH records what it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/submitted\necho "Submitted batch job 7"\n')
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "grpo.sbatch"
    monkeypatch.chdir(tmp_path)  # where the job starts, and where its config is checked first
    (tmp_path / "sft.yaml").write_text("policy:\n  model: /shared/models/tiny\n")
    argv = ["launch", "slurm", "--nodes", "3", "--script", str(script), "--",
            "posttrain", "run", "sft", "--config", "sft.yaml"]

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, err = launch(argv, capsys)
    assert code == 2
    assert err == ("error: posttrain launch slurm: sbatch is not on PATH; run this on a Slurm login node, or use "
                   "--dry-run to print the script\n")
    assert not script.exists()

    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    code, out, _ = launch(argv, capsys)
    assert code == 0
    assert (tmp_path / "submitted").read_text() == f"{script}\n"
    assert script.read_text().endswith("posttrain run sft --config sft.yaml \\\n  cluster.num_nodes=3\n")
    assert "#SBATCH --nodes=3" in script.read_text()


def test_launch_slurm_checks_the_run_config_before_writing_anything(capsys, tmp_path, monkeypatch):
    """A mistake the run would refuse (here a negative learning rate, then an unknown
    algorithm) fails the launch at once, naming the key and where it was set; --no-check
    writes the script anyway."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sft.yaml").write_text("policy:\n  model: /shared/models/tiny\n  optimizer:\n    lr: -0.001\n")
    script = tmp_path / "sft.sbatch"
    argv = ["launch", "slurm", "--nodes", "2", "--script", str(script), "--",
            "posttrain", "run", "sft", "--config", "sft.yaml"]
    code, out, err = launch(argv, capsys)
    assert (code, out) == (2, "")
    assert err == (
        f"error: posttrain launch slurm: nothing was written or submitted: the run's config, loaded here ({tmp_path}) "
        "as the job will load it, is refused (--no-check skips this check): policy.optimizer.lr: expected a learning "
        "rate >= 0, e.g. 1e-05, found -0.001. Where set: policy.optimizer.lr at sft.yaml:4.\n"
    )
    assert not script.exists()
    code, _, err = launch([*argv[:-5], "posttrain", "run", "stf", "--config", "sft.yaml"], capsys)
    assert code == 2 and "is refused (--no-check skips this check): unknown algorithm 'stf'" in err
    assert err.endswith("Did you mean 'sft'?\n")

    code, out, _ = launch(["launch", "slurm", "--nodes", "2", "--dry-run", "--no-check", *argv[6:]], capsys)
    assert code == 0 and out.endswith("posttrain run sft --config sft.yaml \\\n  cluster.num_nodes=2\n")


def test_ranks_are_ordered_by_node_and_share_bundles_in_groups():
    # bundles 0 and 2 on node b, 1 and 3 on node a: b's ranks first (its bundle comes first)
    assert rank_order(["b", "a", "b", "a"]) == ((0, 2, 1, 3), ("b", "b", "a", "a"))
    # two ranks per bundle (a tensor-parallel group): ranks 0-1 on bundle 0, 2-3 on bundle 1
    assert rank_order(["b", "a"], 2) == ((0, 0, 1, 1), ("b", "b", "a", "a"))
    # a colocated group follows: 2 engines over 4 ranks on nodes a, a, b, b
    assert follow_nodes(["a", "a", "b", "b"], 2) == [{"ray.io/node-id": "a"}, {"ray.io/node-id": "b"}]
    assert follow_nodes(["a", "b"], 1) == [{"ray.io/node-id": "a"}]


@pytest.mark.ray
def test_the_wait_gives_up_naming_the_node_that_did_not_join(ray_cluster, capsys):
    address = ray_cluster.get_runtime_context().gcs_address
    here = socket.gethostname()
    code, out, err = launch(["launch", "wait", "--address", address, "--nodes", here, "--timeout-s", "5"], capsys)
    assert code == 0 and out.startswith("1 Ray node(s) alive: ")
    code, _, err = launch(
        ["launch", "wait", "--address", address, "--nodes", here, "node-b", "--timeout-s", "1"], capsys
    )
    assert code == 2
    # the test session's Ray may print its raylet's lines on this stderr at any time
    (err,) = [line + "\n" for line in err.splitlines() if line.startswith("error: ")]
    assert err.startswith(
        f"error: node(s) node-b did not join the Ray cluster at {address} after 1 s (--timeout-s). Alive: "
    )
    assert f"(host {here}, id " in err and err.endswith(
        f"Start Ray on the missing nodes (ray start --address={address}) and check their Ray logs.\n"
    )
    assert ray_cluster.is_initialized()  # the wait leaves a connection it did not make


def test_the_wait_gives_up_on_a_head_that_does_not_answer(capsys):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = launch(["launch", "wait", "--address", f"127.0.0.1:{port}", "--num-nodes", "2",
                           "--timeout-s", "1"], capsys)
    assert code == 2
    assert err.startswith(f"error: the Ray head at 127.0.0.1:{port} did not answer within 1 s (--timeout-s): ")
