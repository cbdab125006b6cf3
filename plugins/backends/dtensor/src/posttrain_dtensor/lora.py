"""LoRA adapters on the dtensor policy (``policy.lora``), made by ``peft``.

:func:`attach_adapters` injects peft's LoRA layers into the Hugging Face model in place,
before it is sharded: each targeted ``nn.Linear`` becomes a ``peft`` ``lora.Linear`` whose
``base_layer`` is the original (frozen) layer and whose ``lora_A`` / ``lora_B`` (adapter
:data:`ADAPTER`) are the only trainable parameters; ``A`` is random (peft's Kaiming
initialisation, seeded by the run's seed, so every rank builds the same) and ``B`` zero, so
the adapted model computes exactly the base model until the first step.

Tensor parallel (:func:`tensor_parallel_plan`): the base layer takes its planned style and
the adapter matrix on the same side of the split follows it (column-wise: ``B``, split by
output rows like the base weight; row-wise: ``A``, split by input columns); the other
matrix (``rank`` wide) stays whole on every tensor-parallel rank. Under the styles whose
layer gathers its output or splits its input itself (``colwise_gather_output``,
``rowwise_split_input``) the adapter sees and gives whole activations: both matrices stay whole.

The reference policy is the base model: :func:`adapters_disabled` turns the adapters off
for a pass, so no second copy of the weights is kept.

With exact logprobs, :func:`compute_merged` makes each adapted layer compute with its merged
weight, the very tensor a merged refit sends to the engines.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from posttrain.config.schema import LoraConfig, RunConfig
from posttrain.config.validate import where_set
from posttrain.errors import ConfigError
from posttrain.models.auto import vision_tower
from posttrain.models.folder import read_model_config

if TYPE_CHECKING:
    import peft

#: peft's name of the one adapter the policy trains.
ADAPTER = "default"
#: Which adapter matrix is split like the base weight under each tensor-parallel style; under
#: the others (whose layers take or give whole activations) both stay whole.
SHARDED_MATRIX = {"colwise": "lora_B", "rowwise": "lora_A"}


def peft_config(options: LoraConfig, targets: list[str] | str) -> peft.LoraConfig:
    """``policy.lora`` as peft's ``LoraConfig`` adapting ``targets`` (no bias, B initialised
    to zero). peft is imported only where LoRA is used, so full fine-tuning ranks never load it."""
    import peft

    return peft.LoraConfig(
        r=options.rank, lora_alpha=options.alpha, lora_dropout=options.dropout, target_modules=targets,
        bias="none", task_type="CAUSAL_LM",
    )


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's peft LoRA layers by module path (empty without adapters)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def attach_adapters(lm: nn.Module, config: RunConfig) -> dict[str, nn.Module]:
    """Inject ``policy.lora``'s adapters into the causal LM ``lm`` in place and freeze every
    other parameter; return the adapted layers by module path. ``all-linear`` adapts the
    linear layers but the output head, by name (:func:`linear_names`): the packed experts of a
    mixture of experts are parameters, not linear layers, and stay frozen (peft's own
    ``all-linear`` would wrap them). A vision-language model's vision tower is never adapted:
    the targets are its language model's layers. Raises :class:`ConfigError` when ``target_modules``
    matches nothing, the output head, or a module that is not linear."""
    import peft

    options = config.policy.lora
    key = "policy.lora.target_modules"
    head = lm.get_output_embeddings()
    names = linear_names(lm)
    targets = names if options.target_modules == "all-linear" else options.target_modules
    vision = {id(m) for tower in vision_tower(lm) for m in tower.modules()}  # a VLM's: never adapted
    matched = {path: module for path, module in lm.named_modules()
               if path and id(module) not in vision and _targeted(targets, path)}
    if not matched:
        raise ConfigError(
            f"{key}: {options.target_modules!r} matches no module of the model '{config.policy.model}'. Its linear "
            f"layers (the output head aside) are named {', '.join(names)} (a list entry matches a name "
            f"or a path ending in '.name'; a string is a regular expression over full paths such as "
            f"'{next(_linear_paths(lm), 'model.layers.0.mlp.up_proj')}'; all-linear takes every linear layer but "
            f"the output head).{where_set(config, key)}"
        )
    for path, module in matched.items():
        if module is head:
            raise ConfigError(
                f"{key}: {options.target_modules!r} puts an adapter on the output head '{path}', which the dtensor "
                f"backend applies in vocabulary chunks from its weight alone; leave it out (all-linear does)."
                f"{where_set(config, key)}"
            )
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"{key}: {options.target_modules!r} matches '{path}', a {type(module).__name__}; the dtensor backend "
                f"adapts linear layers only: {', '.join(names)}.{where_set(config, key)}"
            )
    peft.inject_adapter_in_model(peft_config(options, list(matched)), lm, adapter_name=ADAPTER)
    return lora_layers(lm)


def _targeted(targets: list[str] | str, path: str) -> bool:
    """Whether peft adapts the module at ``path`` for ``target_modules=targets``: a string is
    a regular expression over the whole path, a list entry a name or the end of the path."""
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == name or path.endswith(f".{name}") for name in targets)


def _linear_paths(lm: nn.Module) -> Iterator[str]:
    """The module paths of the causal LM's linear layers but its output head (of a
    vision-language model: its language model's, not its vision tower's)."""
    head = lm.get_output_embeddings()
    vision = {id(m) for tower in vision_tower(lm) for m in tower.modules()}
    return (name for name, module in lm.named_modules()
            if isinstance(module, nn.Linear) and module is not head and id(module) not in vision)


def linear_names(lm: nn.Module) -> list[str]:
    """The distinct last names of the causal LM's adaptable linear layers (``q_proj``, ...)."""
    return sorted({name.rsplit(".", 1)[-1] for name in _linear_paths(lm)})


