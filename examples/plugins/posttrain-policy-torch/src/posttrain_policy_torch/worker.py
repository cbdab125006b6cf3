"""The ``torch`` policy backend: one plain-PyTorch rank driven by posttrain's backend kit.

:class:`TorchPolicyWorker` implements :class:`~posttrain.backend.policy_worker.PolicyWorker`
for a single process (no ``torch.distributed``): a transformers causal LM in float32, a
``torch.optim`` optimizer, the kit's learning-rate schedule, and the frozen initial weights
kept on CPU for reference logprobs. :func:`start_policy` runs it as a one-rank
:class:`~posttrain.distributed.WorkerGroup` behind :class:`~posttrain.backend.policy_driver.ShardedPolicy`,
which plans every pass; the worker follows the plan's microbatches. Each microbatch is run
as right-padded rows, whatever the batching mode (a packed plan gives the same logprobs).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.backend.hf_export import write_hf_metadata, write_hf_shards
from posttrain.backend.logprobs import loss_positions, sequence_logprobs, topk_logits
from posttrain.backend.lr_schedule import build_scheduler
from posttrain.backend.policy_driver import ShardedPolicy
from posttrain.backend.policy_worker import PolicyWorker, RankTrainResult, require_policy_checkpoint
from posttrain.backend.sampling import logprob_temperature
from posttrain.backend.weight_sync import ParamMeta
from posttrain.backend.work import RankWork
from posttrain.batch import Batch
from posttrain.config import OptimizerConfig, RunConfig
from posttrain.distributed import VirtualCluster, WorkerGroup
from posttrain.interfaces.loss import LossFunction, combine_metrics, global_valid_counts

#: The one file a checkpoint folder holds: weights, optimizer and scheduler state.
CHECKPOINT_FILE = "policy.pt"


def start_policy(config: RunConfig, cluster: VirtualCluster, name: str = "policy", reference: bool = True) -> ShardedPolicy:
    """One worker on ``cluster`` (``policy.resources``), the worker group ``name``; it is
    data-parallel rank 0 and its results stand for the whole batch."""
    group = WorkerGroup(
        cluster, TorchPolicyWorker, name=name, num_workers=1, resources=config.policy.resources,
        args=(config, reference),
    )
    return ShardedPolicy(config, group, dp_rank_of=[0], result_ranks=[0], reference=reference)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """``policy.optimizer`` as a ``torch.optim`` optimizer (sgd, adam or adamw)."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    adam = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.name]
    return adam(params, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, weight_decay=cfg.weight_decay)


