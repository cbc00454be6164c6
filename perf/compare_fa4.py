"""IKBO attention head to head with FlashAttention-4, FlashAttention-3 and torch SDPA on one
Hopper GPU.

    python -m perf.compare_fa4                      # the published configuration
    python -m perf.compare_fa4 --sweep ratio B S_q  # one-variable sweeps around it (L = 1024)
    python -m perf.compare_fa4 --sweep S_q_fine     # S_q 1 ... 128 at L 1024 and 8192
    python -m perf.compare_fa4 --L 1024 --order shuffled --broadcast q --dtype fp16
    python -m perf.compare_fa4 --jagged lognormal --L 8192   # K/V of per-user lengths <= L
    python -m perf.compare_fa4 --preset short-history        # the ranking-model shapes (PRESETS)
    python -m perf.compare_fa4 --sweep S_q_fine --H 1 2 4 8 --D 64 128 --dtype bf16 fp16
    python -m perf.compare_fa4 --S-q 1 --L 1024 2048 --variant split_pair=0 split_pair=0,prefetch_blocks=2

Every provider (``perf/attention_providers.py``) is checked against fp32 on a sample of
candidates (``perf/attention_workload.py``), then those that pass are timed. Options, providers
and output: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch

from perf import harness
from perf.attention_layouts import PAGE_SIZE
from perf.attention_providers import DISPLAY_ORDER, PEER, display_index, parse_policy, providers, variant
from perf.attention_workload import LENGTHS, Inputs, Problem, check_candidates, length_spec, make_inputs, \
    make_problem, reference_outputs
from perf.harness import ContextLost, context_lost, short_error
from perf.providers import LIBS, select

NAME = "compare_fa4"
DEVICE = "cuda"  # a CPU dry run of the whole script swaps it (tests)
PUBLISHED = {"B": 2048, "ratio": 64, "S_q": 64, "L": [512, 1024, 2048, 4096, 8192, 16384]}
SWEEP_L = 1024  # L of the ratio / B / S_q sweeps
GRID = ("L", "ratio", "B", "S_q")  # the point of a problem, besides dtype, direction, order, lengths, H, D


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One variable (``var``: L, ratio, B or S_q) over ``values``, the others at the published
    point, at each L of ``L`` (``--L`` overrides it; unused when ``var`` is L)."""
    var: str
    values: tuple
    L: tuple = (SWEEP_L,)


