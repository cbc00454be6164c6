"""The reference models (examples/) end to end, in four versions, on one Hopper GPU:

    python -m perf.bench_models                   # --configs headline: every model at B 1024, ratio 70
    python -m perf.bench_models --configs grid    # every model at B {256, 1024, 4096} x ratio {10, 70, 1000}
    python -m perf.bench_models --models combined --B 1024 --ratio 70

The versions (eager, compile, rewrite, hand), how each is checked and timed, and the columns:
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from examples import combined, din, multi_seed, wukong
from perf import harness
from perf.harness import make_idx, user_counts
from perf.providers import LIBS, Provider

NAME = "bench_models"
DEVICE = "cuda"  # a CPU dry run of the whole script swaps it (tests)
GRID = {"B": [256, 1024, 4096], "ratio": [10, 70, 1000]}
HEADLINE = (1024, 70)
TOL = 3e-2  # bf16 end to end, against eager bf16


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    module: object  # the examples module: make_inputs(cfg, B, U, ...)
    model: Callable  # the class as written
    hand: Callable  # the hand-written class, built from the model
    cfg: object


MODELS = {
    "combined": ModelSpec(combined, combined.CombinedRanker, combined.CombinedRankerIkbo, combined.CombinedConfig()),
    "wukong": ModelSpec(wukong, wukong.WukongBlock, wukong.WukongBlockIkbo, wukong.WukongConfig()),
    "din": ModelSpec(din, din.DinBlock, din.DinBlockIkbo, din.DinConfig()),
    "multi_seed": ModelSpec(multi_seed, multi_seed.MultiSeedBlock, multi_seed.MultiSeedBlockIkbo,
                            multi_seed.MultiSeedConfig()),
}


class Models(NamedTuple):
    model: torch.nn.Module  # as written
    hand: torch.nn.Module  # written by hand with the IKBO ops


def _call(models: Models, fn, inputs: tuple):
    return fn(*inputs)


# The versions as providers: setup makes the callable (the compiled ones compile at their first
# call), run calls it.
PROVIDERS = {prov.name: prov for prov in [
    Provider("eager", lambda m, x: m.model, _call),
    Provider("compile", lambda m, x: torch.compile(m.model), _call),
    Provider("rewrite", lambda m, x: LIBS.get("ikbo_rewrite").compile(m.model), _call, needs=("ikbo_rewrite",)),
    Provider("hand", lambda m, x: torch.compile(m.hand), _call),
]}
VERSIONS = list(PROVIDERS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", choices=["headline", "grid"], default="headline")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--versions", nargs="+", choices=VERSIONS, default=VERSIONS)
    p.add_argument("--B", type=int, nargs="+", help="batch sizes (instead of the --configs ones)")
    p.add_argument("--ratio", type=int, nargs="+", help="candidates per user (instead of the --configs ones)")
    p.add_argument("--tol", type=float, default=TOL)
    harness.add_common_args(p)
    p.set_defaults(warmup=3, rep=20)
    return p.parse_args(argv)


def shapes(args) -> list:
    if args.B or args.ratio:
        return [(b, r) for b in (args.B or [HEADLINE[0]]) for r in (args.ratio or [HEADLINE[1]])]
    if args.configs == "grid":
        return [(b, r) for b in GRID["B"] for r in GRID["ratio"]]
    return [HEADLINE]


def build(spec: ModelSpec, B: int, ratio: int, seed: int) -> tuple[Models, tuple, int]:
    """(models as written and by hand, inputs, U): weights and inputs on the device, bf16."""
    counts = user_counts(B, ratio)
    torch.manual_seed(seed)
    model = spec.model(spec.cfg).to(DEVICE, torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(seed)
    inputs = spec.module.make_inputs(spec.cfg, B, len(counts), dtype=torch.bfloat16, device=DEVICE, generator=gen)
    inputs = tuple(inputs[:-1]) + (make_idx(counts, "sorted").to(DEVICE),)
    return Models(model, spec.hand(model)), inputs, len(counts)


def peak_mib(call) -> Optional[float]:
    """Memory one call allocates at its peak, beyond what was allocated before it."""
    if DEVICE != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def left_broadcasts(fn) -> list:
    """The rewrite's reports: every broadcast it left, with the reason."""
    reports = getattr(fn, "reports", None) or []
    return [{"node": x.node, "shape": x.shape, "reasons": x.reasons} for r in reports for x in r.left]


def run_shape(name: str, spec: ModelSpec, B: int, ratio: int, args) -> tuple[list, dict]:
    torch._dynamo.reset()
    models, inputs, U = build(spec, B, ratio, args.seed)
    fields = {"model": name, "B": B, "ratio": ratio, "U": U}
    rows, timed, ref, made = [], {}, None, {}
    with torch.no_grad():
        for version in args.versions:  # the first is the reference
            prov = PROVIDERS[version]
            row = {**fields, "version": version, "status": "ok", "note": LIBS.skip_note(prov)}
            rows.append(row)
            if row["note"]:
                row["status"] = "skipped"
                continue
            try:
                made[version] = prov.setup(models, inputs)
                call = functools.partial(prov.run, models, made[version], inputs)
                row["first_s"], out = harness.first_call_s(call)
                ref = out.float() if ref is None else ref
                row["rel_err"] = harness.rel_error(out.float(), ref)
                del out
                if not row["rel_err"] <= args.tol:
                    row.update(status="wrong", note=f"rel. error {row['rel_err']:.3g} > {args.tol:g}: not timed")
                    continue
                row["peak_mib"] = peak_mib(call)
                timed[version] = (row, call)
            except Exception as e:
                harness.record_failure(row, e, rows, DEVICE)
        # interleaved: plain calls and CUDA-graph replays in turns; sustained: plain calls,
        # each version alone back to back (time_checked)
        done = harness.time_checked(timed, rows, device=DEVICE, **harness.timing_settings(args))
        if args.timing != "sustained" and done:
            graphs = harness.bench_graph_interleaved({v: f for v, (_, f) in done.items()}, warmup=args.warmup,
                                                     rep=args.rep)
            for v, (row, _) in done.items():
                row["graph_ms"] = graphs.get(v)
        if args.timing != "interleaved" and DEVICE == "cuda":  # the captured graph, back to back
            for v, (row, f) in done.items():
                r = harness.sustained_graph(f, args.sustained_s, warm_s=args.sustained_warmup_s)
                if r is not None:
                    row.update(graph_ms_sustained=r["ms"], graph_W=r["W"], graph_MHz=r["MHz"])
    summary = compare(rows, fields)
    summary["rewrite_left"] = left_broadcasts(made["rewrite"]) if "rewrite" in made else None
    return rows, summary


