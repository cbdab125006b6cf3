"""Sharding a Hugging Face causal LM with tensor parallel and FSDP2 over a DeviceMesh.

The rank's meshes (:class:`Meshes`): ``tp`` and ``dp``, with ``dp`` also split into groups of
``ep`` ranks that share a mixture of experts' experts (:mod:`posttrain_dtensor.experts`). Tensor parallel follows the model's own
``base_model_tp_plan`` (transformers ships one per architecture: column-wise q/k/v/gate/up,
row-wise o/down), applied with ``parallelize_module`` over the ``tp`` axis; the styles it
serves are :data:`TP_STYLES` and :data:`WHOLE_STYLES` (:func:`check_tensor_parallel` refuses
a plan with others when the config is validated). The language-model head and embeddings
stay whole across ``tp`` (the head is applied in vocabulary chunks, see
:mod:`posttrain.backend.logprobs`), tied or not. FSDP2 ``fully_shard`` then shards every
decoder layer and the root over the ``dp`` axis.

The root FSDP unit is :class:`CausalLMHead`, a thin module around the Hugging Face model
whose forward runs the decoder and then a head function on the final hidden states and the
output-embedding weight. Because that all happens inside one root forward, FSDP has the
head weight gathered and reduces its gradient like any other parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from posttrain.backend.vision import embed_with_images
from posttrain.errors import ConfigError
from posttrain_dtensor.experts import EXPERTS_STYLE
from posttrain_dtensor.lora import plan_key_matches, tensor_parallel_plan
from posttrain_dtensor.tied_gradient import TiedGradient

#: Hugging Face tensor-parallel styles this backend applies with ``parallelize_module``, by
#: their names in ``base_model_tp_plan``: a column-wise layer gives its shard of the output
#: features (``colwise``) or, gathered, all of them (``colwise_gather_output``: Phi-3's fused
#: projections, OLMo 2's q/k/v, whose norms span every head); a row-wise one takes its shard of
#: the input features (``rowwise``) or splits whole ones itself (``rowwise_split_input``).
TP_STYLES: dict[str, Callable[[], object]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}
#: Styles served by keeping the module whole on every tensor-parallel rank:
#: ``embedding_rowwise`` (the embedding, whole like the head that reads it, tied or not) and
#: ``replicated_with_grad_allreduce`` (Qwen 3's and Gemma 3's q/k norms, which see each rank's
#: own heads: their gradients are summed over the ranks, :func:`sum_gradients`).
WHOLE_STYLES = ("embedding_rowwise", "replicated_with_grad_allreduce")

Head = Callable[[torch.Tensor, torch.Tensor], object]


class CausalLMHead(nn.Module):
    """Root module: decoder forward, then ``head(hidden_states, output_weight)``.

    ``lm`` is the Hugging Face ``*ForCausalLM`` (the output weight is its output embedding;
    its logits are never computed here) or, for a value head, the ``*ForSequenceClassification``
    with one label (the output weight is its ``score`` layer's [1, H]). Only models whose
    logits are that linear map of the final hidden state, soft-capped or not
    (:func:`output_softcap`), fit: not models with logit scaling.
    """

    def __init__(self, lm: nn.Module, tied: TiedGradient | None = None):
        super().__init__()
        self.lm = lm
        self.tied = tied  # the output weight is read through it (:mod:`posttrain_dtensor.tied_gradient`)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        head: Head,
        segment_bounds: torch.Tensor | None = None,
        **images: torch.Tensor,
    ) -> object:
        """``segment_bounds``: packed rows' ``cu_seqlens`` for the segment attention kernel;
        ``images``: a vision-language model's ``pixel_values``, ``image_grids`` and
        ``image_mask`` (:mod:`posttrain_dtensor.vision`), embedded here, where FSDP has
        gathered the vision tower and the embedding."""
        extra = {} if segment_bounds is None else {"cu_seq_lens_q": segment_bounds}
        if images:
            embeds = embed_with_images(self.lm, input_ids, images["pixel_values"], images["image_grids"],
                                       images["image_mask"])
            extra["inputs_embeds"], input_ids = embeds, None
        out = self.lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **extra
        )
        return head(out.last_hidden_state, self.output_weight())

    def output_weight(self) -> torch.Tensor:
        """The output embedding's weight [V, H], or a sequence classifier's ``score`` weight."""
        if self.tied is not None:
            return self.tied.head_weight()
        embedding = self.lm.get_output_embeddings()
        return (embedding if embedding is not None else self.lm.score).weight


@attrs.frozen
class Meshes:
    """A rank's device meshes: ``tp`` (the ranks splitting each layer), ``dp`` (the data-parallel
    ranks), and ``dp`` split into groups of ``ep`` ranks, ``edp`` numbering the groups (expert
    parallelism, :mod:`posttrain_dtensor.experts`; ``ep`` has one rank without it)."""

    dp: DeviceMesh
    edp: DeviceMesh
    ep: DeviceMesh
    tp: DeviceMesh


def build_meshes(device_type: str, dp_size: int, tp_size: int, ep_size: int = 1) -> Meshes:
    """The :class:`Meshes` of a ``("edp", "ep", "tp")`` mesh over the default process group
    (``dp_size * tp_size`` ranks; ``ep_size`` divides ``dp_size``)."""
    mesh = init_device_mesh(device_type, (dp_size // ep_size, ep_size, tp_size), mesh_dim_names=("edp", "ep", "tp"))
    return Meshes(dp=mesh["edp", "ep"]._flatten("dp"), edp=mesh["edp"], ep=mesh["ep"], tp=mesh["tp"])


def output_softcap(lm: nn.Module) -> float | None:
    """The soft-cap a causal LM applies to its logits, ``softcap * tanh(logits / softcap)``
    (``final_logit_softcapping`` in its config: Gemma 2), or None (a value head has none)."""
    if lm.get_output_embeddings() is None:
        return None
    cap = getattr(lm.config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def check_model_fits(config: object, tp_size: int) -> None:
    """Refuse, from the model's config alone, a model this backend would get wrong or a
    tensor-parallel layout it cannot serve (:func:`check_tensor_parallel`)."""
    if getattr(config, "logit_scale", None):
        raise ConfigError(
            "policy.model: the model config sets 'logit_scale', which the dtensor backend's chunked logprob "
            "head does not apply; use a model whose logits are lm_head(hidden), soft-capped or not"
        )
    if tp_size > 1:
        config = config.get_text_config()  # a vision-language model's language model is what is split
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, key, None)
            if heads is not None and heads % tp_size:
                raise ConfigError(
                    f"policy.tensor_parallel_size={tp_size} does not divide the model's {key}={heads}; "
                    "choose a tensor-parallel size that divides both attention head counts"
                )
        check_tensor_parallel(config)


def dense_plan(config: object) -> dict[str, str]:
    """A (text) config's ``base_model_tp_plan`` without a mixture of experts' experts: the
    entries of style :data:`~posttrain_dtensor.experts.EXPERTS_STYLE` and those under them. The
    experts stay whole on every tensor-parallel rank, which all route the same tokens (their
    inputs are whole there); expert parallelism splits them instead."""
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    experts = [name for name, style in plan.items() if style == EXPERTS_STYLE]
    return {name: style for name, style in plan.items()
            if not any(name == prefix or name.startswith(prefix + ".") for prefix in experts)}


def check_tensor_parallel(config: object) -> None:
    """Refuse a model whose ``base_model_tp_plan`` is missing or uses a style this backend
    does not serve (outside a mixture of experts' experts, which stay whole), naming the
    entries and the styles it does."""
    model_type = getattr(config, "model_type", "?")
    if not getattr(config, "base_model_tp_plan", None):
        raise ConfigError(
            f"policy.tensor_parallel_size > 1, but the model type '{model_type}' has no base_model_tp_plan in "
            "transformers; set policy.tensor_parallel_size=1 (FSDP over policy.num_workers shards it)"
        )
    plan = dense_plan(config)
    unsupported = {name: style for name, style in plan.items() if style not in (*TP_STYLES, *WHOLE_STYLES)}
    if unsupported:
        raise ConfigError(
            f"policy.tensor_parallel_size > 1: the tensor-parallel plan of model type '{model_type}' uses styles "
            f"the dtensor backend does not implement: {unsupported}; it implements "
            f"{', '.join(sorted((*TP_STYLES, *WHOLE_STYLES)))}. Set policy.tensor_parallel_size=1 for this model "
            "(FSDP over policy.num_workers shards it)"
        )


def apply_tensor_parallel(lm: nn.Module, tp_mesh: DeviceMesh, *, adapters: bool = False) -> list[nn.Module]:
    """Shard ``lm``'s decoder (:func:`split_decoder`) over ``tp_mesh`` following its (text
    config's) ``base_model_tp_plan`` without the experts (:func:`dense_plan`; with
    ``adapters``, as :func:`posttrain_dtensor.lora.tensor_parallel_plan` extends it to the
    LoRA layers; the plan was checked by :func:`check_tensor_parallel`). Returns the modules
    whose parameters' gradients :func:`sum_gradients` must sum over the ranks."""
    decoder = split_decoder(lm)
    plan = dense_plan(lm.config.get_text_config())
    summed = [name for name, style in plan.items() if style == "replicated_with_grad_allreduce"]
    plan = {name: style for name, style in plan.items() if style in TP_STYLES}
    if adapters:
        plan = tensor_parallel_plan(decoder, plan)
    # each rank keeps its slice of its own copy (no scatter from rank 0: with several ranks only rank 0's
    # copy holds the weights, which load_from_rank0 sends once the model is laid out)
    parallelize_module(decoder, tp_mesh, {name: TP_STYLES[style]() for name, style in plan.items()},
                       src_data_rank=None)
    return [module for path, module in decoder.named_modules()
            if any(plan_key_matches(pattern, path) for pattern in summed)]


