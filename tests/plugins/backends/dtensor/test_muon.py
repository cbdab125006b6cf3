"""Muon (``policy.optimizer.name: muon``) on the dtensor backend: on one rank its steps are
``torch.optim.Muon``'s on the hidden 2-D weights and fused AdamW's on the rest, bit for bit;
sharded by FSDP2 (dp=2) or tensor parallel (tp=2), the same gradients give the same weights
bit for bit; the policy trains with it and a resumed run continues exactly; config mistakes are
refused at load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import MuonConfig, OptimizerConfig
from posttrain_dtensor.config import DTensorConfig
from posttrain_dtensor.optim import MuonAdamW, hidden_matrices
from tests.plugins.backends.dtensor.muon_ranks import MUON

REPO = Path(__file__).resolve().parents[4]


def _tiny_lm(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def _random_grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.01


def test_one_rank_steps_are_torch_muon_and_adamw_bit_for_bit(tiny_model_path):
    ours, theirs = _tiny_lm(tiny_model_path), _tiny_lm(tiny_model_path)
    matrices = hidden_matrices(ours, list(ours.parameters()))
    names = {id(p): n for n, p in ours.named_parameters()}
    assert {names[id(p)] for p in matrices} == {n for n, p in ours.named_parameters()
                                                if p.ndim == 2 and "embed" not in n and "lm_head" not in n}
    optimizer = MuonAdamW(list(ours.parameters()), MUON, matrices)
    by_name = dict(theirs.named_parameters())
    hidden = [by_name[names[id(p)]] for p in matrices]
    rest = [p for n, p in theirs.named_parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=0.05, weight_decay=0.01, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=0.02, weight_decay=0.1, fused=True)
    for step in range(3):
        _random_grads(ours, step)
        _random_grads(theirs, step)
        optimizer.step()
        muon.step()
        adamw.step()
    for name, p in ours.named_parameters():
        assert torch.equal(p, by_name[name]), name


def test_muon_config_mistakes_are_refused_at_load(tiny_model_path, dt):
    from posttrain.config.validate import validate_config
    from posttrain.errors import ConfigError

    config = dt.policy_config(tiny_model_path, optimizer=OptimizerConfig(name="muon", muon=MuonConfig(momentum=1.0)))
    with pytest.raises(ConfigError, match=r"policy.optimizer.muon.momentum: expected a number in \[0, 1\)"):
        validate_config(config)
    config = dt.policy_config(tiny_model_path, optimizer=OptimizerConfig(name="muon"), backend="megatron")
    with pytest.raises(ConfigError, match="does not implement Muon; policy backends that do: dtensor"):
        validate_config(config)


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_sharded_steps_from_the_same_gradients_are_one_ranks_bit_for_bit(tiny_model_path, tmp_path, layout):
    """FSDP2 and tensor parallel over two gloo ranks (tests/plugins/backends/dtensor/muon_ranks.py):
    each rank gathers a weight's update, orthogonalises the whole matrix and keeps its shard, so
    three steps from the same full gradients give one rank's weights exactly."""
    from tests.plugins.backends.dtensor.muon_ranks import load, stepped

    out = tmp_path / "weights.pt"
    done = subprocess.run([sys.executable, "-m", "tests.plugins.backends.dtensor.muon_ranks", tiny_model_path, layout,
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded, one = torch.load(out), stepped(load(tiny_model_path))
    assert sharded.keys() == one.keys()
    assert max(float((one[n] - load(tiny_model_path).state_dict()[n]).abs().max()) for n in one) > 1e-3
    assert [n for n in one if not torch.equal(sharded[n], one[n])] == []


def test_a_gradient_rounding_step_moves_muons_result_far_more_than_adamws(tiny_model_path):
    """Why the layouts are compared from the same gradients: Newton-Schulz orthogonalisation
    amplifies rounding. Gradients 1e-7 apart (relative, about what a data-parallel reduction
    changes) give weights up to about 1e-3 apart after one Muon step; after one AdamW step on
    the same weights, at most a few float32 steps."""
    from tests.plugins.backends.dtensor.muon_ranks import load

    def one_step(name: str, noise: float) -> dict[str, torch.Tensor]:
        model = load(tiny_model_path)
        params = list(model.parameters())
        cfg = MUON if name == "muon" else OptimizerConfig(name="adamw", lr=0.02, weight_decay=0.1)
        optimizer = MuonAdamW(params, cfg, hidden_matrices(model, params)) if name == "muon" else \
            torch.optim.AdamW(params, lr=0.02, weight_decay=0.1, fused=True)
        g, jitter = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.01 * (1 + noise * torch.randn(p.shape, generator=jitter))
        optimizer.step()
        return {n: p.detach() for n, p in model.named_parameters()}

    def spread(name: str) -> float:
        a, b = one_step(name, 0.0), one_step(name, 1e-7)
        return max(float((a[n] - b[n]).abs().max()) for n in a)

    assert spread("muon") > 1e-4 > 1e-6 > spread("adamw")


@pytest.fixture(scope="module")
def muon_runs(tiny_model_path, virtual_cluster, dt, tmp_path_factory):
    """Three Muon steps of the dtensor policy on one batch, at one rank and at dp=2: the
    weights after them, and after resuming from the checkpoint of the second step."""
    from posttrain_dtensor.policy import DTensorPolicy

    batch = dt.make_batch()
    runs = {}
    for layout, workers in (("one_rank", 1), ("fsdp_dp2", 2)):
        config = dt.policy_config(tiny_model_path, dtensor=DTensorConfig(), num_workers=workers, optimizer=MUON)
        policy = DTensorPolicy(config, virtual_cluster, name=f"muon-{layout}")
        try:
            initial = dt.full_weights(policy)
            folder = str(tmp_path_factory.mktemp(f"muon_{layout}") / "step_2")
            losses = []
            for step in range(3):
                if step == 2:
                    policy.save_checkpoint(folder)
                losses.append(policy.train(batch, dt.nll)["loss"])
            final = dt.full_weights(policy)
            policy.load_checkpoint(folder)
            policy.train(batch, dt.nll)
            runs[layout] = dict(initial=initial, final=final, resumed=dt.full_weights(policy), losses=losses)
        finally:
            policy.shutdown()
    return runs


@pytest.mark.ray
@pytest.mark.parametrize("layout", ["one_rank", "fsdp_dp2"])
def test_muon_trains_the_policy_and_a_resumed_run_continues_exactly(muon_runs, layout, dt):
    run = muon_runs[layout]
    assert run["losses"][2] < run["losses"][0], run["losses"]
    assert dt.max_diff(run["final"], run["initial"]) > 1e-3
    assert all(torch.equal(run["resumed"][n], w) for n, w in run["final"].items())
