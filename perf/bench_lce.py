"""The linear-compression (LCE) ladder on one Hopper GPU: torch baselines, our kernel stages,
and a same-run cuBLAS ceiling.

    python -m perf.bench_lce                          # published shape (fp16, bf16) + B and ratio sweeps (fp16)
    python -m perf.bench_lce --configs published --dtype bf16
    python -m perf.bench_lce --configs ratio --ratio 2 70 10000

out[b] = w_cand @ e_cand[b] + w_user @ e_user[idx[b]]; w_cand [M, K_cand], w_user [M, K_user],
e_cand [B, K_cand, N], e_user [U, K_user, N], idx [B]. Useful work: 2 M N (B K_cand + U K_user).
The providers (``--dtype fp8``: also the FP8 ones) and columns: docs/benchmarks.md.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Optional

import torch

from perf import gemm_bench, harness
from perf.fp8_peers import FP8, dequantize, pad16, quantize_rows, rows_16_apart, scaled_mm
from perf.gemm_bench import DTYPES, GemmProvider as Provider, no_setup, torch_path, w_cat
from perf.harness import per_problem
from perf.providers import LIBS, select

NAME = "bench_lce"
IKBO = ("ikbo_gemm.lce",)  # what the ikbo providers need
DEVICE = "cuda"  # a CPU dry run of the whole script swaps it (tests)
ROTATIONS = 8  # copies of the activations at most: each is large
PUBLISHED = {"B": 1024, "ratio": 70, "M": 433, "N": 256, "K_user": 1184, "K_cand": 872}
SWEEPS = {"B": [256, 512, 1024, 2048, 4096], "ratio": [2, 5, 10, 30, 70, 200, 1000, 10000]}
SPEEDUP_COLUMNS = {"torch materialize+bmm": "x_mat_bmm", "torch bmm": "x_bmm",
                   "torch decomposition": "x_decomp", "torch.compile decomposition": "x_compiled"}
FP8_SPEEDUP_COLUMNS = {"fp8 materialize+scaled_mm": "x_fp8_mat", "fp8 decomposition": "x_fp8_decomp",
                       "torch.compile fp8 decomposition": "x_fp8_compiled", "fp8 scaled_mm floor": "x_fp8_floor",
                       "fp8 scaled_mm floor, per-tensor": "x_fp8_floor_pt",
                       "ikbo fused": "x_ikbo_bf16"}
TIMED_COLUMNS = ["ms", "tflops", "pct_ceiling", *SPEEDUP_COLUMNS.values(),
                 *FP8_SPEEDUP_COLUMNS.values()]  # per timing mode
AUTOTUNE_MODE = "max-autotune-no-cudagraphs"
AUTOTUNE_NOTE = "max-autotune compiles for tens of seconds: at the published shape only (--max-autotune all)"


def lce_flops(M: int, N: int, B: int, U: int, K_user: int, K_cand: int) -> int:
    return 2 * M * N * (B * K_cand + U * K_user)


@dataclasses.dataclass(kw_only=True)
class LceProblem(gemm_bench.GemmProblem):
    M: int
    N: int
    K_user: int
    K_cand: int

    @property
    def flops(self) -> int:
        return lce_flops(self.M, self.N, self.B, self.U, self.K_user, self.K_cand)

    def fields(self) -> dict:
        return super().fields("M", "N", "K_user", "K_cand")


@dataclasses.dataclass
class Fp8Operands:
    """The operands in e4m3: w with one scale per row, e K-major ([B, N, K], as ikbo_gemm.lce
    takes it) with one per batch entry, and e again with K padded to 16 for _scaled_mm."""
    w_cand: torch.Tensor  # [M, K_cand]
    w_user: torch.Tensor
    e_cand: torch.Tensor  # [B, N, K_cand]
    e_user: torch.Tensor  # [U, N, K_user]
    w_cand_scale: torch.Tensor  # [M]
    w_user_scale: torch.Tensor
    e_cand_scale: torch.Tensor  # [B]
    e_user_scale: torch.Tensor  # [U]
    e_cand16: torch.Tensor  # [B, N16, K16]: N and K padded to 16 for _scaled_mm
    e_user16: torch.Tensor
    e_cand16_scale: torch.Tensor  # [B N16]: e_cand_scale repeated over the rows of e_cand16
    e_user16_scale: torch.Tensor
    # The candidate side with one scale per tensor (0-d), as the per-tensor floor takes it.
    w_cand_pt: torch.Tensor  # [M, K16]
    w_cand_pt_scale: torch.Tensor
    e_cand16_pt: torch.Tensor  # [B, N16, K16]
    e_cand_pt_scale: torch.Tensor

    @staticmethod
    def of(w_cand, w_user, e_cand, e_user) -> "Fp8Operands":
        (wc, swc), (wu, swu) = quantize_rows(w_cand), quantize_rows(w_user)
        (ec, sec), (eu, seu) = (quantize_rows(e.transpose(1, 2), dim=(1, 2)) for e in (e_cand, e_user))
        ec, eu = rows_16_apart(ec), rows_16_apart(eu)  # as quantize_fp8 returns them (lce reads them as they are)
        n16 = -(-ec.shape[1] // 16) * 16
        wc_pt, swc_pt = quantize_rows(pad16(w_cand), dim=(0, 1))
        ec_pt, sec_pt = quantize_rows(pad16(pad16(e_cand.transpose(1, 2).contiguous()), 1), dim=(0, 1, 2))
        return Fp8Operands(wc, wu, ec, eu, swc, swu, sec, seu, pad16(pad16(ec), 1), pad16(pad16(eu), 1),
                           sec.repeat_interleave(n16), seu.repeat_interleave(n16), wc_pt, swc_pt, ec_pt, sec_pt)

    def clone_activations(self) -> "Fp8Operands":
        e = {n: getattr(self, n).clone() for n in ("e_cand", "e_user", "e_cand16", "e_user16", "e_cand16_pt")}
        return dataclasses.replace(self, **e)


@dataclasses.dataclass
class LceInputs:
    w_cand: torch.Tensor
    w_user: torch.Tensor
    e_cand: torch.Tensor
    e_user: torch.Tensor
    fp8: Optional[Fp8Operands] = None  # FP8 problems: the operands quantized (the 16-bit ones are bf16)

    def clone_activations(self) -> "LceInputs":
        """A copy of the per-request inputs; the weights stay shared."""
        return dataclasses.replace(self, e_cand=self.e_cand.clone(), e_user=self.e_user.clone(),
                                   fp8=self.fp8 and self.fp8.clone_activations())

    def activation_bytes(self) -> int:
        extra = (self.fp8.e_cand, self.fp8.e_user) if self.fp8 else ()
        return sum(t.numel() * t.element_size() for t in (self.e_cand, self.e_user, *extra))

    def dequantized(self, per_tensor: bool = False) -> "LceInputs":
        """fp32 inputs of the FP8 operands' values, e back in [B, K, N] (``per_tensor``: the
        candidate side's per-tensor operands)."""
        q = self.fp8
        deq = LceInputs(dequantize(q.w_cand, q.w_cand_scale), dequantize(q.w_user, q.w_user_scale),
                        dequantize(q.e_cand, q.e_cand_scale).transpose(1, 2),
                        dequantize(q.e_user, q.e_user_scale).transpose(1, 2))
        if per_tensor:
            K, N = q.w_cand.shape[1], q.e_cand.shape[1]
            deq.w_cand = dequantize(q.w_cand_pt, q.w_cand_pt_scale)[:, :K]
            deq.e_cand = dequantize(q.e_cand16_pt, q.e_cand_pt_scale)[:, :N, :K].transpose(1, 2)
        return deq