def check_targets(config: RunConfig) -> None:
    """:func:`attach_adapters` on a weightless (meta-device) copy of ``policy.model``, for its
    errors before any worker starts."""
    from transformers import AutoConfig

    from posttrain.models.auto import generative_class

    read_model_config(config.policy.model, "policy.model")  # a clear error before transformers' own
    with torch.device("meta"):
        model_config = AutoConfig.from_pretrained(config.policy.model)
        lm = generative_class(model_config).from_config(model_config)
    attach_adapters(lm, config)


def plan_key_matches(pattern: str, path: str) -> bool:
    """Whether a tensor-parallel plan key (``layers.*.mlp.up_proj``) names module ``path``."""
    atoms, parts = pattern.split("."), path.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts, strict=True))


def tensor_parallel_plan(base_model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` (module path pattern -> ``colwise`` / ``rowwise``, relative to ``base_model``)
    with every adapted layer it names replaced by its base layer and its split adapter matrix
    (see the module docstring); entries naming no adapted layer are kept as they are."""
    adapted = lora_layers(base_model)
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        hits = [path for path in adapted if plan_key_matches(pattern, path)]
        if not hits:
            out[pattern] = style
            continue
        for path, _ in base_model.named_modules():
            if not plan_key_matches(pattern, path):
                continue
            if path in adapted:
                out[f"{path}.base_layer"] = style
                if style in SHARDED_MATRIX:
                    out[f"{path}.{SHARDED_MATRIX[style]}.{ADAPTER}"] = style
            else:
                out[path] = style
    return out


def compute_merged(layers: dict[str, nn.Module]) -> None:
    """Make every adapted layer of ``layers`` compute ``x @ (W + (B @ A) * scale).T + bias``:
    one product with the merged weight, computed as
    :class:`~posttrain_dtensor.weights.MergedWeights` computes the weight a refit sends, so the
    layer's output has the bits of the engine's layer holding that weight (peft's two-path
    sum, ``W x + scale * B (A x)``, has others). Gradients reach ``A`` and ``B`` through the
    merge; with the adapters disabled the layer is its base layer. Needs float32 weights and
    no adapter dropout (checked with the config)."""
    for layer in layers.values():
        layer.forward = types.MethodType(_merged_forward, layer)


def _merged_forward(self: nn.Module, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    base = self.get_base_layer()
    if self.disable_adapters:
        return base(x, *args, **kwargs)
    delta = self.lora_B[ADAPTER].weight @ self.lora_A[ADAPTER].weight
    return nn.functional.linear(x, base.weight + delta * self.scaling[ADAPTER], base.bias)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the model as its base model (every adapter off) inside the block.

    peft clears ``requires_grad`` of the adapters it turns off; it is set back at once, since
    FSDP2 gives the gathered copy of a parameter the flag its shard has at the first gather
    (a copy made during a reference pass would otherwise never get a gradient again)."""
    layers = list(lora_layers(model).values())
    trainable = [p for p in model.parameters() if p.requires_grad]
    for layer in layers:
        layer.enable_adapters(False)
    for param in trainable:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
