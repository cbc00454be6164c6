"""A linear layer over concatenated user and candidate features on one Hopper GPU: torch
baselines, ``ikbo_gemm.linear`` and a same-run cuBLAS ceiling.

    python -m perf.bench_linear                          # the headline and ratio groups
    python -m perf.bench_linear --configs grid --budget-s 3600
    python -m perf.bench_linear --configs headline --N 256 --activation none gelu --timing both

out[b] = act(x_cand[b] @ w_cand^T + x_user[idx[b]] @ w_user^T + bias); x_cand [B, K_cand],
x_user [U, K_user], w_cand [N, K_cand], w_user [N, K_user] (nn.Linear's [out, in]), bias [N],
idx [B]. Useful work: 2 N (B K_cand + U K_user). The providers (``--dtype fp8``: also the FP8
ones), columns and configuration groups: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from perf import gemm_bench, harness
from perf.fp8_peers import FP8, dequantize, pad16, quantize_rows, scaled_mm
from perf.gemm_bench import DTYPES, GemmProvider as Provider, no_setup, torch_path, w_cat
from perf.harness import per_problem
from perf.providers import LIBS

NAME = "bench_linear"
IKBO = ("ikbo_gemm.linear",)  # what the ikbo providers need
DEVICE = "cuda"  # a CPU dry run of the whole script swaps it (tests)
ROTATIONS = 1024  # the inputs are small: enough copies that 3x L2 lies between two uses of one
K_PAIRS = [(512, 512), (1024, 2048), (4096, 4096)]  # (K_user, K_cand)
GROUPS = {
    "headline": {"B": [2048, 8192], "ratio": [70], "K": K_PAIRS, "N": [1024, 4096],
                 "dtype": ["bf16", "fp16"], "activation": ["relu"]},
    "ratio": {"B": [2048], "ratio": [10, 70, 1000], "K": [(1024, 2048)], "N": [1024],
              "dtype": ["bf16"], "activation": ["relu", "none"]},
    "grid": {"B": [512, 2048, 8192], "ratio": [10, 70, 1000], "K": K_PAIRS, "N": [256, 1024, 4096],
             "dtype": ["bf16", "fp16"], "activation": ["relu", "none"]},
}
ACTIVATIONS = {"none": lambda x: x, "relu": torch.relu, "gelu": F.gelu,
               "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "silu": F.silu,
               "sigmoid": torch.sigmoid}
OURS = "ikbo linear"
OURS_FP8 = "ikbo linear fp8"
OURS_FP8_PROMOTED = "ikbo linear fp8, promoted"  # PlanRules(fp8_promote=True)
# Extra providers: the op under launch-plan rules other than its own (linear.PlanRules), by the
# name of the rule set in ikbo_gemm.linear, and the column of the op's row that compares them.
# The op under other launch-plan rules (ikbo_gemm.PlanRules.parse specs; each is a named rule set
# of ikbo_gemm.linear: SMALL_GRID_RULES, WIDE_USER_RULES, ...), and its ratio column.
PLAN_VARIANTS = {"ikbo linear, small-grid rules": ("split_k=1,user_pairs=1", "x_small_grid"),
                 "ikbo linear, wide user phase": ("wide_user=1", "x_wide_user"),
                 "ikbo linear, split K + wide user": ("split_k=1,wide_user=1", "x_split_wide_user"),
                 "ikbo linear, no shared tile": ("shared_tile_min_k=none", "x_no_shared_tile"),
                 "ikbo linear, no user cluster split": ("user_cluster_split=0", "x_no_user_cluster_split"),
                 "ikbo linear, spare SMs by MACs": ("spare_by_time=0", "x_spare_by_macs"),
                 "ikbo linear, row-group raster 8": ("cand_band_rows=8", "x_raster8"),
                 "ikbo linear, column-tile walk": ("cand_band_rows=1", "x_column_walk"),
                 "ikbo linear, shared tile": ("cand_split=128x256x1", "x_shared_tile"),
                 "ikbo linear, 2x2 clusters": ("cand_cluster_n=2", "x_cluster_2x2")}
SPEEDUP_COLUMNS = {"torch cat+linear": "x_cat_linear", "torch decomposition": "x_decomp",
                   "torch.compile decomposition": "x_compiled", "torch addmm floor": "x_floor",
                   **{name: column for name, (_, column) in PLAN_VARIANTS.items()}}
FP8_SPEEDUP_COLUMNS = {"fp8 cat+scaled_mm": "x_fp8_cat", "fp8 decomposition": "x_fp8_decomp",
                       "torch.compile fp8 decomposition": "x_fp8_compiled", "fp8 scaled_mm floor": "x_fp8_floor",
                       OURS: "x_ikbo_bf16", OURS_FP8_PROMOTED: "x_fp8_promoted"}


def linear_flops(B: int, U: int, N: int, K_user: int, K_cand: int) -> int:
    return 2 * N * (B * K_cand + U * K_user)


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation`` (a name of ACTIVATIONS) applied to ``x``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation](x)


@dataclasses.dataclass(kw_only=True)
class LinearProblem(gemm_bench.GemmProblem):
    K_user: int
    K_cand: int
    N: int
    activation: str

    @property
    def flops(self) -> int:
        return linear_flops(self.B, self.U, self.N, self.K_user, self.K_cand)

    def fields(self) -> dict:
        return super().fields("K_user", "K_cand", "N", activation=self.activation)


@dataclasses.dataclass
class Fp8Operands:
    """The layer's operands in e4m3, each with its row-wise float32 scale."""

    x_cand: torch.Tensor  # [B, K_cand] e4m3
    x_user: torch.Tensor
    w_cand: torch.Tensor
    w_user: torch.Tensor
    x_cand_scale: torch.Tensor  # [B]
    x_user_scale: torch.Tensor  # [U]
    w_cand_scale: torch.Tensor  # [N]
    w_user_scale: torch.Tensor  # [N]

    @staticmethod
    def of(x_cand, x_user, w_cand, w_user) -> "Fp8Operands":
        (xc, sxc), (xu, sxu), (wc, swc), (wu, swu) = map(quantize_rows, (x_cand, x_user, w_cand, w_user))
        return Fp8Operands(xc, xu, wc, wu, sxc, sxu, swc, swu)


