"""What the timeline tools share: an op's calls traced under torch.profiler (eager, a device sync
between calls), and the per-call medians of each kernel's start and duration."""
from __future__ import annotations

import functools
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from perf.providers import LIBS


def summarize(calls: list, kernels: list) -> dict:
    """Per-call timelines -> medians. ``calls``: (start, end) of each call on the host's clock;
    ``kernels``: (name, start, duration) of each GPU kernel, in microseconds on the same clock.
    A kernel belongs to the call during which it started. Launches of one kernel within a call
    (the two phases of one kernel class) are told apart by their order: "name #1", "name #2"."""
    spans, per_kernel = [], defaultdict(list)
    for c0, c1 in calls:
        inside = sorted((k for k in kernels if c0 <= k[1] <= c1), key=lambda k: k[1])
        if not inside:
            continue
        start = inside[0][1]
        spans.append(max(k[1] + k[2] for k in inside) - start)
        names = [name[:60] for name, _, _ in inside]
        seen = defaultdict(int)
        for name, (_, t0, dur) in zip(names, inside):
            seen[name] += 1
            label = f"{name} #{seen[name]}" if names.count(name) > 1 else name
            per_kernel[label].append((dur, t0 - start))
    summary = {name: {"us": statistics.median(d for d, _ in v), "starts_at_us": statistics.median(s for _, s in v),
                      "per_call": len(v) / max(1, len(spans))} for name, v in per_kernel.items()}
    return {"span_us": statistics.median(spans) if spans else None, "kernels": summary}


def trace(fn, iters: int) -> dict:
    """``summarize`` of ``iters`` calls of ``fn`` (after three untraced ones)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(iters):
            with torch.profiler.record_function(f"call{i}"):
                fn()
                torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    marks = {f"call{i}" for i in range(iters)}  # the ranges' GPU-side annotations are not kernels
    kernels = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == cuda and e.time_range.elapsed_us() > 0 and e.name not in marks
               and "Memcpy" not in e.name and "Memset" not in e.name]
    calls = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.name.startswith("call") and e.device_type != cuda]
    return summarize(calls, kernels)


def print_timeline(title: str, res: dict) -> None:
    """The call's span, then each kernel in start order: its start from the call's first kernel,
    its duration and how many run a call."""
    span = res["span_us"]
    print(f"{title}: span {'-' if span is None else f'{span:.1f}'} us")
    for k, v in sorted(res["kernels"].items(), key=lambda kv: kv[1]["starts_at_us"]):
        print(f"    +{v['starts_at_us']:7.1f} us  {v['us']:7.1f} us  x{v['per_call']:.0f}  {k}")


def trace_providers(provs, p, inputs, iters: int, title: str, fields: dict, results: list) -> None:
    """Trace each provider whose libraries loaded on problem ``p``: its summary, with ``fields``,
    appended to ``results`` and printed under ``title``."""
    for prov in provs:
        if LIBS.skip_note(prov):
            continue
        st = prov.setup(p, inputs)
        res = trace(functools.partial(prov.run, p, st, inputs), iters)
        res.update(provider=prov.name, **fields)
        results.append(res)
        print_timeline(f"{title} {prov.name}", res)


def write_results(path, results: list) -> None:
    """The rows as JSON at ``path`` (nothing where it is None), with the GPU's name."""
    if path:
        Path(path).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": results}, indent=1))
