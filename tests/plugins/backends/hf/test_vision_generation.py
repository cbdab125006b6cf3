"""The hf engine on a vision-language model (tiny Qwen2-VL), without Ray: prompts with images
of different sizes, and one without, batched and left-padded. Each row's sampled tokens and
their logprobs are what transformers' forward of that row alone, with its image, gives."""

from __future__ import annotations

import pytest
import torch

from posttrain.backend.generation_group import GenerationRequest
from posttrain.data.chat import ChatEncoder, load_tokenizer
from posttrain.data.dataset import build_dataset
from posttrain.data.images import ImageInputs, sample_images
from posttrain.testing.shapes import write_counting_rows
from posttrain_hf.worker import HFEngineWorker


@pytest.fixture(scope="module")
def prompts(zoo_model, tmp_path_factory):
    """Three prompt rows: two images of different sizes, then the question alone."""
    path = zoo_model("qwen2_vl")
    rows = write_counting_rows(tmp_path_factory.mktemp("shapes"), 3, seed=4, prompts=True)
    tokenizer = load_tokenizer(path)
    dataset = build_dataset(str(rows), "prompt", ChatEncoder(tokenizer, images=ImageInputs.from_model(path, tokenizer)))
    batch = dataset.collate(range(3))
    return path, batch


def test_each_rows_tokens_and_logprobs_are_transformers_forward_with_its_image(prompts):
    path, batch = prompts
    assert [len(g) for g in batch["image_grid_thw"]] == [1, 1, 0]
    assert batch["image_grid_thw"][0].tolist() != batch["image_grid_thw"][1].tolist()
    engine = HFEngineWorker(model_path=path, dtype="float32", max_batch_size=4, attn_implementation="sdpa")
    rows = [ids[:n].tolist() for ids, n in zip(batch["input_ids"], batch["input_lengths"], strict=True)]
    images = [sample_images(batch, i) for i in range(3)]
    request = GenerationRequest(prompts=rows, seeds=[1, 2, 3], max_new_tokens=[6] * 3, stop_strings=[[]] * 3,
                                stop_token_ids=[], temperature=1.0, top_p=1.0, top_k=None, images=images)
    completions = engine.generate(request)
    model = engine.model
    for prompt, (pixels, grid), completion in zip(rows, images, completions, strict=True):
        assert len(completion.token_ids) == 6
        ids = torch.tensor([prompt + completion.token_ids])
        extra = {} if not len(grid) else dict(pixel_values=pixels, image_grid_thw=grid,
                                              mm_token_type_ids=(ids == model.config.image_token_id).int())
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0, len(prompt) - 1:-1]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, rtol=0, atol=1e-5)
