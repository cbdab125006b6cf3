"""The engine actor of the ``vllm`` backend: one ``vllm.LLM`` in its own process.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the factory in
the actor's environment): it starts in seconds and refits without crossing another
process boundary. Tokens go in and come out (``skip_tokenizer_init``) unless the engine
was started with ``detokenize``, which stop strings need, or serves a vision-language model.

Images (a vision-language model's prompts): vLLM's processor reads each row's images (the
encoded files the request carries) and widens their placeholders itself, so each image's
tokens in the prompt are put back to the one placeholder the chat template wrote
(:meth:`~posttrain.data.images.ImageInputs.collapse`), and the prompt vLLM widened is checked
to be posttrain's token for token.

Sampling: one ``SamplingParams`` per row with the row's seed and
``logprobs_mode="processed_logprobs"`` for the engine, so the reported logprob is that of
the temperature-scaled, top-k/top-p-filtered distribution the token was drawn from
(:mod:`posttrain.backend.sampling`). ``ignore_eos`` with explicit ``stop_token_ids`` (which hold
the model's EOS ids) makes the stop set exactly the request's.

LoRA adapters (``adapters``, ``policy.lora.refit: adapter``): the engine starts with LoRA on
and the base model's weights, which never change; each refit receives the adapter matrices
(the weight sync's broadcast, into every vLLM worker), writes them as a PEFT folder in the
actor's temporary folder, and loads it as adapter ``version + 1`` (:class:`AdapterSlot`);
every later generation uses it. Before the first refit the engine samples from the base
model, which is what a LoRA policy is at step 0.

KV cache: ``kv_cache_bytes`` when set; otherwise, on CPU, :func:`cpu_kv_cache_bytes` (room
for the rows the engine runs at once, each of ``max_model_len`` tokens), and on GPU what
``gpu_memory_utilization`` leaves. The actor's environment loses ``VLLM_CPU_KVCACHE_SPACE``,
vLLM-CPU's fixed size in GiB, which would replace either.

Devices: the engine computes on CUDA exactly when its actor was given GPUs
(:func:`~posttrain.distributed.placement.gpus_given`). An engine of several GPUs
(``tensor_parallel_size`` > 1) holds none itself: posttrain gives it one bundle per GPU of its
placement group (:func:`~posttrain.distributed.placement.device_bundles`), and vLLM's Ray
executor starts its tensor-parallel workers there, each with its share of its GPU
(:func:`ray_executor`). vLLM's own choice inside a placement group is that executor too, but
over every GPU bundle of the group, and only after checking that the actor sees as many GPUs
as the engine's workers ("World size (2) is larger than the number of available GPUs").

Colocation: with CUDA and ``enable_sleep_mode``, :meth:`sleep` frees the weights and KV
cache (level 1) and :meth:`wake_up` restores them; a refit wakes the weights first. On
CPU vLLM refuses sleep mode, so both are no-ops there.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import attrs
import torch

from posttrain.backend.generation_group import Completion, EngineWorker, GenerationRequest
from posttrain.backend.weight_sync import TransferInit
from posttrain.config.schema import LoraConfig
from posttrain.data.images import ImageInputs, decode_image
from posttrain.distributed.placement import DeviceBundles, device_bundles, gpus_given
from posttrain.errors import ConfigError, WorkerError
from posttrain_vllm.config import engine_lora_options

#: Prompt tokens one CPU engine step may prefill (whole prompts; at least max_model_len).
CPU_STEP_TOKENS = 8192
#: Rows an engine runs at once unless ``engine_kwargs`` sets ``max_num_seqs``: vLLM's default
#: for ``vllm.LLM`` on CPUs and GPUs below 70 GiB.
DEFAULT_MAX_NUM_SEQS = 256
#: Tokens per KV cache block on vLLM's CPU attention unless ``engine_kwargs`` sets ``block_size``
#: (vLLM-CPU's own default is 128; its kernels want a multiple of 32). The prefix cache reuses
#: whole blocks only, so with 128 a GRPO group's shared prompt or a multi-turn episode's earlier
#: turns, mostly shorter than a block, were computed again for every row and turn: 32 decoded a
#: three-turn rollout (128 rows, small model) in 0.6x the time and a one-turn one in 0.9x
#: (docs/backends/vllm.md, "On CPUs").
CPU_BLOCK_TOKENS = 32
#: vLLM-CPU's KV cache size in GiB; when set it replaces ``kv_cache_memory_bytes``.
KV_SPACE_VAR = "VLLM_CPU_KVCACHE_SPACE"


def compile_nothing() -> None:
    """Turn torch.compile off in this (the engine's) process. With ``enforce_eager`` vLLM
    compiles no model, but its sampler still compiles small helpers of its own with inductor
    on their first call (the rank of each sampled token, for its logprob). On CPU that ran a
    C++ compiler in the first run on a machine (2 GB of ``cc1plus`` beside the run, for a
    kernel that counts), and in every later run inductor's checks of the CPU's instruction set
    (short-lived ``python -c`` processes of about 80 MB each, 335-439 MB in all, and a ``g++``)."""
    import torch._dynamo

    torch._dynamo.config.disable = True


class VllmEngineWorker(EngineWorker):
    """``engine_kwargs`` go to ``vllm.LLM`` last (they override the backend's choices).
    ``log_level`` is that of vLLM's logger (as ``VLLM_LOGGING_LEVEL``, which the factory
    sets to it); below ``logging.ERROR`` the weights' loading bar is drawn too."""

    def __init__(
        self,
        *,
        model_path: str,
        dtype: str,
        seed: int,
        tensor_parallel_size: int,
        max_model_len: int,
        enforce_eager: bool,
        gpu_memory_utilization: float,
        detokenize: bool,
        enable_sleep_mode: bool,
        log_level: int,
        engine_kwargs: dict[str, Any],
        adapters: LoraConfig | None = None,
        kv_cache_bytes: int | None = None,
    ):
        super().__init__()
        # vLLM is imported here, in the engine's process, never where this class is only
        # named (the driver): importing vLLM changes the importing process's settings. Its
        # logger gets its level (VLLM_LOGGING_LEVEL) only when the engine starts; what it
        # logs while being imported is held to the same level.
        logging.getLogger("vllm").setLevel(log_level)
        from vllm import LLM

        from posttrain_vllm.transfer import ENGINE_NAME, register

        register()  # the weight-transfer engine, for an engine in this process

        on_cuda = gpus_given()
        executor, executor_env = ray_executor(device_bundles())
        os.environ.update(executor_env)
        if not on_cuda:
            if enforce_eager:
                compile_nothing()
            shape = AttentionShape.of(model_path)  # its head size was checked with the config
            kv_cache_bytes = kv_cache_bytes or cpu_kv_cache_bytes(shape, dtype, max_model_len, engine_kwargs)
            os.environ.pop(KV_SPACE_VAR, None)
        self.sleep_enabled = on_cuda and enable_sleep_mode
        self.detokenize = detokenize
        self.images = _image_inputs(model_path)
        self.adapters = AdapterSlot(adapters, model_path) if adapters is not None else None
        self.asleep: set[str] = set()
        # On CPU a prompt must never be split over engine steps: vLLM rewinds a seeded row's
        # random generator after a partial prefill, which CPU generators cannot do ("CPU
        # Generator does not use offset"), so a call whose prompts exceed one step's token
        # budget (4096 by default) failed. Whole prompts are scheduled, as many as fit.
        # KV blocks of CPU_BLOCK_TOKENS, so that the prefix cache can reuse short prefixes.
        cpu_scheduling = {} if on_cuda else {
            "enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_STEP_TOKENS),
            "block_size": CPU_BLOCK_TOKENS,
        }
        options = {
            "model": model_path,
            "dtype": dtype,
            "seed": seed,
            "tensor_parallel_size": tensor_parallel_size,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
            "gpu_memory_utilization": gpu_memory_utilization,
            **({"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes is not None else {}),
            "skip_tokenizer_init": not detokenize and self.images is None,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": "posttrain_vllm.extension.RefitExtension",
            "weight_transfer_config": {"backend": ENGINE_NAME},
            "enable_sleep_mode": self.sleep_enabled,
            "use_tqdm_on_load": log_level < logging.ERROR,
            **(engine_lora_options(adapters) if adapters is not None else {}),
            **executor,
            **cpu_scheduling,
            **engine_kwargs,
        }
        renderer_log, warmup = logging.getLogger(SkippedChatTemplateWarmup.LOGGER), SkippedChatTemplateWarmup()
        if options["skip_tokenizer_init"]:
            renderer_log.addFilter(warmup)
        try:
            self.llm = LLM(**options)
        finally:
            renderer_log.removeFilter(warmup)

    # ------------------------------------------------------------------ generation

    def generate(self, request: GenerationRequest) -> list[Completion]:
        from vllm import SamplingParams

        if not len(request):
            return []
        if not self.detokenize and any(request.stop_strings):
            row = next(i for i, stops in enumerate(request.stop_strings) if stops)
            raise ConfigError(
                f"row {row} has stop strings {request.stop_strings[row]}, but the vLLM engine was started "
                "without a tokenizer; set generation.vllm.detokenize: true (or list the stop strings in "
                "generation.stop_strings)"
            )
        self.wake_up()
        params = [
            SamplingParams(
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k or 0,
                seed=seed,
                max_tokens=budget,
                stop=stops or None,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=True,
                logprobs=0,
                detokenize=bool(stops),
                skip_special_tokens=True,
            )
            for seed, budget, stops in zip(request.seeds, request.max_new_tokens, request.stop_strings, strict=True)
        ]
        lora_request = self.adapters.request if self.adapters is not None else None
        prompts = [self._prompt(request, row) for row in range(len(request))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        completions = []
        for row, output in enumerate(outputs):
            if "multi_modal_data" in prompts[row] and list(output.prompt_token_ids) != request.prompts[row]:
                raise WorkerError(
                    f"row {row}: vLLM widened the prompt's image placeholders into {len(output.prompt_token_ids)} "
                    f"tokens, posttrain's processor into {len(request.prompts[row])}; the engine would generate from "
                    "another sequence than the trainer scores. Use generation.backend: hf"
                )
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = [step[token].logprob for token, step in zip(tokens, sample.logprobs, strict=True)]
            completions.append(Completion(tokens, logprobs, truncated=sample.finish_reason == "length"))
        return completions

    def _prompt(self, request: GenerationRequest, row: int) -> dict[str, Any]:
        """vLLM's input for ``row``: its token ids, and with images the ids with each image's
        tokens put back to its placeholder and the images themselves."""
        ids = request.prompts[row]
        encoded = request.encoded_images[row] if request.encoded_images is not None else []
        if not encoded:
            return {"prompt_token_ids": ids}
        if self.images is None or request.images is None:
            raise WorkerError(f"row {row} has images, but the engine's model is a text-only model")
        _, grids = request.images[row]
        try:
            collapsed = self.images.collapse(ids, grids.tolist())
        except ValueError as exc:
            raise WorkerError(f"row {row}: {exc}; vLLM would read each as an image placeholder. Use "
                              "generation.backend: hf, which embeds them as the text they are") from None
        return {"prompt_token_ids": collapsed,
                "multi_modal_data": {"image": [decode_image(data) for data in encoded]}}

    def kv_cache_blocks(self) -> tuple[int, int, int]:
        """The engine's KV cache: its number of blocks, the tokens a block holds, and the rows
        the engine runs at once (``max_num_seqs``)."""
        engine = self.llm.llm_engine.vllm_config
        return engine.cache_config.num_gpu_blocks, engine.cache_config.block_size, engine.scheduler_config.max_num_seqs

    # ------------------------------------------------------------------ weights

    def init_weight_transfer(self, init: TransferInit) -> None:
        from posttrain_vllm.transfer import PosttrainInitInfo

        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": PosttrainInitInfo.from_init(init)})

    def receive_weights(self, version: int) -> list[str]:
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
        if self.adapters is not None:  # the base weights stay; the adapter covers what it covers
            self.adapters.receive(self.llm, version)
            self.weight_version = version
            return []
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", kwargs={"update_info": {"version": version}})
        self.llm.collective_rpc("finish_weight_update")
        uncovered, mismatched = self.llm.collective_rpc("posttrain_after_update")[0]
        self.llm.reset_prefix_cache()  # KV blocks computed with the old weights must not be reused
        if self.images is not None:  # nor image features the old vision tower computed
            self.llm.llm_engine.reset_encoder_cache()
        self.weight_version = version
        if mismatched:
            raise WorkerError(f"weight sync (version {version}): {len(mismatched)} parameter group(s) of the vLLM "
                              f"model differ from what the trainer sent (generation.refit_checksums), e.g. "
                              f"{'; '.join(mismatched[:3])}")
        return uncovered

    def close(self) -> None:
        """Remove the adapter folder (with ``policy.lora.refit: adapter``)."""
        if self.adapters is not None:
            self.adapters.close()

    # ------------------------------------------------------------------ colocation

    def sleep(self) -> None:
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=sorted(self.asleep))
            self.asleep.clear()


def _image_inputs(model_path: str) -> ImageInputs | None:
    """The model's image inputs (None for a text-only model)."""
    from transformers import AutoConfig

    from posttrain.data.chat import load_tokenizer
    from posttrain.models.auto import is_vision_language

    if not is_vision_language(AutoConfig.from_pretrained(model_path)):
        return None
    return ImageInputs.from_model(model_path, load_tokenizer(model_path))


def ray_executor(spans: DeviceBundles | None) -> tuple[dict[str, Any], dict[str, str]]:
    """``(vllm.LLM options, environment variables)`` that run an engine's workers on the GPU
    bundles it was given: vLLM's Ray executor (``distributed_executor_backend="ray"``), its
    workers on those bundles of the actor's placement group (``VLLM_RAY_BUNDLE_INDICES``,
    one worker per bundle, in tensor-parallel rank order), each asking Ray for its share of
    the bundle's GPU (``VLLM_RAY_PER_WORKER_GPUS``). Nothing for an engine that holds its GPU
    itself or has none (vLLM runs its one worker in the actor's process)."""
    if spans is None:
        return {}, {}
    return {"distributed_executor_backend": "ray"}, {
        "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, spans.bundles)),
        "VLLM_RAY_PER_WORKER_GPUS": f"{spans.gpus_per_device:g}",
    }


class AdapterSlot:
    """The one LoRA adapter an engine serves: received into a PEFT folder of the actor's
    own and loaded as adapter ``version + 1`` (replacing the previous one; a version sent again
    is loaded again). :attr:`request` is what ``generate`` passes: None until the first refit."""

    NAME = "posttrain-policy"

    def __init__(self, lora: LoraConfig, base_model: str):
        self.lora = lora
        self.base_model = base_model
        self._folder = tempfile.TemporaryDirectory(prefix="posttrain-adapter-")  # removed by close()
        self.folder = self._folder.name
        self.request: Any = None

    def close(self) -> None:
        """Remove the adapter's folder."""
        self._folder.cleanup()

    def receive(self, llm: Any, version: int) -> None:
        """Collective with the weight sync's sender: receive the adapter, load it, forget the
        KV blocks computed under the previous one."""
        from vllm.lora.request import LoRARequest

        llm.collective_rpc("posttrain_receive_adapter", args=(self.folder, attrs.asdict(self.lora), self.base_model))
        loaded = LoRARequest(self.NAME, version + 1, self.folder, load_inplace=True)
        llm.llm_engine.add_lora(loaded)
        if self.request is not None and self.request.lora_int_id != loaded.lora_int_id:
            llm.llm_engine.remove_lora(self.request.lora_int_id)
        self.request = LoRARequest(self.NAME, loaded.lora_int_id, self.folder)
        llm.reset_prefix_cache()


class SkippedChatTemplateWarmup(logging.Filter):
    """``vllm.LLM`` warms up the chat template as it starts, which fails when the engine has
    no tokenizer (``skip_tokenizer_init``, as posttrain starts it unless it detokenizes:
    prompts come as token ids and no chat template is ever rendered); vLLM logs that as a
    warning with a traceback. This filter, on vLLM's renderer logger, turns that record into
    one info line saying why the warmup was skipped."""

    LOGGER = "vllm.renderers.base"
    FAILED = "Chat template warmup failed"
    SKIPPED = "Chat template warmup skipped: the engine has no tokenizer (skip_tokenizer_init); prompts are token ids"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == self.FAILED:
            record.msg, record.args = self.SKIPPED, ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


@attrs.frozen
class AttentionShape:
    """What a model's KV cache holds per token: a key and a value of ``kv_heads x head_dim``
    in each of ``layers`` layers (from its Hugging Face config)."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_path: str) -> AttentionShape:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path).get_text_config()
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        )


def cpu_kv_cache_bytes(shape: AttentionShape, dtype: str, max_model_len: int, engine_kwargs: dict[str, Any]) -> int:
    """The KV cache an engine on CPU needs to run its most rows at once without preempting
    any: ``max_num_seqs`` rows (``engine_kwargs``, else :data:`DEFAULT_MAX_NUM_SEQS`) of
    ``max_model_len`` tokens, rounded up to whole blocks (``engine_kwargs["block_size"]``,
    else :data:`CPU_BLOCK_TOKENS`), at ``2 * layers * kv_heads * head_dim`` values of
    ``dtype`` per token. E.g. the small benchmark model (8 layers, 4 KV heads of 64, float32,
    128 tokens): 256 * 128 * 16 KiB = 512 MiB."""
    rows = engine_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS
    block = engine_kwargs.get("block_size") or CPU_BLOCK_TOKENS
    tokens = -(-max_model_len // block) * block
    return rows * tokens * 2 * shape.layers * shape.kv_heads * shape.head_dim * getattr(torch, dtype).itemsize
