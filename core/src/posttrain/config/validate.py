"""Checks on a structured config that span several keys or need the plugin registries.

:func:`validate_config` runs core's checks, then every plugin's ``posttrain_validate_config``
hook. Messages name the keys, the numbers, where each key was set, and the fix.

Batch sizes: core requires ``policy.num_workers`` to be a multiple of the model-parallel
sizes and ``policy.train_global_batch_size`` a multiple of ``policy.train_micro_batch_size``
x the data-parallel size. The running algorithm may add rules (:class:`BatchSizeRules`)
through a ``batch_size_rules()`` method of its section (the one named like
``config.algorithm``, e.g. ``grpo``); core checks them together with its own, so the sizes
a message suggests satisfy every rule at once.

Devices: a worker computes on CUDA exactly when its group asks for GPUs
(:func:`~posttrain.distributed.placement.gpus_given`); ``cluster.use_gpus`` says the run uses
GPUs. The two must agree, a tensor-parallel group must fit the node a run starts itself, and
colocated engines must fit the policy's GPUs (:mod:`posttrain.distributed.placement`) and be
reachable by the weight sync (:func:`check_devices`).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Iterable
from typing import Any

import attrs

from posttrain.config.environments import read_environment_options
from posttrain.config.exact import BATCH_INVARIANT_FEATURE, EXACT_FEATURE, EXACT_KEY
from posttrain.config.features import backends_declaring, lacking_feature, section_declares
from posttrain.config.requirements import Requirement, section_requirements
from posttrain.config.schema import RunConfig
from posttrain.errors import ConfigError, PluginError
from posttrain.plugins import PluginHost, Registry, plugin_host

WORKERS = "policy.num_workers"
GLOBAL = "policy.train_global_batch_size"
MICRO = "policy.train_micro_batch_size"
#: What ``policy.lora`` needs, whichever backend implements it.
PEFT = Requirement("peft", "pip install 'peft>=0.17'", distribution="peft", minimum="0.17")


def where_set(config: RunConfig | None, *keys: str) -> str:
    """``" Where set: a.b at exp.yaml:3; c at command line override 'c=1'."`` for the keys the
    loader saw, or ``""``. Plugins append it to their own validation messages."""
    if config is None:
        return ""
    found = [f"{key} at {config.sources[key]}" for key in dict.fromkeys(keys) if key in config.sources]
    return f" Where set: {'; '.join(found)}." if found else ""


def require_registered(registry: Registry, name: str, key: str, *, config: RunConfig | None = None) -> Any:
    """``registry[name]``, or a :class:`ConfigError` prefixed by the config ``key`` that chose it:
    ``data_plane.backend: unknown data plane 'tq'; installed: ...``."""
    try:
        return registry[name]
    except PluginError as exc:
        raise ConfigError(f"{key}: {exc}{where_set(config, key)}") from None


def validate_config(config: RunConfig, host: PluginHost | None = None) -> None:
    """Check sizes, the packages the selected backends need, the optimizer and its schedule,
    ``policy.lora``, ``generation.exact_logprobs``, the GPUs asked for, batch arithmetic (with the algorithm's
    :class:`BatchSizeRules`), the data plane, every configured environment (its name and
    options), then the plugins' checks.

    Raises :class:`ConfigError` on the first problem; returns nothing when the config is fine.
    """
    host = host if host is not None else plugin_host()
    policy = config.policy
    sizes = [(f"policy.{name}", getattr(policy, name)) for name in
             ("num_workers", "train_global_batch_size", "train_micro_batch_size")]
    rows = [("generation.rows_per_call", config.generation.rows_per_call)] if config.generation.rows_per_call is not None else []
    for key, value in [*sizes, *config.replica_factors(), *rows]:
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, found {value}.{where_set(config, key)}")
    check_requirements(config, host)
    check_optimizer(config)
    check_muon(config, host)
    check_lora(config, host)
    check_generation_placement(config, host)
    check_policy_in_driver(config, host)
    check_exact_logprobs(config, host)
    check_routing_replay(config, host)
    check_router_losses(config, host)
    check_expert_parallel(config, host)
    check_devices(config)
    check_batch_sizes(config, batch_size_rules(config))
    require_registered(host.data_planes, config.data_plane.backend, "data_plane.backend", config=config)
    check_environments(config, host)
    host.hook.posttrain_validate_config(config=config)


# --------------------------------------------------------------------------- packages

#: The keys that select a backend: section ``<prefix>.<name>`` is in use when ``<prefix>.backend`` is ``name``.
SELECTING_KEYS = ("policy.backend", "generation.backend", "data_plane.backend")


def check_requirements(config: RunConfig, host: PluginHost) -> None:
    """Refuse a run whose selected backends need a package this environment lacks (or has too
    old; :mod:`posttrain.config.requirements`): the selecting key, the backend and its
    distribution, the problem and the install command."""
    for key in SELECTING_KEYS:
        prefix = key.rsplit(".", 1)[0]
        name = getattr(config, prefix).backend
        section = f"{prefix}.{name}"
        if section not in host.config_sections:
            continue
        for requirement in section_requirements(host.config_sections[section]):
            problem = requirement.problem()
            if problem is not None:
                raise ConfigError(
                    f"{key}: {name} ({host.config_sections.distribution_of(section)}) needs {requirement.module}, but "
                    f"{problem} in this environment ({sys.executable}); nothing was started. Install it with: "
                    f"{requirement.install}.{where_set(config, key)}"
                )


# --------------------------------------------------------------------------- optimizer


def check_optimizer(config: RunConfig) -> None:
    """``policy.optimizer``, ``policy.scheduler`` and ``policy.max_grad_norm`` hold values the
    policy backends' optimizers accept (the names are checked by their annotations)."""
    optimizer, scheduler = config.policy.optimizer, config.policy.scheduler
    checks: list[tuple[str, Any, bool, str]] = [
        ("policy.optimizer.lr", optimizer.lr, _finite(optimizer.lr) and optimizer.lr >= 0,
         "a learning rate >= 0, e.g. 1e-05"),
        ("policy.optimizer.weight_decay", optimizer.weight_decay,
         _finite(optimizer.weight_decay) and optimizer.weight_decay >= 0, "a number >= 0 (0: no decay)"),
        ("policy.optimizer.betas", optimizer.betas,
         len(optimizer.betas) == 2 and all(0 <= beta < 1 for beta in optimizer.betas),
         "two numbers in [0, 1), e.g. [0.9, 0.999]"),
        ("policy.optimizer.eps", optimizer.eps, _finite(optimizer.eps) and optimizer.eps >= 0,
         "a small number >= 0, e.g. 1e-08"),
        ("policy.max_grad_norm", config.policy.max_grad_norm,
         config.policy.max_grad_norm is None or config.policy.max_grad_norm > 0,
         "a norm > 0, or null for no clipping"),
        ("policy.scheduler.warmup_steps", scheduler.warmup_steps, scheduler.warmup_steps >= 0,
         "a number of optimizer steps >= 0 (0: no warmup)"),
        ("policy.scheduler.total_steps", scheduler.total_steps,
         scheduler.total_steps is None or scheduler.total_steps >= 1,
         "a number of optimizer steps >= 1, or null for the run's length"),
        ("policy.scheduler.min_lr_ratio", scheduler.min_lr_ratio, 0 <= scheduler.min_lr_ratio <= 1,
         "a factor in [0, 1]"),
    ]
    refuse_failed(config, checks)
    total, warmup = scheduler.total_steps, scheduler.warmup_steps
    if scheduler.name != "constant" and total is not None and warmup > total:
        raise ConfigError(
            f"policy.scheduler.warmup_steps={warmup} is past policy.scheduler.total_steps={total}, where the "
            f"{scheduler.name} decay ends; lower warmup_steps to at most {total}, or raise total_steps."
            f"{where_set(config, 'policy.scheduler.warmup_steps', 'policy.scheduler.total_steps')}"
        )


