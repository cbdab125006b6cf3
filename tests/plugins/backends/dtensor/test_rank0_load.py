"""With several ranks the dtensor policy reads its checkpoint on rank 0 alone: the other ranks
build the model on the meta device and receive their shards from rank 0, so the host holds
one whole copy of the model, not one per rank. (That the shards are the checkpoint's, for every
architecture, layout, LoRA and value head, the two-rank tests check against transformers.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.backend.policy_worker import PolicyWorker
from posttrain.testing.zoo import build_zoo_model
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray

#: A Llama with tied embeddings of about 31 million parameters (125 MB in float32).
SIZE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64)


def peak_resident_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def test_only_rank_0_holds_the_whole_model(tmp_path, virtual_cluster, dt):
    path = str(build_zoo_model(tmp_path / "model", "llama_tied", **SIZE))
    config = dt.policy_config(path, num_workers=2)
    # no reference copy of the initial weights, which would add a shard to each rank's peak
    policy = DTensorPolicy(config, virtual_cluster, name="policy-rank0-load", reference=False)
    try:
        infos = policy.group.run_all(PolicyWorker.info)
        model_bytes = 4 * infos[0]["parameters"]
        peaks = [peak_resident_bytes(info["pid"]) for info in infos]
        # rank 0 held the whole model and its shard until the shards were sent, rank 1 its shard alone
        # (when each rank read the checkpoint, the two peaks were within a few MB)
        assert peaks[0] - peaks[1] > 0.75 * model_bytes, (peaks, model_bytes)
        batch = dt.make_batch()
        want = dt.reference_logprobs(dt.reference_model(path, torch.float32), batch)
        got = policy.get_logprobs(batch)["logprobs"] * batch["token_mask"]
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-5)  # sums over 512 features, in float32
    finally:
        policy.shutdown()
