"""Vision-language models on the dtensor backend: tiny Qwen2-VL, Qwen2.5-VL and Idefics3
(SmolVLM's architecture, images cut into tiles) checkpoints
(:func:`posttrain.testing.zoo.build_zoo_vlm`) on rows whose user turn holds an image of
coloured squares (:mod:`posttrain.testing.shapes`), some rows without one.

At one rank and with FSDP over two ranks, padded and packed, the policy's logprobs and its
step-0 loss and gradients equal transformers' eager float64 forward of each sample alone with
its image (logprobs within 1e-5 and 2e-6 of their value, float32's rounding of the -10 nats some
tokens get; gradients within 1e-5 of their scale: the merger's bias gradient reaches 4). A
frozen vision tower keeps its weights; LoRA adapts the language model alone. SGD with lr=1: a
step's weight change is the gradient.
"""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.config.schema import LoraConfig, SequencePackingConfig
from posttrain.data.chat import ChatEncoder, load_tokenizer
from posttrain.data.dataset import build_dataset
from posttrain.data.images import ImageInputs, image_fields, sample_images
from posttrain.testing.policy import reference_logprobs, reference_model, reference_step
from posttrain.testing.shapes import write_counting_rows
from posttrain.testing.zoo import build_zoo_vlm
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray

ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "idefics3")
#: Where each architecture's vision tower and the merger feeding its language model live.
VISION_TOWER = ("model.visual.", "model.vision_model.", "model.connector.")
WORKERS = {"one_rank": 1, "fsdp_dp2": 2}
PACKING = SequencePackingConfig(enabled=True, max_tokens_per_row=96)


def image_batch(model: str, data: str):
    """Eight rows: six with an image (of different sizes), two with the text alone."""
    tokenizer = load_tokenizer(model)
    dataset = build_dataset(data, "sft", ChatEncoder(tokenizer, images=ImageInputs.from_model(model, tokenizer)))
    return dataset.collate(range(8))


@pytest.fixture(scope="module")
def counting_rows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    path = write_counting_rows(folder, 8)
    lines = path.read_text().splitlines()
    for n in (1, 4):  # text alone: the image part left out
        row = json.loads(lines[n])
        row["messages"][0]["content"] = row["messages"][0]["content"][1:]
        lines[n] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module", params=[(a, layout) for a in ARCHITECTURES for layout in WORKERS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def setup(request, virtual_cluster, dt, counting_rows, zoo_model, tmp_path_factory):
    arch, layout = request.param
    path = zoo_model(arch)
    config = dt.policy_config(path, num_workers=WORKERS[layout], max_total_sequence_length=96)
    policy = DTensorPolicy(config, virtual_cluster, name=f"policy-{arch}-{layout}")
    initial_ckpt = str(tmp_path_factory.mktemp(f"{arch}-{layout}") / "step_0")
    policy.save_checkpoint(initial_ckpt)
    batch = image_batch(path, counting_rows)
    ref_loss, ref_grads = reference_step(path, batch)
    yield dict(policy=policy, path=path, initial_ckpt=initial_ckpt, initial_weights=dt.full_weights(policy),
               batch=batch, ref_loss=ref_loss, ref_grads=ref_grads)
    policy.shutdown()


def test_the_batch_holds_images_and_text_only_rows(setup):
    (_, field) = image_fields(setup["batch"])
    grids = setup["batch"][field]
    assert [len(g) for g in grids] == [1, 0, 1, 1, 0, 1, 1, 1]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_logprobs_equal_transformers_forward_with_the_images(policy, setup, packed):
    if packed:
        policy.config.policy.sequence_packing = PACKING
    got = policy.get_logprobs(setup["batch"])["logprobs"]
    want = reference_logprobs(reference_model(setup["path"]), setup["batch"])
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_step_zero_loss_and_gradients_equal_transformers(policy, setup, dt, packed):
    if packed:
        policy.config.policy.sequence_packing = PACKING
    metrics = policy.train(setup["batch"], dt.nll)
    grads = dt.sgd_grads(setup["initial_weights"], dt.full_weights(policy), lr=1.0)
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-5)
    for name, want in setup["ref_grads"].items():  # float32 against float64: 1e-5 of the larger gradients' scale
        assert float((grads[name] - want).abs().max()) < 1e-5 * max(1.0, float(want.abs().max())), name
    assert any(name.startswith(VISION_TOWER) and g.abs().max() > 0 for name, g in grads.items())


def one_step(virtual_cluster, dt, path: str, batch, name: str, **policy) -> tuple[dict, dict, DTensorPolicy]:
    """The exported weights before and after one SGD step on ``batch`` of a policy built with
    ``policy`` options, and the policy (shut down by the caller)."""
    config = dt.policy_config(path, max_total_sequence_length=96, **policy)
    trained = DTensorPolicy(config, virtual_cluster, name=name)
    before = dt.full_weights(trained)
    trained.train(batch, dt.nll)
    return before, dt.full_weights(trained), trained


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_frozen_vision_tower_keeps_its_weights_while_the_language_model_learns(virtual_cluster, dt, zoo_model,
                                                                                counting_rows, arch):
    path = zoo_model(arch)
    before, after, policy = one_step(virtual_cluster, dt, path, image_batch(path, counting_rows), f"policy-frozen-{arch}",
                                     freeze_vision_tower=True)
    policy.shutdown()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {name for name in before if not name.startswith(VISION_TOWER)}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_adapts_the_language_model_only(virtual_cluster, dt, zoo_model, counting_rows, tmp_path, arch):
    """All-linear adapters go on the language model's layers (Qwen2.5-VL's vision MLP has
    layers of the same names, gate/up/down_proj): step 0 is the base model, a step changes
    the merged language model and leaves the vision tower as it was."""
    path = zoo_model(arch)
    batch = image_batch(path, counting_rows)
    lora = LoraConfig(enabled=True, rank=4)
    config = dt.policy_config(path, max_total_sequence_length=96, lora=lora)
    policy = DTensorPolicy(config, virtual_cluster, name=f"policy-lora-{arch}")
    try:
        got = policy.get_logprobs(batch)["logprobs"]
        torch.testing.assert_close(got.double(), reference_logprobs(reference_model(path), batch), rtol=2e-6, atol=1e-5)
        before = dt.full_weights(policy)
        policy.train(batch, dt.nll)
        after = dt.full_weights(policy)
        policy.export_hf(str(tmp_path / "adapter"))
    finally:
        policy.shutdown()
    targets = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert targets and all(".language_model." in target or ".text_model." in target for target in targets)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and not any(name.startswith(VISION_TOWER) for name in changed)