def check_muon(config: RunConfig, host: PluginHost) -> None:
    """With ``policy.optimizer.name: muon``: ``policy.optimizer.muon``'s values, a policy
    backend whose section declares ``supports_muon``, and no LoRA (Muon is for full weights)."""
    if config.policy.optimizer.name != "muon":
        return
    muon = config.policy.optimizer.muon
    checks: list[tuple[str, Any, bool, str]] = [
        ("policy.optimizer.muon.lr", muon.lr, muon.lr is None or (_finite(muon.lr) and muon.lr >= 0),
         "a learning rate >= 0, or null for policy.optimizer.lr"),
        ("policy.optimizer.muon.weight_decay", muon.weight_decay,
         muon.weight_decay is None or (_finite(muon.weight_decay) and muon.weight_decay >= 0),
         "a number >= 0, or null for policy.optimizer.weight_decay"),
        ("policy.optimizer.muon.momentum", muon.momentum, 0 <= muon.momentum < 1, "a number in [0, 1), e.g. 0.95"),
        ("policy.optimizer.muon.ns_steps", muon.ns_steps, muon.ns_steps >= 1, "an integer >= 1, e.g. 5"),
    ]
    refuse_failed(config, checks)
    lacking = lacking_feature(host, "policy", config.policy.backend, "supports_muon")
    if lacking:
        raise ConfigError(
            f"policy.optimizer.name is muon, but the policy backend {lacking[0]} does not implement Muon; policy "
            f"backends that do: {lacking[1]}. Set policy.backend to one of them, or "
            f"policy.optimizer.name: adamw.{where_set(config, 'policy.optimizer.name', 'policy.backend')}"
        )
    if config.policy.lora.enabled:
        raise ConfigError(
            "policy.optimizer.name is muon with policy.lora.enabled: Muon steps full 2-D weights, not low-rank "
            "adapters; set policy.optimizer.name: adamw for LoRA, or policy.lora.enabled: false."
            f"{where_set(config, 'policy.optimizer.name', 'policy.lora.enabled')}"
        )