def split_decoder(lm: nn.Module) -> nn.Module:
    """The module a tensor-parallel plan's paths are relative to: the causal LM's base model,
    or a vision-language model's language model (Qwen-VL's ``language_model``, Idefics3's
    ``text_model``; its vision tower stays whole on every rank)."""
    for name in ("language_model", "text_model"):
        if (language_model := getattr(lm.base_model, name, None)) is not None:
            return language_model
    return lm.base_model


def sum_gradients(modules: list[nn.Module], group: dist.ProcessGroup) -> None:
    """Sum the gradients of ``modules``' own parameters over ``group`` in place (each rank
    holds the share of its tensor-parallel shard's heads). Under FSDP a gradient is the
    rank's data-parallel shard, which every tensor-parallel rank holds alike."""
    for module in modules:
        for param in module.parameters(recurse=False):
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=group)


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM, or of a vision-language model's language model."""
    layers = getattr(split_decoder(lm), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            f"policy.model: cannot find the decoder layers of model type '{lm.config.model_type}' (expected a "
            "ModuleList at base_model.layers, as Llama, Qwen, Mistral, Gemma, Phi-3 and OLMo 2 have, or at "
            "base_model.language_model.layers, as Qwen-VL has, or base_model.text_model.layers, as Idefics3 has), "
            "which FSDP shards one by one; train it on one "
            "rank in float32 (policy.num_workers=1, policy.dtype=float32)"
        )
    return layers


