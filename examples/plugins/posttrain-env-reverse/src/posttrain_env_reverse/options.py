"""Options of the ``reverse`` environment (the mapping under ``environments.reverse``).
Imports nothing heavy: the plugin module declares them on its factory at entry-point load."""

from __future__ import annotations

import attrs


@attrs.frozen
class ReverseOptions:
    """Options of the ``reverse`` environment (``environments.reverse``)."""

    ignore_case: bool = False  # compare the answer with the reversed text without regard to case
