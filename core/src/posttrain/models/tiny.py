"""Build a tiny Llama model and a character-level tokenizer locally and deterministically.

Nothing is downloaded: the tokenizer is made with the ``tokenizers`` library, the model is
initialised from a seed, and both are saved as an ordinary Hugging Face folder that
``transformers`` (and vLLM) load like any other. Tests, the quickstart and benchmarks use it.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

PAD, BOS, END = "<pad>", "<bos>", "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (PAD, BOS, END, *ROLE_TOKENS)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"

#: Roles open with their token; every message closes with <|end|>, which is also EOS, so a
#: generated assistant turn stops where the template expects it to.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

#: The same chat format with tool support, in two tool-call formats (for tests and examples
#: of tool-calling rollouts). Tools (``apply_chat_template(..., tools=...)``) are listed in a
#: system turn before the conversation (after a system message's own text); ``tool`` messages
#: are the tools' replies.
#:
#: - ``hermes`` (Hermes / Qwen style): the model calls a tool by answering
#:   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; replies are wrapped in
#:   ``<tool_response>...</tool_response>``.
#: - ``llama3_json`` (Llama 3.1 style): the model calls a tool by answering a bare JSON object
#:   ``{"name": ..., "parameters": {...}}``; replies are plain.
_TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% set offset = 0 %}"
    "{% if tools %}{{ '<|system|>' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% set offset = 1 %}{% endif %}"
    "{{ 'Tools:\\n' }}{% for tool in tools %}{{ tool['function'] | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '__CALL__<|end|>' }}{% endif %}"
    "{% for message in messages[offset:] %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% elif message['role'] == 'tool' %}{{ '<|tool|>__REPLY__<|end|>' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TOOL_CHAT_TEMPLATES = {
    "hermes": _TOOL_TEMPLATE.replace(
        "__CALL__", 'Call one with <tool_call>{\\"name\\": name, \\"arguments\\": {...}}</tool_call>.'
    ).replace("__REPLY__", "<tool_response>' + message['content'] + '</tool_response>"),
    "llama3_json": _TOOL_TEMPLATE.replace(
        "__CALL__", 'Call one by answering only {\\"name\\": name, \\"parameters\\": {...}}.'
    ).replace("__REPLY__", "' + message['content'] + '"),
}


def build_tokenizer():
    """A character-level fast tokenizer with chat roles; identical on every machine."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        unk_token=PAD,
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def tiny_llama_config(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2,
                      num_kv_heads: int = 2, intermediate_size: int | None = None, max_position: int = 1024):
    from transformers import LlamaConfig

    tokenizer_ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=tokenizer_ids[PAD],
        bos_token_id=tokenizer_ids[BOS],
        eos_token_id=tokenizer_ids[END],
        torch_dtype="float32",
    )


#: Named sizes: ``tiny`` for unit tests (~0.1M parameters), ``small`` (~25M, 101 MB in float32)
#: and ``medium`` (~100M, 0.4 GB) for benchmarks.
#: Head sizes are at least 32 (vLLM's CPU attention refuses smaller ones) and key/value heads
#: divide by 2 (tensor parallel 2).
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2),
    "quickstart": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2),
    "small": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536),
    "medium": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=3072),
}


def build_tiny_model(path: str | Path, *, size: str = "tiny", seed: int = 0, **overrides: int) -> Path:
    """Write a seeded Llama model and the character tokenizer to ``path``; return it.

    ``size`` picks a preset from :data:`SIZES`; keyword overrides change single fields.
    The same arguments always give bit-identical weights.
    """
    from transformers import LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer()
    config = tiny_llama_config(len(tokenizer), **{**SIZES[size], **overrides})
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.pad_token_id = config.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
