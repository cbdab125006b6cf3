"""The driver half of a generation backend whose engines are the ranks of a WorkerGroup.

:class:`WorkerGroupGeneration` implements :class:`~posttrain.interfaces.Generation` for any
engine worker class that provides the :class:`~posttrain.backend.engine.EngineWorker` methods. It turns the batch
into a :class:`~posttrain.backend.engine.GenerationRequest` (prompts without padding, one seed per row, stop
criteria, per-row token budgets), splits it into contiguous shards, one per
data-parallel engine, and assembles the engines' :class:`~posttrain.backend.engine.Completion` lists into the output
batch described in :mod:`posttrain.interfaces.generation`. Weights reach the engines from
the policy's workers directly (:meth:`WorkerGroupGeneration.weight_endpoint`,
:mod:`posttrain.backend.weight_sync`).

What a row's logprobs and seeds mean is defined once in :mod:`posttrain.backend.sampling`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from posttrain.backend.engine import Completion, EngineWorker, GenerationRequest
from posttrain.backend.hosted import HostedEndpoint, HostedGroup
from posttrain.backend.routing import padded_routes
from posttrain.backend.sampling import sample_seeds
from posttrain.backend.weight_sync import BroadcastEndpoint
from posttrain.batch import Batch, padded_tensor
from posttrain.config.schema import GenerationConfig, RunConfig, WorkerResources
from posttrain.data.images import ENCODED_IMAGES, image_fields, sample_images
from posttrain.distributed import VirtualCluster, WorkerGroup
from posttrain.errors import ConfigError, DataError
from posttrain.interfaces.generation import ROUTES_FIELD, Generation
from posttrain.interfaces.policy import Policy

#: Seconds :meth:`WorkerGroupGeneration.shutdown` waits for the engines to close.
CLOSE_TIMEOUT_S = 10.0


@attrs.frozen
class ModelTokens:
    """Token ids the backend needs from the model folder."""

    eos_token_ids: tuple[int, ...]
    pad_token_id: int


def model_tokens(model_path: str) -> ModelTokens:
    """EOS and pad ids from ``generation_config.json`` (preferred) or ``config.json``.

    The pad id falls back to the first EOS id, then 0.
    """
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    try:
        generation_config: Any = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json
        generation_config = None

    def first_set(name: str) -> Any:
        for source in (generation_config, config):
            value = getattr(source, name, None)
            if value is not None:
                return value
        return None

    eos = first_set("eos_token_id")
    eos_ids = tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]))
    pad = first_set("pad_token_id")
    return ModelTokens(eos_ids, int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0))


def prompt_lists(batch: Batch) -> list[list[int]]:
    """The unpadded prompt token ids of each row of a right-padded ``input_ids`` batch."""
    input_ids, lengths = batch["input_ids"], batch["input_lengths"]
    if input_ids.dim() != 2:
        raise DataError(f"generation input 'input_ids' must be [batch, seq], got shape {tuple(input_ids.shape)}")
    bad = [(i, int(n)) for i, n in enumerate(lengths.tolist()) if not 1 <= n <= input_ids.shape[1]]
    if bad:
        row, n = bad[0]
        raise DataError(
            f"generation input row {row} has input_lengths {n}; expected 1..{input_ids.shape[1]} "
            "(the width of input_ids)"
        )
    return [row[:n].tolist() for row, n in zip(input_ids, lengths.tolist(), strict=True)]


def assemble_output(prompts: list[list[int]], completions: list[Completion], pad_token_id: int) -> Batch:
    """The output batch of :mod:`posttrain.interfaces.generation` from prompts and completions."""
    pairs = list(zip(prompts, completions, strict=True))
    lengths = [len(p) + len(c.token_ids) for p, c in pairs]
    output = Batch(
        output_ids=padded_tensor([[*p, *c.token_ids] for p, c in pairs], pad_token_id, torch.long),
        logprobs=padded_tensor([[*[0.0] * len(p), *c.logprobs] for p, c in pairs], 0.0, torch.float32),
        generation_lengths=torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long),
        unpadded_sequence_lengths=torch.tensor(lengths, dtype=torch.long),
        truncated=torch.tensor([c.truncated for c in completions], dtype=torch.bool),
    )
    if completions and all(c.routed_experts is not None for c in completions):
        output[ROUTES_FIELD] = padded_routes([c.routed_experts for c in completions], max(lengths))
    return output


def split_bounds(num_rows: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts whose sizes differ by at most one."""
    per, extra = divmod(num_rows, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + per + (part < extra))
    return bounds


