"""Data loading: files and formats, assistant-only masks, truncation, errors, the resumable loader.

Expected token ids are built by hand from the tiny character tokenizer's vocabulary (one id
per character, one per special token), not with the chat template, so they check the
template path rather than repeat it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from posttrain.config.schema import DataConfig, PolicyConfig, RunConfig
from posttrain.data import (
    ChatEncoder,
    StatefulDataLoader,
    build_dataset,
    dataloader_from_config,
    dataset_from_config,
    detect_format,
    encoder_from_config,
    require_dataset,
)
from posttrain.errors import CheckpointError, ConfigError, DataError
from posttrain.models.tiny import CHAT_TEMPLATE, build_tokenizer
from tests.stand_ins import Numbers

TOKENIZER = build_tokenizer()
VOCAB = TOKENIZER.get_vocab()
BOS, END, PAD = VOCAB["<bos>"], VOCAB["<|end|>"], VOCAB["<pad>"]


def chars(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def turn(role: str, content: str) -> tuple[list[int], list[int]]:
    """A rendered message: its ids and its loss mask (content + end token for the assistant)."""
    ids = [VOCAB[f"<|{role}|>"], *chars(content), END]
    return ids, [0] + [int(role == "assistant")] * (len(ids) - 1)


def conversation(*messages: tuple[str, str], generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    ids, mask = [BOS], [0]
    for role, content in messages:
        t_ids, t_mask = turn(role, content)
        ids, mask = ids + t_ids, mask + t_mask
    if generation_prompt:
        ids, mask = ids + [VOCAB["<|assistant|>"]], mask + [0]
    return ids, mask


def msgs(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in pairs]


def write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)  # schema from every row
    return path


def masked_ids(ids: list[int], mask: list[int]) -> list[int]:
    return [t for t, m in zip(ids, mask, strict=True) if m]


def row_of(batch, i: int) -> tuple[list[int], list[int]]:
    n = int(batch["input_lengths"][i])
    return batch["input_ids"][i, :n].tolist(), batch["token_mask"][i, :n].long().tolist()


@pytest.fixture
def encoder() -> ChatEncoder:
    return ChatEncoder(TOKENIZER)


# ------------------------------------------------------------------ formats x file types

SUFFIXES = [".jsonl", ".json", ".parquet"]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_messages_rows(tmp_path, encoder, suffix):
    rows = [
        {"messages": msgs(("system", "be brief"), ("user", "hi"), ("assistant", "yo"))},
        {"messages": msgs(("user", "2+2?"), ("assistant", "4"))},
    ]
    ds = build_dataset(write_rows(tmp_path / f"d{suffix}", rows), "sft", encoder)
    assert ds.report.format == "messages" and len(ds) == 2
    batch = ds.collate([0, 1])
    assert row_of(batch, 0) == conversation(("system", "be brief"), ("user", "hi"), ("assistant", "yo"))
    assert row_of(batch, 1) == conversation(("user", "2+2?"), ("assistant", "4"))
    width = batch["input_ids"].shape[1]
    assert batch["input_ids"][1, int(batch["input_lengths"][1]):].tolist() == [PAD] * (width - len(row_of(batch, 1)[0]))
    assert batch["sample_mask"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("template", ["hermes", "llama3_json"])
def test_tool_use_demonstrations_render_their_tools_and_train_the_assistant_turns(tmp_path, template):
    from posttrain.models.tiny import TOOL_CHAT_TEMPLATES

    tools = [{"type": "function", "function": {"name": "calculator", "description": "Arithmetic.",
                                                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    demo = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": '{"name": "calculator"}'},
            {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]
    encoder = ChatEncoder(TOKENIZER, TOOL_CHAT_TEMPLATES[template])
    ds = build_dataset(write_rows(tmp_path / "d.jsonl", [{"messages": demo, "tools": tools}]), "sft", encoder)
    ids, mask = row_of(ds.collate([0]), 0)
    rendered = TOKENIZER.apply_chat_template(demo, tools=tools, chat_template=TOOL_CHAT_TEMPLATES[template],
                                             return_dict=True, return_assistant_tokens_mask=True)
    assert ids == rendered["input_ids"] and mask == rendered["assistant_masks"]
    assert TOKENIZER.decode(masked_ids(ids, mask)) == '{"name": "calculator"}<|end|>42<|end|>'
    assert "calculator" in TOKENIZER.decode(ids[: ids.index(TOKENIZER.convert_tokens_to_ids("<|user|>"))])


def test_tools_must_be_a_list_of_schemas(tmp_path, encoder):
    rows = [{"messages": msgs(("user", "hi"), ("assistant", "yo")), "tools": "calculator"}]
    with pytest.raises(DataError, match="'tools' must be a list of JSON schemas \\(objects\\), found"):
        build_dataset(write_rows(tmp_path / "d.jsonl", rows), "sft", encoder)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_prompt_response_rows(tmp_path, encoder, suffix):
    rows = [{"prompt": "hi", "response": "yo", "system": "sys"}, {"prompt": "a", "response": "b", "system": None}]
    ds = build_dataset(write_rows(tmp_path / f"d{suffix}", rows), "sft", encoder)
    assert ds.report.format == "prompt_response"
    batch = ds.collate([0, 1])
    assert row_of(batch, 0) == conversation(("system", "sys"), ("user", "hi"), ("assistant", "yo"))
    assert row_of(batch, 1) == conversation(("user", "a"), ("assistant", "b"))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_preference_rows_are_interleaved_pairs(tmp_path, encoder, suffix):
    rows = [
        {"prompt": "2+2", "chosen": "4", "rejected": "five"},
        {"prompt": "x", "chosen": "good", "rejected": "bad"},
    ]
    ds = build_dataset(write_rows(tmp_path / f"d{suffix}", rows), "preference", encoder)
    batch = ds.collate([1, 0])
    assert len(batch) == 4
    assert row_of(batch, 0) == conversation(("user", "x"), ("assistant", "good"))
    assert row_of(batch, 1) == conversation(("user", "x"), ("assistant", "bad"))
    assert row_of(batch, 2) == conversation(("user", "2+2"), ("assistant", "4"))
    assert row_of(batch, 3) == conversation(("user", "2+2"), ("assistant", "five"))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_preference_conversations_split_at_the_shared_prompt(tmp_path, encoder, suffix):
    # The shared prefix holds an earlier assistant turn: it is prompt, so it carries no loss.
    shared = [("user", "q"), ("assistant", "a1"), ("user", "more")]
    rows = [{"chosen": msgs(*shared, ("assistant", "yes")), "rejected": msgs(*shared, ("assistant", "no"))}]
    ds = build_dataset(write_rows(tmp_path / f"d{suffix}", rows), "preference", encoder)
    batch = ds.collate([0])
    for i, reply in enumerate(("yes", "no")):
        prompt_ids, _ = conversation(*shared)
        reply_ids, reply_mask = turn("assistant", reply)
        assert row_of(batch, i) == (prompt_ids + reply_ids, [0] * len(prompt_ids) + reply_mask)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_prompt_rows_for_rl(tmp_path, encoder, suffix):
    rows = [
        {"prompt": "1+1", "answer": "2", "task": "math", "level": 1},
        {"messages": msgs(("system", "s"), ("user", "2+3")), "answer": "5", "task": None, "level": 3},
    ]
    ds = build_dataset(write_rows(tmp_path / f"d{suffix}", rows), "prompt", encoder)
    assert ds.report.format == "prompt"
    batch = ds.collate([0, 1])
    assert row_of(batch, 0) == conversation(("user", "1+1"), generation_prompt=True)
    assert row_of(batch, 1) == conversation(("system", "s"), ("user", "2+3"), generation_prompt=True)
    assert batch["token_mask"].sum() == 0
    assert batch["messages"] == [msgs(("user", "1+1")), msgs(("system", "s"), ("user", "2+3"))]
    assert batch["answer"] == ["2", "5"]
    assert batch["task"] == ["math", None]
    assert batch["metadata"] == [{"answer": "2", "level": 1}, {"answer": "5", "level": 3}]


def test_a_tokenizer_without_a_chat_template_is_named(tmp_path):
    folder = tmp_path / "no_template"
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError) as info:
        ChatEncoder(AutoTokenizer.from_pretrained(folder))
    assert str(info.value) == (
        f"the tokenizer '{folder}' has no chat template (its tokenizer_config.json sets no chat_template and it has no "
        "chat_template.jinja); set data.chat_template to a Jinja template file or the template text"
    )


def test_detect_format_by_keys():
    assert detect_format({"prompt": "p", "chosen": "a", "rejected": "b"}) == "preference"
    assert detect_format({"prompt": "p", "response": "r"}) == "prompt_response"
    assert detect_format({"messages": msgs(("user", "u"), ("assistant", "a"))}) == "messages"
    assert detect_format({"messages": msgs(("user", "u")), "answer": 1}) == "prompt"
    assert detect_format({"prompt": "p", "answer": 1}) == "prompt"
    assert detect_format({"text": "t"}) is None


# ------------------------------------------------------------------ masks and truncation


def test_assistant_only_mask_is_the_assistant_content_and_end_token(encoder):
    conv = msgs(("system", "rules"), ("user", "hello"), ("assistant", "hi there"), ("user", "bye"), ("assistant", "ok"))
    enc = encoder.encode(conv)
    masked = masked_ids(enc.input_ids, enc.token_mask)
    assert masked == chars("hi there") + [END] + chars("ok") + [END]
    assert enc.input_ids == conversation(*[(m["role"], m["content"]) for m in conv])[0]


def test_prefix_masks_without_generation_markers_match_the_marked_template(encoder):
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    prefix_encoder = ChatEncoder(TOKENIZER, plain)
    assert encoder.marks_generation and not prefix_encoder.marks_generation
    conv = msgs(("user", "a"), ("assistant", "bc"), ("user", "d"), ("assistant", "ef"))
    assert prefix_encoder.encode(conv) == encoder.encode(conv)
    assert prefix_encoder.encode(conv, loss_from=2) == encoder.encode(conv, loss_from=2)
    late = prefix_encoder.encode(conv, loss_from=2)
    masked = masked_ids(late.input_ids, late.token_mask)
    assert masked == chars("ef") + [END]


def test_template_that_renders_prefixes_differently_is_refused(tmp_path):
    counted = "{{ messages | length }}" + CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(ConfigError, match=r"d\.jsonl row 1: the chat template renders the conversation before or through assistant turn 1 differently"):
        build_dataset(path, "sft", ChatEncoder(TOKENIZER, counted))


CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_a_template_that_refuses_a_role_names_the_row_and_the_template(tmp_path, zoo_model):
    """Gemma 2's template raises on system turns."""
    path = write_rows(tmp_path / "d.jsonl", [{"messages": CHAT},
                                             {"messages": [{"role": "system", "content": "Be brief."}, *CHAT]}])
    model = zoo_model("gemma2")
    with pytest.raises(DataError) as info:
        build_dataset(path, "sft", ChatEncoder(AutoTokenizer.from_pretrained(model)))
    assert str(info.value) == (
        f"{path} row 2: the chat template of the tokenizer '{model}' cannot render this conversation (roles: system, "
        "user, assistant): TemplateError: System role not supported. Set data.chat_template to a template that "
        "renders these roles, or change the rows"
    )


