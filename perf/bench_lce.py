"""The linear-compression (LCE) ladder on one Hopper GPU: torch baselines, our kernel stages,
and a same-run cuBLAS ceiling.

    python -m perf.bench_lce                          # published shape (fp16, bf16) + B and ratio sweeps (fp16)
    python -m perf.bench_lce --configs published --dtype bf16
    python -m perf.bench_lce --configs ratio --ratio 2 70 10000

out[b] = w_cand @ e_cand[b] + w_user @ e_user[idx[b]]; w_cand [M, K_cand], w_user [M, K_user],
e_cand [B, K_cand, N], e_user [U, K_user, N], idx [B]. Useful work: 2 M N (B K_cand + U K_user).

Providers, each checked against an fp32 reference before it is timed (a wrong one is
reported, never timed); those that pass are timed in turns, one call of each per round:
  torch materialize+bmm    cat(e_user[idx], e_cand) along K, then one batched GEMM with
                           cat(w_user, w_cand) (the stage-0 baseline, copy timed)
  torch bmm                the same GEMM on a copy made beforehand (copy not timed)
  torch decomposition      user GEMM at U, candidate GEMM at B, then gather + add
  torch.compile decomposition
                           the decomposition under torch.compile (Inductor keeps cuBLAS for the
                           GEMMs and fuses the gather and add): the strongest torch path
  torch.compile decomposition max-autotune
                           the same, mode="max-autotune-no-cudagraphs" (it autotunes each GEMM
                           for tens of seconds: at the published shape only, unless
                           --max-autotune all)
  torch.compile materialize+bmm
                           materialize + batched GEMM under torch.compile
  ikbo two_launch          ikbo_gemm.lce(schedule="two_launch"): user GEMM, then the candidate
                           GEMM with the gather-add fused into its epilogue
  ikbo fused               ikbo_gemm.lce(schedule="fused"): one persistent warp-specialized kernel
FP8 (--dtype fp8 / --sweep-dtype fp8): the bf16 providers above on the bf16 inputs, and their
e4m3 peers, w with one scale per row, e with one per batch entry (ikbo_gemm.quantize_fp8's
formula, amax / 448), bf16 out. torch._scaled_mm takes e K-major, [B, N, K] as the rows of
one GEMM's B operand ([B N, K]), so each peer computes out^T per batch as [M, B N] and returns
its [B, M, N] view:
  fp8 materialize+scaled_mm    what an FP8 model does today: cat(e_user[idx], e_cand) along K,
                               quantized and transposed (timed), then one row-wise _scaled_mm
                               with the quantized cat(w_user, w_cand)
  fp8 decomposition            user _scaled_mm at U, candidate _scaled_mm at B, gather + add;
                               torch.compile fp8 decomposition: the same compiled
  fp8 scaled_mm floor          the candidate _scaled_mm alone; "..., per-tensor": with one scale
                               per operand (its own quantization), the faster form at M 433
  ikbo fp8                     ikbo_gemm.lce on the FP8 operands (e [B, N, K], rows 16 bytes
                               apart as quantize_fp8 returns them)
  ikbo fp8 + quantize          the same with quantize_fp8(e, dim=(1, 2), layout="transposed") of
                               e_cand and e_user [B, K, N] in the call
The FP8 operands are quantized once, untimed (but by the providers that say so); _scaled_mm's
need K and N divisible by 16: the torch peers get e padded with zeros to [B, N16, K16] then
(and the per-batch scales repeated over their N16 rows), the weights once per problem. rel_err of an FP8
provider is against the fp32 formula on its dequantized operands (materialize: its own
quantized concatenation), quant_err against the bf16 problem's fp32 reference.
The torch.compile providers compile afresh for each problem (static shapes, one graph, no
Inductor disk cache), so compile_s is a cold compile.
Columns: median ms, TFLOP/s, speedup over each torch provider (its ms / this ms: x_mat_bmm,
x_bmm, x_decomp, and x_compiled over the compiled decomposition), percent of the 8192^3 cuBLAS
GEMM ceiling, and compile_s = first call (synchronized) minus a steady call.

Timing (--timing, docs/benchmarks.md): interleaved (the default), sustained or both; sustained adds
about 3 s per provider and point: --configs published --timing both for the headline.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Optional

import torch

from perf import gemm_bench, harness
from perf.fp8_peers import FP8, dequantize, pad16, quantize_rows, rows_16_apart, scaled_mm
from perf.gemm_bench import GemmProvider as Provider, w_cat
from perf.harness import make_idx, user_counts
from perf.providers import LIBS, select

NAME = "bench_lce"
IKBO = ("ikbo_gemm.lce",)  # what the ikbo providers need
DTYPES = {**harness.DTYPES, "fp8": FP8}
DEVICE = "cuda"  # a CPU dry run of the whole script swaps it (tests)
PUBLISHED = {"B": 1024, "ratio": 70, "M": 433, "N": 256, "K_user": 1184, "K_cand": 872}
SWEEPS = {"B": [256, 512, 1024, 2048, 4096], "ratio": [2, 5, 10, 30, 70, 200, 1000, 10000]}
SPEEDUP_COLUMNS = {"torch materialize+bmm": "x_mat_bmm", "torch bmm": "x_bmm",
                   "torch decomposition": "x_decomp", "torch.compile decomposition": "x_compiled"}
FP8_SPEEDUP_COLUMNS = {"fp8 materialize+scaled_mm": "x_fp8_mat", "fp8 decomposition": "x_fp8_decomp",
                       "torch.compile fp8 decomposition": "x_fp8_compiled", "fp8 scaled_mm floor": "x_fp8_floor",
                       "fp8 scaled_mm floor, per-tensor": "x_fp8_floor_pt",
                       "ikbo fused": "x_ikbo_bf16"}
AUTOTUNE_MODE = "max-autotune-no-cudagraphs"


def lce_flops(M: int, N: int, B: int, U: int, K_user: int, K_cand: int) -> int:
    return 2 * M * N * (B * K_cand + U * K_user)


@dataclasses.dataclass
class LceProblem:
    B: int
    ratio: int
    M: int
    N: int
    K_user: int
    K_cand: int
    dtype: torch.dtype
    counts: list
    idx: torch.Tensor  # int32 [B] on the GPU
    cache: dict = dataclasses.field(default_factory=dict)

    @property
    def U(self) -> int:
        return len(self.counts)

    @property
    def flops(self) -> int:
        return lce_flops(self.M, self.N, self.B, self.U, self.K_user, self.K_cand)

    def fields(self) -> dict:
        return {"B": self.B, "ratio": self.ratio, "U": self.U, "M": self.M, "N": self.N,
                "K_user": self.K_user, "K_cand": self.K_cand,
                "dtype": {v: k for k, v in DTYPES.items()}[self.dtype]}


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

    def scales(self) -> dict:
        return {n: getattr(self, n) for n in ("w_cand_scale", "w_user_scale", "e_cand_scale", "e_user_scale")}

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
    counts = user_counts(B, ratio)  # exact ratio, last user the remainder (70 x 14 + 44)
    idx = make_idx(counts, "sorted").to(device or DEVICE)
    return LceProblem(B, ratio, shape["M"], shape["N"], shape["K_user"], shape["K_cand"], dtype,
                      counts, idx)


def make_inputs(p: LceProblem, gen: torch.Generator, device=None) -> LceInputs:
    device = device or DEVICE

    dtype = torch.bfloat16 if p.dtype == FP8 else p.dtype  # FP8: the bf16 problem and its quantization

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    # weights scaled like a trained layer (std 1/sqrt(K)) so outputs stay O(1) in fp16
    inp = LceInputs(randn(p.M, p.K_cand, scale=(p.K_cand + p.K_user) ** -0.5),
                    randn(p.M, p.K_user, scale=(p.K_cand + p.K_user) ** -0.5),
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


# --------------------------------------------------------------------------- providers


def _materialize(p: LceProblem, inp: LceInputs) -> torch.Tensor:
    return torch.cat([inp.e_user[p.idx], inp.e_cand], dim=1)  # [B, K_user + K_cand, N]


def _bmm_setup(p: LceProblem, inp: LceInputs):
    return w_cat(p, inp), _materialize(p, inp)


# The torch paths on plain tensors, the form torch.compile is given.

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


def _decomposition(p: LceProblem, st, inp: LceInputs) -> torch.Tensor:
    return decomposition(inp.w_cand, inp.w_user, inp.e_cand, inp.e_user, p.idx)


def _compiled(name: str, fn: Callable, mode: Optional[str] = None) -> Provider:
    """A provider running ``harness.torch_compiled(fn, mode)``, compiled at its first call."""
    def setup(p: LceProblem, inp: LceInputs):
        return harness.torch_compiled(fn, mode)

    def run(p: LceProblem, f, i: LceInputs) -> torch.Tensor:
        return f(i.w_cand, i.w_user, i.e_cand, i.e_user, p.idx)

    return Provider(name, setup, run, max_autotune=mode == AUTOTUNE_MODE)


def _compiled_materialize_bmm() -> Provider:
    def setup(p: LceProblem, inp: LceInputs):
        return w_cat(p, inp), harness.torch_compiled(materialize_bmm)

    return Provider("torch.compile materialize+bmm", setup,
                    lambda p, st, i: st[1](st[0], i.e_cand, i.e_user, p.idx))


def _ours(schedule: str) -> Callable:
    def run(p: LceProblem, st, inp: LceInputs) -> torch.Tensor:
        return LIBS.get(IKBO[0]).lce(inp.w_cand, inp.w_user, inp.e_cand, inp.e_user, p.idx,
                                     schedule=schedule, validate=False)
    return run


# --------------------------------------------------------------------------- FP8 providers

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


def _fp8_weights(p: LceProblem, i: LceInputs) -> tuple:
    """(w_cand8, scale, w_user8, scale), K padded to 16, once per problem (static weights)."""
    if "w8" not in p.cache:
        q = i.fp8
        p.cache["w8"] = (pad16(q.w_cand), q.w_cand_scale, pad16(q.w_user), q.w_user_scale)
    return p.cache["w8"]


def _fp8_args(p: LceProblem, w, i: LceInputs) -> tuple:
    q = i.fp8
    return (w[0], w[1], w[2], w[3], q.e_cand16, q.e_cand16_scale, q.e_user16, q.e_user16_scale, p.idx, p.N)


def quantized_cat(p: LceProblem, e_user: torch.Tensor, e_cand: torch.Tensor) -> tuple:
    """What an FP8 model quantizes: cat(e_user[idx], e_cand) along K, one scale per candidate,
    transposed to [B, N16, K16]; with the scales repeated over each candidate's rows."""
    e = torch.cat([e_user.index_select(0, p.idx), e_cand], dim=1).transpose(1, 2)  # [B, N, K]
    e8, scale = quantize_rows(e, dim=(1, 2))
    e16 = pad16(pad16(e8.contiguous()), 1)
    return e16, scale.repeat_interleave(e16.shape[1])


