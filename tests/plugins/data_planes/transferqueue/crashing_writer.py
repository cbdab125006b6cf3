"""A run driver that dies mid-step: run as a script by the transferqueue plane tests.

``python crashing_writer.py RUN_DIR PARTITION`` joins the Ray cluster named by
``RAY_ADDRESS``, creates the run's ``transferqueue`` plane with the plugin's factory (starting TransferQueue when none
runs), writes four samples, prints ``PUT_DONE``, waits for a line on stdin and exits with
``os._exit(1)``: no shutdown, no clear, as a crash would leave it.
"""

from __future__ import annotations

import os
import sys

import torch

from posttrain.config.schema import RunConfig
from posttrain_transferqueue.plugin import create_transferqueue_plane

if __name__ == "__main__":
    run_dir, partition = sys.argv[1], sys.argv[2]
    plane = create_transferqueue_plane(RunConfig(run_dir=run_dir))  # what data_plane.backend=transferqueue builds
    keys = [f"stale{i}" for i in range(4)]
    plane.put(
        partition, keys, {"input_ids": torch.arange(64).reshape(4, 16)}, tags={"keep": torch.ones(4, dtype=torch.bool)}
    )
    print("PUT_DONE", plane.namespace, flush=True)
    sys.stdin.readline()
    os._exit(1)