class TorchPolicyWorker(PolicyWorker):
    """The only rank: the whole model, its optimizer and schedule, on one device (the GPU
    Ray gives the actor when ``policy.resources.gpus`` > 0, else the CPU)."""

    def __init__(self, config: RunConfig, reference: bool = True):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.policy = config.policy
        self.temperature = logprob_temperature(config.generation.temperature)
        use_gpu = self.policy.resources.gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(self.policy.model, dtype=torch.float32).to(self.device)
        # the initial weights, for reference logprobs (none when the run asks for none)
        self.reference = {name: t.detach().to("cpu", copy=True) for name, t in self.model.state_dict().items()} if reference else {}
        self.optimizer = build_optimizer(self.model.parameters(), self.policy.optimizer)
        self.scheduler = build_scheduler(self.optimizer, self.policy.scheduler)

    # ------------------------------------------------------------------ forward

    def _row_logprobs(self, rows: Batch) -> torch.Tensor:
        """[b, S] logprobs of ``rows`` (on the device) in the policy convention; differentiable."""
        lengths = rows["input_lengths"].cpu()
        width = rows["input_ids"].shape[1]
        span = int(lengths.max())  # the longest row; the columns after it are padding
        ids = rows["input_ids"][:, :span]
        mask = rows["token_mask"][:, :span].cpu() if "token_mask" in rows else None
        predicted = loss_positions(lengths, span, mask).to(self.device)
        values = sequence_logprobs(
            self._hidden(ids), self._head(), ids, predicted, self.policy.logprob_chunk_size, self.temperature
        )
        return F.pad(values, (0, width - span))

    def _hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [b, T, H]. No attention mask: the rows are right-padded, and
        causal attention never lets a real token see the padding after it."""
        return self.model.base_model(input_ids=ids).last_hidden_state

    def _head(self) -> torch.Tensor:
        """The output embedding [V, H]; the kit applies it one vocabulary chunk at a time."""
        return self.model.get_output_embeddings().weight

    @contextlib.contextmanager
    def _weights(self, reference: bool) -> Iterator[None]:
        """Run the block under the frozen initial weights when ``reference`` (swapped in from
        CPU, then the current weights are put back exactly)."""
        if not reference:
            yield
            return
        current = {name: t.detach().to("cpu", copy=True) for name, t in self.model.state_dict().items()}
        self.model.load_state_dict(self.reference)
        try:
            yield
        finally:
            self.model.load_state_dict(current)

    # ------------------------------------------------------------------ passes

    @torch.no_grad()
    def logprobs(self, work: RankWork, reference: bool = False) -> Batch:
        self.model.eval()
        batch = work.batch
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        with self._weights(reference):
            for idx in work.microbatches:
                out[idx] = self._row_logprobs(batch.select(idx).to(self.device)).cpu()
        return Batch({"reference_logprobs" if reference else "logprobs": out})

    @torch.no_grad()
    def topk(self, work: RankWork, k: int) -> Batch:
        self.model.eval()
        batch = work.batch
        n, width = batch["input_ids"].shape
        values = torch.zeros(n, width, k, dtype=torch.float32)
        indices = torch.zeros(n, width, k, dtype=torch.int64)
        for idx in work.microbatches:
            lengths = batch["input_lengths"][idx]
            span = int(lengths.max())
            real = torch.arange(span)[None, :] < lengths[:, None]  # padding positions keep 0
            hidden = self._hidden(batch["input_ids"][idx, :span].to(self.device))[real.to(self.device)]
            top_values, top_indices = topk_logits(hidden, self._head(), k, self.policy.logprob_chunk_size)
            row, col = real.nonzero(as_tuple=True)  # the order in which hidden[real] holds them
            sample = torch.as_tensor(idx)[row]
            values[sample, col], indices[sample, col] = top_values.cpu(), top_indices.cpu()
        # position t predicts token t + 1: the last column predicts nothing
        return Batch({"topk_logits": values[:, :-1], "topk_indices": indices[:, :-1]})

    def train(self, work: RankWork, loss_fn: LossFunction, eval_mode: bool = False) -> RankTrainResult:
        start = time.perf_counter()
        batch = work.batch
        seqs, toks = (count.to(self.device) for count in global_valid_counts(batch, None))  # one rank: global
        self.model.train(not eval_mode)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, parts = 0.0, []
        with torch.set_grad_enabled(not eval_mode):
            for idx in work.microbatches:  # gradient accumulation: each loss is already globally normalised
                rows = batch.select(idx).to(self.device)
                loss, metrics = loss_fn(self._row_logprobs(rows), rows, seqs, toks)
                if not eval_mode:
                    loss.backward()
                loss_sum += float(loss.detach())
                parts.append(metrics)
        result = RankTrainResult(
            loss=loss_sum,
            metrics=combine_metrics(parts, loss_fn.metric_reductions),
            num_tokens=float(toks),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            step_time_s=0.0,
        )
        if not eval_mode:
            result["grad_norm"] = self._step()
        result["step_time_s"] = time.perf_counter() - start
        return result

    def _step(self) -> float:
        """Clip to ``policy.max_grad_norm`` (none: the norm is only measured), step the
        optimizer and the schedule; returns the gradient norm before clipping."""
        max_norm = self.policy.max_grad_norm if self.policy.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ------------------------------------------------------------------ state

    def save_checkpoint(self, path: str) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        torch.save(state, folder / CHECKPOINT_FILE)

    def load_checkpoint(self, path: str) -> None:
        folder = require_policy_checkpoint(path, (CHECKPOINT_FILE,), "torch")
        state = torch.load(folder / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def weight_metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, tuple(p.shape), "float32") for name, p in self.model.named_parameters()]

    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        return {name: params[name].detach().to("cpu", copy=True) for name in names}

    def export_hf(self, path: str, shard_bytes: int) -> None:
        write_hf_shards(path, self.weight_sizes(), self.gather_weights, shard_bytes, writer=True)
        tokenizer = self.policy.tokenizer or self.policy.model
        write_hf_metadata(path, self.model.config, tokenizer, torch.float32, self.model.generation_config)

    def info(self) -> dict[str, Any]:
        return {
            "backend": "torch",
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "world_size": 1,
            "device": str(self.device),
            "dtype": "float32",
        }
