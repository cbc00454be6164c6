"""tools/attention_timeline.py on the CPU: the per-call summary of kernel events, its arguments,
and its refusal to run without a GPU."""
from __future__ import annotations

import random

import pytest

from tools import attention_timeline as timeline
from tools import timeline as shared


def test_summary_spans_and_kernels():
    rng = random.Random()
    calls, kernels, spans = [], [], []
    t = rng.uniform(0, 1000)
    for _ in range(5):
        c0 = t
        k0 = c0 + rng.uniform(1, 5)  # work list, then the forward overlapping it, then the merge
        w, f0, f, m = rng.uniform(2, 4), rng.uniform(0.5, 1.5), rng.uniform(10, 30), rng.uniform(2, 3)
        kernels += [("worklist", k0, w), ("fwd", k0 + f0, f), ("merge", k0 + f0 + f + 0.3, m)]
        spans.append(f0 + f + 0.3 + m)
        t = c0 + 40 + rng.uniform(0, 5)
        calls.append((c0, t - 1))
    kernels.append(("elsewhere", t + 100, 7.0))  # outside every call: not counted
    rng.shuffle(kernels)
    res = shared.summarize(calls, kernels)
    assert res["span_us"] == pytest.approx(sorted(spans)[2])
    assert set(res["kernels"]) == {"worklist", "fwd", "merge"}
    assert res["kernels"]["worklist"]["starts_at_us"] == 0.0
    assert all(v["per_call"] == 1.0 for v in res["kernels"].values())
    fwd = sorted(d for n, _, d in kernels if n == "fwd")
    assert res["kernels"]["fwd"]["us"] == pytest.approx(fwd[2])


def test_summary_tells_launches_of_one_kernel_apart():
    """The two phases of one kernel class in a call: "name #1" (first launched) and "name #2"."""
    rng = random.Random()
    calls, kernels, first, second = [], [], [], []
    t = rng.uniform(0, 1000)
    for _ in range(5):
        u, c = rng.uniform(2, 6), rng.uniform(20, 40)
        k0 = t + rng.uniform(1, 3)
        kernels += [("gemm", k0 + 0.5, c), ("gemm", k0, u)]  # listed out of launch order
        first.append(u)
        second.append(c)
        calls.append((t, t + 50))
        t += 60
    res = shared.summarize(calls, kernels)
    assert set(res["kernels"]) == {"gemm #1", "gemm #2"}
    assert res["kernels"]["gemm #1"]["us"] == pytest.approx(sorted(first)[2])
    assert res["kernels"]["gemm #2"]["us"] == pytest.approx(sorted(second)[2])
    assert res["kernels"]["gemm #2"]["starts_at_us"] == pytest.approx(0.5)


def test_summary_without_events():
    assert shared.summarize([(0.0, 1.0)], []) == {"span_us": None, "kernels": {}}


def test_arguments():
    args = timeline.parse_args(["--preset", "long-history"])
    assert (args.B, args.ratio, args.S_q, args.L, args.H, args.D, args.jagged) == (4096, 512, [1], [16384], 4, 128, None)
    assert timeline.parse_args(["--jagged", "lognormal:64"]).jagged == "lognormal:64"
    for bad in (["--jagged", "pareto"], ["--variant", "no_such_field=1"]):
        with pytest.raises(SystemExit):
            timeline.parse_args(bad)


def test_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        timeline.main(["--S-q", "1", "--L", "1024"])
