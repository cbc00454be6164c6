"""ikbo_gemm.linear's candidate phase in 2 x 2 clusters (PlanRules.cand_cluster_n = 2: both
operand tiles multicast) on an sm_90 GPU. A tile's sums run in the same order as in 2-CTA
clusters, so every output bit must be the same wherever both plans run the same user phase (a
smaller candidate grid may leave the user phase other SMs): each tile kind (ping-pong, the shared
128 x 256 tile, FP8 with and without promotion), a last column group half past N, bands,
clusters that walk many tiles, an out-of-range index (its NaN row); the 16-bit cases also
against the fp32 reference."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import ikbo_gemm
from fp8_inputs import linear_fp8_problem
from ikbo_gemm.config import LINEAR_SHARED_TILE
from test_linear_gpu import BF16, DEVICE, F16, assert_matches_reference, make_inputs

pytestmark = pytest.mark.gpu
linear_mod = importlib.import_module("ikbo_gemm.linear")  # the module, not the op


def plan_of(args, activation, rules, out, out_dtype=None):
    """The plan a call with these arguments made (from the plan cache)."""
    scales = {k: args.get(k) for k in ("x_cand_scale", "x_user_scale", "w_cand_scale", "w_user_scale")}
    return linear_mod._plan(args["x_cand"], args["x_user"], args["idx"], args["w_cand"], args["w_user"],
                            args.get("bias"), activation, out, rules, scales, out_dtype)


def both(args, activation, rules=linear_mod.DEFAULT_RULES):
    """(2-CTA clusters' output, 2 x 2 clusters' output into a poisoned buffer, the 2 x 2 plan,
    whether both plans run the same user phase)."""
    base = ikbo_gemm.linear(**args, activation=activation, rules=rules)
    wide = dataclasses.replace(rules, cand_cluster_n=2)
    out = torch.full_like(base, float("nan"))
    assert ikbo_gemm.linear(**args, activation=activation, out=out, rules=wide) is out
    p0, p1 = plan_of(args, activation, rules, None), plan_of(args, activation, wide, out)
    # The candidate grid may leave other SMs to the user phase, which then may sum K in other
    # slices: the same bits only where both run the same user phase.
    same_user = (p0.user_cfg, p0.splits, p0.grid_user) == (p1.user_cfg, p1.splits, p1.grid_user)
    return base, out, p1, same_user


# id -> (B, U, N, K_user, K_cand, dtype, rules)
CASES = {
    "b4096-n1024-k4096": (4096, 59, 1024, 512, 4096, BF16, {}),
    "b1000-n1000-fp16": (1000, 100, 1000, 1000, 1000, F16, {}),  # N 1000: a partial column tile
    "b4096-n640": (4096, 59, 640, 64, 1024, BF16, {}),  # 5 column tiles: the last group half past N
    "b65536-ratio70-n1024": (65536, 937, 1024, 1000, 1000, BF16, {}),  # many tiles a cluster
    "bands-of-3": (4096, 59, 1024, 64, 2048, BF16, dict(cand_band_rows=3)),
    "two-clusters": (1000, 13, 1000, 64, 2048, BF16, dict(cand_clusters=2)),  # the ring turns over often
    "shared-tile": (3000, 30, 1000, 200, 2048, BF16, dict(cand_split=(LINEAR_SHARED_TILE, 1))),
    "shared-tile-n640": (1000, 7, 640, 64, 1024, F16, dict(cand_split=(LINEAR_SHARED_TILE, 1))),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_two_by_two_clusters_keep_the_bits(case):
    B, U, N, K_user, K_cand, dtype, rules = case
    args = make_inputs(B, U, N, K_user, K_cand, dtype, seed=41)
    base, out, plan, same_user = both(args, "relu", dataclasses.replace(linear_mod.DEFAULT_RULES, **rules))
    assert (plan.cand_cfg.cluster_m, plan.cand_cfg.cluster_n) == (2, 2) and plan.grid_cand % 4 == 0
    if same_user:
        torch.testing.assert_close(out, base, rtol=0, atol=0)
    assert_matches_reference(out, args, "relu")


def test_out_of_range_index_stays_in_its_row():
    args = make_inputs(2048, 29, 1024, 256, 1024, BF16, seed=42)
    args["idx"][7] = 29  # one past U
    base, out, plan, same_user = both(args, None)
    assert plan.cand_cfg.cluster_n == 2
    keep = torch.arange(2048, device=DEVICE) != 7
    assert torch.isnan(out[7]).all() and torch.isfinite(out[keep]).all()
    if same_user:
        torch.testing.assert_close(out, base, rtol=0, atol=0, equal_nan=True)
    assert_matches_reference(out[keep], dict(args, x_cand=args["x_cand"][keep], idx=args["idx"][keep]), None)


@pytest.mark.parametrize("promote", [False, True])
def test_fp8_two_by_two_clusters_keep_the_bits(promote):
    kw = linear_fp8_problem(4096, 59, 1000, 1024, 2048, seed=43, device=DEVICE)
    rules = ikbo_gemm.PlanRules(fp8_promote=promote)
    base, out, plan, same_user = both(kw, "relu", rules)
    assert plan.cand_cfg.cluster_n == 2 and plan.cand_cfg.promote == promote
    assert same_user  # many candidate tiles a CTA: the user phase runs ahead in both plans
    torch.testing.assert_close(out, base, rtol=0, atol=0)
