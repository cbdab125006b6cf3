"""Core's typed configuration sections. Plugins add theirs through the
``posttrain_config_sections`` hook; see :mod:`posttrain.config.loader` for how YAML becomes
these classes.

Every field has a default except where the user must decide. Units are in the names
(``_s`` seconds, ``_bytes``, ``_tokens``).
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class ClusterConfig:
    """Where workers run. ``ray_address`` (or the ``RAY_ADDRESS`` variable) joins a running
    cluster; otherwise a local one is started with ``num_cpus`` logical CPUs (detected when
    None; may exceed the physical cores)."""

    ray_address: str | None = None
    num_nodes: int = 1
    num_cpus: int | None = None
    num_gpus: int | None = None
    use_gpus: bool = False


@attrs.define
class OptimizerConfig:
    name: str = "adamw"  # adamw | adam | sgd
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = attrs.field(factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@attrs.define
class SchedulerConfig:
    name: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    total_steps: int | None = None  # decay horizon for linear/cosine; defaults to the run's steps
    min_lr_ratio: float = 0.0


@attrs.define
class SequencePackingConfig:
    """Lay several sequences end to end in one row (attention kept within each)."""

    enabled: bool = False
    max_tokens_per_row: int | None = None  # None: policy.max_total_sequence_length
    round_to: int = 1  # row width multiple (tensor-parallel alignment)


@attrs.define
class DynamicBatchingConfig:
    """Group samples into microbatches by a padded-token budget instead of a fixed count."""

    enabled: bool = False
    max_tokens_per_microbatch: int = 4096
    round_to: int = 1


@attrs.define
class WorkerResources:
    """What each worker actor of a group asks Ray for, and its process environment."""

    cpus: float = 1.0
    gpus: float = 0.0
    env_vars: dict[str, str] = attrs.field(factory=dict)
    runtime_env: dict[str, Any] = attrs.field(factory=dict)  # Ray runtime_env (py_executable, pip, ...)


@attrs.define
class PolicyConfig:
    """The model being trained and how it is trained."""

    backend: str = "dtensor"
    model: str = ""  # a local Hugging Face folder
    tokenizer: str | None = None  # None: the model folder
    dtype: str = "float32"  # float32 | bfloat16 | float16
    num_workers: int = 1  # ranks in the training worker group
    tensor_parallel_size: int = 1  # more model-parallel sizes live in the backend's section (policy.<backend>)
    train_global_batch_size: int = 32  # samples per optimizer step
    train_micro_batch_size: int = 4  # samples per forward/backward per rank
    logprob_micro_batch_size: int = 8
    max_total_sequence_length: int = 1024
    max_grad_norm: float | None = 1.0
    logprob_chunk_size: int = 1024  # vocabulary chunk when computing logprobs
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    sequence_packing: SequencePackingConfig = attrs.field(factory=SequencePackingConfig)
    dynamic_batching: DynamicBatchingConfig = attrs.field(factory=DynamicBatchingConfig)
    resources: WorkerResources = attrs.field(factory=WorkerResources)


@attrs.define
class GenerationConfig:
    """How rollouts are sampled."""

    backend: str = "hf"
    model: str | None = None  # None: policy.model
    dtype: str = "float32"
    num_workers: int = 1  # data-parallel engines
    tensor_parallel_size: int = 1
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: list[int] = attrs.field(factory=list)
    stop_strings: list[str] = attrs.field(factory=list)
    ignore_eos: bool = False  # True: the model's EOS ids do not end a completion (only stop_token_ids do)
    colocated: bool = True  # share devices with the policy and take turns
    refit_bucket_bytes: int = 256 * 1024 * 1024
    resources: WorkerResources = attrs.field(factory=WorkerResources)


@attrs.define
class DataSource:
    """A dataset written as a mapping under ``data.train`` or ``data.validation``, e.g.
    ``{name: openai/gsm8k, subset: main, split: train}`` or ``{path: saved, split: test}``.
    Set exactly one of ``name`` (a Hugging Face Hub dataset) and ``path`` (a local file or
    folder). Folders and Hub datasets are read through the ``datasets`` library."""

    name: str | None = None  # a Hub dataset id (org/dataset); offline (HF_HUB_OFFLINE=1) read from the datasets cache
    path: str | None = None  # a .jsonl/.json/.parquet file, a save_to_disk folder or a dataset repository folder
    subset: str | None = None  # the dataset's configuration (load_dataset's name), e.g. main
    split: str | None = None  # None: the only split, else the one named like the key (train or validation)
    revision: str | None = None  # a Hub branch, tag or commit of name (offline: the cached copy, whatever its revision)
    columns: dict[str, str] | None = None  # {column: row key} renames for this dataset; None: data.columns

    def __attrs_post_init__(self) -> None:
        if (self.name is None) == (self.path is None):
            found = "both" if self.name is not None else "neither"
            raise ValueError(
                f"set exactly one of name (a Hub dataset id, e.g. org/dataset) and path (a local file or folder), "
                f"found {found}"
            )
        if self.revision is not None and self.name is None:
            raise ValueError("revision applies to a Hub dataset (name), not to a local path")


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
    ``split`` says otherwise.

    Rows are recognised by their keys (``format``). Columns named otherwise are renamed by
    ``columns``. Without renames, common layouts are recognised when there is no
    ``messages`` column: ``question`` or ``problem`` is the ``prompt`` and, for SFT,
    ``completion``, ``answer`` or ``solution`` is the ``response`` (for RL prompts a
    reference ``answer`` stays the answer; beside ``chosen``/``rejected``, ``question`` is
    the prompt)."""

    train: str | DataSource | None = None  # a path, or {name: org/dataset, subset, split, revision} / {path, split}
    validation: str | DataSource | None = None  # like train; split defaults to the one named validation
    columns: dict[str, str] = attrs.field(factory=dict)  # {column: row key}, e.g. {question: prompt, answer: response}
    format: str = "auto"  # auto | prompt | messages | prompt_response | preference
    shuffle: bool = True
    seed: int | None = None  # None: the run's seed
    max_length: int | None = None  # None: policy.max_total_sequence_length
    chat_template: str | None = None  # a template file; None: the tokenizer's
    skip_malformed: bool = False  # skip and count malformed rows instead of failing
    num_workers: int = 0