def _fp8_cat_weight(p: LceProblem, i: LceInputs) -> tuple:
    if "w8_cat" not in p.cache:
        w8, sw = quantize_rows(w_cat(p, i))
        p.cache["w8_cat"] = (pad16(w8), sw)
    return p.cache["w8_cat"]


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


def _ours_fp8(quantize: bool) -> Callable:
    def run(p: LceProblem, st, i: LceInputs) -> torch.Tensor:
        q, op = i.fp8, LIBS.get(IKBO[0])
        scales = q.scales()
        e_cand, e_user = q.e_cand, q.e_user
        if quantize:
            (e_cand, scales["e_cand_scale"]), (e_user, scales["e_user_scale"]) = (
                op.quantize_fp8(e, dim=(1, 2), layout="transposed") for e in (i.e_cand, i.e_user))
        return op.lce(q.w_cand, q.w_user, e_cand, e_user, p.idx, validate=False, **scales)
    return run


def providers(fp8: bool = False) -> list:
    """In check order: torch first, ours last (a failure there cannot spoil the baselines); with
    ``fp8`` the FP8 providers too."""
    fp8_torch = [
        Provider("fp8 materialize+scaled_mm", _fp8_cat_weight, _fp8_cat, fp8="cat"),
        Provider("fp8 decomposition", _fp8_weights, lambda p, w, i: fp8_decomposition(*_fp8_args(p, w, i)),
                 fp8="operands"),
        Provider("torch.compile fp8 decomposition",
                 lambda p, i: (_fp8_weights(p, i), harness.torch_compiled(fp8_decomposition)),
                 lambda p, st, i: st[1](*_fp8_args(p, st[0], i)), fp8="operands"),
        Provider("fp8 scaled_mm floor", _fp8_weights, _fp8_floor, fp8="operands", floor=True),
        Provider("fp8 scaled_mm floor, per-tensor", lambda p, i: None, _fp8_floor_per_tensor, fp8="per_tensor",
                 floor=True),
    ] if fp8 else []
    fp8_ours = [
        Provider("ikbo fp8", lambda p, i: None, _ours_fp8(False), needs=IKBO, fp8="operands"),
        Provider("ikbo fp8 + quantize", lambda p, i: None, _ours_fp8(True), needs=IKBO, fp8="operands"),
    ] if fp8 else []
    return [
        Provider("torch materialize+bmm", w_cat,
                 lambda p, w, i: torch.matmul(w, _materialize(p, i))),
        Provider("torch bmm", _bmm_setup, lambda p, st, i: torch.matmul(st[0], st[1])),
        Provider("torch decomposition", lambda p, i: None, _decomposition),
        _compiled("torch.compile decomposition", decomposition),
        _compiled("torch.compile decomposition max-autotune", decomposition_autotuned, AUTOTUNE_MODE),
        _compiled_materialize_bmm(),
        *fp8_torch,
        Provider("ikbo two_launch", lambda p, i: None, _ours("two_launch"), needs=IKBO),
        Provider("ikbo fused", lambda p, i: None, _ours("fused"), needs=IKBO),
        *fp8_ours,
    ]


