"""Hook implementations: registers the ``torch`` policy backend and checks its settings.

Kept free of heavy imports (torch, transformers and Ray are imported when the backend is
built), so listing plugins stays fast and every Ray worker can load it cheaply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.distributed import VirtualCluster
    from posttrain.interfaces import Policy

BACKEND = "torch"


def build_torch_policy(
    config: RunConfig, cluster: VirtualCluster, *, name: str = "policy", reference: bool = True
) -> Policy:
    """The factory posttrain calls for ``policy.backend: torch``: one worker (the worker
    group ``name``), driven by the kit; with ``reference`` False it keeps no initial weights."""
    from posttrain_policy_torch.worker import start_policy

    return start_policy(config, cluster, name=name, reference=reference)


@hookimpl
def posttrain_policy_backends() -> Mapping[str, Callable[..., Any]]:
    return {BACKEND: build_torch_policy}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    """Refuse what one float32 process cannot do, before any worker starts."""
    from posttrain.config import where_set

    policy = config.policy
    if policy.backend != BACKEND:
        return
    for key, value in (("tensor_parallel_size", policy.tensor_parallel_size), ("num_workers", policy.num_workers)):
        if value != 1:
            raise ConfigError(
                f"policy.{key}: the torch backend trains in one process, so it must be 1; found {value}. "
                f"Set policy.{key}=1, or use a distributed backend (policy.backend=dtensor)."
                f"{where_set(config, f'policy.{key}')}"
            )
    if policy.dtype != "float32":
        raise ConfigError(
            f"policy.dtype: the torch backend supports float32; found '{policy.dtype}'.{where_set(config, 'policy.dtype')}"
        )
