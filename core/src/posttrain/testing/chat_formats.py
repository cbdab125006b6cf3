"""Byte-level BPE tokenizers with the chat formats of the families users bring, built locally.

:func:`build_chat_tokenizer` trains a byte-level BPE (the kind GPT-2, Llama 3, Qwen and OLMo
ship) on :data:`CORPUS` with the ``tokenizers`` library, then adds a family's special tokens
after the learned vocabulary and its chat template: :data:`FORMATS` holds ChatML (Qwen 2 and,
with ``{% generation %}`` markers, Qwen 3; with image parts, Qwen-VL), SmolVLM's (Idefics3) role
prefixes with image parts, Llama 3's headers, Gemma 2's and Gemma 3's turns,
Phi-3's role tags, Mistral's ``[INST]`` and OLMo 2's (Tulu) tags. Nothing is downloaded; the
same arguments give the same tokenizer on every machine.

The templates keep the quirks that matter to a trainer: Gemma 2 refuses a system turn, Gemma
3 and Mistral fold it into the first user turn, Phi-3 ends a finished conversation with its
end-of-text token and drops roles it does not know (which is why its template marks the
assistant's tokens with ``{% generation %}``: the prefix rule of
:mod:`posttrain.data.chat` does not hold for it), OLMo 2 drops them too, Llama 3 and Gemma trim
message text.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

#: Text the BPE merges are learned from: prose, arithmetic and code, like the data tests use.
CORPUS = """\
A language model reads text as a sequence of tokens and learns to predict the next one.
Post-training teaches a pretrained model to follow instructions, to answer questions in a
given format, and to prefer the answers people prefer. Supervised fine-tuning shows the model
good conversations; preference optimisation shows it a better and a worse answer to the same
prompt; reinforcement learning lets it try, scores what it wrote and moves it towards the
answers that scored well.
The user asks a question and the assistant answers it. The system message tells the
assistant how to behave. A tool returns the result of a call the assistant made.
What is 7 plus 5? The answer is 12. What is 9 times 8? The answer is 72.
What is 144 divided by 12? The answer is 12. What is 3 + 4? 7. What is 10 - 3? 7.
Compute 2 * (3 + 4) = 14, then 14 / 2 = 7, and 100 - 37 = 63. Seven, eight, nine, ten.
Question: how many legs do three cats have? Answer: three cats have 12 legs.
Question: if a train leaves at 9 and arrives at 11, how long is the trip? Answer: 2 hours.
Please think step by step, then give the final answer in a box: \\boxed{42}.
def add(a, b):
    return a + b

