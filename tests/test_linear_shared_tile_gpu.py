"""ikbo_gemm.linear's candidate phase in 128 x 256 tiles both consumer warpgroups share
(LinearConfig.consumers_per_tile = 2) on an sm_90 GPU: every shipped configuration forced onto
shapes with partial tiles, clusters that walk many tiles (the operand ring and the staging
buffers turn over), one candidate, one user of 10,000 candidates, NaN isolation, and the default
plan where it takes the shared tile, each against the fp32 reference."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import ikbo_gemm
from ikbo_gemm.config import LINEAR_SHARED_TILE
from test_linear_gpu import BF16, DEVICE, F16, assert_matches_reference, make_inputs
from test_linear_split_gpu import run

pytestmark = pytest.mark.gpu
linear_mod = importlib.import_module("ikbo_gemm.linear")  # the module, not the op


def shared_rules(clusters=None):
    """The default rules with the candidate phase forced onto the shared tile (and its grid
    shrunk to ``clusters`` clusters: each then walks several tiles)."""
    return dataclasses.replace(linear_mod.DEFAULT_RULES, cand_split=(LINEAR_SHARED_TILE, 1), cand_clusters=clusters)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("activation, bias", [("relu", True), (None, False)])
@pytest.mark.parametrize("B", [300, 100])  # 100: one row tile, no cluster
def test_every_shared_configuration(dtype, activation, bias, B):
    # N 1000: three full column tiles and a partial one; K 1000 ends inside a k-block.
    args = make_inputs(B, 7, 1000, 200, 1000, dtype, bias=bias, seed=31)
    out, plan = run(args, activation, shared_rules())
    cfg = plan.cand_cfg
    assert (cfg.tile_m, cfg.tile_n, cfg.consumers_per_tile) == (*LINEAR_SHARED_TILE, 2)
    assert cfg.cluster_m == (2 if B > 128 else 1)
    assert_matches_reference(out, args, activation)


def test_shared_clusters_walk_many_tiles():
    # 2 clusters over 8 x 4 tiles of K 2048 (32 k-blocks): the ring and each consumer's staging
    # buffers turn over many times per CTA.
    args = make_inputs(1000, 13, 1000, 64, 2048, BF16, idx_dtype=torch.int64, seed=32)
    out, plan = run(args, "relu", shared_rules(clusters=2))
    assert plan.grid_cand == 4
    assert_matches_reference(out, args, "relu")


@pytest.mark.parametrize("B, U, N, K_user, K_cand", [
    (1, 1, 256, 64, 64),  # one candidate, one k-block
    (10000, 1, 136, 8, 520),  # one user of 10,000 candidates; N past one partial column tile
    (257, 257, 512, 72, 24),  # ratio 1; K below one k-block
])
def test_shared_tile_odd_shapes(B, U, N, K_user, K_cand):
    args = make_inputs(B, U, N, K_user, K_cand, BF16, seed=33)
    out, _ = run(args, "relu", shared_rules())
    assert_matches_reference(out, args, "relu")


def test_shared_tile_nan_stays_in_its_row_and_user():
    args = make_inputs(600, 6, 512, 128, 1024, BF16, seed=34)
    args["x_cand"][70, 0] = float("nan")  # a row of consumer 1's half of the first tile
    args["x_user"][2, 0] = float("nan")
    args["idx"][300] = 6  # out of range: unchecked, it reads NaN
    out = torch.full((600, 512), float("nan"), dtype=BF16, device=DEVICE)
    ikbo_gemm.linear(**args, out=out, rules=shared_rules(), validate=False)
    bad_rows = (args["idx"].long() == 2) | (torch.arange(600, device=DEVICE) == 70)
    bad_rows[300] = True
    assert torch.isnan(out[bad_rows]).all()
    assert torch.isfinite(out[~bad_rows]).all()


def test_default_plan_takes_the_shared_tile_where_tiles_are_many():
    # B 8192, N 1024, K 1024 + 2048: 256 shared tiles, at least one per SM on any Hopper part.
    args = make_inputs(8192, 117, 1024, 1024, 2048, BF16, seed=35)
    out, plan = run(args, "relu", linear_mod.DEFAULT_RULES)
    assert plan.cand_cfg.consumers_per_tile == 2
    assert_matches_reference(out, args, "relu")
    ping_pong, plan = run(args, "relu", linear_mod.NO_SHARED_TILE_RULES)
    assert plan.cand_cfg.consumers_per_tile == 1
    # Both sum each output's products in fp32 in the same k order: the same bits.
    assert torch.equal(out, ping_pong)

