"""Features a backend or an algorithm declares on its config section's class, as class attributes set true.

- ``supports_lora`` on a policy backend's section (``policy.<backend>``): it implements
  ``policy.lora``;
- ``supports_muon`` on a policy backend's section: it implements ``policy.optimizer.name:
  muon``;
- ``supports_lora_adapters`` on a generation backend's section (``generation.<backend>``): its
  engines load the adapters a refit with ``policy.lora.refit: adapter`` sends;
- ``runs_in_driver`` on a policy backend's section: its single worker can run inside the
  driver's process (``policy.in_driver``; the factory passes the setting to its
  :class:`~posttrain.distributed.WorkerGroup`);
- ``runs_in_policy_workers`` on a generation backend's section: its engines can run inside the
  policy's worker processes (``generation.in_policy_workers``); its factory then takes the
  policy as ``host`` (:mod:`posttrain.backend.hosted`);
- ``supports_exact_logprobs`` on a policy backend's section: with ``generation.exact_logprobs``
  it scores tokens as :mod:`posttrain.backend.exact` lays out; on a generation backend's
  section: its engines then report those logprobs, bit for bit;
- ``records_routed_experts`` on a generation backend's section: its engines report the experts
  each token of a mixture of experts went through (``policy.moe``); ``replays_routed_experts``
  on a policy backend's section: its routers can be made to use them; ``trains_router_losses``
  on a policy backend's section: it adds the routers' losses to training (``policy.moe``);
  ``splits_experts`` on a policy backend's section: it implements expert parallelism
  (``policy.moe.expert_parallel_size``);
- ``carries_routed_experts`` on an algorithm's section: its policy passes carry the experts
  routing replay gives the routers (``policy.moe.routing_replay``, ``router_agreement``): the
  rollouts' and the previous-logprob pass's;
- ``batch_invariant_logprobs`` on a generation backend's section: with
  ``generation.exact_logprobs`` its engines run batch-invariant kernels instead (their logprobs
  do not depend on the batch, but are not the trainer's bit for bit).

Core's config check refuses a feature the chosen backend does not declare
(:func:`posttrain.config.validate.check_lora`, :func:`~posttrain.config.validate.check_muon`,
:func:`~posttrain.config.validate.check_generation_placement`, :func:`~posttrain.config.validate.check_policy_in_driver`,
:func:`~posttrain.config.validate.check_exact_logprobs`,
:func:`~posttrain.config.validate.check_routing_replay`,
:func:`~posttrain.config.validate.check_router_losses`,
:func:`~posttrain.config.validate.check_expert_parallel`);
``posttrain plugins`` lists what each plugin
declares. Imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

from posttrain.plugins import PluginHost

#: Attribute -> what ``posttrain plugins`` says of a section that declares it.
FEATURES = {
    "supports_lora": "LoRA (policy.lora)",
    "supports_muon": "the Muon optimizer (policy.optimizer.name: muon)",
    "supports_lora_adapters": "LoRA adapters sent by refit (policy.lora.refit: adapter)",
    "runs_in_driver": "its single worker inside the driver's process (policy.in_driver)",
    "runs_in_policy_workers": "engines inside the policy's workers (generation.in_policy_workers)",
    "supports_exact_logprobs": "exact logprobs, the trainer's bit for bit (generation.exact_logprobs)",
    "batch_invariant_logprobs": "batch-invariant logprobs (generation.exact_logprobs)",
    "records_routed_experts": "the experts each token was routed to, recorded (policy.moe)",
    "replays_routed_experts": "routing replay: the rollout's or its own previous experts used by the policy (policy.moe)",
    "trains_router_losses": "the routers' load-balancing and z-losses (policy.moe.aux_loss_coef, z_loss_coef)",
    "splits_experts": "expert parallelism (policy.moe.expert_parallel_size)",
    "carries_routed_experts": "routing replay: the experts of its rollouts or previous-logprob pass (policy.moe)",
}


def declared_features(section_class: type) -> list[str]:
    """The descriptions of the :data:`FEATURES` that ``section_class`` declares."""
    return [text for attribute, text in FEATURES.items() if getattr(section_class, attribute, False) is True]


def section_declares(host: PluginHost, section: str, feature: str) -> bool:
    """Whether the registered config section ``section`` declares ``feature`` (an attribute
    of :data:`FEATURES`)."""
    return section in host.config_sections and getattr(host.config_sections[section], feature, False) is True


def _registry(host: PluginHost, kind: str) -> Any:
    return {"policy": host.policy_backends, "generation": host.generation_backends, "algorithm": host.algorithms}[kind]


def section_of(kind: str, name: str) -> str:
    """The config section of the ``kind`` plugin ``name``: ``policy.<name>`` or
    ``generation.<name>`` for a backend, ``<name>`` for an algorithm."""
    return name if kind == "algorithm" else f"{kind}.{name}"


def backends_declaring(host: PluginHost, kind: str, feature: str) -> str:
    """The registered ``kind`` plugins (``policy`` or ``generation`` backends, or ``algorithm``s)
    whose section declares ``feature``, comma-separated, or ``none installed``: the list a
    refusal offers."""
    names = [name for name in _registry(host, kind) if section_declares(host, section_of(kind, name), feature)]
    return ", ".join(names) or "none installed"


def lacking_feature(host: PluginHost, kind: str, name: str, feature: str) -> tuple[str, str] | None:
    """For a refusal, when the registered ``kind`` plugin ``name`` (a ``policy`` or
    ``generation`` backend, or an ``algorithm``) does not declare ``feature``: its label,
    ``'name' (distribution version)``, and the plugins that do (:func:`backends_declaring`).
    None when it declares it, or is not registered (the registry's check names that)."""
    registry = _registry(host, kind)
    if name not in registry or section_declares(host, section_of(kind, name), feature):
        return None
    return f"'{name}' ({registry.distribution_of(name)})", backends_declaring(host, kind, feature)
