"""Core's typed configuration sections. Plugins add theirs through the
``posttrain_config_sections`` hook; see :mod:`posttrain.config.loader` for how YAML becomes
these classes.

Every field has a default except where the user must decide. Units are in the names
(``_s`` seconds, ``_bytes``, ``_tokens``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs


@attrs.define
class ClusterConfig:
    """Where workers run. ``ray_address`` (or the ``RAY_ADDRESS`` variable) joins a running
    cluster; otherwise a local one is started with ``num_cpus`` logical CPUs (detected when
    None; may exceed the physical cores). A joined cluster's own resources count; the run
    waits until ``num_nodes`` of its nodes are alive."""

    # a running cluster to join, e.g. 10.0.0.1:6379; None: $RAY_ADDRESS, else start a local one
    ray_address: str | None = None
    # Ray nodes the run needs alive before any worker starts (a joined cluster; a local one has 1); workers
    # are spread over the nodes by Ray, ranks ordered by node
    num_nodes: int = 1
    node_wait_s: float = 300.0  # seconds to wait for num_nodes nodes to join; then the run stops, naming those alive
    num_cpus: int | None = None  # logical CPUs of a local cluster; None: os.cpu_count(); ignored when joining
    num_gpus: int | None = None  # GPUs of a local cluster; None: those Ray detects; ignored when joining
    # the run computes on GPUs: true exactly when policy.resources.gpus or generation.resources.gpus asks for some
    # (checked at load); a worker computes on CUDA exactly when its group asks for GPUs, and sees none otherwise
    use_gpus: bool = False


@attrs.define
class MuonConfig:
    """Muon (``policy.optimizer.name: muon``): each 2-D hidden weight steps by its
    orthogonalised momentum (Newton-Schulz iterations, as ``torch.optim.Muon``); the other
    trained parameters (embeddings, output head, norms, biases) step by AdamW with
    ``policy.optimizer``'s lr, weight_decay, betas and eps."""

    lr: float | None = None  # the 2-D weights' learning rate (>= 0); None: policy.optimizer.lr
    weight_decay: float | None = None  # the 2-D weights' decoupled decay (>= 0); None: policy.optimizer.weight_decay
    momentum: float = 0.95  # in [0, 1)
    nesterov: bool = True  # Nesterov momentum
    ns_steps: int = 5  # Newton-Schulz iterations (>= 1)
    # the update's scale per weight shape [A, B]: match_rms_adamw (0.2 * sqrt(max(A, B)), so AdamW's learning
    # rate and decay carry over) | original (sqrt(max(1, A / B)))
    adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"


@attrs.define
class OptimizerConfig:
    """The policy's optimizer, built by the policy backend. Values are checked when the
    config is loaded (:func:`posttrain.config.validate.check_optimizer`)."""

    # adamw | adam | sgd (no momentum) | muon (2-D hidden weights; AdamW for the rest: backends that declare it)
    name: Literal["adamw", "adam", "sgd", "muon"] = "adamw"
    lr: float = 1e-5  # base learning rate (>= 0), scaled per optimizer step by policy.scheduler
    # >= 0; adamw: decoupled decay; adam and sgd: an L2 term added to the gradient; 0: none
    weight_decay: float = 0.0
    betas: list[float] = attrs.field(factory=lambda: [0.9, 0.999])  # Adam's [beta1, beta2], each in [0, 1); unused by sgd
    eps: float = 1e-8  # added to Adam's denominator (>= 0); unused by sgd
    muon: MuonConfig = attrs.field(factory=MuonConfig)  # with name muon


@attrs.define
class SchedulerConfig:
    """The learning-rate schedule: a factor of ``policy.optimizer.lr`` per optimizer step
    (:mod:`posttrain.backend.lr_schedule`)."""

    # after warmup: constant | linear | cosine (decay to min_lr_ratio at total_steps)
    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0  # optimizer steps of linear warmup, the factor rising from 1/warmup_steps to 1; 0: none
    # optimizer step where linear/cosine decay ends (>= 1, not before warmup_steps); None: the run's optimizer steps
    total_steps: int | None = None
    min_lr_ratio: float = 0.0  # linear/cosine: the factor the decay ends at, in [0, 1] (0: down to 0)