@pytest.mark.parametrize("arch", ["phi3", "olmo2"])
def test_a_template_that_drops_a_role_names_the_row_the_role_and_the_template(tmp_path, zoo_model, arch):
    """Phi-3's and OLMo 2's templates write nothing for a role they do not know (here a tool's
    reply): training on such rows would silently train on other conversations."""
    rows = [{"messages": CHAT}, {"messages": [*CHAT, {"role": "tool", "content": "sunny, 20 C"},
                                              {"role": "assistant", "content": "Nice."}]}]
    path = write_rows(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as info:
        build_dataset(path, "sft", ChatEncoder(AutoTokenizer.from_pretrained(zoo_model(arch))))
    assert str(info.value) == (
        f"{path} row 2: the chat template of the tokenizer '{zoo_model(arch)}' does not render the 'tool' message of "
        "this conversation (roles: user, assistant, tool): its text is missing from what the template writes. Set "
        "data.chat_template to a template that renders role 'tool', or leave such messages out of the data"
    )
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}")
    config = RunConfig(policy=PolicyConfig(model=zoo_model(arch)), data=DataConfig(chat_template=str(template)))
    with pytest.raises(DataError, match=rf"row 2: data.chat_template \('{template}'\) does not render the 'tool'"):
        build_dataset(path, "sft", encoder_from_config(config))