SWEEPS = {
    "L": Sweep("L", (512, 1024, 2048, 4096, 8192, 16384)),
    "ratio": Sweep("ratio", (10, 32, 64, 128, 256, 1000)),
    "B": Sweep("B", (256, 512, 1024, 2048, 4096)),
    "S_q": Sweep("S_q", (32, 64, 128)),
    # decode-like to prefill-like query counts, odd ones included (17, 48, 100: partial tiles)
    "S_q_fine": Sweep("S_q", (1, 2, 4, 8, 16, 17, 32, 48, 64, 100, 128), L=(1024, 8192)),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named set of shapes: ``parts`` maps a part's name to its lists of B, ratio, S_q, L and
    jagged (a length distribution, or None for padded K/V); H and D are the preset's. Options
    given beside ``--preset`` replace those of every part."""
    description: str
    H: int
    D: int
    parts: dict


PRESETS = {
    "short-history": Preset(
        "DIN/BST-style target attention over short behaviour sequences: B 2048, ratio 32, S_q 1 and 4, "
        "H 4, D 64; lognormal lengths of median 64 up to 256 (kv_offsets), and every history 128 long "
        "both padded (k/v [U, 128, H, D]) and as kv_offsets, so the two layouts compare directly",
        H=4, D=64, parts={
            "lognormal": {"B": [2048], "ratio": [32], "S_q": [1, 4], "L": [256], "jagged": ["lognormal:64"]},
            "128 padded": {"B": [2048], "ratio": [32], "S_q": [1, 4], "L": [128], "jagged": [None]},
            "128 kv_offsets": {"B": [2048], "ratio": [32], "S_q": [1, 4], "L": [128], "jagged": ["equal"]},
        }),
    "long-history": Preset(
        "TWIN/SIM-style single-query attention over long histories of few users: B 4096, U 8, S_q 1, "
        "H 4, D 128; every history 16384 keys (padded), and lognormal lengths up to 32768 (kv_offsets)",
        H=4, D=128, parts={
            "16384 padded": {"B": [4096], "ratio": [512], "S_q": [1], "L": [16384], "jagged": [None]},
            "lognormal": {"B": [4096], "ratio": [512], "S_q": [1], "L": [32768], "jagged": ["lognormal"]},
        }),
    "gr-cross": Preset(
        "generative-recommender cross attention: 8 users x 1300 candidates (B 10400), S_q 1, H 6, D 128, "
        "K/V histories of lognormal lengths up to 32768 keys",
        H=6, D=128, parts={
            "": {"B": [10400], "ratio": [1300], "S_q": [1], "L": [32768], "jagged": ["lognormal"]},
        }),
}


class Series(NamedTuple):
    """A sweep as run: the row field it varies and its configuration keys, in run order."""
    var: str
    keys: list


KEY_FIELDS = ("B", "ratio", "S_q", "L", "dtype", "broadcast", "order", "jagged", "H", "D")  # _key's order


def _key(r: dict) -> tuple:
    return tuple(r.get(f) for f in KEY_FIELDS)


def run_problem(p: Problem, inp: Inputs, provs: list, args, ceiling: float, rng) -> list:
    """Check every provider, then time those that passed; a row per provider (ContextLost, carrying
    the rows so far, after a sticky CUDA error)."""
    cand = check_candidates(p.B, rng)
    ref = reference_outputs(p, inp, cand)
    n_rot = harness.rotation_count(inp.nbytes(), harness.l2_bytes())
    sets = [inp] + [inp.clone() for _ in range(n_rot - 1)]

    def rel_error_of(prov, out):
        if not prov.checked:
            return None
        if out is None or tuple(out.shape) != (p.B, p.S_q, p.H, p.D):
            return math.inf
        return harness.rel_error(out[cand.to(out.device)].float(), ref)

    harness.reset_compiled()
    rows, timed = harness.check_providers(provs, p, inp, fields=p.fields(), rel_error_of=rel_error_of,
                                          tol=args.tol, skip_note=LIBS.skip_note, device=DEVICE)
    timed = harness.time_checked(timed, rows, rotate=sets, device=DEVICE, **harness.timing_settings(args))
    modes = harness.TIMINGS[args.timing]
    if "interleaved" in modes and "graph" not in modes:  # graph replays of the short calls, in
        # turns, beside the plain ones (the graph mode replays every call: "ms_graph")
        short = {n: fn for n, (row, fn) in timed.items() if row["ms"] < args.graph_below_ms}
        for name, ms in harness.bench_graph_interleaved(short, rep=args.rep, rotate=sets).items():
            timed[name][0]["graph_ms"] = ms
            if ms is None:
                timed[name][0]["note"] = "CUDA graph capture failed"
    timed.clear()
    derive_ratios(rows, provs, p.flops, ceiling, args.timing)
    rows.sort(key=lambda r: display_index(r["provider"]))
    p.cache.clear()
    return rows


def derive_ratios(rows: list, provs: list, flops: float, ceiling: float, timing: str) -> None:
    """Per timing mode, each attention row's TFLOP/s, pct_cublas, ikbo_speedup, best_peer and
    x_best_peer; graph_best_peer and graph_x_best_peer from the graph replays beside interleaved calls."""
    attention = {prov.name for prov in provs if prov.checked}
    peers = {prov.name for prov in provs if PEER in prov.tags}
    by_name = {r["provider"]: r for r in rows if r["provider"] in attention}

    def best_peer(field: str, prefix: str, suffix: str) -> dict:
        timed = {name: r[field] for name, r in by_name.items() if r.get(field)}
        best = min((n for n in timed if n in peers), key=timed.get, default=None)
        for name, ms in timed.items() if best is not None else ():
            by_name[name][f"{prefix}best_peer{suffix}"] = best
            by_name[name][f"{prefix}x_best_peer{suffix}"] = timed[best] / ms
        return timed

    for s in harness.mode_suffixes(timing):
        timed = best_peer("ms" + s, "", s)
        for name, ms in timed.items():
            r = by_name[name]
            r["tflops" + s] = harness.tflops(flops, ms)
            r["pct_cublas" + s] = 100.0 * r["tflops" + s] / ceiling
            if "ikbo" in timed and name != "ikbo":
                r["ikbo_speedup" + s] = ms / timed["ikbo"]
    best_peer("graph_ms", "graph_", "")


def host_overheads(args, provs: list, key: tuple) -> dict:
    """CPU microseconds per call on a tiny problem (B = 4, ratio 2, L = 128; jagged lengths <= 128)
    of the configuration ``key``'s dtype, direction, lengths, H and D."""
    harness.reset_compiled()
    rng = np.random.default_rng(args.seed)
    dtype, broadcast, jagged, H, D = harness.DTYPES[key[4]], key[5], key[7], key[8], key[9]
    p = make_problem(4, 2, args.S_q[0] if args.S_q else PUBLISHED["S_q"], 128, H, D,
                     dtype, broadcast, "sorted", rng, device=DEVICE, jagged=jagged)
    inp = make_inputs(p, torch.Generator(device=DEVICE).manual_seed(args.seed), device=DEVICE)
    result = {}
    for prov in provs:
        if LIBS.skip_note(prov):
            continue
        try:
            st = prov.setup(p, inp)
            result[prov.name] = harness.host_overhead_us(lambda: prov.run(p, st, inp), iters=100)
        except Exception as e:
            if context_lost(DEVICE):
                raise ContextLost(f"{prov.name}: {short_error(e)}", []) from e
            result[prov.name] = None
    return result


def _grid(options: dict) -> tuple[list, str]:
    """The points of the product of ``options``' lists of GRID, and the variable they vary."""
    grid = [options[n] for n in GRID]
    varied = [n for n, g in zip(GRID, grid) if len(g) > 1]
    return [dict(zip(GRID, v)) for v in itertools.product(*grid)], (varied or ["L"])[0]


def _series(args) -> dict:
    """Name -> (varied field, points: dicts of GRID values plus "jagged") before the product with
    dtype, direction, order, H and D."""
    given = {n: getattr(args, n) for n in (*GRID, "jagged") if getattr(args, n)}
    if args.preset:
        named = {}
        for part, options in PRESETS[args.preset].parts.items():
            options = {**options, **given}
            points, var = _grid(options)
            var = "S_q" if len(points) == 1 else var
            named[f"{args.preset} {part}".strip()] = (var, [{**pt, "jagged": j} for pt in points
                                                            for j in options["jagged"]])
        return named
    jagged = args.jagged or [None]
    if not args.sweep:
        points, var = _grid({n: given.get(n) or ([PUBLISHED[n]] if n != "L" else PUBLISHED["L"]) for n in GRID})
        return {var: (var, [{**pt, "jagged": j} for pt in points for j in jagged])}
    named = {}
    for name in args.sweep:
        sweep = SWEEPS[name]
        at_L = [None] if sweep.var == "L" else (args.L or list(sweep.L))
        for L in at_L:
            base = {n: (given.get(n) or [PUBLISHED[n]])[0] for n in ("ratio", "B", "S_q")}
            label = name if len(at_L) == 1 else f"{name} at L={L}"
            named[label] = (sweep.var, [{**base, "L": L, sweep.var: v, "jagged": j}
                                        for v in (given.get(sweep.var) or sweep.values) for j in jagged])
    return named


def build_configs(args) -> tuple[list, dict]:
    """Unique keys (B, ratio, S_q, L, dtype, broadcast, order, jagged, H, D) in run order, and sweep
    label (docs/benchmarks.md) -> Series."""
    keys, sweeps = [], {}
    shapes = len(args.H) > 1 or len(args.D) > 1
    for name, (var, points) in _series(args).items():
        for point in points:
            jag = point["jagged"]
            for dtype, order, bc, H, D in itertools.product(args.dtype, args.order, args.broadcast, args.H, args.D):
                key = (point["B"], point["ratio"], point["S_q"], point["L"], dtype, bc, order, jag, H, D)
                label = (f"{name} ({dtype}, {bc}, {order}{'' if jag is None else ', jagged ' + jag}"
                         f"{f', H={H} D={D}' if shapes else ''})")
                series = sweeps.setdefault(label, Series(var, []))
                if key not in series.keys:
                    series.keys.append(key)
                if key not in keys:
                    keys.append(key)
    return keys, sweeps


def length_arg(spec: str) -> str:
    """``--jagged``'s type: a length distribution (``length_spec``), or an argument error naming it."""
    try:
        length_spec(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def variant_arg(spec: str) -> tuple:
    """``--variant``'s type: (spec, its attention policy), or an argument error naming the spec."""
    try:
        return spec, parse_policy(spec)
    except (ValueError, TypeError, ImportError) as e:
        raise argparse.ArgumentTypeError(f"{spec!r}: {e}") from None


def parse_args(argv=None):
    ap = harness.parser("python -m perf.compare_fa4", __doc__)
    ap.add_argument("--sweep", nargs="+", choices=sorted(SWEEPS),
                    help="one-variable sweeps around the published point, each at its L (1024; "
                         "S_q_fine: 1024 and 8192) or at every --L; without it, the product of the "
                         "lists below")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="named shapes, each with its own sweep: "
                         + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items())
                         + ". Options given as well win")
    ap.add_argument("--L", type=int, nargs="+",
                    help="keys per user (default 512 ... 16384); with --jagged, the longest")
    ap.add_argument("--ratio", type=int, nargs="+", help="candidates per user (default 64, +-1)")
    ap.add_argument("--B", type=int, nargs="+", help="candidates (default 2048)")
    ap.add_argument("--S-q", dest="S_q", type=int, nargs="+", help="queries per candidate (default 64)")
    ap.add_argument("--jagged", nargs="+", type=length_arg, metavar="DIST",
                    help="K/V rows of lengths in [1, L] drawn from DIST, packed with kv_offsets: "
                         + "; ".join(f"{k}: {v[1]}" for k, v in LENGTHS.items()).replace("%", "%%"))
    ap.add_argument("--H", type=int, nargs="+", help="heads (default 2); several: each point at each")
    ap.add_argument("--D", type=int, nargs="+", help="head dimension (default 128); several: each point at each")
    ap.add_argument("--dtype", nargs="+", choices=sorted(harness.DTYPES), default=["bf16"])
    ap.add_argument("--broadcast", nargs="+", choices=["kv", "q"], default=["kv"],
                    help="kv: K/V per user (default); q: Q per user, K/V per candidate")
    ap.add_argument("--order", nargs="+", choices=["sorted", "shuffled"], default=["sorted"],
                    help="candidates grouped by user, or shuffled")
    ap.add_argument("--providers", nargs="+", metavar="NAME", choices=DISPLAY_ORDER,
                    help=f"subset of: {', '.join(DISPLAY_ORDER)}")
    ap.add_argument("--variant", nargs="+", type=variant_arg, default=[], metavar="SPEC",
                    help="also time ikbo under ikbo_fa.AttentionPolicy.parse(SPEC), one provider 'ikbo SPEC' "
                         "per SPEC (e.g. split_pair=0 split_pair=0,prefetch_blocks=2)")
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative error against fp32")
    ap.add_argument("--graph-below-ms", type=float, default=1.0,
                    help="also time CUDA-graph replays of calls faster than this")
    ap.add_argument("--no-plot", action="store_true")
    harness.add_common_args(ap, timing="both")
    args = ap.parse_args(argv)
    preset = PRESETS.get(args.preset)
    args.H = args.H or [preset.H if preset else 2]
    args.D = args.D or [preset.D if preset else 128]
    return args