@attrs.define
class SequencePackingConfig:
    """Lay several sequences end to end in one row (attention kept within each)."""

    # pack each rank's samples into rows, one row per microbatch (the micro batch sizes go unused);
    # dtensor backend only (attn_implementation sdpa or eager); exclusive with dynamic_batching
    enabled: bool = False
    # tokens per packed row (a longer sample is an error); None: policy.max_total_sequence_length
    max_tokens_per_row: int | None = None
    round_to: int = 1  # packed row width rounded up to a multiple of this (e.g. tensor-parallel alignment)


@attrs.define
class DynamicBatchingConfig:
    """Group samples into microbatches by a padded-token budget instead of a fixed count."""

    enabled: bool = False  # in place of the micro batch sizes (train and logprob); exclusive with sequence_packing
    # tokens per microbatch: samples x the longest one's length (rounded up to round_to); a longer sample goes alone
    max_tokens_per_microbatch: int = 4096
    round_to: int = 1  # lengths rounded up to a multiple of this when counting a microbatch's padded tokens


@attrs.define
class LoraConfig:
    """Low-rank adapters (LoRA): train ``W + (alpha / rank) B A`` with ``W`` frozen, ``A``
    (rank x in) random and ``B`` (out x rank) zero at the start, so step 0 is the base model.
    Only ``A`` and ``B`` reach the optimizer, its state and checkpoints; the reference policy is
    the base model with the adapters off. Policy backends that implement it say so (the
    ``supports_lora`` attribute of their config section); others refuse it. An adapter refit
    (``refit: adapter``) needs a generation backend whose section sets ``supports_lora_adapters``."""

    enabled: bool = False  # train adapters instead of every weight (needs a policy backend that supports LoRA)
    rank: int = 8  # the adapters' inner dimension r (>= 1)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (> 0)
    dropout: float = 0.0  # dropout on each adapter's input while training, in [0, 1)
    # linear layers that get an adapter: a list of module names (a name matches itself and any path
    # ending in .name, e.g. [q_proj, v_proj]), a string: a regular expression over full module paths, or
    # all-linear: every linear layer but the output head
    target_modules: list[str] | str = "all-linear"
    # how a refit gives the generation engines the weights: merged (W + alpha/rank B A under the base
    # names; every engine) or adapter (A and B only, loaded as a LoRA adapter; engines that support it)
    refit: Literal["merged", "adapter"] = "merged"
    export_merged: bool = False  # an algorithm's export_dir also gets the merged model, in its merged/ folder


@attrs.define
class MoEConfig:
    """Mixture-of-experts options. Routing replay records the experts each token went through
    when the rollout generated it (``rollout``), or in the policy's previous-logprob pass
    (``previous``), and makes the policy's routers choose those in its later passes, so a router
    that the two sides' arithmetic (or an update) would flip cannot change which experts a
    token's logprob comes from (docs/moe.md). Backends declare it (``records_routed_experts`` on
    a generation backend's section, ``replays_routed_experts`` on a policy backend's); others
    refuse it. The router losses
    (:mod:`posttrain.backend.router_losses`) need a policy backend that declares
    ``trains_router_losses``, expert parallelism one that declares ``splits_experts``."""

    # off | rollout: the policy's routers use the experts the generation engine chose for each token |
    # previous: its training passes use the experts it chose itself in the step's previous-logprob pass
    routing_replay: Literal["off", "rollout", "previous"] = "off"
    # record the engine's experts and report moe/router_agreement (per layer: the fraction of tokens whose
    # experts the policy chose alike) without replaying them; on with routing_replay: rollout (previous reports
    # the agreement with the previous pass's experts)
    router_agreement: bool = False
    # weight of the routers' load-balancing loss (Switch Transformer's, as transformers computes it) added to
    # the training loss; 0: off. Reported as moe/aux_loss (unscaled) whenever the model is a mixture of experts
    aux_loss_coef: float = 0.0
    # weight of the routers' z-loss (ST-MoE: mean squared log-sum-exp of the router logits); 0: off
    z_loss_coef: float = 0.0
    # expert parallelism: each group of this many data-parallel ranks shares one copy of every layer's experts,
    # each rank holding experts / size of them; tokens travel to their experts and back by all-to-all. Divides
    # the data-parallel size and the experts per layer; 1: every rank's FSDP shard holds some of every expert
    expert_parallel_size: int = 1

    @property
    def records_routes(self) -> bool:
        """Whether the rollouts carry the engine's routes (their replay or agreement asked)."""
        return self.routing_replay == "rollout" or self.router_agreement

    @property
    def routes_key(self) -> str | None:
        """The key that makes the policy use routes (for messages; replay's when it is on), or
        None when none does."""
        if self.routing_replay != "off":
            return "policy.moe.routing_replay"
        return "policy.moe.router_agreement" if self.router_agreement else None

    @property
    def router_losses(self) -> bool:
        """Whether the training loss has a router loss term (either coefficient above 0)."""
        return self.aux_loss_coef > 0 or self.z_loss_coef > 0

    @property
    def router_losses_key(self) -> str:
        """The key that asks for router losses, for messages: the load-balancing one when set."""
        return "policy.moe.aux_loss_coef" if self.aux_loss_coef > 0 else "policy.moe.z_loss_coef"