def refuse_failed(config: RunConfig, checks: list[tuple[str, Any, bool, str]]) -> None:
    """Raise :class:`ConfigError` for the first ``(key, value, ok, expected)`` that is not
    ``ok``, naming the key, what was expected, what was found and where it was set."""
    for key, value, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{key}: expected {expected}, found {value!r}.{where_set(config, key)}")


def _finite(value: float) -> bool:
    return math.isfinite(value)


# --------------------------------------------------------------------------- LoRA


def check_lora(config: RunConfig, host: PluginHost) -> None:
    """``policy.lora``'s values and, when it is enabled, a policy backend that implements it
    and, for ``refit: adapter``, a generation backend that loads adapters (the features their
    sections declare: :mod:`posttrain.config.features`). The policy backend checks what only
    it can, e.g. that ``target_modules`` matches its model."""
    lora = config.policy.lora
    if not lora.enabled:
        return
    checks: list[tuple[str, Any, bool, str]] = [
        ("policy.lora.rank", lora.rank, lora.rank >= 1, "an integer >= 1, e.g. 8"),
        ("policy.lora.alpha", lora.alpha, _finite(lora.alpha) and lora.alpha > 0,
         "a number > 0, e.g. 16 (the adapters' scale is alpha / rank)"),
        ("policy.lora.dropout", lora.dropout, 0 <= lora.dropout < 1, "a probability in [0, 1), e.g. 0.05"),
        ("policy.lora.target_modules", lora.target_modules, bool(lora.target_modules),
         "module names (e.g. [q_proj, v_proj]), a regular expression, or all-linear"),
    ]
    refuse_failed(config, checks)
    problem = PEFT.problem()
    if problem is not None:
        raise ConfigError(
            f"policy.lora.enabled is true, which needs peft, but {problem} in this environment ({sys.executable}); "
            f"nothing was started. Install it with: {PEFT.install}, or set policy.lora.enabled: false."
            f"{where_set(config, 'policy.lora.enabled')}"
        )
    lacking = lacking_feature(host, "policy", config.policy.backend, "supports_lora")
    if lacking:
        raise ConfigError(
            f"policy.lora.enabled is true, but the policy backend {lacking[0]} does not implement LoRA; policy backends "
            f"that do: {lacking[1]}. Set policy.backend to one of them, or policy.lora.enabled: false."
            f"{where_set(config, 'policy.lora.enabled', 'policy.backend')}"
        )
    lacking = lacking_feature(host, "generation", config.generation.backend, "supports_lora_adapters")
    if lora.refit == "adapter" and lacking:
        raise ConfigError(
            f"policy.lora.refit is adapter, but the generation backend {lacking[0]} does not load LoRA adapters; "
            f"generation backends that do: {lacking[1]}. Set "
            f"generation.backend to one of them, or policy.lora.refit: merged (every backend loads merged weights)."
            f"{where_set(config, 'policy.lora.refit', 'generation.backend')}"
        )


# --------------------------------------------------------------------------- the policy in the driver

IN_DRIVER_KEY = "policy.in_driver"


def check_policy_in_driver(config: RunConfig, host: PluginHost) -> None:
    """Refuse ``policy.in_driver: true`` where the policy cannot run in the driver's process
    (:func:`_in_driver_obstacle`)."""
    if not config.policy.in_driver:
        return
    obstacle = _in_driver_obstacle(config, host)
    if obstacle:
        problem, keys = obstacle
        raise ConfigError(f"{IN_DRIVER_KEY} is true, but {problem}. Set {IN_DRIVER_KEY}: false (or null: decided by "
                          f"the run).{where_set(config, IN_DRIVER_KEY, *keys)}")


def policy_in_driver_by_default(config: RunConfig, host: PluginHost) -> bool:
    """What ``policy.in_driver: null`` (the default) becomes: true where the backend's section
    declares ``runs_in_driver``, nothing else stands in the way (:func:`_in_driver_obstacle`)
    and ``$RAY_ADDRESS`` is unset, so the run starts its own
    local cluster. On one machine that saves the worker's process: its start, its imports
    and its memory; the numbers are the same (:mod:`posttrain.distributed.driver_rank`)."""
    return (section_declares(host, f"policy.{config.policy.backend}", "runs_in_driver")
            and _in_driver_obstacle(config, host) is None and not os.environ.get("RAY_ADDRESS"))


def _in_driver_obstacle(config: RunConfig, host: PluginHost) -> tuple[str, tuple[str, ...]] | None:
    """Why the policy cannot run in the driver's process, and the keys that say so: a backend
    that does not declare ``runs_in_driver``, more than one worker, GPUs, a ``runtime_env``
    beyond ``env_vars``, or a cluster the run joins; None when nothing does."""
    policy = config.policy
    lacking = lacking_feature(host, "policy", policy.backend, "runs_in_driver")
    if lacking:
        return f"the policy backend {lacking[0]} cannot run its worker there; backends that can: {lacking[1]}", \
            ("policy.backend",)
    if policy.num_workers != 1:
        return f"policy.num_workers is {policy.num_workers}; the driver holds one worker", ("policy.num_workers",)
    if policy.resources.gpus > 0:
        return f"policy.resources.gpus is {policy.resources.gpus:g}; the driver computes on CPU", ("policy.resources.gpus",)
    if set(policy.resources.runtime_env) - {"env_vars"}:
        return "policy.resources.runtime_env asks for a Python environment of the worker's own", \
            ("policy.resources.runtime_env",)
    if config.cluster.ray_address or config.cluster.num_nodes > 1:
        return "the run joins a cluster; the policy runs on its nodes", ("cluster.ray_address",)
    return None


