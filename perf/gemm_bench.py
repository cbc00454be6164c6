"""What bench_lce and bench_linear share: their problems' users, their providers' kind, the check
of every provider against the fp32 reference (an FP8 one against its dequantized operands, with
the quantization's own error beside it), one problem's measurement, and the run over the
problems within a time budget. Each benchmark declares what these need as a ``GemmBench``; its
inputs have ``w_user``, ``w_cand``, ``activation_bytes()`` and ``clone_activations()``.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch

from perf import harness
from perf.fp8_peers import FP8
from perf.harness import make_idx, per_problem, user_counts
from perf.providers import LIBS, Provider

COLUMNS = ["provider", "status", "rel_err", "quant_err", "compile_s"]
DTYPES = {**harness.DTYPES, "fp8": FP8}


@dataclasses.dataclass(kw_only=True)
class GemmProblem:
    """B candidates of U users (``counts``; ``idx`` int32 [B] on the device) in ``dtype``; the
    GEMM's sizes are the subclass's fields."""
    B: int
    ratio: int
    dtype: torch.dtype
    counts: list
    idx: torch.Tensor
    cache: dict = dataclasses.field(default_factory=dict)  # what providers make once per problem

    @classmethod
    def of(cls, B: int, ratio: int, dtype: torch.dtype, device, **sizes):
        counts = user_counts(B, ratio)  # exact ratio, the last user the remainder
        return cls(B=B, ratio=ratio, dtype=dtype, counts=counts, idx=make_idx(counts).to(device), **sizes)

    @property
    def U(self) -> int:
        return len(self.counts)

    def fields(self, *sizes: str, **more) -> dict:
        """The row fields: B, ratio, U, ``sizes``, dtype and ``more``."""
        dtype = {v: k for k, v in DTYPES.items()}[self.dtype]
        return {"B": self.B, "ratio": self.ratio, "U": self.U, **{s: getattr(self, s) for s in sizes},
                "dtype": dtype, **more}

    def title(self, unit: str) -> str:
        """The line above the problem's table: its fields (sizes as name=value), GFLOP, and what
        the x_* columns are, times in ``unit``."""
        words = [f"{k}={v}" if isinstance(v, int) else str(v) for k, v in self.fields().items()]
        return (f"{words[0]} {words[1]} ({words[2]}) {' '.join(words[3:])}  "
                f"[{self.flops / 1e9:.1f} GFLOP; x_* = that torch provider's {unit} / this {unit}, "
                "in the same timing]")


@dataclasses.dataclass(frozen=True)
class GemmBench:
    """A GEMM benchmark, as the shared run needs it."""

    name: str  # the results' file name stem
    make_inputs: Callable  # (problem, generator, device) -> inputs
    reference: Callable  # (problem, inputs) -> the fp32 output
    cat_reference: Callable  # (problem, inputs) -> the concatenating FP8 peer's own fp32 output
    speedup_columns: dict  # torch provider -> its ratio column
    fp8_speedup_columns: dict  # FP8 peer -> its ratio column
    timed_columns: list  # the table's timed columns
    rotations: int  # copies of the activations at most
    in_us: bool = False  # each time in us beside ms (small GEMMs)


@dataclasses.dataclass(frozen=True)
class GemmProvider(Provider):
    floor: bool = False  # the candidate side alone: checked against the candidate GEMM's reference
    fp8: Optional[str] = None  # an FP8 provider (FP8 problems only), checked against the fp32 formula on
    # "operands": the dequantized FP8 operands; "per_tensor": its per-tensor ones; "cat": its own
    # quantized concatenation
    extra: bool = False  # run only when --providers names it
    max_autotune: bool = False  # compiles for long: bench_lce's --max-autotune says where it runs

    @property
    def ours(self) -> bool:
        return bool(self.needs)


def no_setup(p, inp) -> None:
    return None


def torch_path(name: str, fn: Callable, args_of: Callable, setup: Callable = no_setup,
               compiled: bool = False, mode: Optional[str] = None, **kw) -> GemmProvider:
    """A torch path on plain tensors: ``fn(*args_of(p, state, inputs))`` with the state of
    ``setup``; ``compiled``: ``fn`` under ``harness.torch_compiled`` (in ``mode``), compiled at its
    first call."""
    if not compiled:
        return GemmProvider(name, setup, lambda p, st, i: fn(*args_of(p, st, i)), **kw)
    return GemmProvider(name, lambda p, i: (setup(p, i), harness.torch_compiled(fn, mode)),
                        lambda p, st, i: st[1](*args_of(p, st[0], i)), **kw)


@per_problem
def w_cat(p, inp) -> torch.Tensor:
    """cat(w_user, w_cand) along K, made once per problem: weights are static in a deployed model."""
    return torch.cat([inp.w_user, inp.w_cand], dim=1).contiguous()


def check_providers(p, inp, provs: Sequence[GemmProvider], tol: float, *, reference: Callable,
                    cat_reference: Callable, skip: Optional[dict] = None, device="cuda") -> tuple[list, dict]:
    """``harness.check_providers`` against ``reference(p, inp, user_side=)`` (an FP8 provider:
    of its dequantized operands, or ``cat_reference(p, inp)`` for its own quantized concatenation,
    with its error against the 16-bit problem's as "quant_err"); FP8 providers on FP8 problems
    only; skipped: those whose library is missing and those ``skip`` names (name -> why)."""
    provs = [pr for pr in provs if not pr.fp8 or p.dtype == FP8]
    refs, quant_err, skip = {}, {}, skip or {}

    def ref(floor: bool, fp8: Optional[str]) -> torch.Tensor:
        if (floor, fp8) not in refs:
            if fp8 == "cat":
                refs[floor, fp8] = cat_reference(p, inp)
            elif fp8 == "per_tensor":
                refs[floor, fp8] = reference(p, inp.dequantized(per_tensor=True), user_side=not floor)
            else:
                refs[floor, fp8] = reference(p, inp.dequantized() if fp8 else inp, user_side=not floor)
        return refs[floor, fp8]

    def rel_error_of(prov, out):
        if prov.fp8:  # the quantization's own error: against the 16-bit problem
            quant_err[prov.name] = harness.rel_error(out.float(), ref(prov.floor, None))
        return harness.rel_error(out.float(), ref(prov.floor, prov.fp8))

    rows, timed = harness.check_providers(
        provs, p, inp, fields=p.fields(), rel_error_of=rel_error_of, tol=tol,
        skip_note=lambda prov: LIBS.skip_note(prov) or skip.get(prov.name), device=device)
    for r in rows:
        if r["provider"] in quant_err:
            r["quant_err"] = quant_err[r["provider"]]
    return rows, timed


def peer_columns(dtype: torch.dtype, columns: dict, fp8_columns: dict) -> dict:
    """Peer provider -> ratio column: the 16-bit peers, and on FP8 problems the FP8 ones too."""
    return {**columns, **fp8_columns} if dtype == FP8 else columns


def run_problem(p, provs: Sequence[GemmProvider], args, ceiling: float, bench: GemmBench, device,
                skip: Optional[dict] = None) -> list:
    """Check every provider (``check_providers``), then time those that passed (``--timing``),
    calls cycling through up to ``bench.rotations`` copies of the activations; one row per
    provider, with TFLOP/s and the ratios to the peers (``peer_columns``), printed."""
    inp = bench.make_inputs(p, torch.Generator(device=device).manual_seed(args.seed), device)
    n_rot = harness.rotation_count(inp.activation_bytes(), harness.l2_bytes(), cap=bench.rotations)
    sets = [inp] + [inp.clone_activations() for _ in range(n_rot - 1)]
    harness.reset_compiled()
    rows, timed = check_providers(p, inp, provs, args.tol, reference=bench.reference,
                                  cat_reference=bench.cat_reference, skip=skip, device=device)
    harness.time_checked(timed, rows, rotate=sets, device=device,
                         **harness.timing_settings(args))
    timed.clear()
    harness.compile_seconds(rows)
    harness.derive_rates(rows, args.timing, flops=p.flops, ceiling=ceiling,
                         peers=peer_columns(p.dtype, bench.speedup_columns, bench.fp8_speedup_columns))
    for r in rows if bench.in_us else []:
        for s in harness.mode_suffixes(args.timing):
            if r.get("ms" + s):
                r["us" + s] = r["ms" + s] * 1e3
    harness.print_rows(p.title("time" if bench.in_us else "ms"), rows, COLUMNS, bench.timed_columns,
                       args.timing)
    p.cache.clear()
    return rows


def add_args(ap: argparse.ArgumentParser, names: Sequence[str], budget_help: str) -> None:
    """The GEMM benchmarks' common options: --providers, --tol, --budget-s, then harness's."""
    ap.add_argument("--providers", nargs="+", metavar="NAME", choices=names, help=f"subset of: {', '.join(names)}")
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative error against fp32")
    ap.add_argument("--budget-s", type=float, default=240.0, help=budget_help)
    harness.add_common_args(ap)


def run(bench: GemmBench, device, args, argv, provs: Sequence[GemmProvider], keys: list, dtypes: list,
        always: set, problem_of: Callable, *, settings: dict, **fields) -> tuple[harness.Run, list]:
    """The run (``harness.Run``) with the same-run ceilings of ``dtypes``: ``run_problem`` of
    ``problem_of(key) -> (problem, providers it skips: name -> why)`` for each key, those past
    --budget-s skipped (not those in ``always``). Returns (the run, the keys skipped)."""
    run = harness.Run(bench.name, args, argv, provs)
    ceilings = harness.ceilings_tflops(dtypes)
    run.begin({"tol": args.tol, **settings}, ceiling_tflops=ceilings, **fields)
    skipped = []
    with run:
        for key in keys:
            if key not in always and time.perf_counter() - run.start > args.budget_s:
                skipped.append(key)
                continue
            p, skip = problem_of(key)
            run.add(run_problem(p, provs, args, ceilings[p.fields()["dtype"]], bench, device, skip))
    return run, skipped


def finish(run: harness.Run) -> int:
    print(f"\nresults: {run.save()}  ({run.payload['seconds']:.0f} s)")
    return 0