@attrs.define
class WorkerResources:
    """What each worker actor of a group asks Ray for, and its process environment."""

    cpus: float = 1.0  # Ray logical CPUs per worker (fractions allowed; may exceed the physical cores)
    gpus: float = 0.0  # GPUs per worker; a fraction shares a GPU with the colocated group (e.g. 0.5 each), never with the group's other ranks
    env_vars: dict[str, str] = attrs.field(factory=dict)  # each worker's environment variables (over runtime_env's)
    runtime_env: dict[str, Any] = attrs.field(factory=dict)  # Ray runtime_env of each worker (py_executable, pip, ...)

    def with_env_default(self, name: str, value: str) -> WorkerResources:
        """These resources with the environment variable ``name`` set to ``value`` in each
        worker, unless ``env_vars`` or ``runtime_env``'s ``env_vars`` already set it."""
        if name in self.env_vars or name in self.runtime_env.get("env_vars", {}):
            return self
        return attrs.evolve(self, env_vars={**self.env_vars, name: value})


@attrs.define
class PolicyConfig:
    """The model being trained and how it is trained."""

    backend: str = "dtensor"  # a registered policy backend (dtensor, megatron); its options under policy.<backend>
    model: str = ""  # a local Hugging Face folder
    # what the model outputs: lm (next-token logprobs of a causal LM) | value (one scalar per position from a
    # linear head on the final hidden states, exported as a sequence-classification folder: reward models and
    # critics). Algorithms that train a value model set it on the model they build; backends: dtensor
    head: Literal["lm", "value"] = "lm"
    tokenizer: str | None = None  # None: the model folder
    # training compute dtype: auto | float32 | bfloat16 | float16 (megatron: not float16). auto: bfloat16 when
    # the workers have GPUs (resources.gpus) and LoRA is off, with float32 master weights; else float32
    dtype: str = "auto"
    num_workers: int = 1  # ranks in the training worker group; over the model-parallel sizes: data-parallel replicas
    # ranks splitting each layer (tensor parallel); more model-parallel sizes live in the backend's section
    # (policy.<backend>)
    tensor_parallel_size: int = 1
    train_global_batch_size: int = 32  # samples per optimizer step
    train_micro_batch_size: int = 4  # samples per forward/backward per rank (unless packing or dynamic batching)
    logprob_micro_batch_size: int = 8  # samples per forward per rank in logprob and top-k passes (likewise)
    # tokens of one sequence, prompt and response: data rows are cut to it (unless data.max_length) and GRPO
    # rollouts stop at it; the default packed row width and vLLM context
    max_total_sequence_length: int = 1024
    max_grad_norm: float | None = 1.0  # clip the global L2 gradient norm to this before each step; None: no clipping
    logprob_chunk_size: int = 1024  # vocabulary entries per chunk when computing logprobs (bounds the logits held)
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)  # the optimizer
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)  # the learning-rate schedule
    sequence_packing: SequencePackingConfig = attrs.field(factory=SequencePackingConfig)  # several samples per row
    dynamic_batching: DynamicBatchingConfig = attrs.field(factory=DynamicBatchingConfig)  # microbatches by token budget
    lora: LoraConfig = attrs.field(factory=LoraConfig)  # low-rank adapters instead of full fine-tuning
    # a vision-language model's vision tower (and the merger that feeds the language model): false trains it with
    # the language model; true keeps it as loaded (no gradients, no optimizer state)
    freeze_vision_tower: bool = False
    moe: MoEConfig = attrs.field(factory=MoEConfig)  # mixture-of-experts options: routing replay
    resources: WorkerResources = attrs.field(factory=WorkerResources)  # what each policy worker asks Ray for
    # run the single policy worker inside the driver's process instead of a Ray actor (backends that declare it:
    # dtensor): no worker process to start; the same numbers. null: decided when the run starts, true for one
    # worker with no GPU on a local cluster (docs/reliability.md: a rank killed then takes the driver with it)
    in_driver: bool | None = None