# --------------------------------------------------------------------------- generation placement


def check_generation_placement(config: RunConfig, host: PluginHost) -> None:
    """With ``generation.in_policy_workers``: a generation backend whose section declares
    ``runs_in_policy_workers``, ``generation.colocated`` (one process generates and trains in
    turn), and ``generation.num_workers`` left at 1 or equal to ``policy.num_workers`` (the
    engines are the policy's ranks)."""
    gen = config.generation
    if not gen.in_policy_workers:
        return
    where = where_set(config, "generation.in_policy_workers", "generation.backend")
    lacking = lacking_feature(host, "generation", gen.backend, "runs_in_policy_workers")
    if lacking:
        raise ConfigError(
            f"generation.in_policy_workers is true, but the generation backend {lacking[0]} runs its engines in "
            f"processes of their own; backends that run in the policy's workers: {lacking[1]}. Set generation.backend "
            "to one of them, "
            f"or generation.in_policy_workers: false.{where}"
        )
    if not gen.colocated:
        raise ConfigError(
            "generation.in_policy_workers is true with generation.colocated false: engines inside the policy's "
            "processes take turns with training, they cannot run beside it. Set generation.colocated: true, or "
            f"generation.in_policy_workers: false.{where_set(config, 'generation.in_policy_workers', 'generation.colocated')}"
        )
    if gen.num_workers not in (1, config.policy.num_workers):
        raise ConfigError(
            f"generation.num_workers is {gen.num_workers}, but with generation.in_policy_workers the engines are the "
            f"policy's {config.policy.num_workers} worker(s), one each; leave generation.num_workers at 1 or set it to "
            f"{config.policy.num_workers}.{where_set(config, 'generation.num_workers', 'policy.num_workers')}"
        )


def in_policy_workers_by_default(config: RunConfig, host: PluginHost) -> bool:
    """What ``generation.in_policy_workers: null`` (the default) becomes for a run with a
    policy that can host engines: true when the generation backend's section declares
    ``runs_in_policy_workers``, the engines are colocated, one per policy worker, of the
    policy's own model, and neither group asks for GPUs. On CPUs this saves the engines'
    processes and the weight copy through a sync group, and gives the same samples and
    metrics (generation and training take turns either way)."""
    gen, policy = config.generation, config.policy
    return (
        section_declares(host, f"generation.{gen.backend}", "runs_in_policy_workers")
        and gen.colocated
        and gen.num_workers == policy.num_workers
        and gen.model in (None, policy.model)
        and gen.resources.gpus == 0
        and policy.resources.gpus == 0
    )


def check_exact_logprobs(config: RunConfig, host: PluginHost) -> None:
    """Refuse ``generation.exact_logprobs`` with a backend or a setting that breaks it, naming
    the key, what it is, and what to set instead."""
    if not config.generation.exact_logprobs:
        return
    gen, policy = config.generation, config.policy
    engines = host.generation_backends
    lacking = lacking_feature(host, "policy", policy.backend, EXACT_FEATURE)
    if lacking:
        raise ConfigError(
            f"{EXACT_KEY} is true, but the policy backend {lacking[0]} "
            f"cannot score tokens as the engines do; backends that can: {lacking[1]}. Set "
            f"policy.backend to one of them, or {EXACT_KEY}: false.{where_set(config, EXACT_KEY, 'policy.backend')}"
        )
    exact = section_declares(host, f"generation.{gen.backend}", EXACT_FEATURE)
    if gen.backend in engines and not exact and not section_declares(host, f"generation.{gen.backend}", BATCH_INVARIANT_FEATURE):
        able = backends_declaring(host, "generation", EXACT_FEATURE)
        raise ConfigError(
            f"{EXACT_KEY} is true, but the generation backend '{gen.backend}' ({engines.distribution_of(gen.backend)}) "
            f"computes logprobs with kernels of its own; backends that report the trainer's: "
            f"{able}. Set generation.backend to one of them, or {EXACT_KEY}: false."
            f"{where_set(config, EXACT_KEY, 'generation.backend')}"
        )
    problems = []
    if exact and config.cluster.use_gpus:
        problems.append(("cluster.use_gpus is true: exact logprobs are bit for bit on CPUs, where the kernels give "
                         "a row the same bits in any batch; GPU libraries choose kernels by the shape of the whole "
                         "product. On GPUs use generation.backend: vllm, which runs batch-invariant kernels",
                         ("cluster.use_gpus", "generation.backend")))
    if gen.dtype != policy.dtype:
        problems.append((f"generation.dtype is {gen.dtype} and policy.dtype {policy.dtype}: the two sides must compute "
                         "in one dtype; set both to the same", ("generation.dtype", "policy.dtype")))
    if gen.top_k is not None or gen.top_p < 1:
        problems.append((f"generation.top_k is {gen.top_k} and generation.top_p {gen.top_p}: the engines would report "
                         "logprobs of the filtered distribution, the trainer computes the full softmax; set "
                         "generation.top_k: null and generation.top_p: 1.0", ("generation.top_k", "generation.top_p")))
    for key, size in config.replica_factors() if exact else ():
        if size != 1:
            problems.append((f"{key} is {size}: model parallelism splits the sums of the policy's products over "
                             f"devices, which the engines do not; set {key}: 1 (data parallelism keeps them whole)",
                             (key,)))
    if problems:
        message, keys = problems[0]
        raise ConfigError(f"{EXACT_KEY} is true, but {message}.{where_set(config, EXACT_KEY, *keys)}")


