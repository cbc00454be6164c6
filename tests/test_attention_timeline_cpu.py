"""tools/attention_timeline.py on the CPU: the per-call summary of kernel events, its flag
setter, and its refusal to run without a GPU."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "attention_timeline.py"


@pytest.fixture(scope="module")
def timeline():
    spec = importlib.util.spec_from_file_location("attention_timeline", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_spans_and_kernels(timeline):
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
    res = timeline.summarize(calls, kernels)
    assert res["span_us"] == pytest.approx(sorted(spans)[2])
    assert set(res["kernels"]) == {"worklist", "fwd", "merge"}
    assert res["kernels"]["worklist"]["starts_at_us"] == 0.0
    assert all(v["per_call"] == 1.0 for v in res["kernels"].values())
    fwd = sorted(d for n, _, d in kernels if n == "fwd")
    assert res["kernels"]["fwd"]["us"] == pytest.approx(fwd[2])


def test_summary_without_events(timeline):
    assert timeline.summarize([(0.0, 1.0)], []) == {"span_us": None, "kernels": {}}


def test_parse_policy(timeline):
    from ikbo_fa import DEFAULT_POLICY, AttentionPolicy

    assert timeline.parse_policy(["split_kv=0", "split_min_keys=2048"]) == AttentionPolicy(split_kv=False,
                                                                                         split_min_keys=2048)
    assert timeline.parse_policy([]) == DEFAULT_POLICY
    for bad in ("_NO_SUCH_FLAG=1", "split_kv", "attention=1", "_SPLIT_KV=0"):
        with pytest.raises(SystemExit, match="--set: policy"):
            timeline.parse_policy([bad])


def test_needs_a_gpu(timeline):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        timeline.main(["--S-q", "1", "--L", "1024"])
