"""Where the GPU time of one attention call goes: each kernel's duration and the span of the call.

    python -m tools.attention_timeline --S-q 1 --L 1024 2048 4096 [--B 2048 --ratio 64 --H 2 --D 128]
    python -m tools.attention_timeline --preset gr-cross
    python -m tools.attention_timeline --S-q 1 --L 1024 --variant split_kv=0

For each shape, ikbo_fa.attention (and ``ikbo SPEC`` under each ``--variant`` policy) and FA4
varlen (when flash-attn-4 is installed) run eagerly
with a device sync between calls, under torch.profiler; per provider it prints the median
duration of every kernel and of the call's span (first kernel start to last kernel end, on the
GPU). Launch gaps that CUDA graphs remove are in the span; host time is not. Writes JSON where
``--out`` names a file.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from perf import compare_fa4 as cf
from perf.attention_providers import providers, variant
from perf.attention_workload import make_inputs, make_problem
from perf.providers import LIBS, needed
from tools.timeline import trace_providers, write_results


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.attention_timeline", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(cf.PRESETS), help="its first part's shape (perf.compare_fa4)")
    ap.add_argument("--S-q", type=int, nargs="+", default=[1])
    ap.add_argument("--L", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--B", type=int, default=2048)
    ap.add_argument("--ratio", type=int, default=64)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--jagged", type=cf.length_arg, default=None, metavar="DIST")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variant", nargs="+", type=cf.variant_arg, default=[], metavar="SPEC",
                    help="also trace ikbo under ikbo_fa.AttentionPolicy.parse(SPEC), e.g. split_kv=0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.preset:
        pre = cf.PRESETS[args.preset]
        part = next(iter(pre.parts.values()))
        args.S_q, args.L, args.B, args.ratio = part["S_q"], part["L"], part["B"][0], part["ratio"][0]
        args.H, args.D, args.jagged = pre.H, pre.D, part["jagged"][0]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_timeline needs a CUDA GPU")
    named = {p.name: p for p in providers()}
    provs = [named["ikbo"], *(variant(spec, policy) for spec, policy in args.variant), named["fa4 varlen packed"]]
    for note in LIBS.load(needed(provs)):
        print(note)
    results = []
    for s_q in args.S_q:
        for L in args.L:
            rng = np.random.default_rng(0)
            gen = torch.Generator(device="cuda").manual_seed(0)
            p = make_problem(args.B, args.ratio, s_q, L, args.H, args.D, torch.bfloat16, "kv", "sorted", rng,
                             jagged=args.jagged)
            inp = make_inputs(p, gen)
            fields = dict(S_q=s_q, L=L, B=args.B, ratio=args.ratio, H=args.H, D=args.D, jagged=args.jagged)
            trace_providers(provs, p, inp, args.iters, f"S_q {s_q} L {L} B {args.B} H {args.H} D {args.D}", fields,
                            results)
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
