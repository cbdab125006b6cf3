"""SFT of a vision-language model (tiny Qwen2-VL and Idefics3) on image rows end to end: counting coloured
squares (:mod:`posttrain.testing.shapes`), packed rows on the dtensor backend. The validation
loss falls, and the Hugging Face export loads with transformers' own classes
(``AutoModelForImageTextToText``, its image processor and tokenizer) and gives the trainer's
final validation loss."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from posttrain.config import config_from_dict
from posttrain.data.chat import ChatEncoder
from posttrain.data.dataset import build_dataset
from posttrain.data.images import ImageInputs
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain.testing.policy import reference_logprobs
from posttrain.testing.shapes import write_counting_rows

STEPS = 6
#: Each architecture's image processor, as its export's folder gives it.
IMAGE_PROCESSORS = {"qwen2_vl": "Qwen2VLImageProcessorPil", "idefics3": "Idefics3ImageProcessorPil"}

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", params=list(IMAGE_PROCESSORS))
def run(request, zoo_model, ray_cluster, tmp_path_factory):
    data = tmp_path_factory.mktemp("shapes")
    train = write_counting_rows(data / "train", 48, seed=1)
    val = write_counting_rows(data / "val", 8, seed=2)
    run_dir = tmp_path_factory.mktemp("vlm_sft")
    tree = {
        "algorithm": "sft",
        "seed": 0,
        "run_dir": str(run_dir),
        "policy": {
            "model": zoo_model(request.param),
            "train_global_batch_size": 8,
            "train_micro_batch_size": 4,
            "max_total_sequence_length": 96,
            "sequence_packing": {"enabled": True, "max_tokens_per_row": 192},
            "optimizer": {"name": "adamw", "lr": 3e-3},
            "resources": {"cpus": 0.5},
        },
        "data": {"train": str(train), "validation": str(val)},
        "logger": {"progress_bar": False},
        "sft": {"max_num_steps": STEPS, "val_period": STEPS, "val_at_start": True, "val_global_batch_size": 8,
                "export_dir": str(run_dir / "hf")},
    }
    run_algorithm(config_from_dict(tree, []))
    return run_dir, str(val), read_metrics(run_dir / "metrics.jsonl"), request.param


def test_the_validation_loss_falls(run):
    _, _, records, _ = run
    val = [r for r in records if r["phase"] == "validation"]
    assert [r["step"] for r in val] == [0, STEPS]
    assert val[-1]["loss"] < 0.8 * val[0]["loss"]


def test_the_export_loads_with_transformers_classes_and_gives_the_trainers_loss(run):
    run_dir, val, records, arch = run
    folder = str(run_dir / "hf")
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(AutoImageProcessor.from_pretrained(folder)).__name__ == IMAGE_PROCESSORS[arch]
    batch = build_dataset(val, "sft", ChatEncoder(tokenizer, images=ImageInputs.from_model(folder, tokenizer))).collate(
        range(8))
    mask = batch["token_mask"].double()
    with torch.no_grad():
        loss = float(-(reference_logprobs(model, batch) * mask).sum() / mask.sum())
    final = [r for r in records if r["phase"] == "validation"][-1]["loss"]
    assert loss == pytest.approx(final, abs=1e-4)