def check_routing_replay(config: RunConfig, host: PluginHost) -> None:
    """Refuse ``policy.moe.routing_replay`` or ``router_agreement`` with an algorithm or a backend
    that does not declare it (:mod:`posttrain.config.features`; ``previous`` needs no generation
    backend's),
    agreement with the engine together with ``previous``, or either with exact logprobs
    (which already make the policy route every token as the engine's rescoring did, and skip
    the previous-logprob pass)."""
    moe, gen, policy = config.policy.moe, config.generation, config.policy
    key = moe.routes_key
    if key is None:
        return
    if moe.routing_replay == "previous" and moe.router_agreement:
        raise ConfigError(
            "policy.moe.router_agreement compares the engine's experts with the policy's, but policy.moe."
            "routing_replay: previous gives the policy's training passes its own experts of the previous-logprob "
            "pass (and reports moe/router_agreement against those). Set one of them."
            f"{where_set(config, 'policy.moe.router_agreement', key)}"
        )
    needs = [
        ("generation", gen.backend, "records_routed_experts", "the experts each generated token went through, which "
         "the generation backend {backend} does not report; backends that do: {able}"),
        ("policy", policy.backend, "replays_routed_experts", "a policy backend that can give its routers the "
         "experts of another pass; the policy backend {backend} cannot; backends that can: {able}"),
    ]
    refuse_lacking(config, host, key, "algorithm", config.algorithm, "carries_routed_experts",
                   "an algorithm whose policy passes carry the experts to replay or compare (its rollouts' or its "
                   "previous-logprob pass's); the algorithm {backend} has none; algorithms that do: {able}")
    for kind, backend, feature, what in needs[1:] if moe.routing_replay == "previous" else needs:
        refuse_lacking(config, host, key, kind, backend, feature, what)
    if gen.exact_logprobs and moe.routing_replay == "previous":
        raise ConfigError(
            f"{key}: previous replays the experts of the previous-logprob pass, which {EXACT_KEY}: true skips (the "
            f"engine's logprobs are the trainer's, its routes too). Set {key} to its default, or {EXACT_KEY}: false."
            f"{where_set(config, key, EXACT_KEY)}"
        )
    if gen.exact_logprobs:
        raise ConfigError(
            f"{key} is set with {EXACT_KEY}: true, which already has the policy route every token as the engine's "
            f"rescoring did (the same arithmetic, bit for bit); the decode's routes would then differ from the ones "
            f"the logprobs came from. Set {key} to its default, or {EXACT_KEY}: false.{where_set(config, key, EXACT_KEY)}"
        )


def check_router_losses(config: RunConfig, host: PluginHost) -> None:
    """Refuse a negative ``policy.moe.aux_loss_coef`` or ``z_loss_coef``, and either above 0
    with a policy backend that does not declare ``trains_router_losses``."""
    moe = config.policy.moe
    refuse_failed(config, [(f"policy.moe.{name}", getattr(moe, name),
                            _finite(getattr(moe, name)) and getattr(moe, name) >= 0, "a weight >= 0 (0: off)")
                           for name in ("aux_loss_coef", "z_loss_coef")])
    if not moe.router_losses:
        return
    refuse_lacking(config, host, moe.router_losses_key, "policy", config.policy.backend, "trains_router_losses",
                   "a policy backend that adds the routers' losses to training; the policy backend {backend} does "
                   "not; backends that do: {able}")


def check_expert_parallel(config: RunConfig, host: PluginHost) -> None:
    """Refuse a ``policy.moe.expert_parallel_size`` below 1 or not dividing the data-parallel
    size, and one above 1 with a policy backend that does not declare ``splits_experts``
    (the backend checks that it divides the model's experts)."""
    key, size = "policy.moe.expert_parallel_size", config.policy.moe.expert_parallel_size
    refuse_failed(config, [(key, size, size >= 1, "an integer >= 1 (1: no expert parallelism)")])
    if size == 1:
        return
    refuse_lacking(config, host, key, "policy", config.policy.backend, "splits_experts",
                   "a policy backend that splits the experts over ranks; the policy backend {backend} does not; "
                   "backends that do: {able}")
    dp = config.data_parallel_size
    if dp % size:
        raise ConfigError(
            f"{key}={size} does not divide the policy's data-parallel size {dp} (policy.num_workers="
            f"{config.policy.num_workers} over the model-parallel sizes): expert-parallel groups are made of "
            f"data-parallel ranks. Set policy.num_workers to a multiple of {size} times the model-parallel sizes, or "
            f"{key} to a divisor of {dp}.{where_set(config, key, 'policy.num_workers')}"
        )


