"""Turn conversations into token ids and a loss mask with the tokenizer's chat template.

The loss mask marks the tokens the model is trained to produce: the tokens of assistant
turns (their content and the end-of-turn tokens the template writes after it), never the
role header that opens a turn, which is part of the prompt the model is given.

Two ways to find those tokens:

- Templates that wrap assistant output in ``{% generation %}...{% endgeneration %}`` get
  the mask from ``apply_chat_template(..., return_assistant_tokens_mask=True)``.
- Other templates: each assistant turn spans from the end of the conversation before it,
  rendered with the generation prompt, to the end of the conversation including it. This
  needs a template that renders a conversation's prefixes as prefixes of the whole; one
  that does not (e.g. one that drops earlier reasoning) fails with a :class:`ConfigError`
  asking for a ``{% generation %}`` template.

A template that cannot render a conversation (its own ``raise_exception``, e.g. Gemma 2's
refusal of system turns) or that drops a role's messages from what it writes (e.g. Phi-3's
and OLMo 2's templates skip roles they do not know: checked on the first message of each
role) makes the row a :class:`RowError` naming the template (:attr:`ChatEncoder.source`); the
dataset adds the row.

Truncation keeps the first ``max_length`` tokens (the end is cut). The mask is cut with the
tokens, so the loss covers only the assistant tokens that remain; an example left with no
loss tokens is kept but marked, and the dataset gives it ``sample_mask`` 0.

Images (:mod:`posttrain.data.images`): with a vision-language model's :class:`ImageInputs`,
each image's placeholder is widened to the image's tokens before truncation, which never
keeps part of an image: a cut inside one moves to before it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from posttrain.data.formats import Message, RowError
from posttrain.data.images import ImageInputs, image_parts, message_texts
from posttrain.errors import ConfigError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@attrs.frozen
class Encoded:
    """Token ids and a same-length 0/1 loss mask; ``full_length``: the tokens before truncation."""

    input_ids: list[int]
    token_mask: list[int]
    truncated: bool = False
    full_length: int = attrs.field(default=attrs.Factory(lambda self: len(self.input_ids), takes_self=True))
    num_images: int = 0  # the leading images whose tokens the ids hold (all of them unless truncated)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.token_mask)


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise ConfigError(f"cannot load a tokenizer from '{path}' (policy.tokenizer / policy.model): {exc}") from None


def read_chat_template(value: str) -> str:
    """``data.chat_template``: the template text itself, or a path to a Jinja file."""
    if "{{" in value or "{%" in value:  # a template, however long (no path holds these)
        return value
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ConfigError(f"data.chat_template: no file '{value}'; give a Jinja template file or the template text")


class ChatEncoder:
    """Encode conversations with one tokenizer and chat template. ``source`` says where
    ``chat_template`` came from, for messages (e.g. ``data.chat_template``); without a
    template, the tokenizer's own is used and named by the tokenizer's folder."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None = None, *, source: str | None = None,
        images: ImageInputs | None = None,
    ):
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(
                f"the tokenizer '{getattr(tokenizer, 'name_or_path', '') or '?'}' has no chat template (its "
                "tokenizer_config.json sets no chat_template and it has no chat_template.jinja); set "
                "data.chat_template to a Jinja template file or the template text"
            )
        self.tokenizer = tokenizer
        self.template = template
        #: A vision-language model's image inputs; None for a text-only model.
        self.images = images
        #: Where the template comes from, as messages name it.
        self.source = (source or "the given chat template") if chat_template else (
            f"the chat template of the tokenizer '{getattr(tokenizer, 'name_or_path', '') or '?'}'"
        )
        self._rendered_roles: set[str] = set()  # roles whose first message was found in a rendering
        self.marks_generation = bool(_GENERATION_TAG.search(template))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ConfigError("the tokenizer has neither a pad token nor an EOS token to pad batches with")
        self.pad_token_id: int = int(pad)

    def encode(
        self, messages: Sequence[Message], *, loss_from: int = 0, max_length: int | None = None,
        tools: Sequence[Any] | None = None, image_grids: Sequence[Sequence[int]] = (),
    ) -> Encoded:
        """Tokenise a whole conversation (with ``tools`` rendered by the template); mask the
        assistant turns at index ``loss_from`` and after. ``image_grids``: the grid of each of the
        conversation's images, in order (:meth:`ImageInputs.grids`).

        ``loss_from`` > 0 leaves earlier assistant turns (part of a preference prompt) unmasked.
        """
        self._check_images(messages)
        self._check_roles(messages, tools)
        if self.marks_generation:
            ids, mask = self._render(messages, assistant_mask=True, tools=tools)
        else:
            ids = self._render(messages, tools=tools)[0]
            mask = self._prefix_mask(messages, ids, tools)
        if loss_from > 0:
            prompt_ids = self._render(messages[:loss_from], add_generation_prompt=True)[0]
            boundary = _common_prefix_length(prompt_ids, ids)
            mask[:boundary] = [0] * boundary
        return self._truncate(ids, mask, max_length, image_grids)

    def encode_prompt(
        self, messages: Sequence[Message], *, max_length: int | None = None,
        image_grids: Sequence[Sequence[int]] = (),
    ) -> Encoded:
        """Tokenise a prompt followed by the generation prompt (the assistant turn header); no
        loss tokens. ``image_grids`` as for :meth:`encode`."""
        self._check_images(messages)
        self._check_roles(messages)
        ids = self._render(messages, add_generation_prompt=True)[0]
        return self._truncate(ids, [0] * len(ids), max_length, image_grids)

    def _check_images(self, messages: Sequence[Message]) -> None:
        """Refuse image parts for a text-only model."""
        if image_parts(messages) and self.images is None:
            name = getattr(self.tokenizer, "name_or_path", "") or "?"
            raise ConfigError(
                f"the row has images, but the model of '{name}' is a text-only model (its config.json has no "
                "vision_config); set policy.model to a vision-language model, or leave the images out of the data"
            )

    def _truncate(
        self, ids: list[int], mask: list[int], max_length: int | None, image_grids: Sequence[Sequence[int]]
    ) -> Encoded:
        """The images' placeholders widened, then :func:`_truncate`, the cut moved to before
        an image it would split."""
        if self.images is None or not image_grids:
            return _truncate(ids, mask, max_length)
        ids, mask, spans = self.images.widen(ids, mask, image_grids)
        if max_length is not None and len(ids) > max_length:
            max_length = next((start for start, end in spans if start < max_length < end), max_length)
        out = _truncate(ids, mask, max_length)
        return attrs.evolve(out, num_images=sum(end <= len(out.input_ids) for _, end in spans))

    def _prefix_mask(self, messages: Sequence[Message], ids: list[int], tools: Sequence[Any] | None = None) -> list[int]:
        """Assistant turn ``i`` spans from the end of ``messages[:i]`` rendered with the
        generation prompt to the end of ``messages[:i + 1]``. That holds only if ``messages[:i]``
        and ``messages[:i + 1]`` render as prefixes of the whole conversation's tokens and the
        generation prompt extends ``messages[:i]``; otherwise this raises :class:`ConfigError`."""
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], tools=tools)[0] if i else []
            through = self._render(messages[: i + 1], tools=tools)[0]
            start = _common_prefix_length(self._render(messages[:i], add_generation_prompt=True, tools=tools)[0], through)
            if ids[: len(before)] != before or ids[: len(through)] != through or start < len(before):
                raise ConfigError(
                    f"the chat template renders the conversation before or through assistant turn {i} "
                    "differently from the same turns inside the whole conversation, so assistant tokens "
                    "cannot be located; set data.chat_template to a template that wraps assistant output "
                    "in {% generation %}...{% endgeneration %}"
                )
            mask[start: len(through)] = [1] * (len(through) - start)
        return mask

    def _check_roles(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> None:
        """On the first message of each role with text: that the template writes its text
        (stripped), else a :class:`RowError` naming the role and the template."""
        new = [m for m in messages if m["role"] not in self._rendered_roles and "".join(message_texts(m)).strip()]
        if not new:
            return
        text = self._apply(messages, tokenize=False, tools=tools)
        for message in new:
            if any(part.strip() not in text for part in message_texts(message)):
                roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
                raise RowError(
                    f"{self.source} does not render the '{message['role']}' message of this conversation (roles: "
                    f"{roles}): its text is missing from what the template writes. Set data.chat_template to a "
                    f"template that renders role '{message['role']}', or leave such messages out of the data"
                )
            self._rendered_roles.add(message["role"])

    def _render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False, assistant_mask: bool = False,
        tools: Sequence[Any] | None = None,
    ) -> tuple[list[int], list[int]]:
        out = self._apply(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                          assistant_mask=assistant_mask, tools=tools)
        ids = [int(t) for t in out["input_ids"]]
        return ids, [int(m) for m in out["assistant_masks"]] if assistant_mask else []

    def _apply(
        self, messages: Sequence[Message], *, tokenize: bool, add_generation_prompt: bool = False,
        assistant_mask: bool = False, tools: Sequence[Any] | None = None,
    ) -> Any:
        """``apply_chat_template`` with this encoder's template; a template error is a :class:`RowError`."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                chat_template=self.template,
                tokenize=tokenize,
                return_dict=tokenize,
                add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=assistant_mask,
                tools=list(tools) if tools else None,
            )
        except TemplateError as exc:  # a syntax error, or the template's own raise_exception()
            roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
            raise RowError(
                f"{self.source} cannot render this conversation (roles: {roles}): {type(exc).__name__}: {exc}. "
                "Set data.chat_template to a template that renders these roles, or change the rows"
            ) from None


def _truncate(ids: list[int], mask: list[int], max_length: int | None) -> Encoded:
    if max_length is not None and len(ids) > max_length:
        return Encoded(ids[:max_length], mask[:max_length], truncated=True, full_length=len(ids))
    return Encoded(ids, mask)


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
