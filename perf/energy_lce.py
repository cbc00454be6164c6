"""Energy per call of the LCE providers at the board's power limit, and the speedups it allows.

    python -m perf.energy_lce                     # published shape, fp16, 5 s per workload
    python -m perf.energy_lce --dtype bf16 --seconds 8

Under sustained load an H200 draws its power limit (700 W) and lowers its clock until it
fits, so time per call is energy per call over that limit: the ratio of two providers' energy
is the ratio of their times. A short burst from a cool GPU runs at full clock before the
limit acts (a few tens of ms), so each workload is timed twice:
  burst_ms   after 3 s idle, the median of its calls within the first 25 ms;
  ms         back to back for --seconds after a warm-up, while nvidia-smi samples the board's
             power and SM clock every 100 ms (harness.sustained): the median ms per call of
             chunks of calls; mJ = mean power x mean ms per call (ms_mean).
Workloads, in order:
  idle                     nothing running
  device copy 1 GiB        DRAM read + write: energy per byte moved, above idle
  cuBLAS 8192^3 GEMM       energy per FLOP of a compute-bound GEMM, all in (idle included)
  perf/bench_lce.py's providers, each checked against an fp32 reference first

Two estimates bracket the energy a kernel for this op needs, and so the best speedup over each
torch provider at the power limit (that provider's mJ / the estimate):
  flops only   its useful FLOPs at the GEMM's energy per FLOP, as if moving data cost nothing
               (optimistic; `x_*_flops_only`);
  with DRAM    plus its compulsory DRAM bytes (every input read once, the output written once)
               at the copy's energy per byte, which charges the copy kernel's whole power above
               idle to its bytes (pessimistic; `x_*_with_dram`, and `ms_at_cap`).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from perf import bench_lce, harness

NAME = "energy_lce"
COPY_BYTES = 2**30
GEMM_N = 8192
COLUMNS = ["workload", "burst_ms", "ms", "W", "MHz", "power_capped", "mJ", "tflops", "pJ_per_flop", "pJ_per_byte",
           "x_decomp_burst", "x_decomp", "x_decomp_energy"]


def compulsory_bytes(p: bench_lce.LceProblem) -> int:
    """Every input read once and the output written once."""
    elems = (p.M * (p.K_cand + p.K_user) + p.B * p.K_cand * p.N + p.U * p.K_user * p.N
             + p.B * p.M * p.N)
    return elems * torch.finfo(p.dtype).bits // 8


def energy_mj(flops: float, nbytes: float, pj_per_flop: float, pj_per_byte: float) -> float:
    return (flops * pj_per_flop + nbytes * pj_per_byte) * 1e-9


def summarize(rows: list, idle_w: float, flops: int, nbytes: int) -> dict:
    """Fill the per-row energy columns; returns the two estimates (left out where an input is missing)."""
    by = {r["workload"]: r for r in rows}
    copy, gemm = by.get("device copy 1 GiB"), by.get(f"cuBLAS {GEMM_N}^3 GEMM")
    if copy and copy.get("W") is not None and idle_w is not None:
        copy["pJ_per_byte"] = (copy["W"] - idle_w) / (2 * COPY_BYTES / (copy["ms"] * 1e-3)) * 1e12
    for r in rows:
        if r.get("flops") and r.get("mJ") is not None:
            r["pJ_per_flop"] = r["mJ"] * 1e-3 / r["flops"] * 1e12
        if r.get("flops"):
            r["tflops"] = harness.tflops(r["flops"], r["ms"])
    decomp = by.get("torch decomposition")
    for r in rows:
        if decomp and r.get("flops") == flops and r is not decomp:
            r["x_decomp"] = decomp["ms"] / r["ms"]
            if r.get("burst_ms") and decomp.get("burst_ms"):
                r["x_decomp_burst"] = decomp["burst_ms"] / r["burst_ms"]
            if r.get("mJ") is not None and decomp.get("mJ") is not None:
                r["x_decomp_energy"] = decomp["mJ"] / r["mJ"]
    capped = [r["W"] for r in rows if r.get("power_capped") and r.get("W") is not None]
    est = {"flops": flops, "bytes": nbytes, "cap_W": sum(capped) / len(capped) if capped else None}
    if copy and gemm and copy.get("pJ_per_byte") is not None and gemm.get("pJ_per_flop") is not None:
        est["flops_only_mJ"] = energy_mj(flops, 0, gemm["pJ_per_flop"], 0)
        est["with_dram_mJ"] = energy_mj(flops, nbytes, gemm["pJ_per_flop"], copy["pJ_per_byte"])
        if est["cap_W"]:
            est["ms_at_cap"] = est["with_dram_mJ"] / est["cap_W"]
        for name, col in bench_lce.SPEEDUP_COLUMNS.items():
            if by.get(name, {}).get("mJ") is not None:
                est[f"{col}_flops_only"] = by[name]["mJ"] / est["flops_only_mJ"]
                est[f"{col}_with_dram"] = by[name]["mJ"] / est["with_dram_mJ"]
    return est


def workloads(p: bench_lce.LceProblem, inp: bench_lce.LceInputs, args) -> list:
    """(name, fn, flops): the reference workloads, then the providers that pass their check."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=bench_lce.DEVICE).random_()
    dst = torch.empty_like(src)
    a = torch.randn(GEMM_N, GEMM_N, device=bench_lce.DEVICE, dtype=p.dtype)
    b = torch.randn(GEMM_N, GEMM_N, device=bench_lce.DEVICE, dtype=p.dtype)
    c = torch.empty_like(a)
    work = [("device copy 1 GiB", lambda: dst.copy_(src), 0),
            (f"cuBLAS {GEMM_N}^3 GEMM", lambda: torch.matmul(a, b, out=c), 2 * GEMM_N**3)]
    provs = [pr for pr in bench_lce.providers() if not args.providers or pr.name in args.providers]
    rows, timed = bench_lce.check_providers(p, inp, provs, args.tol)
    for row in rows:
        if row["status"] != "ok":
            print(f"{NAME}: {row['provider']} {row['status']}: {row['note']}", flush=True)
    work += [(name, lambda fn=fn: fn(inp), p.flops) for name, (_, fn) in timed.items()]
    return work


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="energy_lce.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=bench_lce.PUBLISHED["B"])
    ap.add_argument("--ratio", type=int, default=bench_lce.PUBLISHED["ratio"])
    ap.add_argument("--dtype", choices=sorted(harness.DTYPES), default="fp16")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per workload")
    ap.add_argument("--providers", nargs="+", metavar="NAME",
                    help=f"subset of: {', '.join(p.name for p in bench_lce.providers())}")
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative error against fp32")
    ap.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


