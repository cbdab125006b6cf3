"""The hf engine on vision-language models (tiny Qwen2-VL, Qwen2.5-VL and Idefics3), without Ray: prompts with images
of different sizes, and one without, batched and left-padded. Each row's sampled tokens and
their logprobs are what transformers' forward of that row alone, with its image, gives. A
placeholder token the model generates is text: prefilled again (the next turn of a
conversation), it gives the logprobs its decoding gave."""

from __future__ import annotations

import pytest
import torch

from posttrain.backend.generation_group import GenerationRequest, assemble_output, build_request
from posttrain.batch import Batch
from posttrain.config.schema import GenerationConfig
from posttrain.data.chat import ChatEncoder, load_tokenizer
from posttrain.data.dataset import build_dataset
from posttrain.data.images import ImageInputs, image_fields, sample_images
from posttrain.interfaces import Generation
from posttrain.run.rollout import run_rollout
from posttrain.testing.policy import reference_image_inputs
from posttrain.testing.shapes import write_counting_rows
from posttrain_env_math.math_env import MathEnvironment, MathOptions
from posttrain_hf.worker import HFEngineWorker


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "idefics3"])
def prompts(request, zoo_model, tmp_path_factory):
    """Three prompt rows: two images of different sizes, then the question alone."""
    path = zoo_model(request.param)
    rows = write_counting_rows(tmp_path_factory.mktemp("shapes"), 3, seed=6, prompts=True, text_rows=1)
    tokenizer = load_tokenizer(path)
    dataset = build_dataset(str(rows), "prompt", ChatEncoder(tokenizer, images=ImageInputs.from_model(path, tokenizer)))
    batch = dataset.collate(range(3))
    return path, batch


def test_each_rows_tokens_and_logprobs_are_transformers_forward_with_its_image(prompts):
    path, batch = prompts
    pixels, field = image_fields(batch)
    assert [len(g) for g in batch[field]] == [1, 1, 0]
    assert not torch.equal(batch[pixels][0], batch[pixels][1])
    if field == "image_grid_thw":  # images of two sizes: a square image is always 2 x 2 tiles for Idefics3
        assert batch[field][0].tolist() != batch[field][1].tolist()
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
        extra = reference_image_inputs(model, pixels, grid, ids)
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0, len(prompt) - 1:-1]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, rtol=0, atol=1e-5)


def test_a_generated_image_placeholder_is_text_when_prefilled_again(prompts):
    """Its logit raised, the image token (``<|image_pad|>``, ``<image>``) is what greedy decoding picks: the
    second call prefills the prompt and the first three of them, and decodes the rest with the
    logprobs the first call's decoding gave."""
    path, batch = prompts
    engine = HFEngineWorker(model_path=path, dtype="float32", max_batch_size=4, attn_implementation="sdpa")
    placeholder = engine.model.config.image_token_id

    def tilt(module, args, logits):  # the placeholder's logit raised by 8: likeliest, not certain
        logits[..., placeholder] += 8.0
        return logits

    engine.model.lm_head.register_forward_hook(tilt)
    prompt = batch["input_ids"][0, :batch["input_lengths"][0]].tolist()
    images = [sample_images(batch, 0)]

    def greedy(tokens: list[int], n: int):
        request = GenerationRequest(prompts=[tokens], seeds=[0], max_new_tokens=[n], stop_strings=[[]],
                                    stop_token_ids=[], temperature=0.0, top_p=1.0, top_k=None, images=images)
        return engine.generate(request)[0]

    first = greedy(prompt, 6)
    assert placeholder in first.token_ids[:3], "the tilted model should generate the placeholder early"
    again = greedy(prompt + first.token_ids[:3], 3)
    assert again.token_ids == first.token_ids[3:]
    torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(first.logprobs[3:]), rtol=0, atol=1e-5)


class EngineGeneration(Generation):
    """The hf engine behind the Generation interface, as its worker group drives it (greedy)."""

    def __init__(self, engine: HFEngineWorker, eos_token_ids: list[int]):
        self.engine, self.eos_token_ids = engine, eos_token_ids
        self.calls = 0

    def generate(self, batch, *, greedy: bool = False):
        self.calls += 1
        request = build_request(batch, GenerationConfig(max_new_tokens=3), seeds=range(len(batch)), context_length=256,
                                context_key="policy.max_total_sequence_length", eos_token_ids=self.eos_token_ids,
                                greedy=True)
        return assemble_output(request.prompts, self.engine.generate(request), self.engine.pad_token_id)

    def weight_endpoint(self):
        raise NotImplementedError("rollouts never refit")

    def shutdown(self) -> None:
        pass


def test_a_rollout_keeps_each_samples_images_and_skips_a_prompt_the_data_cut(prompts):
    """Through the rollout loop: prompts widened as the dataset widened them, the images in the
    training batch; a prompt whose image the data's length limit cut (its images fewer than its
    placeholders) ends before any generation, as a prompt too long to answer does."""
    path, batch = prompts
    tokenizer = load_tokenizer(path)
    images = ImageInputs.from_model(path, tokenizer)
    pixels, field = image_fields(batch)
    samples = batch.fields(["messages", "task", "metadata", "answer", pixels, field])
    cut = batch.fields(["messages", "task", "metadata", "answer", pixels, field]).select([1])
    cut[pixels], cut[field] = [torch.zeros(0, batch[pixels][0].shape[1])], [torch.zeros(0, 3, dtype=torch.long)]
    samples = Batch.concat([samples, cut])
    engine = HFEngineWorker(model_path=path, dtype="float32", max_batch_size=4, attn_implementation="sdpa")
    generation = EngineGeneration(engine, [tokenizer.eos_token_id])
    math = MathEnvironment(MathOptions(timeout_s=10, num_workers=1))
    out, _ = run_rollout(samples, generation, {"math": math}, tokenizer, max_total_length=96, images=images)
    math.shutdown()
    for i in range(3):
        prompt = int(out["prompt_lengths"][i])
        assert out["input_ids"][i, :prompt].tolist() == batch["input_ids"][i, :batch["input_lengths"][i]].tolist()
        assert out[field][i].tolist() == batch[field][i].tolist()
        assert int(out["response_lengths"][i]) > 0
    assert int(out["response_lengths"][3]) == 0 and bool(out["truncated"][3]) and len(out[field][3]) == 0