def make_problem(B, ratio, dtype, shape=PUBLISHED, device=None) -> LceProblem:
    return LceProblem.of(B, ratio, dtype, device or DEVICE, **{k: shape[k] for k in ("M", "N", "K_user", "K_cand")})


def make_inputs(p: LceProblem, gen: torch.Generator, device=None) -> LceInputs:
    dtype = torch.bfloat16 if p.dtype == FP8 else p.dtype  # FP8: the bf16 problem and its quantization

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device or DEVICE) * scale).to(dtype)

    w_scale = (p.K_cand + p.K_user) ** -0.5  # like a trained layer: outputs O(1) in fp16
    inp = LceInputs(randn(p.M, p.K_cand, scale=w_scale), randn(p.M, p.K_user, scale=w_scale),
                    randn(p.B, p.K_cand, p.N), randn(p.U, p.K_user, p.N))
    if p.dtype == FP8:
        inp.fp8 = Fp8Operands.of(inp.w_cand, inp.w_user, inp.e_cand, inp.e_user)
    return inp


def reference_output(p: LceProblem, inp: LceInputs, chunk: int = 256, user_side: bool = True) -> torch.Tensor:
    """fp32 [B, M, N] (computed in chunks of candidates to bound the fp32 temporaries); without
    ``user_side``, the candidate GEMM alone (the FP8 floor's)."""
    user = torch.matmul(inp.w_user.float(), inp.e_user.float())  # [U, M, N]
    out = torch.empty(p.B, p.M, p.N, dtype=torch.float32, device=inp.e_cand.device)
    idx = p.idx.long()
    for s in range(0, p.B, chunk):
        e = min(p.B, s + chunk)
        out[s:e] = torch.matmul(inp.w_cand.float(), inp.e_cand[s:e].float())
        if user_side:
            out[s:e] += user[idx[s:e]]
    return out