def test_truncation_keeps_the_start_and_cuts_the_mask(tmp_path, encoder):
    rows = [
        {"prompt": "ab", "response": "cdefgh"},  # 2 + 4 prompt tokens, 7 loss tokens
        {"prompt": "abcdefghij", "response": "k"},  # prompt alone longer than the limit
        {"prompt": "a", "response": "b"},  # fits
    ]
    ds = build_dataset(write_rows(tmp_path / "d.jsonl", rows), "sft", encoder, max_length=9)
    batch = ds.collate([0, 1, 2])
    full_ids, full_mask = conversation(("user", "ab"), ("assistant", "cdefgh"))
    assert row_of(batch, 0) == (full_ids[:9], full_mask[:9])
    assert row_of(batch, 0)[1].count(1) == 3  # 'c', 'd', 'e' remain of the response
    assert row_of(batch, 1) == (conversation(("user", "abcdefghij"), ("assistant", "k"))[0][:9], [0] * 9)
    assert row_of(batch, 2) == conversation(("user", "a"), ("assistant", "b"))
    assert batch["sample_mask"].tolist() == [1.0, 0.0, 1.0]
    assert (ds.report.num_truncated, ds.report.num_without_loss) == (2, 1)


def test_truncated_preference_pairs(tmp_path, encoder):
    rows = [
        {"prompt": "ab", "chosen": "x", "rejected": "a much longer reply"},  # prompt: 6 tokens
        {"prompt": "abcd", "chosen": "x", "rejected": "y"},  # prompt: 8 tokens, the whole limit
    ]
    ds = build_dataset(write_rows(tmp_path / "d.jsonl", rows), "preference", encoder, max_length=8)
    batch = ds.collate([0, 1])
    # pair 1: chosen fits with its 2 loss tokens; rejected keeps the first 2 of its 20
    assert row_of(batch, 0) == conversation(("user", "ab"), ("assistant", "x"))
    assert row_of(batch, 1) == tuple(x[:8] for x in conversation(("user", "ab"), ("assistant", "a much longer reply")))
    # pair 2: neither side keeps a loss token, so the pair carries no loss
    assert row_of(batch, 2)[1] == row_of(batch, 3)[1] == [0] * 8
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert (ds.report.num_truncated, ds.report.num_without_loss) == (2, 1)


