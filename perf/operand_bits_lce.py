"""How the LCE providers' times depend on the bits of their operands, in one run.

    python -m perf.operand_bits_lce                         # published shape: fp16, fp16/7, fp16/3, bf16
    python -m perf.operand_bits_lce --variants fp16 fp16/7 bf16

Run back to back, an H200 runs these providers at the clock its power limit allows, and a
tensor core's power depends on the bits it multiplies: the same kernel on the same shape
takes a different time on other data. Each variant draws the inputs as perf/bench_lce.py does:
  fp16      fp16 operands (bench_lce's inputs)
  fp16/N    the same values rounded to N mantissa bits, still fp16: the same kernels and
            instructions, fewer bits to toggle (fp16/7 has bf16's precision)
  bf16      bf16 operands
Every provider of every variant is checked against its own fp32 reference, then timed
(--timing): interleaved (default), all of them in turns in one loop (one call of each per
round), so that they share the GPU's clock and temperature; sustained, each alone back to back
at the power limit (fields *_sustained, with W and MHz); or both. Columns: ms, TFLOP/s, speedup
over the same variant's torch providers (x_*), and ms over the same provider's ms on the first
variant (vs_first), each per timing mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from perf import bench_lce, harness

NAME = "operand_bits_lce"
PROVIDERS = ["torch materialize+bmm", "torch decomposition", "ikbo fused"]
COLUMNS = ["variant", "provider", "status", "rel_err"]
TIMED_COLUMNS = ["ms", "tflops", "x_mat_bmm", "x_decomp", "vs_first"]  # per timing mode
FP16_MANTISSA = 10


def parse_variant(text: str) -> tuple[torch.dtype, int | None]:
    """'fp16' / 'bf16' -> (dtype, None); 'fp16/N' -> (float16, N) for N in [0, 10]."""
    name, _, bits = text.partition("/")
    if name not in harness.DTYPES or (bits and name != "fp16"):
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected fp16, bf16 or fp16/N")
    if not bits:
        return harness.DTYPES[name], None
    if not bits.isdigit() or int(bits) > FP16_MANTISSA:
        raise argparse.ArgumentTypeError(f"variant {text!r}: N must be 0 ... {FP16_MANTISSA}")
    return torch.float16, int(bits)


def round_mantissa(t: torch.Tensor, bits: int) -> torch.Tensor:
    """fp16 ``t`` rounded to ``bits`` mantissa bits (to nearest, ties away from zero; a rounding
    that would overflow stops at the largest finite value with that many bits)."""
    drop = FP16_MANTISSA - bits
    if drop <= 0:
        return t.clone()
    raw = t.view(torch.int16).to(torch.int32) & 0xFFFF
    sign, mag = raw & 0x8000, raw & 0x7FFF
    mag = ((mag + (1 << (drop - 1))) & ~((1 << drop) - 1)).clamp(max=0x7C00 - (1 << drop))
    mag = torch.where((raw & 0x7C00) == 0x7C00, raw & 0x7FFF, mag)  # inf and NaN stay as they are
    out = sign | mag
    return torch.where(out >= 0x8000, out - 0x10000, out).to(torch.int16).view(torch.float16)


def variant_inputs(p: bench_lce.LceProblem, bits, gen: torch.Generator) -> bench_lce.LceInputs:
    inp = bench_lce.make_inputs(p, gen)
    if bits is None:
        return inp
    return bench_lce.LceInputs(*(round_mantissa(t, bits) for t in dataclasses.astuple(inp)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="operand_bits_lce.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["fp16", "fp16/7", "fp16/3", "bf16"],
                    help="fp16, bf16 or fp16/N (N mantissa bits)")
    ap.add_argument("--B", type=int, default=bench_lce.PUBLISHED["B"])
    ap.add_argument("--ratio", type=int, default=bench_lce.PUBLISHED["ratio"])
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative error against fp32")
    harness.add_common_args(ap)
    harness.add_timing_args(ap)
    args = ap.parse_args(argv)
    try:
        args.parsed = [parse_variant(v) for v in args.variants]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if len(set(args.variants)) != len(args.variants):
        ap.error(f"--variants: each variant once, got {args.variants}")
    return args


@torch.no_grad()
def main(argv=None) -> int:
    args = parse_args(argv)
    harness.start_benchmark(NAME)
    bench_lce.load_ikbo_gemm()
    env = harness.environment()
    harness.print_environment(env)
    ceilings = harness.ceilings_tflops(sorted({v.partition("/")[0] for v in args.variants}))
    provs = [pr for pr in bench_lce.providers() if pr.name in PROVIDERS]
    start = time.perf_counter()
    rows, to_time, rotations, flops = [], {}, 1, 0
    for text, (dtype, bits) in zip(args.variants, args.parsed):
        p = bench_lce.make_problem(args.B, args.ratio, dtype)
        inp = variant_inputs(p, bits, torch.Generator(device=bench_lce.DEVICE).manual_seed(args.seed))
        checked, timed = bench_lce.check_providers(p, inp, provs, args.tol)
        n_rot = harness.rotation_count(inp.activation_bytes(), harness.l2_bytes())
        sets = [inp] + [inp.clone_activations() for _ in range(n_rot - 1)]
        rotations, flops = max(rotations, n_rot), p.flops
        for row in checked:
            row.pop("first_call_s", None)
            row["variant"] = text
            rows.append(row)
            if row["provider"] in timed:
                fn = timed[row["provider"]][1]
                to_time[(text, row["provider"])] = (row, lambda i, fn=fn, sets=sets: fn(sets[i % len(sets)]))
    # Every function takes the round's index and picks its own variant's input copy with it.
    harness.time_checked(to_time, rows, rotate=list(range(rotations)), device=bench_lce.DEVICE,
                         **harness.timing_options(args))
    by = {(r["variant"], r["provider"]): r for r in rows}
    first = args.variants[0]
    for suffix in harness.mode_suffixes(args.timing):
        ms = "ms" + suffix
        for (text, name), row in by.items():
            if row.get(ms) is None:
                continue
            row["tflops" + suffix] = harness.tflops(flops, row[ms])
            for peer, col in bench_lce.SPEEDUP_COLUMNS.items():  # the peers this script runs
                if by.get((text, peer), {}).get(ms):
                    row[col + suffix] = by[(text, peer)][ms] / row[ms]
            if by.get((first, name), {}).get(ms):
                row["vs_first" + suffix] = row[ms] / by[(first, name)][ms]
    harness.print_rows(f"{NAME}: B={args.B} ratio={args.ratio}, operands by variant "
                       f"(x_* against the same variant's torch providers)", rows, COLUMNS, TIMED_COLUMNS,
                       args.timing)
    payload = {"benchmark": NAME, "argv": sys.argv[1:] if argv is None else list(argv), "environment": env,
               "ceiling_tflops": ceilings, "variants": args.variants,
               "settings": {**harness.timing_settings(args), "tol": args.tol},
               "seconds": time.perf_counter() - start, "rows": rows}
    print(f"results: {harness.write_results(NAME, payload, args.out_dir)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
