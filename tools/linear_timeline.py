"""Where the GPU time of one ikbo_gemm.linear call goes: each kernel's start and duration.

    python -m tools.linear_timeline --B 2048 --K 4096,4096 --N 1024 [--ratio 70 --dtype bf16]
    python -m tools.linear_timeline --B 2048 --K 4096,4096 --N 1024 --rules wide_user=1 --rules user_tile=64x128

For each shape the op (and ``ikbo linear RULES`` under each ``--rules`` set of PlanRules fields),
the compiled torch decomposition and the candidate GEMM alone (the floor; FP8: their FP8 forms)
run eagerly with a device sync between calls, under torch.profiler. Per provider it prints each
kernel's start from the call's first kernel and its median duration: the user and candidate
launches of the op, and how much they overlap. Launch gaps that CUDA graphs remove are in the
span; host time is not. Writes JSON where ``--out`` names a file.
"""
from __future__ import annotations

import argparse
import sys

import torch

from perf import bench_linear as bl
from perf.gemm_bench import DTYPES
from perf.providers import LIBS, needed
from tools.timeline import trace_providers, write_results

PEERS = {"bf16": ("torch.compile decomposition", "torch addmm floor"),
         "fp16": ("torch.compile decomposition", "torch addmm floor"),
         "fp8": ("torch.compile fp8 decomposition", "fp8 scaled_mm floor")}


def rules_arg(spec: str) -> str:
    """A --rules value: checked by ikbo_gemm.PlanRules.parse, kept as text."""
    from ikbo_gemm.linear import PlanRules

    try:
        PlanRules.parse(spec)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return spec


def providers(dtype: str, rules: list) -> list:
    """The op, the op under each PlanRules spec of ``rules``, then the peers of ``dtype``."""
    named = {p.name: p for p in bl.providers(fp8=dtype == "fp8")}
    ours = named[bl.OURS_FP8 if dtype == "fp8" else bl.OURS]
    return [ours, *(bl.ours_with_rules(f"ikbo linear {spec}", spec, dtype == "fp8") for spec in rules),
            *(named[n] for n in PEERS[dtype])]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.linear_timeline", description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, nargs="+", default=[2048])
    ap.add_argument("--ratio", type=int, default=70)
    ap.add_argument("--K", type=bl._k_pair, nargs="+", default=[(4096, 4096)], metavar="K_USER,K_CAND")
    ap.add_argument("--N", type=int, nargs="+", default=[1024])
    ap.add_argument("--dtype", choices=sorted(PEERS), default="bf16")
    ap.add_argument("--activation", choices=sorted(bl.ACTIVATIONS), default="relu")
    ap.add_argument("--rules", type=rules_arg, action="append", default=[], metavar="SPEC",
                    help="also trace the op under ikbo_gemm.PlanRules.parse(SPEC), e.g. wide_user=1,user_tile=64x128")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("linear_timeline needs a CUDA GPU")
    provs = providers(args.dtype, args.rules)
    for note in LIBS.load(needed(provs)):
        print(note)
    results = []
    for B in args.B:
        for K_user, K_cand in args.K:
            for N in args.N:
                p = bl.make_problem(B, args.ratio, K_user, K_cand, N, DTYPES[args.dtype], args.activation,
                                    device="cuda")
                inp = bl.make_inputs(p, torch.Generator(device="cuda").manual_seed(0), device="cuda")
                fields = dict(B=B, U=p.U, K_user=K_user, K_cand=K_cand, N=N, dtype=args.dtype)
                trace_providers(provs, p, inp, args.iters, f"B {B} U {p.U} K {K_user}+{K_cand} N {N} {args.dtype}",
                                fields, results)
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