def speedup_columns(dtype: torch.dtype) -> dict:
    """Peer provider -> ratio column: the 16-bit peers, and on FP8 problems the FP8 ones and ikbo bf16."""
    return {**SPEEDUP_COLUMNS, **FP8_SPEEDUP_COLUMNS} if dtype == FP8 else SPEEDUP_COLUMNS


CHECK = {"reference": reference_output, "cat_reference": fp8_cat_reference}  # gemm_bench.check_providers'


# --------------------------------------------------------------------------- configurations

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
    ap = argparse.ArgumentParser(prog="bench_lce.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    names = [p.name for p in providers(fp8=True)]
    gemm_bench.add_args(ap, names, "skip the remaining sweep points once this many seconds have passed")
    return gemm_bench.parse(ap, argv, names)


TIMED_COLUMNS = ["ms", "tflops", "pct_ceiling", *SPEEDUP_COLUMNS.values(),
                 *FP8_SPEEDUP_COLUMNS.values()]  # per timing mode
AUTOTUNE_NOTE = "max-autotune compiles for tens of seconds: at the published shape only (--max-autotune all)"


def print_problem(p: LceProblem, rows: list, timing: str) -> None:
    f = p.fields()
    harness.print_rows(f"B={f['B']} ratio={f['ratio']} (U={f['U']}) M={f['M']} N={f['N']} K_user={f['K_user']} "
                       f"K_cand={f['K_cand']} {f['dtype']}  [{p.flops / 1e9:.1f} GFLOP; x_* = that torch "
                       f"provider's ms / this ms, in the same timing]", rows, gemm_bench.COLUMNS, TIMED_COLUMNS, timing)


@torch.no_grad()  # inference: no autograd bookkeeping in any provider
def main(argv=None) -> int:
    args = parse_args(argv)
    shape = {"M": args.M, "N": args.N, "K_user": args.K_user, "K_cand": args.K_cand}
    keys, groups = build_configs(args)
    provs = select(providers(fp8=any(k[2] == "fp8" for k in keys)), args.providers)
    published = set(groups.get("published", []))

    def measure(key, ceilings) -> list:
        B, ratio, dt = key
        gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
        p = make_problem(B, ratio, DTYPES[dt], shape)
        skip = {} if key in published or args.max_autotune == "all" else {
            pr.name: AUTOTUNE_NOTE for pr in provs if pr.max_autotune}
        rows = gemm_bench.run_problem(p, make_inputs(p, gen), provs, args, ceilings[dt], skip=skip,
                                      peers=speedup_columns(p.dtype), device=DEVICE, **CHECK)
        print_problem(p, rows, args.timing)
        return rows

    payload, skipped, stamp = gemm_bench.run(NAME, args, argv, provs, keys, [k[2] for k in keys], published,
                                             measure, shape=shape, settings={"max_autotune": args.max_autotune})
    for B, ratio, dt in skipped:
        note = f"time budget of {args.budget_s:.0f} s spent: skipped B={B} ratio={ratio} {dt}"
        print(f"{NAME}: {note}", flush=True)
        payload["notes"].append(note)
    for name, ks in groups.items():
        sel = [r for r in payload["rows"] if (r["B"], r["ratio"], r["dtype"]) in set(ks)]
        for mode in harness.timing_modes(args.timing) if sel and name != "published" else []:
            print(f"\n{name}: TFLOP/s, {mode}")
            table = []
            for k in ks:
                line = {"B": k[0], "ratio": k[1]}
                for r in sel:
                    if (r["B"], r["ratio"], r["dtype"]) == k:
                        ok = r["status"] == "ok"
                        line[r["provider"]] = r.get("tflops" + harness.SUFFIX[mode]) if ok else r["status"]
                table.append(line)
            harness.print_table(table, ["B", "ratio"] + [pr.name for pr in provs])
    return gemm_bench.finish(NAME, payload, args, stamp)


if __name__ == "__main__":
    sys.exit(main())