@attrs.define
class GenerationConfig:
    """How rollouts are sampled."""

    backend: str = "hf"  # a registered generation backend (hf, vllm); its options under generation.<backend>
    model: str | None = None  # None: policy.model
    # the engines' weights: auto | float32 | bfloat16 | float16. auto: bfloat16 when the engines compute on GPUs
    # (resources.gpus, or the policy's with in_policy_workers), else float32
    dtype: str = "auto"
    num_workers: int = 1  # data-parallel engines
    tensor_parallel_size: int = 1  # GPUs per engine, one node (vllm; hf: 1); resources.gpus is the whole engine's
    max_new_tokens: int = 128  # tokens generated per turn at most (fewer when the engine's context is full)
    temperature: float = 1.0  # >= 0; 0: greedy. Policy backends compute logprobs at this temperature
    top_p: float = 1.0  # nucleus sampling, in (0, 1]: the most likely tokens holding this probability; 1: off
    top_k: int | None = None  # sample among the k most likely tokens (k >= 1); None: off
    # true: the engines report each sampled token's logprob as the policy computes it, bit for bit (backends that
    # declare it: hf with dtensor, on CPUs); vllm on GPUs runs batch-invariant instead (docs/backends/hf.md)
    exact_logprobs: bool = False
    stop_token_ids: list[int] = attrs.field(factory=list)  # end a completion, besides the model's EOS ids
    stop_strings: list[str] = attrs.field(factory=list)  # end a completion (kept in it); a batch may add its own
    ignore_eos: bool = False  # True: the model's EOS ids do not end a completion (only stop_token_ids do)
    # rows one generate call brings at most, all engines together; engines that reserve room per row (vllm on CPUs:
    # its KV cache) reserve it for their share of these, and run a larger call in turns. null: the algorithm's count
    # (GRPO and distillation: the larger of a step's samples and the validation prompts; eval: prompts x samples)
    rows_per_call: int | None = None
    colocated: bool = True  # share devices with the policy and take turns
    # run the engines inside the policy's worker processes, one per rank (backends that declare it: hf):
    # no engine processes, weights loaded in memory at refit; needs colocated (generation and training take turns).
    # null: decided when the run starts, true where it can be and no group asks for GPUs (docs/backends/hf.md)
    in_policy_workers: bool | None = None
    refit_bucket_bytes: int = 256 * 1024 * 1024  # most bytes per bucket when the policy's weights go to the engines
    # seconds each step of a weight sync may wait for a peer (engines joining the group, a bucket's broadcast, the
    # engines loading it) before the refit fails
    weight_sync_timeout_s: float = 120.0
    # seconds a refit waits for every engine to take it, after what the engine is doing (asynchronous GRPO: the
    # generate call in progress); stay below the policy's collective timeout (NCCL: 10 minutes)
    refit_wait_s: float = 300.0
    refit_checksums: bool = False  # debug: after every refit the engines check each tensor they loaded against the trainer's checksum (costs a pass over the weights on each side)
    weight_transport: str = "auto"  # how weights go from the policy's workers to the engines: auto | gloo | nccl (auto: nccl when the policy and the engines have GPUs, through CUDA IPC to engines on policy rank 0's own GPU; else gloo)
    resources: WorkerResources = attrs.field(factory=WorkerResources)  # what each engine asks Ray for

    def with_rows_per_call(self, rows: int) -> GenerationConfig:
        """This section with ``rows_per_call`` set to ``rows`` (an algorithm's count of the
        most rows one generate call brings), unless the user set it."""
        return self if self.rows_per_call is not None else attrs.evolve(self, rows_per_call=max(1, rows))