def refuse_lacking(config: RunConfig, host: PluginHost, key: str, kind: str, backend: str, feature: str,
                   what: str) -> None:
    """Refuse ``key`` when the ``kind`` backend ``backend`` does not declare ``feature``
    (:mod:`posttrain.config.features`): "``key`` needs ``what``", ``what`` formatted with the
    backend's label (``{backend}``) and the backends that declare it (``{able}``)."""
    lacking = lacking_feature(host, kind, backend, feature)
    if lacking:
        selecting = "algorithm" if kind == "algorithm" else f"{kind}.backend"
        raise ConfigError(
            f"{key} needs {what.format(backend=lacking[0], able=lacking[1])}. Set {selecting} to one of them, "
            f"or {key} to its default.{where_set(config, key, selecting)}"
        )


# --------------------------------------------------------------------------- devices


def check_devices(config: RunConfig) -> None:
    """Raise :class:`ConfigError` naming the keys and the fix when the config's GPUs cannot
    work: GPUs without ``cluster.use_gpus`` or the opposite, a tensor-parallel group wider
    than the node a run starts (``cluster.num_gpus``), an engine's tensor-parallel worker
    asking for more than one GPU, colocated engines that do not fit the policy's GPUs, and
    colocated engines on several GPUs with an NCCL weight sync."""
    check_use_gpus(config)
    check_node_width(config)
    check_engine_gpus(config)
    check_colocated_gpus(config)


def _gpu_groups(config: RunConfig) -> list[tuple[str, float]]:
    """``(key, value)`` of each ``resources.gpus`` of the run's groups that asks for GPUs."""
    groups = [("policy.resources.gpus", config.policy.resources.gpus)]
    if not config.generation.in_policy_workers:
        groups.append(("generation.resources.gpus", config.generation.resources.gpus))
    return [(key, gpus) for key, gpus in groups if gpus > 0]


def check_use_gpus(config: RunConfig) -> None:
    """``cluster.use_gpus`` true exactly when a group asks for GPUs."""
    given = _gpu_groups(config)
    if given and not config.cluster.use_gpus:
        keys = " and ".join(f"{key} is {gpus:g}" for key, gpus in given)
        raise ConfigError(
            f"{keys}, but cluster.use_gpus is false. Set cluster.use_gpus: true to compute on those GPUs, or set "
            f"{' and '.join(f'{key}: 0' for key, _ in given)} to run on the CPU."
            f"{where_set(config, 'cluster.use_gpus', *(key for key, _ in given))}"
        )
    if config.cluster.use_gpus and not given:
        raise ConfigError(
            "cluster.use_gpus is true, but no worker group asks for a GPU (policy.resources.gpus and "
            "generation.resources.gpus are 0), so every worker would compute on the CPU. Give the groups GPUs, e.g. "
            "policy.resources.gpus: 1 (or 0.5 each for the policy and colocated engines), or set cluster.use_gpus: "
            f"false.{where_set(config, 'cluster.use_gpus', 'policy.resources.gpus', 'generation.resources.gpus')}"
        )


def check_node_width(config: RunConfig) -> None:
    """A tensor-parallel group (the policy's, or one engine) within the GPUs of the node a run
    starts itself, when ``cluster.num_gpus`` says how many (a joined cluster is checked when
    the group is placed, before any worker starts)."""
    node = config.cluster.num_gpus
    if node is None or config.cluster.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    policy, gen = config.policy, config.generation
    widths = [("policy.tensor_parallel_size", policy.tensor_parallel_size,
               policy.tensor_parallel_size * max(1, math.ceil(policy.resources.gpus)) if policy.resources.gpus else 0)]
    if not gen.in_policy_workers:
        widths.append(("generation.tensor_parallel_size", gen.tensor_parallel_size,
                       max(gen.tensor_parallel_size, math.ceil(gen.resources.gpus)) if gen.resources.gpus else 0))
    for key, size, gpus in widths:
        if gpus > node:
            raise ConfigError(
                f"{key} is {size}: a group of {gpus} GPUs on one node, but the node this run starts has {node} "
                f"(cluster.num_gpus). Lower {key} to at most {node}, or run on a cluster with larger nodes."
                f"{where_set(config, key, 'cluster.num_gpus')}"
            )


def check_engine_gpus(config: RunConfig) -> None:
    """An engine of several GPUs gives each of its tensor-parallel workers at most one."""
    gen = config.generation
    if gen.tensor_parallel_size > 1 and gen.resources.gpus > gen.tensor_parallel_size:
        raise ConfigError(
            f"generation.resources.gpus is {gen.resources.gpus:g} for an engine of generation.tensor_parallel_size "
            f"{gen.tensor_parallel_size}: each of its workers computes on one GPU. Set generation.resources.gpus to "
            f"{gen.tensor_parallel_size} (or less, a share of each GPU, when colocated)."
            f"{where_set(config, 'generation.resources.gpus', 'generation.tensor_parallel_size')}"
        )