@attrs.define
class DataPlaneConfig:
    backend: str = "memory"


@attrs.define
class LoggerConfig:
    """Event logging, the progress bar, and the metric sinks of core's plugin
    (:mod:`posttrain.builtin.sinks`, registered through ``posttrain_metric_sinks`` like any
    sink plugin): each sink key turns one on. A third-party sink reads its own section."""

    level: str = "info"  # structlog events to stderr and <run_dir>/events.jsonl: debug | info | warning | error
    jsonl: bool = True  # <run_dir>/metrics.jsonl, always on by default
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "posttrain"
    mlflow: bool = False
    mlflow_experiment: str = "posttrain"
    progress_bar: bool = True


@attrs.define
class CheckpointConfig:
    enabled: bool = True
    dir: str | None = None  # None: <run_dir>/checkpoints
    save_period: int = 10  # steps
    keep_top_k: int | None = 3  # None keeps every checkpoint
    metric: str | None = None  # e.g. "validation/accuracy"; None ranks by step (newest kept)
    higher_is_better: bool = True
    resume: bool = True  # resume from the latest checkpoint in dir


@attrs.define
class RunConfig:
    """The whole run. Plugin sections are read with :meth:`section`."""

    seed: int = 42
    run_dir: str = "runs/default"
    algorithm: str | None = None
    deterministic: bool = False
    cluster: ClusterConfig = attrs.field(factory=ClusterConfig)
    policy: PolicyConfig = attrs.field(factory=PolicyConfig)
    generation: GenerationConfig = attrs.field(factory=GenerationConfig)
    data: DataConfig = attrs.field(factory=DataConfig)
    data_plane: DataPlaneConfig = attrs.field(factory=DataPlaneConfig)
    logger: LoggerConfig = attrs.field(factory=LoggerConfig)
    checkpointing: CheckpointConfig = attrs.field(factory=CheckpointConfig)
    environments: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # per environment name
    sections: dict[str, Any] = attrs.field(factory=dict)  # plugin sections by dotted path
    # Filled by the loader, ignored by ==: the resolved YAML, and where each key path was set
    # ("exp.yaml:12" or "command line override 'a.b=1'"), for error messages.
    raw: dict[str, Any] = attrs.field(factory=dict, repr=False, eq=False)
    sources: dict[str, str] = attrs.field(factory=dict, repr=False, eq=False)

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

    def section(self, path: str) -> Any:
        """A plugin's typed section, e.g. ``config.section("grpo")``."""
        try:
            return self.sections[path]
        except KeyError:
            raise KeyError(
                f"config section '{path}' is not registered; registered: {sorted(self.sections)}. "
                "Is the plugin that declares it installed?"
            ) from None
