"""The zoo's tokenizers: a byte-level BPE learned locally, the same on every machine, in each
family's own chat format, saved in the zoo's folders as transformers reloads them, and giving
the SFT loss mask exactly the assistant's turns (through the ``{% generation %}`` markers or
the prefix rule, whichever the template allows)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from posttrain.data.chat import ChatEncoder
from posttrain.testing.chat_formats import BPE_VOCAB_SIZE, CORPUS, FORMATS, _bpe_json, build_chat_tokenizer
from posttrain.testing.zoo import ARCHITECTURES, CHAT_FORMATS, VOCAB_MULTIPLE, build_zoo_model, zoo_config

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 7 plus 5?"},
    {"role": "assistant", "content": "12"},
    {"role": "user", "content": "And 9 times 8?"},
    {"role": "assistant", "content": "72"},
]

#: The conversation as each family's released template writes it (Gemma 2 without the system turn).
RENDERED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 plus 5?<|im_end|>\n"
    "<|im_start|>assistant\n12<|im_end|>\n<|im_start|>user\nAnd 9 times 8?<|im_end|>\n<|im_start|>assistant\n72<|im_end|>\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 7 plus 5?<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    "\n\n12<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd 9 times 8?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n72<|eot_id|>",
    "gemma2": "<bos><start_of_turn>user\nWhat is 7 plus 5?<end_of_turn>\n<start_of_turn>model\n12<end_of_turn>\n"
    "<start_of_turn>user\nAnd 9 times 8?<end_of_turn>\n<start_of_turn>model\n72<end_of_turn>\n",
    "gemma3": "<bos><start_of_turn>user\nBe brief.\n\nWhat is 7 plus 5?<end_of_turn>\n<start_of_turn>model\n12<end_of_turn>\n"
    "<start_of_turn>user\nAnd 9 times 8?<end_of_turn>\n<start_of_turn>model\n72<end_of_turn>\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat is 7 plus 5?<|end|>\n<|assistant|>\n12<|end|>\n"
    "<|user|>\nAnd 9 times 8?<|end|>\n<|assistant|>\n72<|end|>\n<|endoftext|>",
    "mistral": "<s>[INST] Be brief.\n\nWhat is 7 plus 5?[/INST] 12</s>[INST] And 9 times 8?[/INST] 72</s>",
    "olmo2": "<|endoftext|><|system|>\nBe brief.\n<|user|>\nWhat is 7 plus 5?\n<|assistant|>\n12<|endoftext|>\n"
    "<|user|>\nAnd 9 times 8?\n<|assistant|>\n72<|endoftext|>",
}
RENDERED["chatml_generation"] = RENDERED["chatml_vision"] = RENDERED["chatml"]
RENDERED["smolvlm"] = ("<|im_start|>System: Be brief.<end_of_utterance>\nUser: What is 7 plus 5?<end_of_utterance>\n"
                       "Assistant: 12<end_of_utterance>\nUser: And 9 times 8?<end_of_utterance>\nAssistant: 72"
                       "<end_of_utterance>\n")

#: The loss tokens' text: the assistant's answers and the tokens that end them (what follows,
#: up to the next turn, too where the template has no markers and the prefix rule finds the turns).
MASKED = {
    "chatml": "12<|im_end|>\n72<|im_end|>\n",
    "chatml_generation": "12<|im_end|>72<|im_end|>",
    "chatml_vision": "12<|im_end|>\n72<|im_end|>\n",
    "llama3": "12<|eot_id|>72<|eot_id|>",
    "gemma2": "12<end_of_turn>\n72<end_of_turn>\n",
    "gemma3": "12<end_of_turn>\n72<end_of_turn>\n",
    "phi3": "12<|end|>72<|end|>",
    "mistral": " 12</s> 72</s>",
    "olmo2": "12<|endoftext|>72<|endoftext|>",
    "smolvlm": " 12<end_of_utterance>\n 72<end_of_utterance>\n",
}


def conversation(fmt: str) -> list[dict[str, str]]:
    return CONVERSATION[1:] if fmt == "gemma2" else CONVERSATION


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_family_renders_its_own_format_and_masks_the_assistant_turns(fmt):
    tokenizer = build_chat_tokenizer(fmt)
    assert tokenizer.apply_chat_template(conversation(fmt), tokenize=False) == RENDERED[fmt]
    encoded = ChatEncoder(tokenizer).encode(conversation(fmt))
    assert encoded.input_ids == tokenizer(RENDERED[fmt], add_special_tokens=False)["input_ids"]
    assert tokenizer.decode([t for t, m in zip(encoded.input_ids, encoded.token_mask, strict=True) if m]) == MASKED[fmt]


def test_templates_mark_generation_where_the_prefix_rule_fails():
    """Phi-3 ends a finished conversation with <|endoftext|> (so a conversation's start is not a
    prefix of it) and Qwen 3's real template rewrites earlier turns: both mark the assistant."""
    marked = {fmt for fmt in FORMATS if ChatEncoder(build_chat_tokenizer(fmt)).marks_generation}
    assert marked == {"chatml_generation", "phi3"}


def test_the_bpe_is_the_same_in_a_fresh_process():
    """The merges learned from the corpus do not depend on the process (thread scheduling)."""
    code = "import hashlib; from posttrain.testing.chat_formats import _bpe_json; print(hashlib.sha256(_bpe_json().encode()).hexdigest())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert fresh == hashlib.sha256(_bpe_json().encode()).hexdigest()


def test_byte_level_bpe_encodes_any_text_and_learned_merges():
    tokenizer = build_chat_tokenizer("llama3")
    text = CORPUS + " héllo wörld 日本\n\n  x"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(CORPUS) / 2  # merges, not one token per byte
    assert len(tokenizer) == BPE_VOCAB_SIZE + len(FORMATS["llama3"].special_tokens)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_zoo_folders_hold_the_family_tokenizer_as_transformers_reloads_it(tmp_path, name):
    """``AutoTokenizer`` (transformers' Qwen2Tokenizer for a Qwen 2 folder) encodes and renders as
    built; the embedding has room for every token, rounded up like released checkpoints."""
    from transformers import GenerationConfig

    path = build_zoo_model(tmp_path / name, name)
    built, loaded = build_chat_tokenizer(CHAT_FORMATS[name]), AutoTokenizer.from_pretrained(path)
    text = CORPUS + " 12345 héllo"
    assert loaded(text)["input_ids"] == built(text)["input_ids"]
    fmt = CHAT_FORMATS[name]
    assert loaded.apply_chat_template(conversation(fmt), tokenize=False) == RENDERED[fmt]
    config = zoo_config(name)
    assert config.vocab_size % VOCAB_MULTIPLE == 0 and len(built) <= config.vocab_size < len(built) + VOCAB_MULTIPLE
    stops = GenerationConfig.from_pretrained(path).eos_token_id
    assert built.convert_ids_to_tokens(stops) == list(FORMATS[fmt].stops)
    assert loaded.eos_token_id == config.eos_token_id and loaded.pad_token_id == config.pad_token_id


def test_the_character_tokenizer_stays_available(tmp_path):
    path = build_zoo_model(tmp_path / "qwen2", "qwen2", tokenizer="character")
    loaded = AutoTokenizer.from_pretrained(path)
    assert loaded.tokenize("ab") == ["a", "b"]
    assert zoo_config("qwen2", tokenizer="character").vocab_size == VOCAB_MULTIPLE * 2  # 103 tokens
