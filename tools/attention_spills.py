"""Compile many attention configurations for sm_90a (no GPU needed) and report those that spill.

    python -m tools.attention_spills [--S-q 1 2 8 17 200] [--variants plain pair split]
                                     [--jobs 2] [--out spills.jsonl]

The shipped configurations are few; the op compiles whatever a problem needs at its first call
(any S_q, each direction, kv_lengths or jagged K/V, with or without lse, and the variants the
launch flags of ``ikbo_fa.attention`` select). This compiles the product of the lists given,
in ``--jobs`` processes, and prints each configuration whose ptxas report has spill stores or
loads, or notes on its wgmma pipeline (serialized wgmma, inserted waits); exit status 1 if any.
KV broadcast by default; ``--direction q`` for Q broadcast (which has no variant but plain).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import torch

VARIANTS = {
    "plain": {},
    "pair": {"split_pair": True},
    "split": {"split_kv": True},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def configs(args):
    """The configurations of the product that AttentionConfig accepts (the others are skipped:
    split_kv needs the lse, split_kv and split_pair need KV broadcast)."""
    from ikbo_fa.config import AttentionConfig

    seen = set()
    for dtype in args.dtype:
        for d in args.D:
            for s_q in args.S_q:
                for rows in args.rows:
                    for lse in (False, True):
                        for name in args.variants:
                            try:
                                cfg = AttentionConfig(DTYPES[dtype], d, s_q, args.direction, rows == "lengths", lse,
                                                      jagged=rows == "jagged", **VARIANTS[name])
                            except ValueError:
                                continue
                            if cfg not in seen:
                                seen.add(cfg)
                                yield cfg


def _compile(cfg):
    from ikbo_fa import compile_config

    start = time.perf_counter()
    try:
        kernel = compile_config(cfg, ptxas_report=True)
        return {"config": str(cfg), "spill_bytes": kernel.spill_bytes, "wgmma_notes": kernel.wgmma_notes,
                "seconds": round(time.perf_counter() - start, 1)}
    except Exception as e:  # reported, not raised: one bad configuration does not hide the rest
        return {"config": str(cfg), "error": f"{type(e).__name__}: {e}"[:2000]}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S-q", type=int, nargs="+", default=[1, 2, 3, 8, 16, 17, 24, 48, 64, 65, 100, 128, 200])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    ap.add_argument("--direction", default="kv", choices=["kv", "q"])
    ap.add_argument("--rows", nargs="+", default=["none", "lengths", "jagged"], choices=["none", "lengths", "jagged"],
                    help="K/V padded (none), with kv_lengths, or jagged")
    ap.add_argument("--variants", nargs="+", default=["plain"], choices=sorted(VARIANTS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, help="one JSON line per configuration")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    todo = list(configs(args))
    print(f"{len(todo)} configurations, {args.jobs} processes", flush=True)
    bad = 0
    out = args.out.open("w") if args.out else None
    # spawn: each worker imports the DSL afresh (it is not fork-safe once initialized)
    pool = multiprocessing.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    try:
        for rec in pool.imap_unordered(_compile, todo) if pool else map(_compile, todo):
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if "error" in rec or rec["spill_bytes"] or rec["wgmma_notes"]:
                bad += 1
                print(json.dumps(rec), flush=True)
    finally:
        if pool:
            pool.close()
            pool.join()
    print(f"{len(todo) - bad} of {len(todo)} compiled without spills or wgmma notes")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