# ------------------------------------------------------------------ malformed rows


def test_missing_key_names_file_row_and_key(tmp_path, encoder):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
        "\n"  # blank lines are skipped but counted: row numbers are line numbers
        '{"prompt": "a", "rejected": "c"}\n'
    )
    with pytest.raises(DataError) as info:
        build_dataset(path, "preference", encoder)
    assert str(info.value) == (
        f"{path} row 3: missing key 'chosen' (preference rows need 'prompt', 'chosen', 'rejected'; "
        "'prompt' may be left out when chosen and rejected are whole conversations)"
    )


def test_wrong_type_names_the_key_and_what_was_found(tmp_path, encoder):
    path = write_rows(tmp_path / "bad.json", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                               {"prompt": "a", "chosen": 5, "rejected": "c"}])
    with pytest.raises(DataError) as info:
        build_dataset(path, "preference", encoder)
    assert str(info.value) == (
        f"{path} row 2: 'chosen' and 'rejected' must both be strings or both be message lists, found int 5 and str 'c'"
    )
    path = write_rows(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": 3}]}])
    with pytest.raises(DataError, match=r"bad\.jsonl row 1: 'messages'\[0\]\['content'\] must be a string or a list of parts, found int 3"):
        build_dataset(path, "prompt", encoder)


def test_skip_malformed_skips_and_counts(tmp_path, encoder):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        '{"prompt": "a", "response": "b"}\n'
        '{"prompt": "c"}\n'
        "not json\n"
        '{"prompt": "d", "response": "e"}\n'
    )
    with pytest.raises(DataError, match=r"mixed\.jsonl row 2: missing key 'response'"):
        build_dataset(path, "sft", encoder)
    ds = build_dataset(path, "sft", encoder, skip_malformed=True)
    assert len(ds) == 2 and [ds[i]["row"] for i in range(2)] == [1, 4]
    assert ds.report.num_rows == 4 and ds.report.num_skipped == 2
    assert ds.report.skipped[0].startswith(f"{path} row 2: missing key 'response'")
    assert ds.report.skipped[1].startswith(f"{path} row 3: invalid JSON: Expecting value")


