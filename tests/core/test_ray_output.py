"""What the driver shows of the lines Ray forwards: a node process's repeated error once, as a
posttrain event, below debug; the workers' output and a crash's trace as Ray prints them."""

from __future__ import annotations

import io
import json
import sys

import structlog

from posttrain.distributed.ray_output import NodeLines, forwarded_output_handler
from posttrain.log import configure_logging

DISK = ("[2026-11-28 00:43:38,352 E 7490 7500] (raylet) file_system_monitor.cc:116: /tmp/ray/session_1 is over "
        "95% full, available space: 10.2436 GB; capacity: 251.972 GB. Object creation will fail if spilling is "
        "required.")
DISK_LATER = DISK.replace("00:43:38,352", "00:43:48,372").replace("10.2436", "10.2431")
SPILL = "[2026-11-28 00:43:50,001 W 7490 7500] (raylet) local_object_manager.cc:42: spilling objects to /tmp/x"
TRACE = "*** SIGSEGV received at time=1764290630 on cpu 1 ***"


def forward(handler, pid: str, *lines: str) -> None:
    handler({"pid": pid, "is_err": True, "job": "", "ip": "10.0.0.1", "lines": list(lines)})


def test_a_node_process_line_is_one_event_per_origin_below_debug(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    printed: list[dict] = []
    configure_logging("info", tmp_path / "events.jsonl")
    try:
        show = forwarded_output_handler(printed.append, NodeLines())
        forward(show, "raylet", DISK)
        forward(show, "raylet", DISK_LATER)  # the same origin again: left out
        forward(show, "raylet", SPILL, TRACE)  # a new origin is an event; the trace is printed
        forward(show, "gcs_server", DISK)  # another process's line with that origin is new
        forward(show, "12345", "step 3 of the worker")
    finally:
        configure_logging("info")
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["level"], e["process"], e["origin"]) for e in events] == [
        ("ray node process reported", "error", "raylet", "file_system_monitor.cc:116"),
        ("ray node process reported", "warning", "raylet", "local_object_manager.cc:42"),
        ("ray node process reported", "error", "gcs_server", "file_system_monitor.cc:116"),
    ]
    assert events[0]["message"] == DISK.split("file_system_monitor.cc:116: ")[1]
    assert events[0]["repeats"] == "shown at logger.level=debug"
    assert [(data["pid"], data["lines"]) for data in printed] == [
        ("raylet", [TRACE]), ("12345", ["step 3 of the worker"]),
    ]


def test_at_debug_every_line_is_printed_as_ray_prints_it():
    printed: list[dict] = []
    show = forwarded_output_handler(printed.append, None)
    forward(show, "raylet", DISK)
    forward(show, "raylet", DISK_LATER)
    assert [data["lines"] for data in printed] == [[DISK], [DISK_LATER]]


def test_ray_prints_the_node_lines_in_a_process_whose_events_go_nowhere(monkeypatch):
    """``init_ray`` from a script that never configured logging: structlog would print an
    event on stdout (its default), where the script's own output goes; Ray's line goes to
    stderr, as without posttrain."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from posttrain.distributed.ray_output import show_forwarded_output

    printed: list[dict] = []
    saved = structlog.get_config() if structlog.is_configured() else None
    monkeypatch.setattr(dispatcher, "handlers", [("ray_print_logs", printed.append)])
    try:
        structlog.reset_defaults()
        show_forwarded_output()
        forward(dispatcher.handlers[0][1], "raylet", DISK)
        configure_logging("info")
        show_forwarded_output()  # wraps the handler again, now with events
        forward(dispatcher.handlers[0][1], "raylet", DISK)
    finally:
        structlog.reset_defaults()
        if saved is not None:
            structlog.configure(**saved)
    assert [data["lines"] for data in printed] == [[DISK]]