@dataclasses.dataclass
class LinearInputs:
    x_cand: torch.Tensor
    x_user: torch.Tensor
    w_cand: torch.Tensor
    w_user: torch.Tensor
    bias: torch.Tensor
    fp8: Optional[Fp8Operands] = None  # --dtype fp8: the operands quantized (the 16-bit ones are bf16)

    def clone_activations(self) -> "LinearInputs":
        """A copy of the per-request features; the weights and bias stay shared."""
        fp8 = self.fp8 and dataclasses.replace(self.fp8, x_cand=self.fp8.x_cand.clone(),
                                               x_user=self.fp8.x_user.clone())
        return dataclasses.replace(self, x_cand=self.x_cand.clone(), x_user=self.x_user.clone(), fp8=fp8)

    def activation_bytes(self) -> int:
        extra = (self.fp8.x_cand, self.fp8.x_user) if self.fp8 else ()
        return sum(t.numel() * t.element_size() for t in (self.x_cand, self.x_user, *extra))

    def dequantized(self) -> "LinearInputs":
        """fp32 inputs of the FP8 operands' values (the bias as it is)."""
        q = self.fp8
        return LinearInputs(dequantize(q.x_cand, q.x_cand_scale), dequantize(q.x_user, q.x_user_scale),
                            dequantize(q.w_cand, q.w_cand_scale), dequantize(q.w_user, q.w_user_scale), self.bias)


def make_problem(B, ratio, K_user, K_cand, N, dtype, activation, device=None) -> LinearProblem:
    return LinearProblem.of(B, ratio, dtype, device or DEVICE, K_user=K_user, K_cand=K_cand, N=N,
                            activation=activation)


def make_inputs(p: LinearProblem, gen: torch.Generator, device=None) -> LinearInputs:
    dtype = torch.bfloat16 if p.dtype == FP8 else p.dtype  # FP8: the bf16 layer and its quantization

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device or DEVICE) * scale).to(dtype)

    w_scale = (p.K_user + p.K_cand) ** -0.5  # like a trained layer: outputs O(1)
    inp = LinearInputs(randn(p.B, p.K_cand), randn(p.U, p.K_user), randn(p.N, p.K_cand, scale=w_scale),
                       randn(p.N, p.K_user, scale=w_scale), randn(p.N, scale=0.5))
    if p.dtype == FP8:
        inp.fp8 = Fp8Operands.of(inp.x_cand, inp.x_user, inp.w_cand, inp.w_user)
    return inp


def reference_output(p: LinearProblem, inp: LinearInputs, user_side: bool = True) -> torch.Tensor:
    """fp32 [B, N]; without ``user_side``, the floor's: the candidate GEMM, bias, activation."""
    out = inp.x_cand.float() @ inp.w_cand.float().T + inp.bias.float()
    if user_side:
        out += (inp.x_user.float() @ inp.w_user.float().T)[p.idx.long()]
    return activate(out, p.activation)