for step in range(10):
    loss = model(batch).loss
    loss.backward()
    optimizer.step()
{"name": "calculator", "arguments": {"expression": "12 * 7"}}
The weather is sunny today, and the temperature will rise to twenty degrees in the afternoon.
She said that the library opens at nine in the morning and closes at six in the evening.
Hello! How can I help you today? Thank you, that was very helpful. You are welcome.
Write a short poem about the sea. The sea is wide and blue, the waves are white and new.
Translate to French: good morning. Bonjour. Translate to German: thank you. Danke.
"""

#: Learned tokens (bytes and merges) of every tokenizer here; family special tokens follow.
BPE_VOCAB_SIZE = 512


@attrs.frozen
class ChatFormat:
    """A family's special tokens and chat template. ``eos`` is the tokenizer's EOS token;
    ``stops`` every token generation stops at (the end of a turn and the end of a text)."""

    special_tokens: tuple[str, ...]
    eos: str
    pad: str
    template: str
    bos: str | None = None
    stops: tuple[str, ...] = ()
    #: Qwen's text splitting (NFC, digits one by one) rather than GPT-2's: what transformers'
    #: ``Qwen2Tokenizer``, which ``AutoTokenizer`` picks for a Qwen 2 folder, sets up.
    qwen_split: bool = False


_CHATML = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}__ASSISTANT__{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Qwen-VL's ChatML: a message's content is text or a list of parts, each image part written
#: as the vision tokens around one image placeholder (the processor widens it to the image's tokens).
_CHATML_VISION = (
    "{%- macro render(content) %}{%- if content is string %}{{- content }}{%- else %}"
    "{%- for part in content %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    + _CHATML.replace("message['content']", "render(message['content'])")
)
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")

#: SmolVLM's (Idefics3) turns: "User:", "Assistant:" and the text, each image part one ``<image>``
#: (the processor widens it to the image's tiles: ``<fake_token_around_image>``, a tile tag such
#: as ``<row_1_col_2>`` or ``<global-img>``, then the tile's ``<image>`` tokens).
_SMOLVLM = (
    "{{- '<|im_start|>' }}"
    "{%- for message in messages %}"
    "{{- message['role'] | capitalize }}"
    "{%- if message['content'] is string %}{{- ': ' + message['content'] }}"
    "{%- else %}{{- ':' if message['content'][0]['type'] == 'image' else ': ' }}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{- '<image>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<end_of_utterance>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}"
)
_SMOLVLM_TOKENS = ("<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                   "<global-img>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))

_LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

#: Gemma: the assistant's role is "model"; roles must alternate after an optional system turn.
_GEMMA = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}__SYSTEM__"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
_GEMMA_TOKENS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")

_PHI3 = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<|assistant|>\\n' }}"
    "{%- generation %}{{- message['content'] + '<|end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}"
)

_MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_prefix = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system_prefix if loop.first else '') + message['content'] + '[/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

_OLMO2 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '<|system|>\\n' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '<|user|>\\n' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' + message['content'] + eos_token + ('' if loop.last else '\\n') }}"
    "{%- endif %}"
    "{%- if loop.last and add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)

#: Format name -> its special tokens and template.
FORMATS: dict[str, ChatFormat] = {
    "chatml": ChatFormat(
        _CHATML_TOKENS, eos="<|im_end|>", pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>"), qwen_split=True,
        template=_CHATML.replace("__ASSISTANT__", "{{- message['content'] + '<|im_end|>' }}"),
    ),
    "chatml_generation": ChatFormat(
        _CHATML_TOKENS, eos="<|im_end|>", pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>"), qwen_split=True,
        template=_CHATML.replace(
            "__ASSISTANT__", "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
        ),
    ),
    "chatml_vision": ChatFormat(
        (*_CHATML_TOKENS, *_VISION_TOKENS), eos="<|im_end|>", pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>"),
        qwen_split=True,
        template=_CHATML_VISION.replace("__ASSISTANT__", "{{- render(message['content']) + '<|im_end|>' }}"),
    ),
    "smolvlm": ChatFormat(
        _SMOLVLM_TOKENS, bos="<|im_start|>", eos="<end_of_utterance>", pad="<|im_end|>", stops=("<end_of_utterance>",),
        template=_SMOLVLM,
    ),
    "llama3": ChatFormat(
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|finetune_right_pad_id|>"),
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
        stops=("<|end_of_text|>", "<|eot_id|>"), template=_LLAMA3,
    ),
    "gemma2": ChatFormat(
        _GEMMA_TOKENS, bos="<bos>", eos="<end_of_turn>", pad="<pad>", stops=("<eos>", "<end_of_turn>"),
        template=_GEMMA.replace("__SYSTEM__", "{{- raise_exception('System role not supported') }}"),
    ),
    "gemma3": ChatFormat(
        _GEMMA_TOKENS, bos="<bos>", eos="<end_of_turn>", pad="<pad>", stops=("<eos>", "<end_of_turn>"),
        template=_GEMMA.replace(
            "__SYSTEM__",
            "{%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' %}{%- set loop_messages = messages[1:] %}",
        ),
    ),
    "phi3": ChatFormat(
        ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        eos="<|endoftext|>", pad="<|endoftext|>", stops=("<|endoftext|>", "<|end|>"), template=_PHI3,
    ),
    "mistral": ChatFormat(
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), bos="<s>", eos="</s>", pad="<unk>", stops=("</s>",),
        template=_MISTRAL,
    ),
    "olmo2": ChatFormat(
        ("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"),
        bos="<|endoftext|>", eos="<|endoftext|>", pad="<|pad|>", stops=("<|endoftext|>",), template=_OLMO2,
    ),
}


@functools.cache
def _bpe_json() -> str:
    """The byte-level BPE learned from :data:`CORPUS`, serialised (trained once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return tokenizer.to_str()


def build_chat_tokenizer(format_name: str) -> Any:
    """A ``PreTrainedTokenizerFast``: the byte-level BPE, then ``format_name``'s special tokens
    (ids from :data:`BPE_VOCAB_SIZE` on) and chat template; identical on every machine."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if format_name not in FORMATS:
        raise KeyError(f"unknown chat format {format_name!r}; known: {', '.join(FORMATS)}")
    fmt = FORMATS[format_name]
    tokenizer = Tokenizer.from_str(_bpe_json())
    if fmt.qwen_split:
        from tokenizers import Regex, normalizers, pre_tokenizers
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.add_special_tokens(list(fmt.special_tokens))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=fmt.bos,
        eos_token=fmt.eos,
        pad_token=fmt.pad,
        chat_template=fmt.template,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
