"""Image rows for a vision-language model (tiny Qwen2-VL): each image's placeholder widened to
its tokens, never loss tokens, whole images kept by truncation, pixel values collated with the
image processor, and every bad input named by row and file."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from posttrain.data.chat import ChatEncoder, load_tokenizer
from posttrain.data.dataset import build_dataset
from posttrain.data.images import ImageInputs
from posttrain.errors import ConfigError, DataError


def image(width: int, height: int, colour: str = "red") -> Image.Image:
    return Image.new("RGB", (width, height), colour)


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    image(width, height).save(out, format="PNG")
    return out.getvalue()


def conversation(*parts: dict, answer: str = "2") -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "How many?"}]},
                         {"role": "assistant", "content": answer}]}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def model(zoo_model):
    return zoo_model("qwen2_vl")


@pytest.fixture(scope="module")
def encoder(model):
    tokenizer = load_tokenizer(model)
    return ChatEncoder(tokenizer, images=ImageInputs.from_model(model, tokenizer))


@pytest.fixture
def images(tmp_path):
    (tmp_path / "pics").mkdir()
    image(56, 56).save(tmp_path / "pics" / "small.png")  # 4 x 4 patches: 4 tokens
    image(112, 84).save(tmp_path / "pics" / "wide.png")  # 6 x 8 patches: 12 tokens
    return tmp_path


def test_placeholders_widen_to_each_images_tokens_and_never_carry_loss(encoder, images):
    path = write_jsonl(images / "train.jsonl", [
        conversation({"type": "image", "image": "pics/small.png"}, {"type": "image", "image": "pics/wide.png"}),
    ])
    batch = build_dataset(path, "sft", encoder).collate([0])
    ids, mask = batch["input_ids"][0], batch["token_mask"][0]
    placeholder = encoder.images.placeholder_id
    assert int((ids == placeholder).sum()) == 4 + 12
    assert not mask[ids == placeholder].any()
    assert encoder.tokenizer.decode(ids[mask.bool()]) == "2<|im_end|>\n"
    assert batch["image_grid_thw"][0].tolist() == [[1, 4, 4], [1, 6, 8]]
    want = encoder.images.processor(images=[image(56, 56), image(112, 84)], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(batch["pixel_values"][0], want)


def test_a_rows_images_column_fills_parts_without_an_image(encoder, tmp_path):
    """TRL's layout: {"type": "image"} parts, the images in an 'images' column (bytes or
    datasets' Image values), as parquet stores them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = conversation({"type": "image"}, {"type": "image"})
    row["messages"][1]["content"] = [{"type": "text", "text": "2"}]  # Arrow needs one type per column
    row["images"] = [{"bytes": png(56, 56), "path": None}, {"bytes": png(112, 84), "path": None}]
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "train.parquet")
    batch = build_dataset(str(tmp_path / "train.parquet"), "sft", encoder).collate([0])
    assert batch["image_grid_thw"][0].tolist() == [[1, 4, 4], [1, 6, 8]]


def test_truncation_keeps_whole_images_only(encoder, images):
    path = write_jsonl(images / "train.jsonl", [conversation({"type": "image", "image": "pics/wide.png"})])
    whole = build_dataset(path, "sft", encoder)[0]
    start = whole["input_ids"].index(encoder.images.placeholder_id)
    inside = build_dataset(path, "sft", encoder, max_length=start + 5)[0]
    assert inside["input_ids"] == whole["input_ids"][:start] and inside["images"] == []
    after = build_dataset(path, "sft", encoder, max_length=start + 12 + 1)[0]
    assert after["input_ids"] == whole["input_ids"][:start + 13] and len(after["images"]) == 1


def test_rows_and_text_only_rows_mix_in_a_batch(encoder, images):
    path = write_jsonl(images / "train.jsonl", [
        conversation({"type": "image", "image": "pics/small.png"}),
        {"messages": [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "0"}]},
    ])
    batch = build_dataset(path, "sft", encoder).collate([0, 1])
    assert [len(g) for g in batch["image_grid_thw"]] == [1, 0]
    assert batch["pixel_values"][1].numel() == 0