def _materialize(p: LceProblem, inp: LceInputs) -> torch.Tensor:
    return torch.cat([inp.e_user[p.idx], inp.e_cand], dim=1)  # [B, K_user + K_cand, N]


def materialize_bmm(w: torch.Tensor, e_cand, e_user, idx) -> torch.Tensor:
    return torch.matmul(w, torch.cat([e_user.index_select(0, idx), e_cand], dim=1))


def decomposition(w_cand, w_user, e_cand, e_user, idx) -> torch.Tensor:
    user = torch.matmul(w_user, e_user)  # [U, M, N]
    out = torch.matmul(w_cand, e_cand)  # [B, M, N]
    return out.add_(user.index_select(0, idx))


def decomposition_autotuned(w_cand, w_user, e_cand, e_user, idx) -> torch.Tensor:
    # A code object of its own: dynamo keeps compiled graphs per code object, and this one is
    # compiled in another mode than ``decomposition``.
    return decomposition(w_cand, w_user, e_cand, e_user, idx)


def _decomposition_args(p: LceProblem, st, i: LceInputs) -> tuple:
    return i.w_cand, i.w_user, i.e_cand, i.e_user, p.idx


def _ours(schedule: str) -> Callable:
    def run(p: LceProblem, st, inp: LceInputs) -> torch.Tensor:
        return LIBS.get(IKBO[0]).lce(inp.w_cand, inp.w_user, inp.e_cand, inp.e_user, p.idx,
                                     schedule=schedule, validate=False)
    return run


def fp8_batched_gemm(w8, sw, e16, se16, n: int) -> torch.Tensor:
    """bf16 [M, b, n]: w8 @ e[i].T for every batch entry i as one row-wise _scaled_mm, e16 [b, N16, K16]
    the rows of its B operand, ``se16`` [b N16] their scales."""
    b, n16 = e16.shape[:2]
    return scaled_mm(w8, sw, e16.reshape(b * n16, -1), se16).view(-1, b, n16)[:, :, :n]


def fp8_decomposition(wc8, swc, wu8, swu, ec16, sec16, eu16, seu16, idx, n: int) -> torch.Tensor:
    """[B, M, N] (a view of [M, B, N]): the two batched _scaled_mm, gather + add."""
    user = fp8_batched_gemm(wu8, swu, eu16, seu16, n)  # [M, U, N]
    out = fp8_batched_gemm(wc8, swc, ec16, sec16, n)  # [M, B, N]
    return out.add_(user.index_select(1, idx)).permute(1, 0, 2)


@per_problem
def _fp8_weights(p: LceProblem, i: LceInputs) -> tuple:
    """(w_cand8, scale, w_user8, scale), K padded to 16, once per problem (static weights)."""
    q = i.fp8
    return pad16(q.w_cand), q.w_cand_scale, pad16(q.w_user), q.w_user_scale


def _fp8_decomposition_args(p: LceProblem, w, i: LceInputs) -> tuple:
    q = i.fp8
    return (*w, q.e_cand16, q.e_cand16_scale, q.e_user16, q.e_user16_scale, p.idx, p.N)


def quantized_cat(p: LceProblem, e_user: torch.Tensor, e_cand: torch.Tensor) -> tuple:
    """What an FP8 model quantizes: cat(e_user[idx], e_cand) along K, one scale per candidate,
    transposed to [B, N16, K16]; with the scales repeated over each candidate's rows."""
    e = torch.cat([e_user.index_select(0, p.idx), e_cand], dim=1).transpose(1, 2)  # [B, N, K]
    e8, scale = quantize_rows(e, dim=(1, 2))
    e16 = pad16(pad16(e8.contiguous()), 1)
    return e16, scale.repeat_interleave(e16.shape[1])


@per_problem
def _fp8_cat_weight(p: LceProblem, i: LceInputs) -> tuple:
    w8, sw = quantize_rows(w_cat(p, i))
    return pad16(w8), sw