def test_a_json_lines_error_at_the_end_of_a_line_names_its_column(tmp_path, encoder):
    """A line cut short (its closing brace missing): the parser stops at the end of the line,
    column 32 (just past its 31 characters), not at column 1 of the line after it."""
    path = tmp_path / "cut.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"\n{"prompt": "e", "response": "f"}\n')
    with pytest.raises(DataError) as info:
        build_dataset(path, "sft", encoder)
    assert str(info.value) == f"{path} row 2: invalid JSON: Expecting ',' delimiter (column 32)"


def test_file_of_the_wrong_kind_and_unknown_type(tmp_path, encoder):
    path = write_rows(tmp_path / "prefs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match=r"prefs\.jsonl: rows look like preference data \(row 1 has keys \['chosen', 'prompt', 'rejected'\]\), but sft data needs"):
        build_dataset(path, "sft", encoder)
    with pytest.raises(ConfigError, match="data.format: 'preference' does not fit sft data"):
        build_dataset(path, "sft", encoder, fmt="preference")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"d\.csv: unsupported file type '\.csv'; use one of \.jsonl, \.json, \.parquet"):
        build_dataset(tmp_path / "d.csv", "sft", encoder)


# ------------------------------------------------------------------ the loader


def indices_of(loader, count: int) -> list[list[int]]:
    out = []
    while len(out) < count:
        for batch in loader:
            out.append(batch["value"].tolist())
            if len(out) == count:
                break
    return out


def test_shuffle_is_determined_by_the_seed():
    a = indices_of(StatefulDataLoader(Numbers(10), 3, seed=7), 6)  # two epochs of 3 batches
    b = indices_of(StatefulDataLoader(Numbers(10), 3, seed=7), 6)
    c = indices_of(StatefulDataLoader(Numbers(10), 3, seed=8), 6)
    assert a == b and a != c
    for epoch in (a[:3], a[3:]):
        flat = [i for batch in epoch for i in batch]
        assert len(set(flat)) == 9  # drop_last: 3 full batches of distinct samples
    assert a[:3] != a[3:]  # a new order every epoch
    assert indices_of(StatefulDataLoader(Numbers(5), 2, shuffle=False, drop_last=False), 3) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("consumed", [1, 3, 4])  # mid-epoch, at the epoch boundary, into epoch 2