@pytest.mark.parametrize(("part", "images_column", "problem"), [
    ({"type": "image", "image": "pics/missing.png"}, None,
     "cannot read image file '{folder}/pics/missing.png': No such file or directory"),
    ({"type": "image", "image": "notes.txt"}, None, "image file '{folder}/notes.txt' is not an image PIL can read"),
    ({"type": "image", "image": "https://example.com/cat.png"}, None,
     "image 'https://example.com/cat.png' is a URL; nothing is downloaded: save the file and give its path"),
    ({"type": "image"}, ["pics/small.png", "pics/small.png"],
     "the row's 'images' column holds 2 images, but its messages have 1 image parts without an image of their own "
     "to take them; give every image a {'type': 'image'} part, in order"),
    ({"type": "image"}, None,
     "1 of the messages' image parts name no image (no 'image' key) and the row has no 'images' column; give each "
     "part its image ({'type': 'image', 'image': 'cat.png'}) or add an 'images' list"),
    ({"type": "picture"}, None,
     "'messages'[0]['content'][1] must be an object with 'type' one of text, image, found str 'picture'"),
])
def test_a_bad_image_names_the_row_and_the_file(encoder, images, part, images_column, problem):
    (images / "notes.txt").write_text("not an image")
    row = conversation({"type": "image", "image": "pics/small.png"}, part)
    if images_column:
        row["images"] = images_column
    path = write_jsonl(images / "train.jsonl", [conversation({"type": "image", "image": "pics/small.png"}), row])
    with pytest.raises(DataError) as info:
        build_dataset(path, "sft", encoder)
    assert str(info.value) == f"{path} row 2: " + problem.replace("{folder}", str(images))


def test_skip_malformed_leaves_out_a_row_whose_image_cannot_be_read(encoder, images):
    path = write_jsonl(images / "train.jsonl", [
        conversation({"type": "image", "image": "pics/small.png"}),
        conversation({"type": "image", "image": "pics/missing.png"}),
    ])
    dataset = build_dataset(path, "sft", encoder, skip_malformed=True)
    assert len(dataset) == 1 and dataset.report.num_skipped == 1


def test_placeholders_that_do_not_match_the_images_are_refused(encoder, images):
    """A template that writes no placeholder for an image part."""
    template = encoder.template.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
    tokenizer = encoder.tokenizer
    path = write_jsonl(images / "train.jsonl", [conversation({"type": "image", "image": "pics/small.png"})])
    with pytest.raises(DataError, match=r"row 1: the row has 1 images, but the chat template wrote 0 image "
                                        r"placeholders \(<\|image_pad\|>\); each image needs one"):
        build_dataset(path, "sft", ChatEncoder(tokenizer, template, images=encoder.images))


def test_a_text_only_model_given_image_rows_says_so(tiny_model_path, images):
    path = write_jsonl(images / "train.jsonl", [conversation({"type": "image", "image": "pics/small.png"})])
    tokenizer = load_tokenizer(tiny_model_path)
    assert ImageInputs.from_model(tiny_model_path, tokenizer) is None
    with pytest.raises(ConfigError) as info:
        build_dataset(path, "sft", ChatEncoder(tokenizer))
    assert str(info.value) == (
        f"{path} row 1: the row has images, but the model of '{tiny_model_path}' is a text-only model (its "
        "config.json has no vision_config); set policy.model to a vision-language model, or leave the images out "
        "of the data"
    )


def test_prompt_rows_carry_their_images_to_the_batch(encoder, images):
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "pics/wide.png"},
                                                     {"type": "text", "text": "How many?"}]}], "answer": 2}
    path = write_jsonl(images / "prompts.jsonl", [row])
    batch = build_dataset(path, "prompt", encoder).collate([0])
    ids = batch["input_ids"][0]
    assert int((ids == encoder.images.placeholder_id).sum()) == 12
    assert encoder.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert batch["image_grid_thw"][0].tolist() == [[1, 6, 8]] and batch["messages"][0] == row["messages"]


