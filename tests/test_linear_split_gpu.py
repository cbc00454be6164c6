"""ikbo_gemm.linear's K-split clusters on an sm_90 GPU: every split configuration forced onto
shapes with partial tiles and uneven k-slices, clusters that walk several tiles (the exchange
buffer reused), the user phase as K-split pairs, as K-split clusters of 2 or 4 CTAs
(PlanRules.user_cluster_split, the default plan) and in 8 K slices (PlanRules.wide_user), each
against the fp32 reference."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import ikbo_gemm
from ikbo_gemm.config import LINEAR_SPLIT_TILES, LINEAR_SPLITS
from test_linear_gpu import BF16, DEVICE, F16, assert_matches_reference, make_inputs

pytestmark = pytest.mark.gpu
linear_mod = importlib.import_module("ikbo_gemm.linear")  # the module, not the op


def split_rules(tile, split, clusters=None):
    """The small-grid rules with the candidate phase's tile and K split forced (and its grid
    shrunk to ``clusters`` clusters: each then walks several tiles)."""
    return dataclasses.replace(linear_mod.SMALL_GRID_RULES, cand_split=(tile, split), cand_clusters=clusters)


def run(args, activation, rules):
    B, N = args["x_cand"].shape[0], args["w_cand"].shape[0]
    out = torch.full((B, N), float("nan"), dtype=args["x_cand"].dtype, device=DEVICE)
    assert ikbo_gemm.linear(**args, activation=activation, out=out, rules=rules) is out
    plan = linear_mod._plan(args["x_cand"], args["x_user"], args["idx"], args["w_cand"], args["w_user"],
                            args["bias"], activation, out, rules, dict.fromkeys(FP8_SCALES),
                            None)  # the plan the call made, from the cache
    return out, plan


FP8_SCALES = ("x_cand_scale", "x_user_scale", "w_cand_scale", "w_user_scale")  # none: 16-bit operands
SPLIT_CONFIGS = [(tile, s) for tile in LINEAR_SPLIT_TILES for s in LINEAR_SPLITS if (tile[1] // 16) % s == 0]


@pytest.mark.parametrize("tile, split", SPLIT_CONFIGS, ids=[f"m{t[0]}-n{t[1]}-k{s}" for t, s in SPLIT_CONFIGS])
def test_every_split_configuration(tile, split):
    # B and N past whole tiles; 1000 = 15.6 k-blocks: the last slice is short.
    args = make_inputs(300, 7, 200, 256, 1000, BF16, seed=11)
    out, plan = run(args, "relu", split_rules(tile, split))
    assert (plan.cand_cfg.split_k, plan.cand_cfg.cluster_m) == (split, 1)
    assert_matches_reference(out, args, "relu")


@pytest.mark.parametrize("split", LINEAR_SPLITS)
def test_split_clusters_walk_several_tiles(split):
    # Two clusters over 4 x 8 tiles: the exchange buffer and its barriers turn over 16 times.
    args = make_inputs(500, 9, 1000, 64, 2048, F16, idx_dtype=torch.int64, seed=12)
    out, plan = run(args, None, split_rules((128, 128), split, clusters=2))
    assert plan.grid_cand == 2 * split
    assert_matches_reference(out, args, None)


def test_split_slices_of_one_k_block():
    # K 256 = 4 k-blocks over 4 CTAs: one k-block each.
    args = make_inputs(130, 5, 130, 100, 256, BF16, seed=13)
    out, _ = run(args, "gelu", split_rules((128, 128), 4))
    assert_matches_reference(out, args, "gelu")


def test_split_nan_stays_in_its_row_and_user():
    args = make_inputs(600, 6, 256, 128, 1024, BF16, seed=14)
    args["x_cand"][5, 0] = float("nan")
    args["x_user"][2, 0] = float("nan")
    out, _ = run(args, None, split_rules((128, 128), 2))
    bad_rows = (args["idx"].long() == 2) | (torch.arange(600, device=DEVICE) == 5)
    assert torch.isnan(out[bad_rows]).all()
    assert torch.isfinite(out[~bad_rows]).all()


def test_split_bits_do_not_depend_on_the_grid():
    """Each tile's partial sums meet in rank order, whichever cluster runs it."""
    args = make_inputs(700, 8, 512, 256, 4096, BF16, seed=15)
    wide, _ = run(args, "relu", split_rules((128, 128), 4))
    narrow, plan = run(args, "relu", split_rules((128, 128), 4, clusters=3))
    assert plan.grid_cand == 12
    torch.testing.assert_close(narrow, wide, rtol=0, atol=0)


