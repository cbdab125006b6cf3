"""Thresholds of Python's cyclic garbage collector in posttrain's own processes: the
``posttrain`` command and the Ray worker processes of its jobs.

Importing torch and transformers allocates millions of objects; at Python's default
thresholds (700, 10, 10) that runs hundreds of collections which free almost nothing.
:data:`THRESHOLDS` run about a hundred times fewer: an hf engine's actor, which imports
both, started on 7.3 s of CPU instead of 8.2 s (2 cores). Objects in reference cycles are
still freed, a little later.
"""

from __future__ import annotations

import gc

#: ``gc.set_threshold`` arguments: collect the youngest generation after 100,000 net
#: allocations instead of 700, the older ones after 50 and 100 collections of the one below.
THRESHOLDS = (100_000, 50, 100)


def collect_less_often() -> None:
    """Set this process's collector to :data:`THRESHOLDS` (call it before the heavy imports)."""
    gc.set_threshold(*THRESHOLDS)
