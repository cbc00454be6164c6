"""quantize_fp8's kernels timed alone: the op (its plan: the kernel that reads x once, or the
two-pass kernel) against the two-pass kernel on the same groups.

    python -m tools.quantize_timing [--out perf/results/quantize-h100-<date>.json]

CUDA-graph replays, the two in turns (``perf.harness.bench_graph_interleaved``), each graph over
copies of x enough to leave L2 cold (400 MB at most); the median of 30 rounds. GB/s counts x
read once and x8 written once.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

import ikbo_gemm
from ikbo_gemm.quantize import _padded_rows, staged_plan
from ikbo_gemm.quantize_sm90 import quantize_kernel
from perf import harness

SHAPES = [  # x's shape, dim, layout: linear's x rows, and lce's e at its published K
    ((2048, 2048), -1, "same"), ((8192, 4096), -1, "same"), ((2048, 8192), -1, "same"), ((4096, 1024), -1, "same"),
    ((16384, 512), -1, "same"), ((64, 200000), -1, "same"),
    ((512, 1184, 256), (1, 2), "transposed"), ((1024, 872, 256), (1, 2), "transposed"),
]


def time_shape(shape, dim, layout, dtype=torch.bfloat16) -> dict:
    transposed = layout == "transposed"
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    xs = [torch.randn(shape, device="cuda").to(dtype) for _ in range(max(2, min(8, (400 << 20) // nbytes)))]
    G = shape[0]
    R, C = (shape[1], shape[2]) if transposed else (1, math.prod(shape[1:]))
    two_pass = quantize_kernel(dtype, transposed)

    def two_pass_call(x):
        x8 = _padded_rows((G, C, R), x.device)[..., :R] if transposed else torch.empty(
            (G, R, C), dtype=torch.float8_e4m3fn, device=x.device)
        two_pass(x.view(G, R, C), x8, torch.empty(G, device=x.device))

    ms = harness.bench_graph_interleaved(
        {"op": lambda x: ikbo_gemm.quantize_fp8(x, dim=dim, layout=layout), "two-pass": two_pass_call},
        rep=30, rotate=xs)
    us = {k: v * 1e3 for k, v in ms.items()}
    moved = nbytes + nbytes // xs[0].element_size()
    return dict(shape=list(shape), dim=dim, layout=layout, dtype=str(dtype).replace("torch.", ""),
                plan=staged_plan(G, R, C, xs[0].element_size(), transposed, xs[0].data_ptr()),
                us={k: round(v, 2) for k, v in us.items()}, gb_per_s={k: round(moved / v / 1e3) for k, v in us.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args()
    rows = []
    print(f"{'shape':>18} {'layout':>10} {'plan':>22} {'op us':>8} {'two-pass us':>12} {'op GB/s':>8}")
    for shape, dim, layout in SHAPES:
        row = time_shape(shape, dim, layout)
        rows.append(row)
        print(f"{str(tuple(shape)):>18} {layout:>10} {str(row['plan']):>22} {row['us']['op']:>8} "
              f"{row['us']['two-pass']:>12} {row['gb_per_s']['op']:>8}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=harness.environment(), rows=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