def vision_blocks(lm: nn.Module) -> list[nn.Module]:
    """The blocks of a vision-language model's vision tower (Qwen-VL's ``visual.blocks``,
    Idefics3's ``vision_model.encoder.layers``), each an FSDP unit of its own; none for a causal LM."""
    base = lm.base_model
    blocks = getattr(getattr(base, "visual", None), "blocks", None)
    if blocks is None:
        blocks = getattr(getattr(getattr(base, "vision_model", None), "encoder", None), "layers", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def apply_fsdp(
    lm: nn.Module,
    meshes: Meshes,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    experts: list[nn.Module] = (),
) -> CausalLMHead:
    """Shard each vision block and decoder layer, then the root, over ``meshes.dp``; return the
    root. ``experts``: modules split by expert parallelism
    (:func:`posttrain_dtensor.experts.split_experts`), each sharded first, over ``meshes.edp``
    (the ranks holding the same experts).

    Gradients are summed, not averaged, over data-parallel ranks: every rank's loss is
    already normalised by the global token or sequence count.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in experts:
        fully_shard(module, mesh=meshes.edp, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for layer in [*vision_blocks(lm), *decoder_layers(lm)]:
        fully_shard(layer, mesh=meshes.dp, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    root = CausalLMHead(lm)
    fully_shard(root, mesh=meshes.dp, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return root


def load_from_rank0(root: nn.Module, full: dict[str, torch.Tensor] | None) -> None:
    """Fill ``root``'s parameters and buffers, laid out over the ranks (tensor parallel, FSDP,
    expert parallel), from rank 0's ``full`` state dict of ``root.lm`` (None on the other
    ranks, whose model was built on the meta device and materialised empty): one tensor at a
    time is broadcast over the world group and each rank keeps its shard (torch's
    ``set_model_state_dict`` with ``broadcast_from_rank0``), then the buffers a state dict
    leaves out (rotary frequencies, embedding scales) are broadcast whole."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(root, {} if full is None else {f"lm.{name}": value for name, value in full.items()},
                         options=options)
    saved = set(root.state_dict())
    for name, buffer in root.named_buffers():
        if name not in saved:
            dist.broadcast(buffer, src=0)


def reshard_all(root: nn.Module) -> None:
    """Free every gathered parameter, so the sharded parameters are the only copy.

    FSDP2 keeps the root gathered after a forward without backward; call this before
    changing sharded weights in place (reference swap, checkpoint load).
    """
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