def run_settings(args) -> dict:
    """What the JSON's "settings" records besides the timing: H and D (lists), the preset, the
    length distributions and the variants."""
    settings = {"tol": args.tol, "page_size": PAGE_SIZE, "graph_below_ms": args.graph_below_ms,
                "H": args.H, "D": args.D, "preset": None, "jagged": None,
                "variants": [spec for spec, _ in args.variant]}
    if args.preset:
        settings["preset"] = {"name": args.preset, **dataclasses.asdict(PRESETS[args.preset])}
    dists = {length_spec(j)[0] for _, points in _series(args).values() for j in (pt["jagged"] for pt in points) if j}
    if dists:
        settings["jagged"] = {name: LENGTHS[name][1] for name in sorted(dists)}
    return settings


TABLE_COLUMNS = ["provider", "status", "rel_err", "first_call_s"]
PLOT_COLUMNS = 8  # sweeps side by side in the PNG; more wrap onto further rows
TIMED_COLUMNS = ["ms", "graph_ms", "tflops", "pct_cublas", "ikbo_speedup", "best_peer", "x_best_peer",
                 "graph_x_best_peer"]  # per timing mode


def problem_title(p: Problem) -> str:
    f = p.fields()
    keys = (f"L={f['L']}" if p.jagged is None else
            f"L<={f['L']} jagged={p.jagged} max_len={f['max_len']} mean_len={f['mean_len']:.0f}")
    return (f"B={f['B']} ratio={f['ratio']} (U={f['U']}) S_q={f['S_q']} {keys} keys={f['total_keys']} "
            f"H={f['H']} D={f['D']} {f['dtype']} broadcast={f['broadcast']} {f['order']}  "
            f"[{p.flops / 1e9:.1f} GFLOP; ikbo_speedup = peer ms / ikbo ms, x_best_peer = best FA varlen "
            f"peer ms / row ms, in the same timing]")