@pytest.mark.parametrize("user_tile", [(64, 256), (64, 128)])
def test_user_phase_as_k_split_pairs(monkeypatch, user_tile):
    # B 2048, N 1024: 128 candidate CTAs in 2-CTA clusters; the user tiles go to the slots left,
    # 2 pairs walking 2 (or 4) tiles each.
    monkeypatch.setattr(linear_mod, "max_active_clusters", lambda device, size: {1: 132, 2: 66}.get(size, 132 // size))
    monkeypatch.setattr(linear_mod, "sm_count", lambda device: 132)
    args = make_inputs(2048, 29, 1024, 1000, 4096, BF16, seed=16)
    out, plan = run(args, "silu", dataclasses.replace(linear_mod.SMALL_GRID_RULES, user_tile=user_tile))
    assert (plan.user_cfg.split_k, plan.splits, plan.grid_user) == (2, 1, 4)
    assert plan.cand_cfg.cluster_m == 2
    assert_matches_reference(out, args, "silu")


def test_split_in_a_cuda_graph():
    rules = split_rules((64, 128), 2)
    args = make_inputs(256, 4, 128, 64, 1024, F16, seed=17)
    out = torch.full((256, 128), float("nan"), dtype=F16, device=DEVICE)
    ikbo_gemm.linear(**args, out=out, rules=rules)  # plan and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ikbo_gemm.linear(**args, out=out, rules=rules)
    fresh = make_inputs(256, 4, 128, 64, 1024, F16, seed=18)
    for name, t in args.items():
        if t is not None:
            t.copy_(fresh[name])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, args, None)


@pytest.mark.parametrize("rules, B, U, N, split_cand", [
    ("WIDE_USER_RULES", 2048, 29, 1000, 1),  # 64 user CTAs before 128 candidate CTAs
    ("SPLIT_WIDE_USER_RULES", 1024, 15, 256, 4),  # beside 4-CTA K splits
])
def test_wide_user_phase(rules, B, U, N, split_cand):
    # K_user 1000 = 16 k-blocks in 8 slices (workspace slabs), the last one short.
    args = make_inputs(B, U, N, 1000, 2048, BF16, seed=14)
    out, plan = run(args, "relu", dataclasses.replace(getattr(linear_mod, rules), user_cluster_split=False))
    assert ((plan.user_cfg.tile_m, plan.user_cfg.tile_n), plan.splits, plan.cand_cfg.split_k) == (
        (64, 128), 8, split_cand)
    assert_matches_reference(out, args, "relu")


def h100_grids(monkeypatch, clusters_of_4=30):
    """The plan as on an H100 or H200 (132 SMs), with ``clusters_of_4`` 4-CTA clusters resident."""
    monkeypatch.setattr(linear_mod, "max_active_clusters",
                        lambda device, size: clusters_of_4 if size == 4 else {1: 132, 2: 66}.get(size, 132 // size))
    monkeypatch.setattr(linear_mod, "sm_count", lambda device: 132)


@pytest.mark.parametrize("B, N, dtype, user_tile", [
    (2048, 2048, BF16, (64, 256)),
    (2048, 4096, F16, (64, 128)),  # the wide user phase (N 4096)
    (8192, 1024, BF16, (128, 128)),
])
@pytest.mark.parametrize("user_splits", [None, 2])
def test_user_phase_as_k_split_clusters(monkeypatch, B, N, dtype, user_tile, user_splits):
    # The default plan: the user phase's K slices as clusters of 4 CTAs a tile (2 with at most 2
    # slices), one workspace slab; K_user 1000 = 15.6 k-blocks, the last CTA's slice short.
    h100_grids(monkeypatch)
    rules = dataclasses.replace(linear_mod.DEFAULT_RULES, user_splits=user_splits)
    args = make_inputs(B, -(-B // 70), N, 1000, 1024, dtype, seed=19)
    out, plan = run(args, "relu", rules)
    assert (plan.user_cfg.tile_m, plan.user_cfg.tile_n) == user_tile
    assert (plan.user_cfg.split_k, plan.splits) == (user_splits or 4, 1)
    assert_matches_reference(out, args, "relu")


def test_user_k_split_clusters_walk_several_tiles(monkeypatch):
    """2 user clusters of 4 CTAs over 8 tiles of 64 x 256 (the exchange buffer reused): the same
    bits as one cluster a tile (each tile's partial sums meet in rank order)."""
    args = make_inputs(2000, 29, 2000, 1000, 1024, BF16, seed=20)
    h100_grids(monkeypatch, clusters_of_4=2)
    narrow, plan = run(args, "relu", dataclasses.replace(linear_mod.DEFAULT_RULES, user_splits=4))
    assert (plan.user_cfg.split_k, plan.splits, plan.grid_user) == (4, 1, 8)
    assert_matches_reference(narrow, args, "relu")
    h100_grids(monkeypatch)
    wide, plan = run(args, "relu", linear_mod.DEFAULT_RULES)
    assert (plan.user_cfg.split_k, plan.splits, plan.grid_user) == (4, 1, 32)
    torch.testing.assert_close(narrow, wide, rtol=0, atol=0)