def decomposition(x_cand, x_user, idx, w_cand, w_user, bias, activation: str) -> torch.Tensor:
    user = F.linear(x_user, w_user)  # [U, N]
    out = F.linear(x_cand, w_cand, bias)  # [B, N]
    return activate(out.add_(user.index_select(0, idx)), activation)


def _decomposition_args(p: LinearProblem, st, i: LinearInputs) -> tuple:
    return i.x_cand, i.x_user, p.idx, i.w_cand, i.w_user, i.bias, p.activation


def _cat_linear(p: LinearProblem, w: torch.Tensor, i: LinearInputs) -> torch.Tensor:
    x = torch.cat([i.x_user.index_select(0, p.idx), i.x_cand], dim=1)  # [B, K_user + K_cand]
    return activate(F.linear(x, w, i.bias), p.activation)


def _act(p: LinearProblem) -> Optional[str]:
    """The op's activation argument."""
    return None if p.activation == "none" else p.activation


def _ours(p: LinearProblem, op, i: LinearInputs) -> torch.Tensor:
    return op(i.x_cand, i.x_user, p.idx, i.w_cand, i.w_user, i.bias, activation=_act(p), validate=False)


def fp8_decomposition(xc8, sxc, xu8, sxu, idx, wc8, swc, wu8, swu, bias, n: int, activation: str) -> torch.Tensor:
    """Two row-wise _scaled_mm (operands padded to 16), gather, add, bias, activation."""
    user = scaled_mm(xu8, sxu, wu8, swu, n)  # [U, N] bf16
    out = scaled_mm(xc8, sxc, wc8, swc, n)  # [B, N]
    return activate(out + user.index_select(0, idx) + bias, activation)


@per_problem
def _fp8_weights(p: LinearProblem, i: LinearInputs) -> tuple:
    """(w_cand8, w_user8, their scales): K and N padded to 16, once per problem (static weights)."""
    q = i.fp8
    return (pad16(pad16(q.w_cand), 0), pad16(pad16(q.w_user), 0),
            pad16(q.w_cand_scale, value=1.0), pad16(q.w_user_scale, value=1.0))


def _fp8_decomposition_args(p: LinearProblem, w, i: LinearInputs) -> tuple:
    q = i.fp8
    wc8, wu8, swc, swu = w
    return (pad16(q.x_cand), q.x_cand_scale, pad16(q.x_user), q.x_user_scale, p.idx, wc8, swc, wu8, swu, i.bias,
            p.N, p.activation)


def quantized_cat(p: LinearProblem, x_user: torch.Tensor, x_cand: torch.Tensor) -> tuple:
    """What an FP8 model quantizes: cat(x_user[idx], x_cand), K padded to 16, one scale per row."""
    return quantize_rows(pad16(torch.cat([x_user.index_select(0, p.idx), x_cand], dim=1)))


@per_problem
def _fp8_cat_weight(p: LinearProblem, i: LinearInputs) -> tuple:
    """cat(w_user, w_cand) quantized once per problem, K and N padded to 16."""
    w8, sw = quantize_rows(w_cat(p, i))
    return pad16(pad16(w8), 0), pad16(sw, value=1.0)


def fp8_cat_reference(p: LinearProblem, i: LinearInputs) -> torch.Tensor:
    """fp32 [B, N] of the fp8 cat+scaled_mm provider's own quantized operands."""
    x8, sx = quantized_cat(p, i.x_user, i.x_cand)
    w8, sw = _fp8_cat_weight(p, i)
    return activate((dequantize(x8, sx) @ dequantize(w8, sw).T)[:, :p.N] + i.bias.float(), p.activation)


def _fp8_cat(p: LinearProblem, w, i: LinearInputs) -> torch.Tensor:
    x8, sx = quantized_cat(p, i.x_user, i.x_cand)
    return activate(scaled_mm(x8, sx, *w, p.N) + i.bias, p.activation)


def _fp8_floor(p: LinearProblem, w, i: LinearInputs) -> torch.Tensor:
    q = i.fp8
    return activate(scaled_mm(pad16(q.x_cand), q.x_cand_scale, w[0], w[2], p.N) + i.bias, p.activation)