@attrs.define
class DataSource:
    """A dataset written as a mapping under ``data.train`` or ``data.validation``, e.g.
    ``{name: openai/gsm8k, subset: main, split: train}`` or ``{path: saved, split: test}``.
    Set exactly one of ``name`` (a Hugging Face Hub dataset) and ``path`` (a local file or
    folder). Folders and Hub datasets are read through the ``datasets`` library.

    In a list of sources (a mixture, :mod:`posttrain.data.mixture`), ``tag`` names the source
    in metrics and messages; under ``data.train``, ``weight`` or ``count`` says how much of each
    epoch it gives; ``task`` is the environment of its prompt rows that name none."""

    name: str | None = None  # a Hub dataset id (org/dataset); offline (HF_HUB_OFFLINE=1) read from the datasets cache
    path: str | None = None  # a .jsonl/.json/.parquet file, a save_to_disk folder or a dataset repository folder
    subset: str | None = None  # the dataset's configuration (load_dataset's name), e.g. main
    split: str | None = None  # None: the only split, else the one named like the key (train or validation)
    revision: str | None = None  # a Hub branch, tag or commit of name (offline: the cached copy, whatever its revision)
    columns: dict[str, str] | None = None  # {column: row key} renames for this dataset; None: data.columns
    tag: str | None = None  # its name in a mixture's metrics (data/<tag>/...); None: the file's stem or the dataset id's last part
    weight: float | None = None  # in a data.train mixture: the probability that a drawn sample comes from this source
    count: int | None = None  # in a data.train mixture: exactly this many samples of it per epoch (rows repeat when it has fewer)
    # in a data.train mixture: the weight over training, [[batch, weight], ...] with batches (the loader's, counted
    # from the run's start) ascending from 0, linear between the points and the last weight after them (a curriculum)
    weight_schedule: list[list[float]] | None = None
    task: str | None = None  # the environment of its prompt rows that name no 'task' (rows that name one keep it)

    def __attrs_post_init__(self) -> None:
        if (self.name is None) == (self.path is None):
            found = "both" if self.name is not None else "neither"
            raise ValueError(
                f"set exactly one of name (a Hub dataset id, e.g. org/dataset) and path (a local file or folder), "
                f"found {found}"
            )
        if self.revision is not None and self.name is None:
            raise ValueError("revision applies to a Hub dataset (name), not to a local path")
        if self.weight is not None and self.count is not None:
            raise ValueError(f"set weight or count, not both (found weight {self.weight:g} and count {self.count})")
        if self.weight is not None and not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"weight must be a finite number >= 0 (a sampling probability, normalised over the "
                             f"weighted sources), found {self.weight}")
        if self.count is not None and self.count < 1:
            raise ValueError(f"count must be at least 1 (samples per epoch), found {self.count}")
        if self.weight_schedule is not None:
            self._check_schedule(self.weight_schedule)

    def _check_schedule(self, schedule: list[list[float]]) -> None:
        if self.weight is not None or self.count is not None:
            raise ValueError("set weight_schedule alone: it replaces weight, and a counted source takes no weight")
        example = "e.g. [[0, 1.0], [200, 3.0]]"
        if not schedule or any(len(point) != 2 for point in schedule):
            raise ValueError(f"weight_schedule must be a list of [batch, weight] pairs, {example}; found {schedule}")
        batches = [point[0] for point in schedule]
        if batches[0] != 0 or any(b <= a for a, b in zip(batches, batches[1:], strict=False)) \
                or any(b != int(b) for b in batches):
            raise ValueError(f"weight_schedule's batches must be whole numbers ascending from 0, {example}; "
                             f"found {batches}")
        if any(not (math.isfinite(w) and w >= 0) for _, w in schedule):
            raise ValueError(f"weight_schedule's weights must be finite numbers >= 0; found {[w for _, w in schedule]}")


