"""ikbo_gemm.linear's K-split clusters on an sm_90 GPU: every split configuration forced onto
shapes with partial tiles and uneven k-slices, clusters that walk several tiles (the exchange
buffer reused), the user phase as K-split pairs and in 8 K slices (PlanRules.wide_user), each
against the fp32 reference."""
from __future__ import annotations

import importlib

import pytest
import torch

import ikbo_gemm
from cute_kernels import PlanCache
from ikbo_gemm.config import LINEAR_SPLIT_TILES, LINEAR_SPLITS
from test_linear_gpu import BF16, DEVICE, F16, assert_matches_reference, make_inputs

pytestmark = pytest.mark.gpu
linear_mod = importlib.import_module("ikbo_gemm.linear")  # the module, not the op


@pytest.fixture
def fresh_plans(monkeypatch):
    """A plan cache of its own, and the op planning with the small-grid rules on."""
    monkeypatch.setattr(linear_mod, "_plans", PlanCache())
    monkeypatch.setattr(linear_mod, "DEFAULT_RULES", linear_mod.SMALL_GRID_RULES)


def force_cand_split(monkeypatch, tile, split):
    monkeypatch.setattr(linear_mod, "pick_cand_split", lambda rows, n, kb, sms, clusters: (tile, split))


def shrink_cand_grid(monkeypatch, clusters):
    """Launch the candidate phase on ``clusters`` clusters: each walks several tiles."""
    grids = linear_mod._grids

    def fewer(*args):
        g = grids(*args)
        per = g.split_cand * g.cluster
        return linear_mod._Grids(**{**g.__dict__, "grid_cand": min(g.grid_cand, clusters * per)})

    monkeypatch.setattr(linear_mod, "_grids", fewer)


def run(args, activation):
    B, N = args["x_cand"].shape[0], args["w_cand"].shape[0]
    out = torch.full((B, N), float("nan"), dtype=args["x_cand"].dtype, device=DEVICE)
    assert ikbo_gemm.linear(**args, activation=activation, out=out) is out
    (plan,) = linear_mod._plans.values()
    return out, plan


SPLIT_CONFIGS = [(tile, s) for tile in LINEAR_SPLIT_TILES for s in LINEAR_SPLITS if (tile[1] // 16) % s == 0]


@pytest.mark.parametrize("tile, split", SPLIT_CONFIGS, ids=[f"m{t[0]}-n{t[1]}-k{s}" for t, s in SPLIT_CONFIGS])
def test_every_split_configuration(monkeypatch, fresh_plans, tile, split):
    # B and N past whole tiles; 1000 = 15.6 k-blocks: the last slice is short.
    force_cand_split(monkeypatch, tile, split)
    args = make_inputs(300, 7, 200, 256, 1000, BF16, seed=11)
    out, plan = run(args, "relu")
    assert (plan.cand_cfg.split_k, plan.cand_cfg.cluster_m) == (split, 1)
    assert_matches_reference(out, args, "relu")


@pytest.mark.parametrize("split", LINEAR_SPLITS)
def test_split_clusters_walk_several_tiles(monkeypatch, fresh_plans, split):
    # Two clusters over 4 x 8 tiles: the exchange buffer and its barriers turn over 16 times.
    force_cand_split(monkeypatch, (128, 128), split)
    shrink_cand_grid(monkeypatch, 2)
    args = make_inputs(500, 9, 1000, 64, 2048, F16, idx_dtype=torch.int64, seed=12)
    out, plan = run(args, None)
    assert plan.grid_cand == 2 * split
    assert_matches_reference(out, args, None)


def test_split_slices_of_one_k_block(monkeypatch, fresh_plans):
    # K 256 = 4 k-blocks over 4 CTAs: one k-block each.
    force_cand_split(monkeypatch, (128, 128), 4)
    args = make_inputs(130, 5, 130, 100, 256, BF16, seed=13)
    out, _ = run(args, "gelu")
    assert_matches_reference(out, args, "gelu")


def test_split_nan_stays_in_its_row_and_user(monkeypatch, fresh_plans):
    force_cand_split(monkeypatch, (128, 128), 2)
    args = make_inputs(600, 6, 256, 128, 1024, BF16, seed=14)
    args["x_cand"][5, 0] = float("nan")
    args["x_user"][2, 0] = float("nan")
    out, _ = run(args, None)
    bad_rows = (args["idx"].long() == 2) | (torch.arange(600, device=DEVICE) == 5)
    assert torch.isnan(out[bad_rows]).all()
    assert torch.isfinite(out[~bad_rows]).all()


def test_split_bits_do_not_depend_on_the_grid(monkeypatch, fresh_plans):
    """Each tile's partial sums meet in rank order, whichever cluster runs it."""
    force_cand_split(monkeypatch, (128, 128), 4)
    args = make_inputs(700, 8, 512, 256, 4096, BF16, seed=15)
    wide, _ = run(args, "relu")
    linear_mod._plans.clear()
    shrink_cand_grid(monkeypatch, 3)
    narrow, plan = run(args, "relu")
    assert plan.grid_cand == 12
    torch.testing.assert_close(narrow, wide, rtol=0, atol=0)


@pytest.mark.parametrize("user_tile", [(64, 256), (64, 128)])
def test_user_phase_as_k_split_pairs(monkeypatch, fresh_plans, user_tile):
    # B 2048, N 1024: 128 candidate CTAs in 2-CTA clusters; the user tiles go to the slots left,
    # 2 pairs walking 2 (or 4) tiles each.
    monkeypatch.setattr(linear_mod, "max_active_clusters", lambda device, size: {1: 132, 2: 66}.get(size, 132 // size))
    monkeypatch.setattr(linear_mod, "sm_count", lambda device: 132)
    monkeypatch.setattr(linear_mod, "pick_linear_tile",
                        lambda rows, n: user_tile if rows < 64 else ikbo_gemm.config.pick_linear_tile(rows, n))
    args = make_inputs(2048, 29, 1024, 1000, 4096, BF16, seed=16)
    out, plan = run(args, "silu")
    assert (plan.user_cfg.split_k, plan.splits, plan.grid_user) == (2, 1, 4)
    assert plan.cand_cfg.cluster_m == 2
    assert_matches_reference(out, args, "silu")


def test_split_in_a_cuda_graph(monkeypatch, fresh_plans):
    force_cand_split(monkeypatch, (64, 128), 2)
    args = make_inputs(256, 4, 128, 64, 1024, F16, seed=17)
    out = torch.full((256, 128), float("nan"), dtype=F16, device=DEVICE)
    ikbo_gemm.linear(**args, out=out)  # plan and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ikbo_gemm.linear(**args, out=out)
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
def test_wide_user_phase(monkeypatch, rules, B, U, N, split_cand):
    # K_user 1000 = 16 k-blocks in 8 slices (workspace slabs), the last one short.
    monkeypatch.setattr(linear_mod, "_plans", PlanCache())
    monkeypatch.setattr(linear_mod, "DEFAULT_RULES", getattr(linear_mod, rules))
    args = make_inputs(B, U, N, 1000, 2048, BF16, seed=14)
    out, plan = run(args, "relu")
    assert ((plan.user_cfg.tile_m, plan.user_cfg.tile_n), plan.splits, plan.cand_cfg.split_k) == (
        (64, 128), 8, split_cand)
    assert_matches_reference(out, args, "relu")