def fp8_cat_reference(p: LceProblem, i: LceInputs) -> torch.Tensor:
    """fp32 [B, M, N] of the fp8 materialize+scaled_mm provider's own quantized operands."""
    e16, se16 = quantized_cat(p, i.e_user, i.e_cand)
    w8, sw = _fp8_cat_weight(p, i)
    e = dequantize(e16.reshape(-1, e16.shape[-1]), se16).view(e16.shape)
    return torch.matmul(dequantize(w8, sw), e.transpose(1, 2))[:, :, :p.N]


def _fp8_cat(p: LceProblem, w, i: LceInputs) -> torch.Tensor:
    e16, se16 = quantized_cat(p, i.e_user, i.e_cand)
    return fp8_batched_gemm(*w, e16, se16, p.N).permute(1, 0, 2)


def _fp8_floor(p: LceProblem, w, i: LceInputs) -> torch.Tensor:
    q = i.fp8
    return fp8_batched_gemm(w[0], w[1], q.e_cand16, q.e_cand16_scale, p.N).permute(1, 0, 2)


def _fp8_floor_per_tensor(p: LceProblem, st, i: LceInputs) -> torch.Tensor:
    q = i.fp8
    return fp8_batched_gemm(q.w_cand_pt, q.w_cand_pt_scale, q.e_cand16_pt, q.e_cand_pt_scale, p.N).permute(1, 0, 2)


def _ours_fp8(quantize: bool, promote: bool = False) -> Callable:
    """The op on the FP8 operands; ``quantize``: quantize_fp8 of e in the call; ``promote``:
    LcePolicy(fp8_promote=True)."""
    def run(p: LceProblem, st, i: LceInputs) -> torch.Tensor:
        q, op = i.fp8, LIBS.get(IKBO[0])
        scales = {n: getattr(q, n) for n in ("w_cand_scale", "w_user_scale", "e_cand_scale",
                                             "e_user_scale")}
        e_cand, e_user = q.e_cand, q.e_user
        if quantize:
            (e_cand, scales["e_cand_scale"]), (e_user, scales["e_user_scale"]) = (
                op.quantize_fp8(e, dim=(1, 2), layout="transposed") for e in (i.e_cand, i.e_user))
        policy = op.LcePolicy(fp8_promote=True) if promote else None
        return op.lce(q.w_cand, q.w_user, e_cand, e_user, p.idx, validate=False, policy=policy, **scales)
    return run


def providers(fp8: bool = False) -> list:
    """In check order: torch first, ours last (a failure there cannot spoil the baselines); with
    ``fp8`` the FP8 providers too."""
    provs = [
        Provider("torch materialize+bmm", w_cat, lambda p, w, i: torch.matmul(w, _materialize(p, i))),
        Provider("torch bmm", lambda p, i: (w_cat(p, i), _materialize(p, i)), lambda p, st, i: torch.matmul(*st)),
        torch_path("torch decomposition", decomposition, _decomposition_args),
        torch_path("torch.compile decomposition", decomposition, _decomposition_args, compiled=True),
        torch_path("torch.compile decomposition max-autotune", decomposition_autotuned, _decomposition_args,
                   compiled=True, mode=AUTOTUNE_MODE, max_autotune=True),
        torch_path("torch.compile materialize+bmm", materialize_bmm, lambda p, w, i: (w, i.e_cand, i.e_user, p.idx),
                   w_cat, compiled=True),
        Provider("fp8 materialize+scaled_mm", _fp8_cat_weight, _fp8_cat, fp8="cat"),
        torch_path("fp8 decomposition", fp8_decomposition, _fp8_decomposition_args, _fp8_weights, fp8="operands"),
        torch_path("torch.compile fp8 decomposition", fp8_decomposition, _fp8_decomposition_args, _fp8_weights,
                   compiled=True, fp8="operands"),
        Provider("fp8 scaled_mm floor", _fp8_weights, _fp8_floor, fp8="operands", floor=True),
        Provider("fp8 scaled_mm floor, per-tensor", no_setup, _fp8_floor_per_tensor, fp8="per_tensor", floor=True),
        Provider("ikbo two_launch", no_setup, _ours("two_launch"), needs=IKBO),
        Provider("ikbo fused", no_setup, _ours("fused"), needs=IKBO),
        Provider("ikbo fp8", no_setup, _ours_fp8(False), needs=IKBO, fp8="operands"),
        Provider("ikbo fp8 + quantize", no_setup, _ours_fp8(True), needs=IKBO, fp8="operands"),
        Provider("ikbo fp8, promoted", no_setup, _ours_fp8(False, promote=True), needs=IKBO, fp8="operands",
                 extra=True),
    ]
    return [pr for pr in provs if fp8 or not pr.fp8]