def _ours_fp8(quantize: bool):
    """ikbo_gemm.linear on the FP8 operands, under the PlanRules its setup gave (None: the op's);
    ``quantize``: quantize_fp8 of the features in the call."""
    def run(p: LinearProblem, rules, i: LinearInputs) -> torch.Tensor:
        q, op = i.fp8, LIBS.get(IKBO[0])
        scales = {k: v for k, v in vars(q).items() if k.endswith("_scale")}
        x_cand, x_user = q.x_cand, q.x_user
        if quantize:
            (x_cand, scales["x_cand_scale"]), (x_user, scales["x_user_scale"]) = map(op.quantize_fp8,
                                                                                     (i.x_cand, i.x_user))
        return op.linear(x_cand, x_user, p.idx, q.w_cand, q.w_user, i.bias, activation=_act(p), validate=False,
                         rules=rules, **scales)
    return run


def ours_with_rules(name: str, spec: str, fp8: bool = False, extra: bool = True) -> Provider:
    """The op under ``ikbo_gemm.PlanRules.parse(spec)`` (read at setup), on the 16-bit or (``fp8``)
    FP8 operands."""
    def rules(p, i):
        return LIBS.get(IKBO[0]).PlanRules.parse(spec)

    if fp8:
        return Provider(name, rules, _ours_fp8(False), needs=IKBO, fp8="operands", extra=extra)
    return Provider(name, lambda p, i: functools.partial(LIBS.get(IKBO[0]).linear, rules=rules(p, i)), _ours,
                    needs=IKBO, extra=extra)


def providers(fp8: bool = False) -> list:
    """In check order: torch first, ours last (a failure there cannot spoil the baselines); with
    ``fp8`` the FP8 providers too."""
    provs = [
        Provider("torch cat+linear", w_cat, _cat_linear),
        torch_path("torch decomposition", decomposition, _decomposition_args),
        torch_path("torch.compile decomposition", decomposition, _decomposition_args, compiled=True),
        Provider("torch addmm floor", no_setup, floor=True, run=lambda p, st, i: activate(
            torch.addmm(i.bias, i.x_cand, i.w_cand.T), p.activation)),
        Provider("fp8 cat+scaled_mm", _fp8_cat_weight, _fp8_cat, fp8="cat"),
        torch_path("fp8 decomposition", fp8_decomposition, _fp8_decomposition_args, _fp8_weights, fp8="operands"),
        torch_path("torch.compile fp8 decomposition", fp8_decomposition, _fp8_decomposition_args, _fp8_weights,
                   compiled=True, fp8="operands"),
        Provider("fp8 scaled_mm floor", _fp8_weights, _fp8_floor, floor=True, fp8="operands"),
        *(ours_with_rules(name, spec) for name, (spec, _) in PLAN_VARIANTS.items()),
        Provider(OURS, lambda p, i: LIBS.get(IKBO[0]).linear, _ours, needs=IKBO),
        Provider(OURS_FP8, no_setup, _ours_fp8(False), needs=IKBO, fp8="operands"),
        Provider("ikbo linear fp8 + quantize", no_setup, _ours_fp8(True), needs=IKBO, fp8="operands"),
        ours_with_rules(OURS_FP8_PROMOTED, "fp8_promote=1", fp8=True),
        ours_with_rules("ikbo linear fp8, spare SMs by MACs", "spare_by_time=0", fp8=True),
        ours_with_rules("ikbo linear fp8, no user cluster split", "user_cluster_split=0", fp8=True),
        ours_with_rules("ikbo linear fp8, row-group raster 8", "cand_band_rows=8", fp8=True),
        ours_with_rules("ikbo linear fp8, column-tile walk", "cand_band_rows=1", fp8=True),
        ours_with_rules("ikbo linear fp8, 2x2 clusters", "cand_cluster_n=2", fp8=True),
        ours_with_rules("ikbo linear fp8 promoted, 2x2 clusters", "fp8_promote=1,cand_cluster_n=2", fp8=True),
    ]
    return [pr for pr in provs if fp8 or not pr.fp8]


def chosen_providers(names, fp8: bool = False) -> list:
    """The providers ``--providers`` names, or every one but the extra ones (``fp8``: with the FP8 ones)."""
    return [pr for pr in providers(fp8) if (pr.name in names if names else not pr.extra)]


def build_configs(args) -> tuple[list, dict]:
    """Unique (B, ratio, K_user, K_cand, N, dtype, activation) in run order, and group -> its keys."""
    groups = {}
    for name in args.configs:
        axes = [getattr(args, a) or GROUPS[name][a] for a in ("B", "ratio", "K", "N", "dtype", "activation")]
        groups[name] = [(B, ratio, k[0], k[1], N, dt, act) for B, ratio, k, N, dt, act in itertools.product(*axes)]
    keys = list(dict.fromkeys(k for ks in groups.values() for k in ks))
    return keys, groups


