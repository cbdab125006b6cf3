"""Stop strings for the ``hf`` backend: does a row's generated text now contain one?

Matching follows vLLM, so both backends stop at the same token: the generated tokens are
decoded with special tokens skipped, a stop string counts once it appears anywhere in that
text, and the row ends with the token that completed it. Text before the first generated
token (the prompt) is not searched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopStringMatcher:
    """Checks the tail of a row's generated tokens for stop strings.

    Only the last ``2 * len(longest stop string) + 8`` tokens are decoded at each step: an
    occurrence completed by the newest token lies within them, since every token that is
    not a special token decodes to at least one character (and an earlier occurrence would
    have stopped the row at an earlier step).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def hit(self, token_ids: Sequence[int], stop_strings: Sequence[str]) -> bool:
        if not stop_strings:
            return False
        window = 2 * max(len(s) for s in stop_strings) + 8
        text = self.tokenizer.decode(list(token_ids[-window:]), skip_special_tokens=True)
        return any(s in text for s in stop_strings)