SUMMARY_FIELDS = ("rewrite_vs_hand", "x_latency_vs_compile", "x_memory_vs_compile", "rewrite_vs_hand_sustained",
                  "x_latency_vs_compile_sustained")


def _best(row) -> Optional[float]:
    """The latency a serving stack gets: the graph replay where one could be captured."""
    return row.get("graph_ms") or row.get("ms")


def _sustained(row) -> Optional[float]:
    """Back to back at the power limit: graph replays where captured, else plain calls."""
    return row.get("graph_ms_sustained") or row.get("ms_sustained")


def compare(rows: list, fields: dict) -> dict:
    """Ratios between versions: from the interleaved latency (graph replays where captured) and,
    suffixed ``_sustained``, from the sustained plain calls."""
    out = dict(fields)
    for suffix, time_of in (("", _best), ("_sustained", _sustained)):
        by = {r["version"]: r for r in rows if r["status"] == "ok" and time_of(r)}
        rw, hand, comp = by.get("rewrite"), by.get("hand"), by.get("compile")
        if rw and hand:
            out["rewrite_vs_hand" + suffix] = time_of(rw) / time_of(hand)  # parity target: <= 1.05
        if rw and comp:
            out["x_latency_vs_compile" + suffix] = time_of(comp) / time_of(rw)
        for r in by.values():
            if r["version"] in ("rewrite", "hand") and comp:
                r["x_compile" + suffix] = time_of(comp) / time_of(r)
    by = {r["version"]: r for r in rows if r["status"] == "ok"}
    rw, comp = by.get("rewrite"), by.get("compile")
    if rw and comp and rw.get("peak_mib") and comp.get("peak_mib"):
        out["x_memory_vs_compile"] = comp["peak_mib"] / rw["peak_mib"]
    return out


def print_shape(rows: list, summary: dict, left: list, timing: str = "interleaved") -> None:
    title = f"{summary['model']}: B {summary['B']}, ratio {summary['ratio']} (U {summary['U']})"
    harness.print_rows(title, rows, ["version", "status", "graph_ms", "graph_ms_sustained", "peak_mib", "first_s",
                                     "rel_err"], ["ms", "x_compile"], timing)
    parts = [f"{k} {harness.fmt(summary[k])}" for k in SUMMARY_FIELDS if k in summary]
    if parts:
        print("  " + ", ".join(parts))
    print(f"  broadcasts the rewrite left (the hand-written version removes them): {len(left) or 'none'}")
    for x in left:
        print(f"    {x['node']} {x['shape']}: {'; '.join(x['reasons'])}")


def plot(payload: dict, out_dir) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes_ = payload["summaries"]
    if not shapes_:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes_)), 4))
    width = 0.8 / len(VERSIONS)
    for i, v in enumerate(VERSIONS):
        ys = []
        for s in shapes_:
            r = next((r for r in payload["rows"] if r["version"] == v and r["status"] == "ok"
                      and all(r[k] == s[k] for k in ("model", "B", "ratio"))), None)
            ys.append(_best(r) if r else 0)
        ax.bar([j + i * width for j in range(len(shapes_))], ys, width, label=v)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes_))])
    ax.set_xticklabels([f"{s['model']}\nB{s['B']} r{s['ratio']}" for s in shapes_], fontsize=7)
    ax.set_ylabel("ms per request (CUDA graph replay)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    stamped, latest = harness.result_paths(NAME, ".png", out_dir, payload["stamp"])
    fig.savefig(stamped, dpi=120)
    fig.savefig(latest, dpi=120)
    plt.close(fig)
    return stamped


def main(argv=None) -> int:
    args = parse_args(argv)
    run = harness.Run(NAME, args, argv, [PROVIDERS[v] for v in args.versions])  # compile caches off
    payload = run.begin({"tol": args.tol, "versions": args.versions}, stamp=run.stamp)
    payload["summaries"] = []
    with run:
        for name in args.models:
            for B, ratio in shapes(args):
                rows, summary = run_shape(name, MODELS[name], B, ratio, args)
                print_shape(rows, summary, summary["rewrite_left"] or [], args.timing)
                payload["summaries"].append(summary)
                run.add(rows)
    if payload["summaries"]:
        print("\nsummary (latency = CUDA graph replays where captured, else plain calls; in turns, and "
              "_sustained: each version alone, back to back)")
        harness.print_table(payload["summaries"], ["model", "B", "ratio", "U"] + [
            k for k in SUMMARY_FIELDS if any(k in s for s in payload["summaries"])])
    path = run.save()
    png = plot(payload, args.out_dir)
    print(f"\nresults: {path}" + (f", {png}" if png else "") + f"  ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
