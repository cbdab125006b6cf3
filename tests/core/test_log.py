"""Event logging writes to the stderr of the moment, and as JSON to the events file."""

from __future__ import annotations

import io
import json
import re
import sys

from posttrain.log import configure_logging, get_logger


def test_events_go_to_the_current_stderr_and_the_events_file(tmp_path, monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info", tmp_path / "events.jsonl")
    try:
        first.close()  # the stream logging was configured with is gone
        monkeypatch.setattr(sys, "stderr", second)
        get_logger().info("checkpoint saved", step=3)
        get_logger().debug("not shown")
    finally:
        configure_logging("info")  # close the events file
    assert "checkpoint saved" in second.getvalue() and "not shown" not in second.getvalue()
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (event["event"], event["step"], event["level"]) == ("checkpoint saved", 3, "info")


def render(stream_text: str) -> list[str]:
    """The lines a terminal shows for ``stream_text``: a carriage return goes back to the
    line's start and what follows overwrites it; trailing blanks are not shown."""
    lines, line, column = [], [], 0
    for char in stream_text:
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("".join(line).rstrip())
            line, column = [], 0
        else:
            line[column:column + 1] = [char]
            column += 1
    return [*lines, "".join(line).rstrip()]


def test_a_record_written_during_a_progress_bar_goes_above_it(monkeypatch):
    from tqdm.auto import tqdm

    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    configure_logging("info")
    bar = tqdm(total=4, desc="GRPO", unit="step", bar_format="{desc}: {n_fmt}/{total_fmt} {unit}", mininterval=0)
    bar.update(1)
    get_logger().info("checkpoint saved", step=1)
    bar.update(1)
    bar.close()
    screen = [re.sub(r"^\d{4}-\d\d-\d\dT[\d:.]+Z ", "", line) for line in render(terminal.getvalue())]
    assert screen == [
        "[info     ] checkpoint saved               step=1",
        "GRPO: 2/4 step",
        "",
    ]


def test_libraries_are_quiet_below_debug_and_a_variable_already_set_is_kept(monkeypatch):
    import logging

    from posttrain.log import QUIET_LIBRARY_ENV, configured_level, library_env, library_log_level

    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    assert [library_log_level(level) for level in ("debug", "info", "warning", "error")] == [
        logging.INFO, logging.ERROR, logging.ERROR, logging.ERROR
    ]
    assert library_env("info") == {k: v for k, v in QUIET_LIBRARY_ENV.items() if k != "TRANSFORMERS_VERBOSITY"}
    assert library_env("info")["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert library_env("debug") == {}
    configure_logging("debug")
    try:
        assert configured_level() == "debug" and library_env() == {}
    finally:
        configure_logging("info")
    assert library_log_level() == logging.ERROR


def _shown(module: str) -> list[str]:
    """The warnings a call site in ``module`` would show under the filters in force."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit("an optional part is not installed", UserWarning, f"{module}.py", 1, module=module)
    return [str(w.message) for w in caught]


def test_a_library_s_warnings_are_hidden_below_debug_in_the_driver_and_in_workers(monkeypatch):
    """megatron-core warns at import that Transformer Engine and Apex are missing: below debug
    a run hides the warnings of such a package (and its submodules only), in the driver by
    its configured level and in a worker process by library_env's variable."""
    import warnings

    import posttrain.log as log

    for driver_level, worker_variable, hidden in [("info", None, True), ("debug", None, False),
                                                  (None, "1", True), (None, None, False)]:
        monkeypatch.setattr(log, "_CONFIGURED", driver_level is not None)
        monkeypatch.setattr(log, "_LEVEL", driver_level or "info")
        if worker_variable is None:
            monkeypatch.delenv("POSTTRAIN_QUIET_LIBRARIES", raising=False)
        else:
            monkeypatch.setenv("POSTTRAIN_QUIET_LIBRARIES", worker_variable)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            log.quiet_library_warnings("megatron")
            assert _shown("megatron.core.optimizer") == ([] if hidden else ["an optional part is not installed"])
            assert _shown("megatron") == _shown("megatron.core.optimizer")
            assert _shown("megatronic") == ["an optional part is not installed"]  # another package
    assert log.QUIET_LIBRARY_ENV["POSTTRAIN_QUIET_LIBRARIES"] == "1"  # what a worker below debug is started with