def test_a_placeholder_the_policy_generated_is_scored_as_text(policy, setup):
    """A sample whose answer holds the image token (``<|image_pad|>``, ``<image>``; a young
    policy samples one now and then): its image's features go on the prompt's image tokens
    only, the generated one is embedded as the token it is, as the engine decoded it.
    Reference: transformers in float64, given those embeddings and (Qwen-VL) the positions of
    the prompt's image tokens alone."""
    batch = setup["batch"].select(list(range(len(setup["batch"]))))
    model = reference_model(setup["path"])
    placeholder, n = model.config.image_token_id, int(batch["input_lengths"][0])
    batch["input_ids"] = batch["input_ids"].clone()
    batch["input_ids"][0, n - 2] = placeholder  # the answer's last token before the end of the turn
    got = policy.get_logprobs(batch)["logprobs"][0, :n]

    ids, (pixels, grid) = batch["input_ids"][:1, :n], sample_images(batch, 0)
    with torch.no_grad():
        image = (ids == placeholder) & (torch.arange(n) < n - 2)
        if "image_tiles" in batch:
            side = model.config.vision_config.image_size
            out = model.model.get_image_features(pixels.double().view(1, -1, 3, side, side), return_dict=True)
            features, positions = out.pooler_output.reshape(-1, model.config.text_config.hidden_size), None
        else:
            features = torch.cat(model.model.get_image_features(pixels.double(), grid, return_dict=True).pooler_output)
            positions, _ = model.model.get_rope_index(ids, image.int(), image_grid_thw=grid)
        assert int(image.sum()) == features.shape[0]
        embeds = model.get_input_embeddings()(ids).masked_scatter(image[..., None], features)
        logits = model(inputs_embeds=embeds, position_ids=positions).logits[0, :-1]
    want = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0] * batch["token_mask"][0, 1:n].double()
    torch.testing.assert_close(got[1:].double(), want, rtol=2e-6, atol=1e-5)


def test_packed_rows_give_the_padded_rows_logprobs_and_gradients(policy, setup, dt):
    """Packing keeps every image with its tokens: the same float32 numbers as padded rows, to
    within their rounding: logprobs 1e-6, and 1e-6 of a logprob's value (tokens near -8 nats
    differ by 2 ulps); every gradient within 2e-6 of its scale (sums over tokens and patches in
    another order, and the head's products over the loss tokens alone in another blocking: at
    most 1.67e-6 of 1.56 measured, Qwen2-VL's merger)."""
    batch = setup["batch"]
    padded = policy.get_logprobs(batch)["logprobs"]
    policy.train(batch, dt.nll)
    padded_grads = dt.sgd_grads(setup["initial_weights"], dt.full_weights(policy), lr=1.0)
    policy = dt.restore(policy, setup["initial_ckpt"])
    policy.config.policy.sequence_packing = PACKING
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], padded, rtol=1e-6, atol=1e-6)
    policy.train(batch, dt.nll)
    packed_grads = dt.sgd_grads(setup["initial_weights"], dt.full_weights(policy), lr=1.0)
    for name, want in padded_grads.items():
        assert float((packed_grads[name] - want).abs().max()) <= 2e-6 * max(1.0, float(want.abs().max())), name


@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3"])
def test_tensor_parallel_splits_the_language_model_and_keeps_the_vision_tower_whole(virtual_cluster, dt,
                                                                                    counting_rows, tmp_path, arch):
    """Two tensor-parallel ranks (two key-value heads, so both head counts split): the
    language model follows its text config's plan, the vision tower is whole on each rank;
    logprobs, the step-0 loss and every gradient equal transformers' float64 forward, as at
    one rank."""
    path = str(build_zoo_vlm(tmp_path / f"{arch}_kv2", arch, text={"num_key_value_heads": 2}))
    batch = image_batch(path, counting_rows)
    ref_loss, ref_grads = reference_step(path, batch)
    config = dt.policy_config(path, max_total_sequence_length=96, num_workers=2, tensor_parallel_size=2)
    policy = DTensorPolicy(config, virtual_cluster, name=f"policy-vlm-tp2-{arch}")
    try:
        assert policy.info()["tensor_parallel_size"] == 2
        got = policy.get_logprobs(batch)["logprobs"]
        initial = dt.full_weights(policy)
        metrics = policy.train(batch, dt.nll)
        grads = dt.sgd_grads(initial, dt.full_weights(policy), lr=1.0)
    finally:
        policy.shutdown()
    torch.testing.assert_close(got.double(), reference_logprobs(reference_model(path), batch), rtol=2e-6, atol=1e-5)
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-5)
    for name, want in ref_grads.items():
        assert float((grads[name] - want).abs().max()) < 1e-5 * max(1.0, float(want.abs().max())), name
