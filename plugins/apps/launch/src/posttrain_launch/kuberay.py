"""A KubeRay ``RayJob`` manifest: a Ray cluster of pods on Kubernetes that runs one
``posttrain run`` and is deleted when it ends.

The KubeRay operator (``ray.io/v1``) creates a head pod and ``nodes - 1`` worker pods from
the same image, each with the same resources and the same shared volume, then submits the
entrypoint to the head. The entrypoint changes into ``workdir`` (on the shared volume, so
relative paths of the config mean the same on every pod) and runs the command with
``cluster.num_nodes`` set: the run waits for every pod's node (``cluster.node_wait_s``)
before any worker starts.
"""

from __future__ import annotations

import shlex
from typing import Any

import attrs
import yaml


@attrs.frozen
class RayJobSpec:
    """What the manifest asks Kubernetes for. ``command`` is the ``posttrain run`` command,
    as words; ``env`` holds ``(name, value)`` pairs set in every pod."""

    name: str
    nodes: int
    image: str
    command: tuple[str, ...]
    cpus_per_node: int
    memory_per_node: str  # a Kubernetes quantity, e.g. 64Gi
    gpus_per_node: int = 0  # nvidia.com/gpu per pod; 0: none
    volume_claim: str = "posttrain-shared"  # a PersistentVolumeClaim every pod mounts (ReadWriteMany)
    mount_path: str = "/shared"
    workdir: str = "/shared"  # where the run starts; relative paths of the config count from here
    env: tuple[tuple[str, str], ...] = ()
    ray_version: str = ""  # the Ray version of the image (KubeRay's rayVersion)


def rayjob_manifest(spec: RayJobSpec, *, header: str = "") -> str:
    """The ``RayJob`` manifest for ``spec`` as YAML, after ``header`` (comment lines)."""
    manifest = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": spec.name},
        "spec": {
            "entrypoint": f"cd {shlex.quote(spec.workdir)} && {shlex.join(spec.command)}",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "rayClusterSpec": {
                "rayVersion": spec.ray_version,
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": _pod(spec, "ray-head", ports=True),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "workers",
                        "replicas": spec.nodes - 1,
                        "minReplicas": spec.nodes - 1,
                        "maxReplicas": spec.nodes - 1,
                        "rayStartParams": {},
                        "template": _pod(spec, "ray-worker", ports=False),
                    }
                ],
            },
        },
    }
    return header + yaml.safe_dump(manifest, sort_keys=False, width=120)


def _pod(spec: RayJobSpec, container: str, *, ports: bool) -> dict[str, Any]:
    """The pod template of the head (with Ray's ports) or of a worker."""
    amounts: dict[str, Any] = {"cpu": str(spec.cpus_per_node), "memory": spec.memory_per_node}
    if spec.gpus_per_node:
        amounts["nvidia.com/gpu"] = spec.gpus_per_node
    body: dict[str, Any] = {
        "name": container,
        "image": spec.image,
        "resources": {"limits": dict(amounts), "requests": dict(amounts)},
        "volumeMounts": [{"name": "shared", "mountPath": spec.mount_path}],
    }
    if spec.env:
        body["env"] = [{"name": name, "value": value} for name, value in spec.env]
    if ports:
        body["ports"] = [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": 8265, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
        ]
    return {
        "spec": {
            "containers": [body],
            "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": spec.volume_claim}}],
        }
    }
