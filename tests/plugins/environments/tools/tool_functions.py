"""Tools for the tests: plain functions, imported by reference in the pool's worker processes
(the tests put the repository root on their PYTHONPATH)."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def hang(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: how long to wait
    """
    time.sleep(seconds)
    return f"waited {seconds} s"


def fail(message: str) -> str:
    """Raise an error.

    Args:
        message: what it says
    """
    raise ValueError(message)


def undocumented(x):
    return x