def summary(rows: list, sweeps: dict, mode: str = "interleaved") -> None:
    """Per sweep, TFLOP/s of every provider at each point, the best peer and ikbo / best peer."""
    s = harness.SUFFIX[mode]
    print(f"\nTFLOP/s (eager, {mode}):")
    by = {(_key(r), r["provider"]): r for r in rows}
    names = sorted({r["provider"] for r in rows}, key=lambda n: (display_index(n), n))
    names += ["materialize ms", "best peer", "ikbo / best peer", "ikbo / best peer, graph"]
    for name, (x, keys) in sweeps.items():  # (every key has rows)
        # the sweep's variable, and any other point field its keys vary (a product of lists)
        varies = [f for f in GRID if f == x or len({k[KEY_FIELDS.index(f)] for k in keys}) > 1]
        point = varies + (["total_keys", "max_len"] if "jagged" in name else [])
        table = harness.point_table(rows, keys, _key, "tflops" + s, lambda k: {
            c: next(r[c] for r in rows if _key(r) == k) for c in point})
        for key, line in zip(keys, table):
            ours = by.get((key, "ikbo"), {})
            if "materialize" in line:  # the copy alone: its time, not a rate
                del line["materialize"]
                line["materialize ms"] = by[key, "materialize"].get("ms" + s)
            if ours.get("best_peer" + s):
                line.update({"best peer": ours["best_peer" + s],
                             "ikbo / best peer": ours["x_best_peer" + s]})
            if not s and ours.get("graph_best_peer"):
                line["ikbo / best peer, graph"] = ours["graph_x_best_peer"]
        cols = point + [c for c in names if c != "materialize" and any(c in t for t in table)]
        print(f"sweep {name}")
        harness.print_table(table, cols)