def test_loader_state_resumes_at_the_next_batch(consumed):
    loader = StatefulDataLoader(Numbers(10), 3, seed=1)
    indices_of(loader, consumed)
    state = loader.state_dict()
    expected = indices_of(loader, 4)
    resumed = StatefulDataLoader(Numbers(10), 3, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert indices_of(resumed, 4) == expected
    assert (state["epoch"], state["position"]) == divmod(consumed, 3)


def test_loader_refuses_state_of_other_data():
    state = StatefulDataLoader(Numbers(10), 3).state_dict()
    with pytest.raises(CheckpointError, match=r"num_samples 10 -> 12"):
        StatefulDataLoader(Numbers(12), 3).load_state_dict(state)
    with pytest.raises(DataError, match="the dataset has 2 samples per epoch, fewer than one batch of 3"):
        StatefulDataLoader(Numbers(2), 3)


def test_tokenized_dataset_batches_resume_exactly(tmp_path, encoder):
    rows = [{"prompt": f"q{i}", "response": "r" * (i % 4 + 1)} for i in range(12)]
    ds = build_dataset(write_rows(tmp_path / "d.jsonl", rows), "sft", encoder)
    loader = StatefulDataLoader(ds, 4, seed=3)
    next(iter(loader))
    resumed = StatefulDataLoader(ds, 4, seed=3)
    resumed.load_state_dict(loader.state_dict())
    a, b = next(iter(loader)), next(iter(resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ from a run config


def test_from_config_uses_the_policy_tokenizer_and_a_template_file(tmp_path):
    model_folder = tmp_path / "model"  # the tokenizer is all the data needs from the model folder
    TOKENIZER.save_pretrained(model_folder)
    train = write_rows(tmp_path / "train.jsonl", [{"prompt": f"p{i}", "response": "r"} for i in range(4)])
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE.replace("'<|end|>'", "'<|end|>\n'"))  # every turn ends with a newline
    config = RunConfig(
        seed=5,
        policy=PolicyConfig(model=str(model_folder), max_total_sequence_length=64),
        data=DataConfig(train=str(train), chat_template=str(template)),
    )
    encoder = encoder_from_config(config)
    ds = dataset_from_config(config, "train", "sft", encoder)
    assert dataset_from_config(config, "validation", "sft", encoder) is None
    with pytest.raises(ConfigError, match=r"data.validation is not set; this algorithm needs a file of sft data"):
        require_dataset(config, "validation", "sft", encoder)
    ids, mask = row_of(ds.collate([0]), 0)
    masked = masked_ids(ids, mask)
    assert masked == chars("r") + [END, VOCAB["\n"]]
    loader = dataloader_from_config(config, ds, 2)
    assert loader.seed == 5 and loader.shuffle and loader.drop_last


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "data"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.jsonl")))
def test_example_data_files_load_cleanly(encoder, name):
    kind = "preference" if name.startswith("preference") else "prompt" if name.startswith("math") else "sft"
    ds = build_dataset(EXAMPLES / name, kind, encoder, max_length=256)
    assert ds.report.num_skipped == 0 and len(ds) == ds.report.num_rows
    if kind != "prompt":  # prompts carry no loss tokens by design
        assert ds.report.num_without_loss == 0


def test_a_chat_template_is_given_as_text_of_any_length_or_as_a_file(tmp_path):
    from posttrain.data.chat import read_chat_template
    from posttrain.models.tiny import TOOL_CHAT_TEMPLATES

    long_template = TOOL_CHAT_TEMPLATES["hermes"]
    assert len(long_template) > 255 and read_chat_template(long_template) == long_template  # longer than a file name
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    with pytest.raises(ConfigError, match="data.chat_template: no file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