@torch.no_grad()
def main(argv=None) -> int:
    args = parse_args(argv)
    harness.start_benchmark(NAME)
    bench_lce.load_ikbo_gemm()
    env = harness.environment()
    harness.print_environment(env)
    p = bench_lce.make_problem(args.B, args.ratio, harness.DTYPES[args.dtype])
    inp = bench_lce.make_inputs(p, torch.Generator(device=bench_lce.DEVICE).manual_seed(args.seed))
    start = time.perf_counter()
    idle_w = harness.idle_watts()
    rows = [{"workload": "idle", "W": idle_w}]
    for name, fn, flops in workloads(p, inp, args):
        row = {"workload": name, "flops": flops, "burst_ms": harness.burst_ms(fn),
               **harness.sustained(fn, args.seconds)}
        rows.append(row)
        print(f"{NAME}: {name}: {harness.fmt(row['burst_ms'])} ms cool, {harness.fmt(row['ms'])} ms sustained, "
              f"{harness.fmt(row['W'])} W", flush=True)
    nbytes = compulsory_bytes(p)
    est = summarize(rows, idle_w, p.flops, nbytes)
    f = p.fields()
    print(f"\nB={f['B']} ratio={f['ratio']} (U={f['U']}) M={f['M']} N={f['N']} K_user={f['K_user']} "
          f"K_cand={f['K_cand']} {f['dtype']}, run back to back [{p.flops / 1e9:.1f} GFLOP, "
          f"{nbytes / 1e9:.3f} GB compulsory; burst_ms: from a cool GPU, ms: sustained; "
          f"x_decomp* = decomposition ms / this ms]")
    harness.print_table(rows, COLUMNS)
    if "with_dram_mJ" in est:
        print(f"energy per call: FLOPs only {est['flops_only_mJ']:.0f} mJ, with DRAM {est['with_dram_mJ']:.0f} mJ"
              + (f" ({est['ms_at_cap']:.3f} ms at {est['cap_W']:.0f} W)" if "ms_at_cap" in est else ""))
        for n, c in bench_lce.SPEEDUP_COLUMNS.items():
            if c + "_with_dram" in est:
                print(f"  best x over {n} at the power limit: {est[c + '_with_dram']:.2f} (with DRAM) to "
                      f"{est[c + '_flops_only']:.2f} (FLOPs only)")
    payload = {"benchmark": NAME, "argv": sys.argv[1:] if argv is None else list(argv), "environment": env,
               "problem": f, "settings": {"seconds": args.seconds, "tol": args.tol, "copy_bytes": COPY_BYTES,
                                          "gemm_n": GEMM_N},
               "rows": rows, "estimate": est, "seconds": time.perf_counter() - start}
    path = harness.write_results(NAME, payload, args.out_dir)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
