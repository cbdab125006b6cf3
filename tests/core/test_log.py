"""Event logging writes to the stderr of the moment, and as JSON to the events file."""

from __future__ import annotations

import io
import json
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