def check_colocated_gpus(config: RunConfig) -> None:
    """Colocated engines with GPUs of their own processes: on the policy's GPUs, at most one
    engine process per GPU, the two shares of a GPU within one, and a weight sync that
    reaches them (NCCL holds no two ranks of a group on one GPU, and the CUDA IPC route
    serves engines on policy rank 0's GPU only)."""
    policy, gen = config.policy, config.generation
    if not gen.colocated or gen.in_policy_workers or not (policy.resources.gpus > 0 and gen.resources.gpus > 0):
        return
    tp = gen.tensor_parallel_size
    share = gen.resources.gpus / tp
    keys = ("policy.resources.gpus", "generation.resources.gpus", "generation.tensor_parallel_size")
    if policy.resources.gpus + share > 1 + 1e-9:
        raise ConfigError(
            f"generation.colocated is true: each GPU holds a policy rank (policy.resources.gpus {policy.resources.gpus:g}) "
            f"and an engine process (generation.resources.gpus / generation.tensor_parallel_size = {share:g}), "
            f"{policy.resources.gpus + share:g} of a GPU in all. Make the two add up to at most 1, e.g. 0.5 and "
            f"{0.5 * tp:g}, or set generation.colocated: false.{where_set(config, 'generation.colocated', *keys)}"
        )
    engines = gen.num_workers * tp
    if engines > policy.num_workers:
        raise ConfigError(
            f"generation.colocated is true with {gen.num_workers} engine(s) of {tp} GPU(s) (generation.num_workers x "
            f"generation.tensor_parallel_size = {engines} GPUs), but the policy's {policy.num_workers} rank(s) have "
            f"{policy.num_workers} GPU(s) to share. Lower generation.num_workers, or set generation.colocated: false."
            f"{where_set(config, 'generation.num_workers', 'generation.tensor_parallel_size', 'policy.num_workers')}"
        )
    if engines > 1 and gen.weight_transport in ("auto", "nccl"):
        raise ConfigError(
            f"generation.colocated is true with engines on {engines} GPUs and generation.weight_transport "
            f"'{gen.weight_transport}' (NCCL between GPUs): policy rank 0 sends the weights, NCCL refuses an engine on "
            "its own GPU (Duplicate GPU detected) and the CUDA IPC route reaches only engines on that GPU, so the "
            "first refit would fail. Set generation.weight_transport: gloo (through CPU memory, slower), or "
            "generation.colocated: false (engines on GPUs of their own), or one engine of one GPU "
            "(generation.num_workers: 1, generation.tensor_parallel_size: 1)."
            f"{where_set(config, 'generation.colocated', 'generation.weight_transport', 'generation.num_workers', 'generation.tensor_parallel_size')}"
        )


# --------------------------------------------------------------------------- batch sizes


@attrs.frozen
class BatchSizeRules:
    """What an algorithm requires of the policy's batch sizes besides core's rule (the
    global batch a multiple of the micro batch x the data-parallel size). Its section gives
    them from a ``batch_size_rules(self) -> BatchSizeRules`` method (see the module doc)."""

    micro_multiple: int = 1  # policy.train_micro_batch_size must be a multiple of this
    micro_reason: str = ""  # why, for messages: e.g. "whole chosen/rejected pairs"
    global_divides: int | None = None  # policy.train_global_batch_size must divide this number
    global_reason: str = ""  # what that number is, for messages: e.g. "samples per GRPO step (...)"
    keys: tuple[str, ...] = ()  # the config keys the rules derive from, named in "Where set"


def batch_size_rules(config: RunConfig) -> BatchSizeRules:
    """The rules of the section named like ``config.algorithm``, or none."""
    section = config.sections.get(config.algorithm or "")
    rules = getattr(section, "batch_size_rules", None)
    return rules() if callable(rules) else BatchSizeRules()


def check_batch_sizes(config: RunConfig, rules: BatchSizeRules) -> None:
    """Raise :class:`ConfigError` when the workers or batch sizes break a rule, naming every
    broken rule and suggesting sizes that satisfy all of them."""
    if rules.global_divides is not None and rules.global_divides < 1:
        # a count below 1 (e.g. grpo.num_generations_per_prompt=-1) is its section's own error: its check names the key
        rules = attrs.evolve(rules, global_divides=None)
    factors = config.replica_factors()
    sizes = {WORKERS: config.policy.num_workers, GLOBAL: config.policy.train_global_batch_size,
             MICRO: config.policy.train_micro_batch_size}
    checker = _BatchRules(factors, rules)
    problems = checker.problems(sizes)
    if not problems:
        return
    message = "; ".join(problems) + "."
    fix = checker.suggest(sizes)
    if fix:
        message += " Use " + fix + "."
    keys = [WORKERS, *(label for label, _ in factors), GLOBAL, MICRO, *rules.keys]
    raise ConfigError(message + where_set(config, *keys))


