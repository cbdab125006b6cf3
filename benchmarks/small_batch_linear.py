"""A decoding step's linear layers on the CPU: ``F.linear`` (``x @ weight.T``) against the
hf engine's weight-on-the-left product (``weight @ x.T``), side by side in one run.

    python benchmarks/small_batch_linear.py [--rows 1,4,8,16,32,64] [--threads 2]

The weights are the Qwen3-0.6B shapes (attention, MLP and the 151,936-row head), float32,
and enough copies of each that they do not fit in the cache, as in a real decoding step
where every weight is read once. Prints the weight bytes read per second of each form and
their ratio; ``posttrain_hf.small_batch_linear`` uses the left-hand form up to 64 rows.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"q/o, 1024 x 2048": (2048, 1024), "MLP up, 3072 x 1024": (3072, 1024),
          "MLP down, 1024 x 3072": (1024, 3072), "head, 151936 x 1024": (151936, 1024)}
BYTES_PER_SHAPE = 800_000_000  # well over any CPU cache


def read_rate(product, weights: list[torch.Tensor], x: torch.Tensor, repeats: int = 3) -> float:
    """GB of weights read per second by ``product(x, weight)`` over ``weights``, best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for weight in weights:
            product(x, weight)
        best = min(best, time.perf_counter() - start)
    return sum(w.numel() * w.element_size() for w in weights) / best / 1e9


def main(argv: list[str] | None = None) -> None:
    from posttrain_hf.small_batch_linear import small_batch_linear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| weight | rows | F.linear GB/s | weight @ x.T GB/s | ratio |\n|---|---:|---:|---:|---:|")
    for name, (out_features, in_features) in SHAPES.items():
        copies = max(1, BYTES_PER_SHAPE // (out_features * in_features * 4))
        weights = [torch.randn(out_features, in_features) for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features)
            plain = read_rate(lambda x, w: F.linear(x, w), weights, x)
            left = read_rate(lambda x, w: small_batch_linear(x, w, None), weights, x)
            print(f"| {name} | {rows} | {plain:.1f} | {left:.1f} | {left / plain:.2f} |", flush=True)
        del weights


if __name__ == "__main__":
    main()
