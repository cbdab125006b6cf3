"""The options of the ``judge`` environment (``environments.judge``). Torch-free: the plugin
module imports this at entry-point load."""

from __future__ import annotations

from typing import Literal

import attrs

from posttrain.config.environments import above, at_least

#: The judge prompt when ``prompt`` is unset: the question, the reference and the response.
DEFAULT_PROMPT = (
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
    "Is the response correct? Answer yes or no."
)
#: The fields a prompt template may name.
PROMPT_FIELDS = ("question", "response", "reference")


@attrs.frozen
class JudgeOptions:
    """Options of the ``judge`` environment (``environments.judge``). Set exactly one of
    ``model`` and ``url``."""

    model: str | None = None  # a Hugging Face causal-LM folder, run in the environment's own process (greedy, float32)
    # an OpenAI-compatible API's base URL (e.g. http://judge:8000/v1), asked through /chat/completions
    url: str | None = None
    served_model: str = "judge"  # the model name sent to the endpoint
    api_key_var: str | None = None  # the environment variable holding the endpoint's API key; None: no key
    # the judge's prompt; {question} (the first user message), {response} (the last assistant message) and
    # {reference} (the row's answer, '' when it has none) are filled in
    prompt: str = DEFAULT_PROMPT
    # how the judge's reply becomes a reward: number (the first number in it, divided by max_score, kept in
    # [0, 1]), label (the labels' value of the first label word in it), token_probability (the probability of
    # each label as the reply's first token, normalised over the labels, times its value; model or an endpoint
    # that returns top_logprobs)
    verdict: Literal["number", "label", "token_probability"] = "label"
    labels: dict[str, float] = attrs.field(factory=lambda: {"yes": 1.0, "no": 0.0})  # verdict words and their rewards
    max_score: float = attrs.field(default=1.0, validator=above(0))  # number verdicts: the score that means reward 1
    max_new_tokens: int = attrs.field(default=16, validator=above(0))  # tokens the judge may reply with
    batch_size: int = attrs.field(default=8, validator=above(0))  # prompts per forward pass (model) or requests at once (url)
    timeout_s: float = attrs.field(default=60.0, validator=above(0))  # seconds an endpoint request may take
    retries: int = attrs.field(default=2, validator=at_least(0))  # times a failed or timed-out request is sent again
    cache: bool = True  # a prompt judged once is not judged again (the verdicts of this process)

    def __attrs_post_init__(self) -> None:
        if (self.model is None) == (self.url is None):
            found = "both" if self.model is not None else "neither"
            raise ValueError(f"set exactly one of model (a local model folder) and url (an OpenAI-compatible "
                             f"endpoint), found {found}")
        if self.verdict != "number" and not self.labels:
            raise ValueError(f"verdict {self.verdict} needs at least one label (labels: {{yes: 1.0, no: 0.0}})")
        unknown = sorted(_template_fields(self.prompt) - set(PROMPT_FIELDS))
        if unknown:
            raise ValueError(f"prompt names {', '.join('{' + f + '}' for f in unknown)}; a judge prompt may name "
                             f"{', '.join('{' + f + '}' for f in PROMPT_FIELDS)} (write {{{{ and }}}} for braces)")


def _template_fields(template: str) -> set[str]:
    import string

    try:
        return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as error:
        raise ValueError(f"prompt is not a valid template: {error} (write {{{{ and }}}} for braces)") from None
