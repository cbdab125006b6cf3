"""Rows too long to train on, found while the data is read: a run where most cannot train is
refused before Ray starts; a few are reported.

A row cannot train when the length limit leaves it no loss token: an SFT conversation or a
preference pair cut before its first assistant token, a prompt with no room after it for
the response (the dataset's ``sample_mask`` 0, counted in ``LoadReport.num_without_loss``).
Such a run would log loss 0 (or generate nothing) and exit 0, having learned nothing. The
limit is ``data.max_length``, else ``policy.max_total_sequence_length``; the messages say
which keys to set, and to what, for every row to fit.
"""

from __future__ import annotations

from posttrain.config.schema import RunConfig
from posttrain.config.validate import where_set
from posttrain.data.dataset import LoadReport
from posttrain.errors import DataError
from posttrain.log import get_logger

#: A run is refused when more than this share of a split's rows cannot train.
MAX_UNTRAINABLE_SHARE = 0.5


def check_lengths(config: RunConfig, split: str, kind: str, report: LoadReport) -> None:
    """Raise :class:`DataError` when more than half of ``report``'s examples cannot train
    (see the module docstring); warn when some cannot."""
    if not report.num_without_loss:
        return
    message = untrainable_message(config, split, kind, report)
    if report.num_without_loss > MAX_UNTRAINABLE_SHARE * report.num_examples:
        raise DataError(message)
    get_logger(__name__).warning("some rows cannot train", detail=message)


def untrainable_message(config: RunConfig, split: str, kind: str, report: LoadReport) -> str:
    """What is wrong with the rows that cannot train, and the settings that make them fit."""
    key = report.key or f"data.{split}"
    data_limit, total = config.data.max_length, config.policy.max_total_sequence_length
    limit_key, limit = ("data.max_length", data_limit) if data_limit else ("policy.max_total_sequence_length", total)
    longest = report.longest_without_loss
    count = f"{report.num_without_loss} of {report.num_examples}"
    rows = {"prompt": "prompts", "preference": "pairs"}.get(kind, "rows")
    if longest <= limit:  # not cut: nothing to learn from in the row itself
        return (f"{key} ({report.source}): {count} {rows} have no token to learn from (no assistant token, even "
                f"uncut). Fix or remove those {rows}.")
    settings: dict[str, int] = {}
    if kind == "prompt":
        what = (f"{count} prompts are longer than {limit_key}={limit} tokens (the longest has {longest}), leaving no "
                "room to generate a response: the run would learn nothing from them")
        if data_limit:
            settings["data.max_length"] = longest
        if longest >= total:  # room for a whole response after the longest prompt
            settings["policy.max_total_sequence_length"] = longest + config.generation.max_new_tokens
    else:
        what = (f"{count} {rows} have no token left to learn from once cut to {limit_key}={limit} tokens (the "
                f"longest has {longest}): the run would train on them at loss 0")
        if data_limit:
            settings["data.max_length"] = longest
        if longest > total:
            settings["policy.max_total_sequence_length"] = longest
    fix = " and ".join(f"{name}: {value}" for name, value in settings.items())
    return (f"{key} ({report.source}): {what}. Set {fix} (memory grows with it), or shorten or remove those "
            f"{rows}.{where_set(config, *settings)}")