@attrs.define
class DataConfig:
    """Datasets the run reads. ``train`` and ``validation`` each take a path or a
    :class:`DataSource` mapping (keys ``name``, ``path``, ``subset``, ``split``, ``revision``,
    ``columns``). A path is a JSON Lines, JSON or parquet file (read row by row, as
    written), a folder written by ``save_to_disk`` (a Dataset, or a DatasetDict), or a
    dataset repository folder (data files, optionally a README declaring configs) read with
    ``load_dataset``. ``{name: org/dataset, subset: main, split: train, revision: v1}`` is a
    Hugging Face Hub dataset, read with ``load_dataset``; offline, only a copy in the
    datasets cache is used. Of several splits, the one named like the key is taken unless
    ``split`` says otherwise. A list of them is a mixture (:mod:`posttrain.data.mixture`):
    each source with its own ``weight`` or ``count`` per epoch (training), ``columns``,
    ``task`` and ``tag``.

    Rows are recognised by their keys (``format``). Columns named otherwise are renamed by
    ``columns``. Without renames, common layouts are recognised when there is no
    ``messages`` column: ``question`` or ``problem`` is the ``prompt`` and, for SFT,
    ``completion``, ``answer`` or ``solution`` is the ``response`` (for RL prompts a
    reference ``answer`` stays the answer; beside ``chosen``/``rejected``, ``question`` is
    the prompt)."""

    # a path, or {name: org/dataset, subset, split, revision} / {path, split}; or a list of them (a mixture)
    train: str | DataSource | list[str | DataSource] | None = None
    validation: str | DataSource | list[str | DataSource] | None = None  # like train; split defaults to the one named validation
    columns: dict[str, str] = attrs.field(factory=dict)  # {column: row key}, e.g. {question: prompt, answer: response}
    format: str = "auto"  # auto | prompt | messages | prompt_response | preference
    shuffle: bool = True  # a new order of the training rows each epoch; validation rows keep file order
    seed: int | None = None  # seed of the training order (>= 0); None: the run's seed
    max_length: int | None = None  # tokens per row, longer ones cut at the end; None: policy.max_total_sequence_length
    chat_template: str | None = None  # a Jinja template file, or the template text; None: the tokenizer's
    skip_malformed: bool = False  # skip and count malformed rows instead of failing
    num_workers: int = 0  # accepted but not read yet: the driver reads and tokenizes the rows


@attrs.define
class DataPlaneConfig:
    """Where a step's samples are kept between its stages."""

    # a registered data plane: memory (core's, in the driver process) or transferqueue (Ray actors that
    # policy workers read from; options under data_plane.transferqueue)
    backend: str = "memory"


@attrs.define
class LoggerConfig:
    """Event logging, the progress bar, and the metric sinks of core's plugin
    (:mod:`posttrain.builtin.sinks`, registered through ``posttrain_metric_sinks`` like any
    sink plugin): each sink key turns one on. A third-party sink reads its own section."""

    level: str = "info"  # structlog events to stderr and <run_dir>/events.jsonl: debug | info | warning | error
    jsonl: bool = True  # <run_dir>/metrics.jsonl, always on by default
    tensorboard: bool = False  # <run_dir>/tensorboard, tags <phase>/<name> (needs tensorboard)
    wandb: bool = False  # a Weights & Biases run, keys <phase>/<name>, with the run's config (needs wandb)
    wandb_project: str = "posttrain"  # the W&B project of that run
    mlflow: bool = False  # an MLflow run, keys <phase>/<name> with : written _ (needs mlflow)
    mlflow_experiment: str = "posttrain"  # the MLflow experiment of that run
    progress_bar: bool = True  # a terminal line: steps, ETA, the latest reward, loss and accuracy


@attrs.define
class CheckpointConfig:
    """Checkpoints of the training state (policy, optimizer, data position, random states),
    one ``step_N`` folder each."""

    enabled: bool = True  # false: no checkpoint is saved or resumed from
    dir: str | None = None  # None: <run_dir>/checkpoints
    save_period: int = 10  # training steps between checkpoints (one is saved after the last step too); 0: that one only
    keep_top_k: int | None = 3  # the best checkpoints kept, the newest kept too; None keeps every checkpoint
    metric: str | None = None  # e.g. "validation/accuracy"; None ranks by step (newest kept)
    higher_is_better: bool = True  # whether a higher metric ranks a checkpoint better
    resume: bool = True  # resume from the latest checkpoint in dir
    # times `posttrain run` starts a run again from its latest checkpoint after a worker, engine or node died
    # (not after an error a restart would meet again); 0: the run stops, and the same command resumes it
    max_restarts: int = 0
    restart_backoff_s: float = 5.0  # seconds before the first restart, doubled before each next one

    def __attrs_post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be at least 0 (0: no automatic restart), found {self.max_restarts}")
        if not self.restart_backoff_s >= 0:
            raise ValueError(f"restart_backoff_s must be at least 0 seconds, found {self.restart_backoff_s}")


#: The dtype setting resolved by where a group computes (:func:`device_dtype`).
AUTO_DTYPE = "auto"


def device_dtype(gpus: float, *, lora: bool = False) -> str:
    """``auto``'s dtype for a worker group with ``gpus`` GPUs per worker: bfloat16 on GPUs
    (a policy keeps float32 master weights and computes in it), float32 on CPUs, where
    bfloat16 is slower and rounds; float32 for a LoRA policy, whose merged refit weights are
    float32."""
    return "bfloat16" if gpus > 0 and not lora else "float32"