def build_request(
    batch: Batch,
    generation: GenerationConfig,
    *,
    seeds: Sequence[int],
    context_length: int,
    context_key: str,
    eos_token_ids: Sequence[int],
    greedy: bool,
) -> GenerationRequest:
    """The request for ``batch`` under the ``generation`` config section.

    Each row's budget is ``max_new_tokens`` capped so that prompt plus completion fit
    ``context_length`` (named by ``context_key`` in the error for a prompt that does not
    fit). A row's stop strings are the config's followed by its own (``stop_strings``
    field), without repeats; stop tokens are the config's followed by the EOS ids (unless
    ``ignore_eos``: then the config's alone). A batch with image fields
    (:data:`~posttrain.data.images.IMAGE_FIELDS`, and the encoded files when it has them:
    :data:`~posttrain.data.images.ENCODED_IMAGES`) gives each row its images.
    """
    prompts = prompt_lists(batch)
    budgets = []
    for row, prompt in enumerate(prompts):
        room = context_length - len(prompt)
        if room < 1:
            raise DataError(
                f"generation input row {row} has a {len(prompt)}-token prompt, but the engine context is "
                f"{context_length} tokens ({context_key}); shorten the prompts (data.max_length) or raise the context"
            )
        budgets.append(min(generation.max_new_tokens, room))
    row_stops = batch["stop_strings"] if "stop_strings" in batch else [None] * len(prompts)
    images = [sample_images(batch, i) for i in range(len(prompts))] if image_fields(batch) else None
    return GenerationRequest(
        prompts=prompts,
        seeds=list(seeds),
        max_new_tokens=budgets,
        stop_strings=[list(dict.fromkeys([*generation.stop_strings, *_as_list(own)])) for own in row_stops],
        stop_token_ids=list(dict.fromkeys([*generation.stop_token_ids, *([] if generation.ignore_eos else eos_token_ids)])),
        temperature=0.0 if greedy else generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        images=images,
        encoded_images=[list(own) for own in batch[ENCODED_IMAGES]] if ENCODED_IMAGES in batch else None,
    )


def _as_list(stop_strings: str | Sequence[str] | None) -> list[str]:
    """A row's ``stop_strings`` value: None, one string, or a list of strings."""
    if stop_strings is None:
        return []
    return [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)


#: Values of ``generation.weight_transport``.
WEIGHT_TRANSPORTS = ("auto", "gloo", "nccl")


def weight_transport(config: RunConfig) -> str:
    """The torch.distributed backend of the weight sync: ``generation.weight_transport``,
    with ``auto`` meaning nccl when the cluster uses GPUs and both the policy's workers and
    the engines have one, gloo otherwise. An nccl sync to engines on policy rank 0's own GPU
    goes through CUDA IPC (:func:`posttrain.backend.weight_sync.cuda_ipc_route`)."""
    gen = config.generation
    if gen.weight_transport != "auto":
        return gen.weight_transport
    on_gpus = config.cluster.use_gpus and gen.resources.gpus > 0 and config.policy.resources.gpus > 0
    return "nccl" if on_gpus else "gloo"


def check_sampling_config(config: RunConfig) -> None:
    """Refuse sampling settings no backend can honour, naming the ``generation`` key."""
    gen = config.generation
    problems = []
    if gen.temperature < 0:
        problems.append(f"generation.temperature must be >= 0 (0 = greedy), got {gen.temperature}")
    if not 0 < gen.top_p <= 1:
        problems.append(f"generation.top_p must be in (0, 1], got {gen.top_p}")
    if gen.top_k is not None and gen.top_k < 1:
        problems.append(f"generation.top_k must be >= 1 or null (no top-k), got {gen.top_k}")
    if gen.max_new_tokens < 1:
        problems.append(f"generation.max_new_tokens must be >= 1, got {gen.max_new_tokens}")
    if gen.num_workers < 1:
        problems.append(f"generation.num_workers must be >= 1, got {gen.num_workers}")
    for key in ("weight_sync_timeout_s", "refit_wait_s"):
        if not getattr(gen, key) > 0:
            problems.append(f"generation.{key} must be > 0 seconds, got {getattr(gen, key)}")
    if gen.weight_transport not in WEIGHT_TRANSPORTS:
        problems.append(
            f"generation.weight_transport must be one of {', '.join(WEIGHT_TRANSPORTS)}, got '{gen.weight_transport}'"
        )
    if not (gen.model or config.policy.model):
        problems.append("generation.model (or policy.model) must name a local Hugging Face folder")
    if problems:
        raise ConfigError("; ".join(problems))


