"""How the driver shows what Ray forwards to it: the job's workers' output, and the errors of
Ray's own node processes (the raylet, the GCS server).

Ray prints both in the driver through one handler (``ray_print_logs``). posttrain wraps it
(:func:`show_forwarded_output`) so that

- each batch of lines goes above the progress bar, never into it;
- below ``logger.level: debug``, a node process's log line (``[time L pid tid] (raylet)
  file.cc:line: message``) becomes one posttrain event the first time its origin
  (``file.cc:line``) speaks, and its repeats are left out: the raylet repeats some errors
  every few seconds for as long as they hold (e.g. a disk over 95% full). At debug, and in a
  process whose events go nowhere yet (structlog not configured: a script using
  :func:`~posttrain.distributed.cluster.init_ray` alone), every line is printed as Ray prints it.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import structlog

from posttrain.log import above_progress_bars, get_logger, library_log_level

#: The processes whose log lines Ray forwards under a name instead of a worker's pid.
NODE_PROCESSES = frozenset({"raylet", "gcs_server"})
#: A node process's log line (glog's format): its level letter, origin and message.
NODE_LOG_LINE = re.compile(r"^\[[^\]]* (?P<level>[IWEF]) \d+ \d+\] \(\w+\) (?P<origin>[\w.]+:\d+): (?P<message>.*)$")
_EVENT_LEVEL = {"I": "info", "W": "warning", "E": "error", "F": "critical"}

Handler = Callable[[dict[str, Any]], None]


class NodeLines:
    """Turns node processes' log lines into posttrain events, once per origin."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._log = get_logger("posttrain.ray")

    def log_new(self, process: str, lines: list[str]) -> list[str]:
        """Log each line of ``process`` in glog's format whose origin has not spoken before;
        return the lines that are not in that format (a crash's stack trace), to print as
        they are."""
        unparsed = []
        for line in lines:
            match = NODE_LOG_LINE.match(line)
            if match is None:
                unparsed.append(line)
                continue
            key = (process, match["origin"])
            with self._lock:
                if key in self._seen:
                    continue
                self._seen.add(key)
            getattr(self._log, _EVENT_LEVEL[match["level"]])(
                "ray node process reported", process=process, origin=match["origin"], message=match["message"],
                repeats="shown at logger.level=debug",
            )
        return unparsed


def forwarded_output_handler(print_lines: Handler, node_lines: NodeLines | None) -> Handler:
    """``print_lines`` (Ray's handler) wrapped as the module docstring says; ``node_lines``
    None prints node processes' lines as Ray does (debug)."""

    def show(data: dict[str, Any]) -> None:
        if node_lines is not None and data.get("pid") in NODE_PROCESSES and data.get("lines"):
            data = {**data, "lines": node_lines.log_new(data["pid"], data["lines"])}
            if not data["lines"]:
                return
        # The autoscaler's batches (a status report every few seconds, of which Ray prints
        # only the rare events) pass as they are: clearing the bar for each would make it flicker.
        if not data.get("lines") or data.get("pid") == "autoscaler":
            print_lines(data)
            return
        with above_progress_bars(sys.stderr if data.get("is_err") else sys.stdout):
            print_lines(data)

    return show


def show_forwarded_output() -> None:
    """Wrap Ray's ``ray_print_logs`` handler in this process (ray 2.60 keeps its handlers in
    a private dispatcher) with :func:`forwarded_output_handler` for the configured
    ``logger.level``. Nothing to wrap without ``log_to_driver``."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    node_lines = NodeLines() if library_log_level() >= logging.ERROR and structlog.is_configured() else None
    with dispatcher._lock:
        dispatcher.handlers = [
            (name, forwarded_output_handler(handler, node_lines) if name == "ray_print_logs" else handler)
            for name, handler in dispatcher.handlers
        ]
