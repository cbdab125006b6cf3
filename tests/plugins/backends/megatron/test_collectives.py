"""The collectives the megatron backend adds, on two gloo ranks in a fresh interpreter (forked
ranks, no Ray): the vocabulary-parallel logprob and top-k head of ``posttrain.backend.logprobs``
against the whole vocabulary in float64, including a rank that holds no vocabulary row, and
the context-parallel gather of :mod:`posttrain_megatron.head` (forward places every rank's
positions, backward returns each rank its own)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

pytestmark = pytest.mark.megatron

RANKS = textwrap.dedent(
    """
    import os, socket, sys
    import torch, torch.distributed as dist

    def run(rank, port, splits):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from posttrain.backend.logprobs import VocabShard, target_logprobs, topk_logits
        from posttrain_megatron.head import _GatherContextParallel, cp_positions

        g = torch.Generator().manual_seed(0)
        vocab, hidden = 37, 12
        h = torch.randn(9, hidden, generator=g, dtype=torch.float64)
        w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
        targets = torch.randint(0, vocab, (9,), generator=g)
        coef = torch.linspace(-1.0, 2.0, 9, dtype=torch.float64)
        h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
        want = (h_ref @ w_ref.T / 0.7).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        (want * coef).sum().backward()
        for first in splits:  # rank 0 holds rows [0, first), rank 1 the rest
            start, stop = (0, first) if rank == 0 else (first, vocab)
            h32, w32 = h.float().requires_grad_(), w[start:stop].float().clone().requires_grad_()
            got = target_logprobs(h32, w32, targets, 8, 0.7, VocabShard(dist.group.WORLD, start))
            (got * coef.float()).sum().backward()
            grad_h = h32.grad.clone()
            dist.all_reduce(grad_h)  # each rank's share of the hidden gradient
            assert (got.double() - want.detach()).abs().max() < 1e-5, (first, "values")
            assert (grad_h.double() - h_ref.grad).abs().max() < 1e-5, (first, "hidden grad")
            if stop > start:
                assert (w32.grad.double() - w_ref.grad[start:stop]).abs().max() < 1e-5, (first, "weight grad")
            values, ids = topk_logits(h.float(), w[start:stop].float(), 5, 4, VocabShard(dist.group.WORLD, start))
            ref_values, ref_ids = (h @ w.T).topk(5)
            assert (values.double() - ref_values).abs().max() < 1e-5 and torch.equal(ids, ref_ids), (first, "topk")

        width, size = 8, 2
        positions = cp_positions(width, size, rank)
        full = torch.arange(3 * width, dtype=torch.float64).reshape(3, width)
        local = full[:, positions].clone().requires_grad_()
        gathered = _GatherContextParallel.apply(local, positions, width, dist.group.WORLD)
        assert torch.equal(gathered, full), "cp gather"
        (gathered * full).sum().backward()
        assert torch.equal(local.grad, full[:, positions]), "cp gather backward"
        # one write of the whole line: the two ranks share the pipe, and print() writes the
        # line and its newline apart, which interleave when stdout is unbuffered (PYTHONUNBUFFERED)
        os.write(1, f"rank {rank} ok\\n".encode())

    if __name__ == "__main__":
        sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
        torch.multiprocessing.start_processes(run, args=(port, [20, 37, 0]), nprocs=2, start_method="fork")
    """
)


def test_vocabulary_parallel_head_and_context_parallel_gather_on_two_ranks(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == ["rank 0 ok", "rank 1 ok"]