class WorkerGroupGeneration(Generation):
    """``config.generation.num_workers`` data-parallel engines of ``worker_cls``.

    ``context_length`` is the most tokens (prompt + completion) an engine holds per row;
    ``context_key`` names the config key that sets it, for error messages.
    ``worker_kwargs`` go to ``worker_cls.__init__``; ``ranks_per_engine`` is how many ranks
    of the weight-sync group each engine joins with (its tensor-parallel workers), each a
    process of the engine's own on a GPU of its own when the engines ask for GPUs
    (``devices_per_worker`` of :class:`~posttrain.distributed.WorkerGroup`). With a
    ``host`` policy (``generation.in_policy_workers``), the engines are built inside its
    workers' processes, one per rank (:mod:`posttrain.backend.hosted`), and ``num_workers``,
    ``resources`` and ``ranks_per_engine`` play no part. Sampling seeds derive from
    ``config.seed`` (or the seed of the last :meth:`set_sampling_seed`) and the index of the
    ``generate`` call since then (see :mod:`posttrain.backend.sampling`).
    """

    def __init__(
        self,
        config: RunConfig,
        cluster: VirtualCluster,
        worker_cls: type[EngineWorker],
        *,
        context_length: int,
        context_key: str,
        worker_kwargs: Mapping[str, Any],
        resources: WorkerResources | None = None,
        name: str = "generation",
        ranks_per_engine: int = 1,
        host: Policy | None = None,
    ):
        check_sampling_config(config)
        self.config = config
        self.model_path = config.generation.model or config.policy.model
        self.tokens = model_tokens(self.model_path)
        self.context_length = context_length
        self.context_key = context_key
        self.sampling_seed = config.seed
        self.num_calls = 0
        self.ranks_per_engine = ranks_per_engine
        self._endpoint: BroadcastEndpoint | HostedEndpoint | None = None
        self._refits = threading.Condition()
        self._refitting = 0
        self._group: WorkerGroup[EngineWorker] | HostedGroup
        if host is not None:
            self._group = host.host_engines(worker_cls, worker_kwargs, name)
        else:
            self._group = WorkerGroup(
                cluster,
                worker_cls,
                name=name,
                num_workers=config.generation.num_workers,
                resources=resources or config.generation.resources,
                devices_per_worker=ranks_per_engine,
                kwargs=dict(worker_kwargs),
            )

    # ------------------------------------------------------------------ generation

    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        with self._refits:
            while self._refitting:  # a refit from another thread goes to the engines first
                self._refits.wait()
        request = build_request(
            batch,
            self.config.generation,
            seeds=sample_seeds(self.sampling_seed, self.num_calls, len(batch)),
            context_length=self.context_length,
            context_key=self.context_key,
            eos_token_ids=self.tokens.eos_token_ids,
            greedy=greedy,
        )
        self.num_calls += 1
        bounds = split_bounds(len(request), self._group.world_size)
        shards = [request.rows(start, stop) for start, stop in itertools.pairwise(bounds)]
        results = self._group.run_sharded(EngineWorker.generate_with_version, shards)
        output = assemble_output(request.prompts, [c for _, shard in results for c in shard], self.tokens.pad_token_id)
        output["weight_versions"] = torch.tensor(
            [version for version, shard in results for _ in shard], dtype=torch.long
        )
        return output

    def set_sampling_seed(self, seed: int) -> None:
        """Row seeds of the n-th following call become ``sample_seeds(seed, n, rows)``."""
        self.sampling_seed = seed
        self.num_calls = 0

    # ------------------------------------------------------------------ weights

    def weight_endpoint(self) -> BroadcastEndpoint | HostedEndpoint:
        """The engines as the policy's ranks reach them: their actor handles,
        ``ranks_per_engine`` sync ranks each, their nodes, and the transport
        (``generation.weight_transport``; ``auto`` is nccl when the policy and the engines
        have GPUs, otherwise shared memory when every engine is on the sending rank's node
        and gloo when not). Engines hosted in the policy's workers: each rank loads its own."""
        if self._endpoint is None and isinstance(self._group, HostedGroup):
            self._endpoint = HostedEndpoint(self._group.name)
        elif self._endpoint is None:
            self._endpoint = BroadcastEndpoint(
                tuple(self._group.actors), self.ranks_per_engine, weight_transport(self.config), name=self._group.name,
                engine_nodes=tuple(self._group.node_ids),
                shared_memory_on_one_node=self.config.generation.weight_transport == "auto",
                checksums=self.config.generation.refit_checksums,
                timeout_s=self.config.generation.weight_sync_timeout_s,
                refit_wait_s=self.config.generation.refit_wait_s,
            )
        return self._endpoint

    @contextlib.contextmanager
    def refit_window(self) -> Iterator[None]:
        """No generate call starts while a refit is in this window: one from another thread
        (asynchronous GRPO's rollouts) waits for it, so the refit reaches each engine right
        after the call it is busy with, ahead of the next."""
        with self._refits:
            self._refitting += 1
        try:
            yield
        finally:
            with self._refits:
                self._refitting -= 1
                self._refits.notify_all()

    # ------------------------------------------------------------------ lifecycle

    def prepare_for_generation(self) -> None:
        if self.config.generation.colocated:
            self._group.run_all(EngineWorker.wake_up)

    def finish_generation(self) -> None:
        if self.config.generation.colocated:
            self._group.run_all(EngineWorker.sleep)

    def shutdown(self) -> None:
        """Let each engine release what it keeps outside its process
        (:meth:`~posttrain.backend.engine.EngineWorker.close`; an engine busy or dead for
        :data:`CLOSE_TIMEOUT_S` is skipped), then stop the engines."""
        if isinstance(self._group, WorkerGroup) and not self._group.closed:
            with contextlib.suppress(Exception):
                self._group.get(self._group.run_all_async(EngineWorker.close), timeout_s=CLOSE_TIMEOUT_S)
        self._group.shutdown()
