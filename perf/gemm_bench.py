"""What bench_lce and bench_linear share: their providers' kind, the check of every provider
against the fp32 reference (an FP8 one against its dequantized operands, with the quantization's
own error beside it), one problem's measurement, and the run over the problems within a time
budget. A problem has ``idx``, ``dtype``, ``flops``, ``cache`` and ``fields()``; its inputs
``w_user``, ``w_cand``, ``activation_bytes()`` and ``clone_activations()``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Callable, Optional, Sequence

import torch

from perf import harness
from perf.fp8_peers import FP8
from perf.providers import LIBS, Provider, needed

COLUMNS = ["provider", "status", "rel_err", "quant_err", "compile_s"]


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


def w_cat(p, inp) -> torch.Tensor:
    """cat(w_user, w_cand) along K, made once per problem: weights are static in a deployed model."""
    if "w" not in p.cache:
        p.cache["w"] = torch.cat([inp.w_user, inp.w_cand], dim=1).contiguous()
    return p.cache["w"]


def _dequantized(inp, fp8: Optional[str]):
    """The inputs an FP8 provider of kind ``fp8`` is checked on (None: the 16-bit ones)."""
    if fp8 is None:
        return inp
    return inp.dequantized(per_tensor=True) if fp8 == "per_tensor" else inp.dequantized()


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
            refs[floor, fp8] = (cat_reference(p, inp) if fp8 == "cat" else
                                reference(p, _dequantized(inp, fp8), user_side=not floor))
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


def run_problem(p, inp, provs: Sequence[GemmProvider], args, ceiling: float, *, peers: dict,
                rotations: int = 8, device="cuda", **check) -> list:
    """Check every provider (``check_providers``, ``check`` its keywords), then time those that
    passed (``--timing``), calls cycling through up to ``rotations`` copies of the activations;
    one row per provider, with TFLOP/s and the ratios to ``peers`` (name -> column)."""
    n_rot = harness.rotation_count(inp.activation_bytes(), harness.l2_bytes(), cap=rotations)
    sets = [inp] + [inp.clone_activations() for _ in range(n_rot - 1)]
    harness.reset_compiled()
    rows, timed = check_providers(p, inp, provs, args.tol, device=device, **check)
    harness.time_checked(timed, rows, rotate=sets, device=device, **harness.timing_options(args))
    timed.clear()
    harness.compile_seconds(rows)
    harness.derive_rates(rows, args.timing, flops=p.flops, ceiling=ceiling, peers=peers)
    p.cache.clear()
    return rows


def add_args(ap: argparse.ArgumentParser, names: Sequence[str], budget_help: str) -> None:
    """The GEMM benchmarks' common options: --providers, --tol, --budget-s, then harness's."""
    ap.add_argument("--providers", nargs="+", metavar="NAME", help=f"subset of: {', '.join(names)}")
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative error against fp32")
    ap.add_argument("--budget-s", type=float, default=240.0, help=budget_help)
    harness.add_common_args(ap)
    harness.add_timing_args(ap)


def parse(ap: argparse.ArgumentParser, argv, names: Sequence[str]):
    args = ap.parse_args(argv)
    harness.check_provider_names(ap, args.providers, names)
    return args


def run(name: str, args, argv, provs: Sequence[GemmProvider], keys: list, dtypes: list, always: set,
        measure: Callable, *, settings: dict, **fields) -> tuple[dict, list, str]:
    """The run: the libraries ``provs`` need, the environment, the same-run ceilings of ``dtypes``,
    then ``measure(key, ceilings) -> rows`` for each key, those past --budget-s skipped (not those
    in ``always``), the JSON written after each. Returns (payload, keys skipped, stamp)."""
    harness.start_benchmark(name)
    notes = LIBS.load(needed(provs))
    for note in notes:
        print(f"{name}: {note}", flush=True)
    env = harness.environment()
    harness.print_environment(env)
    ceilings = harness.ceilings_tflops(dtypes)
    stamp = harness.utc_stamp()
    payload = {"benchmark": name, "argv": sys.argv[1:] if argv is None else list(argv), "environment": env,
               "ceiling_tflops": ceilings, **fields,
               "settings": {**harness.timing_settings(args), "tol": args.tol, **settings},
               "notes": notes, "rows": []}
    start, skipped = time.perf_counter(), []
    try:
        for key in keys:
            if key not in always and time.perf_counter() - start > args.budget_s:
                skipped.append(key)
                continue
            payload["rows"] += measure(key, ceilings)
            harness.write_results(name, payload, args.out_dir, stamp)  # partial results survive a crash
            torch.cuda.empty_cache()
    except harness.ContextLost as e:
        harness.note_lost_context(name, payload, e)
    payload["seconds"] = time.perf_counter() - start
    return payload, skipped, stamp


def finish(name: str, payload: dict, args, stamp: str) -> int:
    path = harness.write_results(name, payload, args.out_dir, stamp)
    print(f"\nresults: {path}  ({payload['seconds']:.0f} s)")
    return 0