def plot(rows: list, sweeps: dict, ceilings: dict, path: Path, mode: str = "interleaved") -> Optional[str]:
    """TFLOP/s against the swept variable, one line per provider, and ikbo's speedup below, in the
    timing ``mode``."""
    s = harness.SUFFIX[mode]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped"
    # A sweep per column, wrapped after PLOT_COLUMNS (an H x D x dtype product makes dozens)
    cols = min(len(sweeps), PLOT_COLUMNS)
    grid_rows = -(-len(sweeps) // cols)
    fig, axes = plt.subplots(2 * grid_rows, cols, figsize=(6 * cols, 8 * grid_rows), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1] * grid_rows})
    for i in range(len(sweeps), grid_rows * cols):  # the last row's empty panels
        for ax in axes[2 * (i // cols):2 * (i // cols) + 2, i % cols]:
            ax.set_visible(False)
    for i, (name, (x_name, keys)) in enumerate(sweeps.items()):
        row, col = divmod(i, cols)
        top, bottom = axes[2 * row][col], axes[2 * row + 1][col]
        bottom.sharex(top)
        top.tick_params(labelbottom=False)
        xs = sorted({r[x_name] for k in keys for r in rows if _key(r) == k})
        for color, prov in enumerate(DISPLAY_ORDER):  # one color per provider in both panels
            sel = [r for k in keys for r in rows if _key(r) == k and r["provider"] == prov]
            pts = [(r[x_name], r["tflops" + s]) for r in sel if r.get("tflops" + s)]
            if pts:
                top.plot(*zip(*pts), marker="o", label=prov, color=f"C{color}",
                         linewidth=2.5 if prov == "ikbo" else 1.2)
            sp = [(r[x_name], r["ikbo_speedup" + s]) for r in sel if r.get("ikbo_speedup" + s)]
            if sp:
                bottom.plot(*zip(*sp), marker="o", label=f"vs {prov}", color=f"C{color}")
        dtype = name.split("(")[1].split(",")[0]
        if dtype in ceilings:
            top.axhline(ceilings[dtype], color="gray", linestyle="--", label=f"cuBLAS {dtype} GEMM")
        top.set(title=f"{name}, {mode}", ylabel="TFLOP/s")
        top.legend(fontsize=8)
        bottom.axhline(1.0, color="gray", linewidth=0.8)
        bottom.set(ylabel="ikbo speedup (peer ms / ikbo ms)", xlabel=x_name)
        if bottom.lines[1:]:
            bottom.legend(fontsize=8)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            if xs and min(xs) > 0 and max(xs) >= 16 * min(xs):
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def measure(key: tuple, provs: list, args, ceilings: dict) -> list:
    """One configuration's rows, its table printed."""
    B, ratio, S_q, L, dt, bc, order, jagged, H, D = key
    rng = np.random.default_rng(args.seed)
    p = make_problem(B, ratio, S_q, L, H, D, harness.DTYPES[dt], bc, order, rng, device=DEVICE, jagged=jagged)
    inp = make_inputs(p, torch.Generator(device=DEVICE).manual_seed(args.seed), device=DEVICE)
    rows = run_problem(p, inp, provs, args, ceilings[dt], rng)
    harness.print_rows(problem_title(p), rows, TABLE_COLUMNS, TIMED_COLUMNS, args.timing)
    return rows


@torch.no_grad()  # inference: no autograd bookkeeping in any provider
def main(argv=None) -> int:
    args = parse_args(argv)
    provs = select(providers(), args.providers) + [variant(spec, policy) for spec, policy in args.variant]
    run = harness.Run(NAME, args, argv, provs, ("nvidia-cutlass-dsl", "flash-attn-4", "fa3-fwd"))
    keys, sweeps = build_configs(args)
    ceilings = harness.ceilings_tflops(k[4] for k in keys)
    bandwidth = harness.copy_bandwidth_tbps()
    print(f"device copy bandwidth: {bandwidth:.2f} TB/s", flush=True)
    payload = run.begin(run_settings(args), ceiling_tflops=ceilings, copy_tbps=bandwidth)
    with run:
        for key in keys:
            run.add(measure(key, provs, args, ceilings))
        payload["host_overhead_us"] = host_overheads(args, provs, keys[0])
    if payload.get("host_overhead_us"):
        jagged = f", jagged {keys[0][7]}" if keys[0][7] else ""
        shape = f", H={keys[0][8]} D={keys[0][9]}" if len(args.H) > 1 or len(args.D) > 1 else ""
        print(f"\nhost time per call, tiny problem (B=4, ratio 2, L=128{jagged}{shape}):")
        harness.print_table([{"provider": k, "us": v} for k, v in payload["host_overhead_us"].items()],
                            ["provider", "us"])
    done = {_key(r) for r in payload["rows"]}
    sweeps = {n: Series(var, [k for k in ks if k in done]) for n, (var, ks) in sweeps.items()}
    sweeps = {n: series for n, series in sweeps.items() if series.keys}
    for mode in harness.TIMINGS[args.timing] if sweeps else []:
        summary(payload["rows"], sweeps, mode)
    print(f"\nresults: {run.save()}")
    if not args.no_plot and sweeps:
        png, latest = harness.result_paths(NAME, ".png", args.out_dir, run.stamp)
        note = plot(payload["rows"], sweeps, ceilings, png, harness.TIMINGS[args.timing][0])
        if note:
            print(f"{NAME}: {note}")
        else:
            latest.write_bytes(png.read_bytes())
            print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