@attrs.frozen
class _BatchRules:
    factors: list[tuple[str, int]]  # the model-parallel sizes of one replica
    rules: BatchSizeRules

    @property
    def ranks_per_replica(self) -> int:
        return math.prod(size for _, size in self.factors)

    def problems(self, sizes: dict[str, int]) -> list[str]:
        """What ``sizes`` (workers, global and micro batch) break, one phrase per rule."""
        workers, gbs, mbs = sizes[WORKERS], sizes[GLOBAL], sizes[MICRO]
        unit = self.ranks_per_replica
        out = []
        if workers % unit:
            product = " x ".join(f"{label} ({size})" for label, size in self.factors)
            out.append(f"{WORKERS}={workers} is not divisible by {product} = {unit}")
        dp = max(1, workers // unit)
        if gbs % (mbs * dp):
            out.append(f"{GLOBAL}={gbs} is not divisible by {MICRO} ({mbs}) x data-parallel size ({dp}) = {mbs * dp}")
        multiple = self.rules.micro_multiple
        if mbs % multiple:
            out.append(f"{MICRO}={mbs} is not a multiple of {multiple} ({self.rules.micro_reason})")
        divides = self.rules.global_divides
        if divides is not None and divides % gbs:
            out.append(f"{GLOBAL}={gbs} does not divide {divides} ({self.rules.global_reason})")
        return out

    def suggest(self, sizes: dict[str, int]) -> str:
        """Values that satisfy every rule: each single key that does on its own (the workers
        when they break the parallel sizes, else the global and the micro batch), else the
        fewest keys together."""
        ok = lambda changed: not self.problems({**sizes, **changed})  # noqa: E731
        parallel_wrong = sizes[WORKERS] % self.ranks_per_replica != 0
        singles = []
        for key in [WORKERS] if parallel_wrong else [GLOBAL, MICRO]:
            value = next((v for v in self.candidates(key, sizes) if ok({key: v})), None)
            if value is not None:
                singles.append(f"{key}={value}")
        if singles:
            return ", or ".join(singles)
        combos = [(WORKERS, GLOBAL), (WORKERS, MICRO), (WORKERS, MICRO, GLOBAL)] if parallel_wrong else [(MICRO, GLOBAL)]
        for *firsts, last in combos:
            for values in itertools.product(*(self.nearby(key, sizes) for key in firsts)):
                changed = dict(zip(firsts, values, strict=True))
                value = next((v for v in self.candidates(last, {**sizes, **changed}) if ok({**changed, last: v})), None)
                if value is not None:
                    parts = [f"{key}={v}" for key, v in [*changed.items(), (last, value)]]
                    return f"{', '.join(parts[:-1])} and {parts[-1]} together"
        return ""

    def candidates(self, key: str, sizes: dict[str, int]) -> list[int]:
        """Values of ``key`` that may satisfy the rules with the other sizes as they are,
        most preferred first: the workers and the global batch rounded up, the micro batch
        rounded down."""
        workers, gbs, mbs = sizes[WORKERS], sizes[GLOBAL], sizes[MICRO]
        unit = self.ranks_per_replica
        dp = max(1, workers // unit)
        if key == WORKERS:  # the data-parallel size must divide the global batch
            return _prefer([unit * k for k in _divisors(gbs)], workers, up=True)
        if key == GLOBAL:
            if self.rules.global_divides is not None:
                return _prefer(_divisors(self.rules.global_divides), gbs, up=True)
            step = mbs * dp
            return _prefer([math.ceil(gbs / step) * step, gbs // step * step], gbs, up=True)
        return _prefer(_divisors(gbs // dp) if gbs % dp == 0 else [], mbs, up=False)

    def nearby(self, key: str, sizes: dict[str, int]) -> list[int]:
        """Values of ``key`` near its own, to pair with another key's candidates."""
        current = sizes[key]
        step = self.ranks_per_replica if key == WORKERS else self.rules.micro_multiple
        values = [step * k for k in range(1, 2 * math.ceil(current / step) + 2)]
        return _prefer(values, current, up=key == WORKERS)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _prefer(values: Iterable[int], current: int, *, up: bool) -> list[int]:
    """``values`` other than ``current`` (positive, without repeats), nearest first on the
    preferred side (above when ``up``), then the others nearest first."""
    distinct = sorted({v for v in values if v >= 1 and v != current})
    above = [v for v in distinct if v > current]
    below = [v for v in reversed(distinct) if v < current]
    return above + below if up else below + above


# --------------------------------------------------------------------------- environments


def check_environments(config: RunConfig, host: PluginHost) -> None:
    """Every name under ``environments`` is a registered environment, and its options are
    what the environment declares (:mod:`posttrain.config.environments`)."""
    sources = {tuple(key.split(".")): where for key, where in config.sources.items()}
    for name, options in config.environments.items():
        factory = require_registered(host.environments, name, f"environments.{name}", config=config)
        read_environment_options(name, factory, options, sources)