@attrs.define
class RunConfig:
    """The whole run. Plugin sections are read with :meth:`section`."""

    # seeds Python, NumPy and torch (driver and policy workers), the training order (unless data.seed)
    # and generation sampling (every row's seed derives from it)
    seed: int = 42
    # the run's output folder, created if missing: events.jsonl, metrics.jsonl, checkpoints/ (unless
    # checkpointing.dir), tensorboard/
    run_dir: str = "runs/default"
    algorithm: str | None = None  # a registered algorithm (grpo, sft, dpo); `posttrain run NAME` sets it; None: none
    # torch.use_deterministic_algorithms in the driver and dtensor policy workers: an op without a
    # deterministic kernel then raises
    deterministic: bool = False
    cluster: ClusterConfig = attrs.field(factory=ClusterConfig)  # where workers run
    policy: PolicyConfig = attrs.field(factory=PolicyConfig)  # the model being trained and how
    generation: GenerationConfig = attrs.field(factory=GenerationConfig)  # how rollouts are sampled
    data: DataConfig = attrs.field(factory=DataConfig)  # the datasets
    data_plane: DataPlaneConfig = attrs.field(factory=DataPlaneConfig)  # where a step's samples are kept
    logger: LoggerConfig = attrs.field(factory=LoggerConfig)  # event logging and metric sinks
    checkpointing: CheckpointConfig = attrs.field(factory=CheckpointConfig)  # saving and resuming
    # {environment name: its options} of environments to start, each registered (options: the Environments
    # page); GRPO also starts, with no options, each task its data rows name
    environments: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    sections: dict[str, Any] = attrs.field(factory=dict)  # plugin sections by dotted path
    # Filled by the loader, ignored by ==: the resolved YAML, and where each key path was set
    # ("exp.yaml:12" or "command line override 'a.b=1'"), for error messages.
    raw: dict[str, Any] = attrs.field(factory=dict, repr=False, eq=False)
    sources: dict[str, str] = attrs.field(factory=dict, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        """Resolves the device-aware defaults: ``policy.dtype`` and ``generation.dtype`` of
        ``auto`` become :func:`device_dtype`'s choice for where each side computes."""
        policy, generation = self.policy, self.generation
        if policy.dtype == AUTO_DTYPE:
            self.policy = attrs.evolve(policy, dtype=device_dtype(policy.resources.gpus, lora=policy.lora.enabled))
        if generation.dtype == AUTO_DTYPE:
            gpus = policy.resources.gpus if generation.in_policy_workers else generation.resources.gpus
            self.generation = attrs.evolve(generation, dtype=device_dtype(gpus))

    def replica_factors(self) -> list[tuple[str, int]]:
        """``(config key, size)`` of each parallel dimension within one data-parallel replica
        of the policy: ``policy.tensor_parallel_size``, then those the policy backend's own
        section adds through a ``replica_factors()`` method (e.g. megatron's pipeline and
        context parallel sizes). Their product is the number of ranks per replica."""
        factors = [("policy.tensor_parallel_size", self.policy.tensor_parallel_size)]
        backend_section = self.sections.get(f"policy.{self.policy.backend}")
        if backend_section is not None and hasattr(backend_section, "replica_factors"):
            factors.extend(backend_section.replica_factors())
        return factors

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas of the policy: ``policy.num_workers`` over the ranks per
        replica (the product of :meth:`replica_factors`)."""
        ranks_per_replica = 1
        for _, size in self.replica_factors():
            ranks_per_replica *= size
        return self.policy.num_workers // ranks_per_replica

    def with_schedule_horizon(self, optimizer_steps: int) -> RunConfig:
        """This config with ``policy.scheduler.total_steps`` set to ``optimizer_steps`` when it
        is unset (its documented default: the run's length, which only the algorithm knows)."""
        scheduler = self.policy.scheduler
        if scheduler.total_steps is not None:
            return self
        policy = attrs.evolve(self.policy, scheduler=attrs.evolve(scheduler, total_steps=max(1, optimizer_steps)))
        return attrs.evolve(self, policy=policy)

    def section(self, path: str) -> Any:
        """A plugin's typed section, e.g. ``config.section("grpo")``."""
        try:
            return self.sections[path]
        except KeyError:
            raise KeyError(
                f"config section '{path}' is not registered; registered: {sorted(self.sections)}. "
                "Is the plugin that declares it installed?"
            ) from None