def _k_pair(text: str) -> tuple[int, int]:
    try:
        k_user, k_cand = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K_user,K_cand (two integers), got {text!r}") from None
    if k_user < 1 or k_cand < 1:
        raise argparse.ArgumentTypeError(f"K_user and K_cand must be >= 1, got {text!r}")
    return k_user, k_cand


def parse_args(argv=None):
    ap = harness.parser("bench_linear.py", __doc__)
    ap.add_argument("--configs", nargs="+", choices=sorted(GROUPS), default=["headline", "ratio"],
                    help="configuration groups (default: headline ratio)")
    ap.add_argument("--B", type=int, nargs="+", help="candidates, in every group chosen")
    ap.add_argument("--ratio", type=int, nargs="+", help="candidates per user")
    ap.add_argument("--K", type=_k_pair, nargs="+", metavar="K_USER,K_CAND", help="feature widths")
    ap.add_argument("--N", type=int, nargs="+", help="output features")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES),
                    help="fp8: the bf16 layer and its e4m3 quantization, both (module docstring)")
    ap.add_argument("--activation", nargs="+", choices=ACTIVATIONS)
    gemm_bench.add_args(ap, [p.name for p in providers(fp8=True)],
                        "skip the remaining points (the headline group's excepted) once this many seconds have passed")
    return ap.parse_args(argv)


TIMED_COLUMNS = ["us", "tflops", "pct_ceiling", *SPEEDUP_COLUMNS.values(),
                 *FP8_SPEEDUP_COLUMNS.values()]  # per timing mode
KEY_FIELDS = ["B", "ratio", "K_user", "K_cand", "N", "dtype", "activation"]


def _key(r: dict) -> tuple:
    return tuple(r[f] for f in KEY_FIELDS)


def summary(rows: list, groups: dict, provs: list, timing: str) -> None:
    """Per group and timing mode: each point's us per provider, then ours' ratios (at FP8 points
    those of ikbo linear fp8)."""
    by = {(_key(r), r["provider"]): r for r in rows}
    done = {key for key, _ in by}
    for name, keys in groups.items():
        fp8 = any(k[5] == "fp8" for k in keys)
        names = [pr.name for pr in provs if not pr.fp8 or fp8]
        for s in harness.mode_suffixes(timing):
            table = harness.point_table(rows, [k for k in keys if k in done], _key, "us" + s,
                                        lambda k: dict(zip(KEY_FIELDS, k)))
            ratios = list(SPEEDUP_COLUMNS.values())
            for line in table:
                columns = gemm_bench.peer_columns(DTYPES[line["dtype"]], SPEEDUP_COLUMNS,
                                                  FP8_SPEEDUP_COLUMNS).values()
                ratios += [c for c in columns if c not in ratios]
                ours = by.get((_key(line), OURS_FP8 if line["dtype"] == "fp8" else OURS), {})
                line.update({c: ours.get(c + s) for c in [*columns, "pct_ceiling"]})
            if table:
                mode = {"": "", "_sustained": ", sustained", "_graph": ", CUDA-graph replays"}[s]
                print(f"\n{name}: us per call{mode} (x_* and pct_ceiling: {OURS}"
                      f"{f'; at fp8 points {OURS_FP8}' if fp8 else ''})")
                harness.print_table(table, KEY_FIELDS + names + ratios + ["pct_ceiling"])


BENCH = gemm_bench.GemmBench(NAME, make_inputs, reference_output, fp8_cat_reference, SPEEDUP_COLUMNS,
                              FP8_SPEEDUP_COLUMNS, TIMED_COLUMNS, ROTATIONS, in_us=True)


@torch.no_grad()  # inference: no autograd bookkeeping in any provider
def main(argv=None) -> int:
    args = parse_args(argv)
    keys, groups = build_configs(args)
    provs = chosen_providers(args.providers, fp8=any(k[5] == "fp8" for k in keys))
    run, skipped = gemm_bench.run(
        BENCH, DEVICE, args, argv, provs, keys, [k[5] for k in keys],
        set(groups.get("headline", [])), lambda k: (make_problem(*k[:5], DTYPES[k[5]], k[6]), None),
        groups={n: len(ks) for n, ks in groups.items()}, settings={})
    if skipped:
        run.note(f"time budget of {args.budget_s:.0f} s spent: {len(skipped)} of {len(keys)} points skipped")
    summary(run.payload["rows"], groups, provs, args.timing)
    return gemm_bench.finish(run)


if __name__ == "__main__":
    sys.exit(main())