def build_configs(args) -> tuple[list, dict]:
    """Unique (B, ratio, dtype) in run order, and group name -> its keys."""
    groups = {}
    if "published" in args.configs:
        groups["published"] = [(PUBLISHED["B"], PUBLISHED["ratio"], dt) for dt in args.dtype]
    for name in ("B", "ratio"):
        if name in args.configs:
            values = getattr(args, name) or SWEEPS[name]
            for dt in args.sweep_dtype:
                groups[f"{name} sweep ({dt})"] = [
                    (v, PUBLISHED["ratio"], dt) if name == "B" else (PUBLISHED["B"], v, dt)
                    for v in values]
    keys = list(dict.fromkeys(k for ks in groups.values() for k in ks))
    return keys, groups


def parse_args(argv=None):
    ap = harness.parser("bench_lce.py", __doc__)
    ap.add_argument("--configs", nargs="+", choices=["published", "B", "ratio"],
                    default=["published", "B", "ratio"],
                    help="published shape, B sweep (ratio 70), ratio sweep (B 1024)")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"],
                    help="dtypes of the published shape (fp8: the bf16 problem and its e4m3 quantization)")
    ap.add_argument("--sweep-dtype", nargs="+", choices=sorted(DTYPES), default=["fp16"])
    ap.add_argument("--B", type=int, nargs="+", help=f"B sweep values (default {SWEEPS['B']})")
    ap.add_argument("--ratio", type=int, nargs="+", help=f"ratio sweep values (default {SWEEPS['ratio']})")
    ap.add_argument("--M", type=int, default=PUBLISHED["M"])
    ap.add_argument("--N", type=int, default=PUBLISHED["N"])
    ap.add_argument("--K-user", dest="K_user", type=int, default=PUBLISHED["K_user"])
    ap.add_argument("--K-cand", dest="K_cand", type=int, default=PUBLISHED["K_cand"])
    ap.add_argument("--max-autotune", choices=["published", "all"], default="published",
                    help="where the max-autotune provider runs: the published shape (default) or every point")
    gemm_bench.add_args(ap, [p.name for p in providers(fp8=True)],
                        "skip the remaining sweep points once this many seconds have passed")
    return ap.parse_args(argv)


def _key(r: dict) -> tuple:
    return r["B"], r["ratio"], r["dtype"]


BENCH = gemm_bench.GemmBench(NAME, make_inputs, reference_output, fp8_cat_reference, SPEEDUP_COLUMNS,
                              FP8_SPEEDUP_COLUMNS, TIMED_COLUMNS, ROTATIONS)


@torch.no_grad()  # inference: no autograd bookkeeping in any provider
def main(argv=None) -> int:
    args = parse_args(argv)
    shape = {"M": args.M, "N": args.N, "K_user": args.K_user, "K_cand": args.K_cand}
    keys, groups = build_configs(args)
    provs = select(providers(fp8=any(k[2] == "fp8" for k in keys)), args.providers)
    published = set(groups.get("published", []))

    def problem_of(key) -> tuple:
        everywhere = key in published or args.max_autotune == "all"
        skip = {} if everywhere else {pr.name: AUTOTUNE_NOTE for pr in provs if pr.max_autotune}
        return make_problem(key[0], key[1], DTYPES[key[2]], shape), skip

    run, skipped = gemm_bench.run(BENCH, DEVICE, args, argv, provs, keys,
                                  [k[2] for k in keys], published, problem_of, shape=shape,
                                  settings={"max_autotune": args.max_autotune})
    for B, ratio, dt in skipped:
        run.note(f"time budget of {args.budget_s:.0f} s spent: skipped B={B} ratio={ratio} {dt}")
    rows = run.payload["rows"]
    for name, ks in groups.items():  # the sweeps: TFLOP/s of each provider at each point
        if name == "published" or not any(_key(r) in ks for r in rows):
            continue
        for mode in harness.TIMINGS[args.timing]:
            print(f"\n{name}: TFLOP/s, {mode}")
            table = harness.point_table(rows, ks, _key, "tflops" + harness.SUFFIX[mode],
                                        lambda k: {"B": k[0], "ratio": k[1]})
            harness.print_table(table, ["B", "ratio"] + [pr.name for pr in provs])
    return gemm_bench.finish(run)


if __name__ == "__main__":
    sys.exit(main())
