"""The rollout loop: conversations between a generation backend and environments.

One function, :func:`run_rollout`, for single- and multi-turn tasks. Each sample starts
from its prompt messages, rendered with the chat template and the generation prompt (and
with its environment's tools, :meth:`~posttrain.interfaces.Environment.tool_schemas`,
rendered by the template's own tool support: every render of the sample's conversation
gets them, so tool calls and ``tool`` observations extend the sequence like any turn). Then,
for at most ``max_turns`` turns, for the samples still active:

1. generate one assistant turn each (with the stop strings their environment asked for);
2. decode the new tokens and append the assistant message (with its ``token_ids``);
3. call each task's environment once, on all its samples of this turn
   (failures contained: :func:`posttrain.run.environments.step_contained`; a sample the
   environment could not score is *failed*: its episode ends there, and the batch marks it);
4. add the step's reward; a sample stops when the environment terminates it, when the
   turn budget is spent, or when no room is left under ``max_total_length``;
5. otherwise append the observation message, rendered with the template's formatting for
   its role followed by the generation prompt, and go on.

Token sequence. A sample's ``input_ids`` are exactly the tokens the model was given and
generated, in order: the prompt; each turn's generated tokens; between turns, the
end-of-turn tokens the template writes after an assistant message that the model did not
generate itself (e.g. after a stop string), the observation, and the next generation
prompt. So for a template that renders a conversation's prefixes as prefixes of the whole,
``input_ids`` equal the template's tokenisation of the final message log, except that a
last assistant turn ended by a length limit or a stop string lacks its end-of-turn tokens.
An empty observation on a sample the environment did not terminate adds no message, only
the turn boundary, and the model starts a new assistant turn.

Lengths. No sequence exceeds ``max_total_length`` tokens: generated tokens past it are cut,
and a sample whose observation would leave no room to generate stops before it.
``truncated`` says the sample ended cut: its last assistant turn was stopped by a length
limit (``max_total_length`` or the backend's ``max_new_tokens``), or it stopped for lack of
room. The environment scores a cut turn like any other, and a multi-turn conversation
goes on after a turn cut by ``max_new_tokens`` if the environment continues it.

Rewards are the sum of the environment's rewards over a sample's turns; so is each named
part an environment reports (``EnvironmentReturn.reward_components``), 0 for a sample none
of its steps reported it for.

Failed samples. A failed sample keeps reward 0 in ``rewards`` only as a placeholder: the
batch marks it in ``failed``, the rollout's reward metrics and the environments' ``metrics()``
leave it out, and an algorithm that learns from rewards must leave it out of its loss (GRPO
sets its ``sample_mask`` to 0 and computes its group's baseline without it). Each failed
sample is logged with its data row (the samples' ``origin``). When more than
``environments.<name>.max_failed_fraction`` of a rollout's samples of an environment failed,
the rollout raises :class:`~posttrain.run.environments.EnvironmentFailed`.

Images. Samples of a vision-language model's image prompts carry their images
(:data:`~posttrain.data.images.IMAGE_FIELDS`): the prompt's image placeholders are widened to
each image's tokens (:class:`~posttrain.data.images.ImageInputs`), every ``generate`` call gets
the images of its rows, and the training batch keeps them. Observations are text.

Weight versions. When the generation backend reports which weights generated each row
(``weight_versions``), every generated token keeps that version (a conversation's turns may
come from different versions when weights change between turns).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from posttrain.backend.routing import NO_ROUTE, padded_routes
from posttrain.batch import Batch, padded_tensor
from posttrain.data.images import ENCODED_IMAGES, ImageInputs, image_fields, sample_images
from posttrain.errors import ConfigError
from posttrain.interfaces import Environment, EnvironmentReturn, Generation, Message
from posttrain.interfaces.generation import ROUTES_FIELD
from posttrain.run.environments import check_failures, core_options, metrics_contained, step_contained
from posttrain.run.metrics import StageTimer

#: The batch field of an environment's named reward part ``name`` is ``reward/<name>``.
REWARD_COMPONENT_PREFIX = "reward/"


def run_rollout(
    samples: Mapping[str, Sequence[Any]],
    generation: Generation,
    environments: Mapping[str, Environment],
    tokenizer: Any,
    *,
    max_total_length: int,
    max_turns: int = 1,
    greedy: bool = False,
    chat_template: str | None = None,
    images: ImageInputs | None = None,
) -> tuple[Batch, dict[str, float]]:
    """Roll out every sample; return the training batch and the rollout metrics.

    ``samples`` (e.g. a prompt :class:`Batch` from the data loader) holds per-sample lists:
    ``messages`` (the prompt message log), ``task`` (the environment's name) and
    ``metadata`` (a dict for the environment); an optional ``answer`` list is put into each
    sample's metadata under ``"answer"`` unless the metadata has one; an optional ``origin``
    list names each sample's data row for messages (e.g. ``train.jsonl row 3``); with a
    vision-language model's ``images``, the image fields hold each sample's images.
    ``chat_template`` overrides the tokenizer's.

    The batch (B samples, S = the longest sequence) holds ``input_ids`` int64 [B, S]
    (right-padded with the pad id), ``input_lengths``, ``prompt_lengths``,
    ``response_lengths`` (generated tokens) and ``turns`` int64 [B], ``token_mask`` float32
    [B, S] (1 exactly on generated tokens), ``generation_logprobs`` float32 [B, S] (the
    generation backend's logprob of token t at position t, 0 elsewhere), ``rewards``
    float32 [B], ``truncated`` bool [B], ``failed`` bool [B] (the environment could not score
    the sample: see the module docstring), ``sample_mask`` float32 [B] (ones), and the lists
    ``messages`` (final message logs; added messages carry ``token_ids``), ``metadata``
    (the environments' final per-sample metadata), ``answers`` (the answer the environment
    extracted at the last step, ``EnvironmentReturn.answers``, or None) and ``task``; when every ``generate`` call
    reported ``weight_versions``, ``generation_versions`` int64 [B, S] (the version of the
    weights that generated token t at position t, -1 on tokens not generated); when the
    generation reported them, ``routed_experts`` int16 [B, S, layers, k] (the experts token t
    went through in the engine's last forward over it, -1 where it ran none); for each reward
    part ``name`` an environment reported, ``reward/<name>`` float32 [B]; for image samples,
    the image fields.

    Metrics: ``rollout/mean_turns``, ``rollout/mean_generated_tokens`` (per sample),
    ``rollout/generated_tokens`` (total), ``rollout/mean_generated_tokens_per_turn``,
    ``rollout/truncation_rate``,
    ``rollout/mean_reward`` (over the samples not failed), ``rollout/mean_sequence_length``,
    and per environment ``env/<name>/<metric>`` from its ``metrics()`` (over its samples not
    failed) plus ``env/<name>/errors`` and ``env/<name>/timeouts`` (samples failed) and
    ``env/<name>/retried`` (samples sent again), see :mod:`posttrain.run.environments`; for samples
    of a data mixture (a ``source`` field), per source ``data/<tag>/...`` (:func:`source_metrics`);
    ``timing/generation`` and ``timing/environment``: seconds spent in ``generate`` calls and in
    environment steps, over every turn (the rest of a rollout's time is the driver's own work).
    """
    if max_turns < 1:
        raise ConfigError(f"max_turns must be at least 1, got {max_turns}")
    chat = ChatFormat(tokenizer, chat_template, images)
    conversations = _start_conversations(samples, environments, chat, max_total_length)
    errors: dict[str, int] = defaultdict(int)
    timeouts: dict[str, int] = defaultdict(int)
    retried: dict[str, int] = defaultdict(int)
    versions_known = True
    timer = StageTimer("generation", "environment")

    for turn in range(1, max_turns + 1):
        active = [c for c in conversations if not c.done]
        if not active:
            break
        with timer("generation"):
            outputs = generation.generate(generation_batch(active, chat.pad_token_id, chat.images), greedy=greedy)
        versions_known = versions_known and "weight_versions" in outputs
        for row, conversation in enumerate(active):
            conversation.add_assistant_turn(outputs, row, chat, max_total_length)

        for task, indices in _by_task(active).items():
            group = [active[i] for i in indices]
            env = environments[task]
            with timer("environment"):
                step = step_contained(task, env, [c.messages for c in group], [c.metadata for c in group],
                                      call_retries=core_options(env).call_retries)
            errors[task] += step.errors
            timeouts[task] += step.timeouts
            retried[task] += step.retried
            for k, conversation in enumerate(group):
                conversation.add_environment_step(step.result, k, chat, max_total_length, last_turn=turn == max_turns)

    batch = training_batch(conversations, chat.pad_token_id, with_versions=versions_known)
    if images is not None:
        batch.update(image_columns(conversations, images.fields))
    metrics = rollout_metrics(batch)
    for task, indices in _by_task(conversations).items():
        failures = [(c.origin, c.failed) for c in (conversations[i] for i in indices) if c.failed is not None]
        check_failures(task, core_options(environments[task]), failures, len(indices))
        scored = [i for i in indices if conversations[i].failed is None]
        if scored:
            final_metadata = [conversations[i].metadata for i in scored]
            env_metrics = metrics_contained(task, environments[task], batch["rewards"][scored], final_metadata)
            metrics.update({f"env/{task}/{name}": value for name, value in env_metrics.items()})
        metrics[f"env/{task}/errors"] = float(errors[task])
        metrics[f"env/{task}/timeouts"] = float(timeouts[task])
        metrics[f"env/{task}/retried"] = float(retried[task])
    metrics.update(source_metrics(conversations, batch))
    metrics.update(timer.metrics())
    return batch, metrics


# ----------------------------------------------------------------------------- chat format


_PROBE = "\u2063posttrain-probe\u2063"  # text no real message contains


class ChatFormat:
    """Token ids of a conversation as the chat template formats it."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, images: ImageInputs | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.images = images
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ConfigError("the tokenizer has neither a pad token nor an EOS token to pad batches with")
        self.pad_token_id = int(pad)
        probe = self.render([{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}], generation_prompt=False)
        #: What the template writes after an assistant message's content (e.g. ``<|im_end|>\n``).
        self.end_of_turn = self.encode(probe[probe.rindex(_PROBE) + len(_PROBE):])

    def render(self, messages: Sequence[Message], *, generation_prompt: bool, tools: Sequence[Any] | None = None) -> str:
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.tokenizer.apply_chat_template(
            plain, chat_template=self.chat_template, tokenize=False, add_generation_prompt=generation_prompt,
            tools=list(tools) if tools else None,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> list[int]:
        return self.encode(self.render(messages, generation_prompt=True, tools=tools))

    def widen_images(self, token_ids: list[int], grids: torch.Tensor) -> list[int]:
        """``token_ids`` with each image placeholder widened to the tokens of its image (its
        family's ``grids`` [images, 3], in order)."""
        if self.images is None or not len(grids):
            return token_ids
        return self.images.widen(token_ids, [0] * len(token_ids), grids.tolist())[0]

    def bridge_ids(
        self, messages: Sequence[Message], generated: Sequence[int], observations: Sequence[Message],
        tools: Sequence[Any] | None = None,
    ) -> list[int]:
        """The tokens between an assistant turn's generated tokens (``messages`` ends with
        that turn) and the next generation: the end-of-turn tokens the model did not
        generate, then the ``observations`` (none, one, or several such as tool replies) as
        the template formats them, then the generation prompt."""
        before = self.render(messages, generation_prompt=False, tools=tools)
        after = self.render([*messages, *observations], generation_prompt=True, tools=tools)
        if not after.startswith(before):
            raise ConfigError(
                "the chat template renders a conversation differently once a message is added to it "
                "(e.g. it drops earlier reasoning), so multi-turn rollouts cannot extend the token sequence; "
                "set data.chat_template to a template that renders prefixes as prefixes"
            )
        return self._missing_end_of_turn(generated) + self.encode(after[len(before):])

    def _missing_end_of_turn(self, generated: Sequence[int]) -> list[int]:
        end = self.end_of_turn
        for k in range(len(end), 0, -1):  # the longest start of `end` that the generation ends with
            if list(generated[-k:]) == end[:k]:
                return end[k:]
        return list(end)


# ----------------------------------------------------------------------------- conversations


@attrs.define(eq=False)
class Conversation:
    """One sample's rollout state; ``token_ids``, ``logprobs``, ``mask`` and ``versions`` run
    in parallel."""

    messages: list[Message]
    task: str
    metadata: Any
    token_ids: list[int]
    prompt_length: int
    tools: list[Any] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(init=False)
    mask: list[float] = attrs.field(init=False)
    versions: list[int] = attrs.field(init=False)
    #: int16 [len(token_ids), layers, k]: the experts each token went through in the engine (-1 on
    #: tokens it did not run), when the generation reports them (``routed_experts``)
    routes: torch.Tensor | None = None
    #: The prompt's images as the model takes them: pixel values and its family's grids [images, 3]
    #: (:data:`~posttrain.data.images.IMAGE_FIELDS`); None for text samples.
    images: tuple[torch.Tensor, torch.Tensor] | None = None
    #: The same images as encoded files (:data:`~posttrain.data.images.ENCODED_IMAGES`), when the
    #: prompts carried them; None otherwise.
    encoded_images: list[bytes] | None = None
    stop_strings: list[str] | None = None
    answer: str | None = None
    reward: float = 0.0
    reward_components: dict[str, float] = attrs.field(factory=dict)
    turns: int = 0
    done: bool = False
    truncated: bool = False
    failed: str | None = None  # why the environment could not score the sample; None: scored
    origin: str | None = None  # the sample's data row, for messages
    source: str | None = None  # the tag of the mixture source it came from (data.train as a list); None otherwise

    def __attrs_post_init__(self) -> None:  # the prompt: no logprobs, no loss
        self.logprobs = [0.0] * len(self.token_ids)
        self.mask = [0.0] * len(self.token_ids)
        self.versions = [-1] * len(self.token_ids)

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None, version: int = -1) -> None:
        """Append tokens: generated ones with their logprobs (mask 1) and the version of the
        weights that generated them, others without (mask 0, version -1)."""
        generated = logprobs is not None
        self.token_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend([float(x) for x in logprobs] if generated else [0.0] * len(token_ids))
        self.mask.extend([float(generated)] * len(token_ids))
        self.versions.extend([version if generated else -1] * len(token_ids))
        if self.routes is not None:
            self.routes = torch.cat([self.routes, self.routes.new_full((len(token_ids), *self.routes.shape[1:]), NO_ROUTE)])

    def add_assistant_turn(self, outputs: Batch, row: int, chat: ChatFormat, max_total_length: int) -> None:
        start = len(self.token_ids)
        end = start + int(outputs["generation_lengths"][row])
        generated = outputs["output_ids"][row, start:end].tolist()
        logprobs = outputs["logprobs"][row, start:end].tolist()
        room = max_total_length - start
        self.truncated = bool(outputs["truncated"][row]) or len(generated) > room
        generated, logprobs = generated[:room], logprobs[:room]
        version = int(outputs["weight_versions"][row]) if "weight_versions" in outputs else -1
        self.extend(generated, logprobs, version)
        if ROUTES_FIELD in outputs:  # the engine ran every token before the last it generated
            self.routes = outputs[ROUTES_FIELD][row, :len(self.token_ids)].clone()
        self.messages.append({"role": "assistant", "content": chat.decode(generated), "token_ids": generated})
        self.turns += 1

    def add_environment_step(self, result: EnvironmentReturn, k: int, chat: ChatFormat, max_total_length: int, *, last_turn: bool) -> None:
        """Add the result of sample ``k`` of a contained step (its ``errors`` hold one entry
        per sample): a failed sample records why and ends."""
        self.failed = result.errors[k] if result.errors else None
        self.reward += float(result.rewards[k])
        for name, values in result.reward_components.items():
            self.reward_components[name] = self.reward_components.get(name, 0.0) + float(values[k])
        self.metadata = result.metadata[k]
        self.answer = result.answers[k] if result.answers else None
        self.stop_strings = result.next_stop_strings[k]
        if bool(result.terminateds[k]) or last_turn or self.failed is not None:
            self.done = True
            return
        observation = result.observations[k]
        new = [{"role": observation["role"], "content": observation["content"]}] if observation.get("content") else []
        if not self.add_messages(new, chat, max_total_length):
            self.done = self.truncated = True

    def add_messages(self, messages: Sequence[Message], chat: ChatFormat, max_total_length: int) -> bool:
        """After an assistant turn, append ``messages`` (none: the model starts a new
        assistant turn) and the tokens that lead to the next generation (the last message
        keeps them as its ``token_ids``). False, changing nothing, when no room would be
        left under ``max_total_length`` to generate a token."""
        bridge = chat.bridge_ids(self.messages, self.messages[-1]["token_ids"], messages, self.tools)
        if len(self.token_ids) + len(bridge) >= max_total_length:
            return False
        self.extend(bridge)
        for i, message in enumerate(messages):
            last = i == len(messages) - 1
            self.messages.append({**message, "token_ids": bridge if last else []})
        return True


def _start_conversations(
    samples: Mapping[str, Sequence[Any]], environments: Mapping[str, Environment], chat: ChatFormat, max_total_length: int
) -> list[Conversation]:
    messages, tasks = samples["messages"], samples["task"]
    metadata = samples["metadata"] if "metadata" in samples else [{} for _ in messages]
    answers = samples["answer"] if "answer" in samples else [None] * len(messages)
    origins = samples["origin"] if "origin" in samples else [f"sample {i}" for i in range(len(messages))]
    sources = samples["source"] if "source" in samples else [None] * len(messages)
    images = [sample_images(samples, i) for i in range(len(messages))] if image_fields(samples) else None
    encoded = samples[ENCODED_IMAGES] if ENCODED_IMAGES in samples else [None] * len(messages)
    conversations = []
    tools_of: dict[str, list[Any]] = {}
    prompt_ids: dict[tuple[Any, ...], list[int]] = {}  # a prompt repeated for its group is encoded once
    for i, (prompt, task, meta, answer, origin, source) in enumerate(
            zip(messages, tasks, metadata, answers, origins, sources, strict=True)):
        if task not in environments:
            raise ConfigError(
                f"sample {i} has task {task!r}, but no environment of that name was started; "
                f"started: {', '.join(sorted(environments)) or 'none'}. Set 'task' in the data to one of them"
            )
        if answer is not None and isinstance(meta, Mapping) and "answer" not in meta:
            meta = {**meta, "answer": answer}
        if task not in tools_of:
            tools_of[task] = list(environments[task].tool_schemas())
        key = (task, *((m["role"], json.dumps(m["content"])) for m in prompt))  # what the rendering reads
        if key not in prompt_ids:
            prompt_ids[key] = chat.prompt_ids(prompt, tools_of[task])
        token_ids = list(prompt_ids[key])
        own = images[i] if images is not None and len(images[i][1]) else None
        # a prompt whose images the data's length limit cut: fewer images than placeholders
        cut = chat.images is not None and token_ids.count(chat.images.placeholder_id) != (len(own[1]) if own else 0)
        if own is not None and not cut:
            token_ids = chat.widen_images(token_ids, own[1])
        conversation = Conversation([dict(m) for m in prompt], task, meta, token_ids, prompt_length=len(token_ids),
                                     tools=tools_of[task], origin=origin, source=source, images=None if cut else own,
                                     encoded_images=None if cut or own is None else encoded[i])
        if cut or len(token_ids) >= max_total_length:  # no room to generate anything (a cut prompt: longer still)
            conversation.done = conversation.truncated = True
        conversations.append(conversation)
    return conversations


def source_metrics(conversations: Sequence[Conversation], batch: Batch) -> dict[str, float]:
    """Per mixture source (samples that came with a ``source``): ``data/<tag>/samples``, and over
    its samples ``data/<tag>/mean_reward`` (those scored), ``data/<tag>/mean_generated_tokens``
    and ``data/<tag>/truncation_rate``."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, conversation in enumerate(conversations):
        if conversation.source is not None:
            groups[conversation.source].append(i)
    metrics: dict[str, float] = {}
    for tag, indices in sorted(groups.items()):
        scored = [i for i in indices if conversations[i].failed is None]
        metrics[f"data/{tag}/samples"] = float(len(indices))
        metrics[f"data/{tag}/mean_reward"] = float(batch["rewards"][scored].mean()) if scored else 0.0
        metrics[f"data/{tag}/mean_generated_tokens"] = float(batch["response_lengths"][indices].float().mean())
        metrics[f"data/{tag}/truncation_rate"] = float(batch["truncated"][indices].float().mean())
    return metrics


def _by_task(conversations: Sequence[Conversation]) -> dict[str, list[int]]:
    """Indices into ``conversations`` by task, in order."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, conversation in enumerate(conversations):
        groups[conversation.task].append(i)
    return dict(groups)


def generation_batch(active: Sequence[Conversation], pad_token_id: int, images: ImageInputs | None = None) -> Batch:
    """The input of one ``generate`` call: each conversation's tokens so far, its stop strings
    and, for a vision-language model's ``images`` when a conversation has some, its images."""
    batch = Batch(
        input_ids=padded_tensor([c.token_ids for c in active], pad_token_id, torch.long),
        input_lengths=torch.tensor([len(c.token_ids) for c in active], dtype=torch.long),
    )
    if any(c.stop_strings for c in active):
        batch["stop_strings"] = [c.stop_strings for c in active]
    if images is not None and any(c.images is not None for c in active):
        batch.update(image_columns(active, images.fields))
        if any(c.encoded_images is not None for c in active):
            batch[ENCODED_IMAGES] = [c.encoded_images or [] for c in active]
    return batch


def image_columns(conversations: Sequence[Conversation], fields: tuple[str, str]) -> dict[str, list[torch.Tensor]]:
    """The image ``fields`` (pixel values, the family's grids) of ``conversations``, empty for
    a text conversation."""
    features = next((c.images[0].shape[1] for c in conversations if c.images is not None), 0)
    empty = (torch.zeros(0, features), torch.zeros(0, 3, dtype=torch.long))
    own = [c.images if c.images is not None else empty for c in conversations]
    return {fields[0]: [pixels for pixels, _ in own], fields[1]: [grid for _, grid in own]}


def training_batch(conversations: Sequence[Conversation], pad_token_id: int, *, with_versions: bool) -> Batch:
    """The batch of :func:`run_rollout`'s docstring; ``generation_versions`` only
    ``with_versions`` (every generation reported the versions of its weights)."""
    lengths = [len(c.token_ids) for c in conversations]
    batch = Batch(
        input_ids=padded_tensor([c.token_ids for c in conversations], pad_token_id, torch.long),
        input_lengths=torch.tensor(lengths, dtype=torch.long),
        prompt_lengths=torch.tensor([c.prompt_length for c in conversations], dtype=torch.long),
        response_lengths=torch.tensor([int(sum(c.mask)) for c in conversations], dtype=torch.long),
        token_mask=padded_tensor([c.mask for c in conversations], 0.0, torch.float32),
        generation_logprobs=padded_tensor([c.logprobs for c in conversations], 0.0, torch.float32),
        rewards=torch.tensor([c.reward for c in conversations], dtype=torch.float32),
        truncated=torch.tensor([c.truncated for c in conversations], dtype=torch.bool),
        failed=torch.tensor([c.failed is not None for c in conversations], dtype=torch.bool),
        turns=torch.tensor([c.turns for c in conversations], dtype=torch.long),
        sample_mask=torch.ones(len(conversations), dtype=torch.float32),
        messages=[c.messages for c in conversations],
        metadata=[c.metadata for c in conversations],
        answers=[c.answer for c in conversations],
        task=[c.task for c in conversations],
    )
    if with_versions:
        batch["generation_versions"] = padded_tensor([c.versions for c in conversations], -1, torch.long)
    if any(c.routes is not None for c in conversations):
        batch[ROUTES_FIELD] = padded_routes([c.routes for c in conversations], max(lengths))
    for name in sorted({name for c in conversations for name in c.reward_components}):
        batch[f"{REWARD_COMPONENT_PREFIX}{name}"] = torch.tensor(
            [c.reward_components.get(name, 0.0) for c in conversations], dtype=torch.float32
        )
    return batch


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """The ``rollout/*`` metrics of a training batch (see :func:`run_rollout`)."""
    generated = batch["response_lengths"].float()
    scored = batch["rewards"][~batch["failed"]]
    return {
        "rollout/mean_turns": float(batch["turns"].float().mean()),
        "rollout/mean_generated_tokens": float(generated.mean()),
        "rollout/generated_tokens": float(generated.sum()),
        "rollout/mean_generated_tokens_per_turn": float(generated.sum() / batch["turns"].sum().clamp(min=1)),
        "rollout/truncation_rate": float(batch["truncated"].float().mean()),
        "rollout/mean_reward": float(scored.mean()) if scored.numel() else 0.0,
        "rollout/mean_sequence_length": float(batch["input_lengths"].float().mean()),
    }