def test_both_rows_of_a_preference_pair_get_the_prompts_images(encoder, images):
    prompt = [{"role": "user", "content": [{"type": "image", "image": "pics/wide.png"},
                                           {"type": "text", "text": "How many?"}]}]
    path = write_jsonl(images / "pairs.jsonl", [
        {"prompt": prompt, "chosen": "2", "rejected": "3"},
        {"prompt": "How many?", "chosen": "0", "rejected": "1"},
    ])
    batch = build_dataset(path, "preference", encoder).collate([0, 1])
    assert [g.tolist() for g in batch["image_grid_thw"]] == [[[1, 6, 8]], [[1, 6, 8]], [], []]
    placeholders = (batch["input_ids"] == encoder.images.placeholder_id).sum(1).tolist()
    assert placeholders == [12, 12, 0, 0]


def test_an_image_in_a_preference_completion_is_refused(encoder, images):
    chosen = [{"role": "assistant", "content": [{"type": "image", "image": "pics/small.png"}]}]
    path = write_jsonl(images / "pairs.jsonl", [{"prompt": "Draw one.", "chosen": chosen,
                                                 "rejected": [{"role": "assistant", "content": "no"}]}])
    with pytest.raises(DataError, match="row 1: 'chosen' or 'rejected' holds an image part; images go in the prompt"):
        build_dataset(path, "preference", encoder)


def test_a_qwen_vl_folder_whose_image_processor_gives_no_patch_grid_is_refused(model, tmp_path):
    """A CLIP image processor (a fixed token count per image, no merge size) in a Qwen2-VL folder."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    with pytest.raises(ConfigError) as info:
        ImageInputs.from_model(str(folder), load_tokenizer(str(folder)))
    assert str(info.value) == (
        f"policy.model: '{folder}' is a vision-language model (qwen2_vl) but its image processor cannot be loaded "
        "(it is a CLIPImageProcessorPil, which gives no patch grids (image_grid_thw)); copy its "
        "preprocessor_config.json into the folder"
    )


def test_a_vision_language_family_without_image_rows_is_refused(model, tmp_path):
    """Gemma 3 (an image is a fixed number of soft tokens): refused when the data is read,
    naming the model types whose image rows posttrain reads."""
    import shutil

    from transformers import Gemma3Config

    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    Gemma3Config().to_json_file(folder / "config.json")
    with pytest.raises(ConfigError) as info:
        ImageInputs.from_model(str(folder), load_tokenizer(str(folder)))
    assert str(info.value) == (
        f"policy.model: '{folder}' is a gemma3 vision-language model; image rows are read for the model types "
        "qwen2_vl, qwen2_5_vl, idefics3, smolvlm"
    )


@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3"])
def test_a_prompt_widens_as_its_processor_writes_it_and_collapses_back(zoo_model, arch):
    """Two images (a square one cut into 2 x 2 tiles, a wide one into 1 x 2 for Idefics3): the
    widened ids are what transformers' processor gives (Idefics3's; Qwen-VL's in the test
    above), and :meth:`ImageInputs.collapse` puts each image's tokens back to its placeholder,
    as an engine whose own processor widens them takes the prompt."""
    from transformers import AutoProcessor

    path = zoo_model(arch)
    tokenizer = load_tokenizer(path)
    inputs = ImageInputs.from_model(path, tokenizer)
    encoder = ChatEncoder(tokenizer, images=inputs)
    files = [png(56, 56), png(112, 56)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}, {"type": "image"}]}]
    grids = inputs.grids(files)
    widened = encoder.encode_prompt(messages, image_grids=grids).input_ids
    template_ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]
    if arch == "idefics3":
        assert grids == [(5, 2, 2), (3, 1, 2)]
        processor = AutoProcessor.from_pretrained(path)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        want = processor(text=[text], images=[[image(56, 56), image(112, 56)]], add_special_tokens=False)
        assert widened == list(want["input_ids"][0])
    assert inputs.collapse(widened, grids) == template_ids
    generated = [tokenizer.convert_tokens_to_ids("How"), inputs.placeholder_id]  # a young model's answer
    with pytest.raises(ValueError, match=rf"the prompt holds 1 {re.escape(inputs.placeholder)} token\(s\) beyond its 2 "):
        inputs.collapse(widened + generated, grids)
    with pytest.raises(ValueError, match="image 1's .* tokens are not in the prompt after token"):
        inputs.collapse(widened, [grids[0], (1, 8, 8) if arch == "qwen2_vl" else (2, 1, 1)])
