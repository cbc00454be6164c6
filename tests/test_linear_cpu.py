"""CPU tests of ikbo_gemm.linear: the reference against a float64 evaluation of the
un-decomposed concatenation, argument validation, split_weight, the tile pick, and sm_90a
compiles of every shipped configuration."""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import math

import pytest
import torch

import ikbo_gemm
from ikbo_gemm.config import (
    ACTIVATIONS,
    LINEAR_TILES,
    LinearConfig,
    pick_cand_tile,
    pick_linear_tile,
    tile_cost,
)
from ikbo_gemm.reference import apply_activation, linear_reference

F16, BF16 = torch.float16, torch.bfloat16
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}


def _inputs(seed, B, U, N, K_user, K_cand, dtype=BF16, bias=True, shuffle=True, idx_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    s = 1 / math.sqrt(K_user + K_cand)
    idx = torch.arange(B) * U // max(B, 1)
    if shuffle:
        idx = idx[torch.randperm(B, generator=g)]
    return dict(
        x_cand=torch.randn(B, K_cand, generator=g).to(dtype),
        x_user=torch.randn(U, K_user, generator=g).to(dtype),
        idx=idx.to(idx_dtype),
        w_cand=(torch.randn(N, K_cand, generator=g) * s).to(dtype),
        w_user=(torch.randn(N, K_user, generator=g) * s).to(dtype),
        bias=(torch.randn(N, generator=g) * 0.5).to(dtype) if bias else None,
    )


def _cat_formula_f64(x_cand, x_user, idx, w_cand, w_user, bias, activation):
    """The layer as models write it: a linear on cat(user features gathered by idx, candidate
    features), in float64."""
    x = torch.cat([x_user.double()[idx.long()], x_cand.double()], dim=1)
    w = torch.cat([w_user.double(), w_cand.double()], dim=1)
    y = torch.nn.functional.linear(x, w, None if bias is None else bias.double())
    return apply_activation(y, activation)


CASES = [  # B, U, N, K_user, K_cand
    (1, 1, 1, 1, 1),
    (9, 9, 7, 5, 3),  # ratio 1
    (40, 4, 33, 17, 64),
    (100, 1, 8, 7, 1000),  # one user
    (64, 3, 100, 64, 7),
]


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_reference_matches_the_concatenated_layer(case, activation, dtype, idx_dtype):
    args = _inputs(sum(case), *case, dtype=dtype, idx_dtype=idx_dtype)
    out = linear_reference(**args, activation=activation)
    exact = _cat_formula_f64(**args, activation=activation)
    assert out.shape == exact.shape and out.dtype == dtype
    # One rounding of the fp32 result: within the dtype's unit roundoff of each element (plus fp32 slack).
    assert ((out.double() - exact).abs() <= UNIT_ROUNDOFF[dtype] * exact.abs() + 1e-5).all()


def test_op_on_cpu_is_the_reference_and_fills_out():
    args = _inputs(1, 30, 4, 24, 16, 40)
    out = torch.full((30, 24), float("nan"), dtype=BF16)
    res = ikbo_gemm.linear(**args, activation="relu", out=out)
    assert res is out
    torch.testing.assert_close(out, linear_reference(**args, activation="relu"), rtol=0, atol=0)


def test_empty_batch():
    args = _inputs(2, 0, 3, 16, 8, 8)
    out = ikbo_gemm.linear(**args)
    assert out.shape == (0, 16)


def test_out_of_range_index_nan_row_or_error():
    args = _inputs(3, 12, 3, 8, 4, 4)
    args["idx"][5] = 3
    with pytest.raises(IndexError, match=r"idx\[5\] = 3 is out of range: values must lie in \[0, U\) = \[0, 3\)"):
        ikbo_gemm.linear(**args, validate=True)
    out = ikbo_gemm.linear(**args, validate=False)
    assert out[5].isnan().all() and not out[torch.arange(12) != 5].isnan().any()


@pytest.mark.parametrize("bad, error, match", [
    (dict(x_cand=torch.randn(4, 8)), TypeError, "x_cand must be float16 or bfloat16"),
    (dict(x_user=torch.randn(2, 8, dtype=F16)), TypeError, "x_user is float16 but x_cand is bfloat16"),
    (dict(w_cand=torch.randn(16, 9).to(BF16)), ValueError, r"w_cand has shape \[16, 9\], expected \[N, K_cand\]"),
    (dict(w_user=torch.randn(15, 8).to(BF16)), ValueError, r"its N \(dimension 0\) must be N \(w_cand.shape\[0\]\)"),
    (dict(bias=torch.randn(15).to(BF16)), ValueError, "bias has shape"),
    (dict(idx=torch.zeros(3, dtype=torch.int32)), ValueError, r"idx has shape \[3\]: expected \[B\] = \[4\]"),
    (dict(idx=torch.zeros(4)), TypeError, "idx must be int32 or int64"),
    (dict(x_user=torch.randn(0, 8).to(BF16)), ValueError, "x_user must not be empty"),
    (dict(x_cand=torch.randn(4, 8, 1).to(BF16)), ValueError, r"x_cand must have 2 dimensions \[B, K_cand\]"),
])
def test_bad_input_names_the_argument(bad, error, match):
    args = _inputs(4, 4, 2, 16, 8, 8)
    args.update(bad)
    with pytest.raises(error, match=match):
        ikbo_gemm.linear(**args)
    with pytest.raises(error, match=match):
        linear_reference(**args)


def test_bad_activation():
    args = _inputs(5, 4, 2, 16, 8, 8)
    with pytest.raises(ValueError, match="activation must be one of"):
        ikbo_gemm.linear(**args, activation="tanh")


@pytest.mark.parametrize("user_first", [True, False])
def test_split_weight(user_first):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(10, 7 + 5, generator=g)
    w_cand, w_user = ikbo_gemm.split_weight(w, 7, user_first=user_first)
    assert w_cand.shape == (10, 5) and w_user.shape == (10, 7)
    assert w_cand.is_contiguous() and w_user.is_contiguous()
    torch.testing.assert_close(torch.cat([w_user, w_cand] if user_first else [w_cand, w_user], 1), w)
    with pytest.raises(ValueError, match="k_user must be an int in"):
        ikbo_gemm.split_weight(w, 12)
    with pytest.raises(ValueError, match="weight must be a 2-D tensor"):
        ikbo_gemm.split_weight(w[0], 3)


def test_grad_through_the_reference():
    args = _inputs(7, 6, 2, 5, 3, 4, dtype=F16)
    x = args["x_cand"].float().requires_grad_()
    out = linear_reference(**dict(args, x_cand=x.to(F16)), activation="silu")
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_tile_pick_pads_least():
    for rows, n in ((1, 1), (117, 4096), (8192, 4096), (4096, 100), (65536, 1024), (3, 192)):
        tile = pick_linear_tile(rows, n)
        assert tile in LINEAR_TILES
        assert all(tile_cost(tile[0], tile[1], n, rows) <= tile_cost(t[0], t[1], n, rows) for t in LINEAR_TILES)


def test_cand_tile_halves_the_work_where_the_grid_is_small():
    """Measured on the H200: at B 512 the 64 x 128 tiles (64 CTAs) beat 128 x 128 (32) by
    1.1x-1.5x; at B 1024, N 1024 the 128 of them left no SMs to the user phase."""
    assert pick_cand_tile(512, 1024, 132) == (64, 128)
    assert pick_cand_tile(1024, 256, 132) == (64, 128)
    assert pick_cand_tile(1024, 1024, 132) == (128, 128) == pick_linear_tile(1024, 1024)
    assert pick_cand_tile(8192, 4096, 132) == pick_linear_tile(8192, 4096)
    for rows, n in ((1, 1), (3, 1000), (600, 300), (512, 8)):
        tile = pick_cand_tile(rows, n, 132)
        assert 2 * -(-rows // tile[0]) * -(-n // tile[1]) <= 132


@pytest.mark.parametrize("field, value, match", [
    ("tile_m", 96, "tile_m must be 64 or 128"),
    ("tile_n", 200, "tile_n must be a multiple of 16"),
    ("phase", "both", "phase must be 'user' or 'cand'"),
    ("activation", "tanh", "activation must be one of"),
    ("dtype", torch.float32, "dtype must be torch.float16 or torch.bfloat16"),
])
def test_config_errors_name_the_field(field, value, match):
    base = dict(dtype=BF16, idx_dtype=torch.int32, tile_m=128, tile_n=128, phase="cand")
    with pytest.raises(ValueError, match=match):
        LinearConfig(**dict(base, **{field: value}))
    with pytest.raises(ValueError, match="user phase takes no activation"):
        LinearConfig(**dict(base, phase="user", activation="relu"))


# Clusters of each size resident at once on an H200 (132 SMs), as cute_kernels.max_active_clusters reports.
H200_CLUSTERS = {1: 132, 2: 66, 3: 39, 4: 30, 6: 17, 8: 15}.__getitem__


def test_the_user_phase_takes_the_idle_sms_of_a_partial_candidate_wave():
    from ikbo_gemm.linear import _spare_user_grid

    tile = 128 * 128
    # 4 user tiles of 64 x 256, one per idle SM, each no more work than a candidate tile
    assert _spare_user_grid(4, 64 * 256 * 4096, tile * 4096, 4) == 4
    assert _spare_user_grid(4, 64 * 256 * 1024, tile * 2048, 4) == 4
    assert _spare_user_grid(8, 64 * 128 * 1024, tile * 2048, 4) == 4  # two each
    # a user tile more work than a candidate tile, or no idle SM
    assert _spare_user_grid(4, 64 * 256 * 8192, tile * 4096, 4) == 0
    assert _spare_user_grid(4, 64 * 256 * 1024, tile * 2048, 0) == 0


def test_spare_user_ctas_end_with_the_candidate_main_loops():
    """PlanRules.spare_by_time (None: on, but for FP8 calls under fp8_promote): the spare SMs take
    the user phase only where its CTAs, streaming their operands, end within SPARE_SLACK_US of the
    candidate main loops; else it runs ahead as the wide user phase does. B 2048, N 1024 (128
    candidate CTAs, 4 idle SMs)."""
    from ikbo_gemm.linear import (DEFAULT_RULES, SM_CYCLES_PER_US, SM_MACS_PER_CYCLE, SM_STREAM_BYTES_PER_CYCLE,
                                  SPARE_SLACK_US, PlanRules, _grids as plan_grids, _spare_user_time_fits)

    assert DEFAULT_RULES.spare_by_time is None
    plain = dict(split_k=False, user_pairs=False)
    # K 1024 + 2048: a 64 x 256 user tile of 1024 keys streams in less time than a 2048-deep
    # candidate tile's main loop: the spare SMs, as before
    g = _grids(2048, 29, 1024, 1024, 2048, **plain)
    assert (g.tile_user, g.split_user, g.splits, g.grid_user, g.grid_cand) == ((64, 256), 1, 1, 4, 128)
    # K 4096 + 4096: it would stream (29 + 256) x 4096 elements for about 5 us past the main loops
    g = _grids(2048, 29, 1024, 4096, 4096, **plain)
    assert (g.tile_user, g.split_user, g.splits, g.grid_user, g.grid_cand) == ((64, 128), 4, 1, 32, 128)
    assert g == _grids(2048, 29, 1024, 4096, 4096, wide_user=True, **plain)
    assert g == _grids(2048, 29, 1024, 4096, 4096, spare_by_time=True, **plain)
    old = _grids(2048, 29, 1024, 4096, 4096, spare_by_time=False, **plain)
    assert (old.tile_user, old.grid_user, old.splits) == ((64, 256), 4, 1)
    # FP8 operands (K in the plan's 64-element blocks): by time, as 16-bit ones, the user phase
    # ahead as 4-CTA K-split clusters (one slab); by MACs the 4 spare SMs
    fp8 = [plan_grids(2048, 29, 1024, 2048, 2048, 132, H200_CLUSTERS, PlanRules(spare_by_time=s), fp8=True)
           for s in (None, True, False)]
    assert fp8[0] == fp8[1] and (fp8[0].tile_user, fp8[0].split_user, fp8[0].splits, fp8[0].grid_user) == (
        (64, 128), 4, 1, 32)
    assert (fp8[2].split_user, fp8[2].splits, fp8[2].grid_user) == (1, 1, 4)
    # ... under fp8_promote by MACs unless forced (no K-split clusters: by time, 8 slabs)
    promoted = [plan_grids(2048, 29, 1024, 2048, 2048, 132, H200_CLUSTERS,
                           PlanRules(spare_by_time=s, fp8_promote=True), fp8=True) for s in (None, True, False)]
    assert promoted[0] == promoted[2] and (promoted[0].split_user, promoted[0].splits, promoted[0].grid_user) == (
        1, 1, 4)
    assert promoted[1].split_user == 1 and promoted[1].splits == 8
    # the bound itself: cycles of streaming past the main loop's, against the slack
    cand = 128 * 128 * 4096
    slack = SPARE_SLACK_US * SM_CYCLES_PER_US
    fits = (cand / SM_MACS_PER_CYCLE + slack) * SM_STREAM_BYTES_PER_CYCLE / 2
    assert _spare_user_time_fits(int(fits) - 1, cand) and not _spare_user_time_fits(int(fits) + 2, cand)


def _grids(B, U, N, K_user, K_cand, **rules):
    """The grids on an H200 with the small-grid rules on (unless ``rules`` says otherwise)."""
    from ikbo_gemm.linear import PlanRules, _grids

    return _grids(B, U, N, K_cand, K_user, 132, H200_CLUSTERS, PlanRules(**{"split_k": True, "user_pairs": True,
                                                                            **rules}))


def test_user_pairs_keep_the_candidate_clusters_whole():
    """B 2048, N 1024: 64 two-CTA candidate clusters of the 66 an H200 holds. Four single user
    CTAs could sit on four slots (62 left); two K-split pairs take the two spare slots."""
    g = _grids(2048, 29, 1024, 4096, 4096, spare_by_time=False)
    assert (g.tile_cand, g.cluster, g.split_cand, g.grid_cand) == ((128, 128), 2, 1, 128)
    assert (g.tile_user, g.split_user, g.splits, g.grid_user) == ((64, 256), 2, 1, 4)
    old = _grids(2048, 29, 1024, 4096, 4096, user_pairs=False, spare_by_time=False)
    assert (old.split_user, old.splits, old.grid_user) == (1, 1, 4)
    # where singles leave slots enough (B 8192, N 256: 64 clusters, 2 user CTAs), or the user K
    # has a single k-block, singles as before
    assert _grids(8192, 117, 256, 4096, 4096).split_user == 1
    assert _grids(2048, 29, 1024, 64, 4096).split_user == 1


def test_few_candidate_tiles_split_k_over_clusters():
    from ikbo_gemm.config import EXCHANGE_K_BLOCKS, MIN_SPLIT_K_BLOCKS, pick_cand_split

    # B 1024, N 1024, K 4096: 64 tiles of 128 x 128, one wave of 2-CTA clusters (66), not of 4 (30)
    g = _grids(1024, 15, 1024, 4096, 4096)
    assert (g.tile_cand, g.split_cand, g.cluster, g.grid_cand) == ((128, 128), 2, 1, 128)
    assert _grids(1024, 15, 1024, 4096, 4096, split_k=False).split_cand == 1
    # B 1024, N 256, K 2048: 16 tiles, 4-CTA clusters with 8 k-blocks each
    assert pick_cand_split(1024, 256, 32, 132, H200_CLUSTERS) == ((128, 128), 4)
    # enough tiles for the GPU, or too few k-blocks: as before
    assert pick_cand_split(2048, 1024, 64, 132, H200_CLUSTERS) == ((128, 128), 1)
    assert pick_cand_split(512, 1024, 2 * MIN_SPLIT_K_BLOCKS - 1, 132, H200_CLUSTERS) == (
        pick_cand_tile(512, 1024, 132), 1)
    for rows, n, kb in ((1, 1, 1), (300, 200, 16), (512, 256, 32), (1024, 1024, 64), (600, 100, 200)):
        (tm, tn), s = pick_cand_split(rows, n, kb, 132, H200_CLUSTERS)
        tiles = -(-rows // tm) * -(-n // tn)
        if s > 1:
            assert tiles <= H200_CLUSTERS(s) and kb >= s * MIN_SPLIT_K_BLOCKS and (tn // 16) % s == 0
            assert (tm, tn) in ikbo_gemm.config.LINEAR_SPLIT_TILES
        # never more work per CTA than the unsplit choice
        unsplit = pick_cand_tile(rows, n, 132)
        assert (tile_cost(tm, tn, tn, tm) * (-(-kb // s) + (EXCHANGE_K_BLOCKS if s > 1 else 0))
                <= tile_cost(unsplit[0], unsplit[1], unsplit[1], unsplit[0]) * kb)


@pytest.mark.parametrize("kwargs, match", [
    (dict(split_k=3), "split_k must be 1, 2 or 4"),
    (dict(split_k=2, cluster_m=2), "either shares B tiles"),
    (dict(split_k=2, tile_n=192), "at most 128 x 128"),
    (dict(split_k=4, tile_m=128, tile_n=16), "do not deal evenly"),
])
def test_split_config_errors(kwargs, match):
    base = dict(dtype=BF16, idx_dtype=torch.int32, tile_m=128, tile_n=128, phase="cand")
    with pytest.raises(ValueError, match=match):
        LinearConfig(**dict(base, **kwargs))


@pytest.mark.parametrize("kwargs, match", [
    (dict(consumers_per_tile=3), "consumers_per_tile must be 1 or 2"),
    (dict(tile_m=64, consumers_per_tile=2), "two consumers on one tile need tile_m 128"),
    (dict(phase="user", consumers_per_tile=2), "two consumers on one tile need"),
    (dict(split_k=2, consumers_per_tile=2), "two consumers on one tile need"),
    (dict(dtype=torch.float8_e4m3fn, out_dtype=BF16, consumers_per_tile=2), "two consumers on one tile need"),
    (dict(consumers_per_tile=1), "more than the 192 fp32 accumulator registers"),
])
def test_shared_tile_config_errors(kwargs, match):
    base = dict(dtype=BF16, idx_dtype=torch.int32, tile_m=128, tile_n=256, phase="cand", consumers_per_tile=2)
    with pytest.raises(ValueError, match=match):
        LinearConfig(**dict(base, **kwargs))


def test_shared_tile_plan():
    """The candidate phase takes the 128 x 256 shared tile where K_cand >= shared_tile_min_k (1024),
    N <= shared_tile_max_n (1024), its tiles fill every SM at least once, it pads N no more than
    the usual tile and its rounds of the grid hold no more outputs an SM; never in FP8."""
    from ikbo_gemm.config import LINEAR_SHARED_TILE, linear_configs
    from ikbo_gemm.linear import DEFAULT_RULES, _grids as plan_grids

    shared = LINEAR_SHARED_TILE
    assert _grids(8192, 117, 1024, 2048, 1024).tile_cand == shared  # 256 tiles
    assert _grids(8192, 117, 1024, 4096, 4096).tile_cand == shared
    assert _grids(16384, 234, 1024, 1024, 1024).tile_cand == shared
    assert _grids(16384, 234, 2048, 1024, 1024).tile_cand == (128, 128)  # N above 1024
    assert _grids(8192, 117, 1024, 1024, 512).tile_cand == (128, 128)  # K_cand below 1024
    assert _grids(2048, 29, 1024, 4096, 4096).tile_cand == (128, 128)  # 64 shared tiles < 132 SMs
    # Rounds: 192 shared tiles are 2 rounds of 132 (4 ping-pong tiles' outputs), 384 ping-pong tiles 3.
    assert _grids(6144, 88, 1024, 4096, 4096).tile_cand == (128, 128)
    assert _grids(7168, 103, 1024, 4096, 4096).tile_cand == shared  # 2 rounds against 4 (448 tiles)
    assert _grids(10240, 147, 1024, 1024, 2048).tile_cand == (128, 128)  # 3 rounds (6) against 5
    assert _grids(8192, 117, 4096, 1024, 2048).tile_cand == (128, 128)  # N above 1024
    assert _grids(8192, 117, 4096, 1024, 2048, shared_tile_max_n=None).tile_cand == shared
    assert _grids(8192, 117, 1000, 4096, 4096).tile_cand == shared  # N 1024 either way
    assert _grids(8192, 117, 1100, 4096, 4096).tile_cand != shared  # N 1280, where 128-column tiles run 1152
    assert _grids(8192, 117, 1024, 4096, 4096, shared_tile_min_k=None).tile_cand == (128, 128)
    assert _grids(8192, 117, 1024, 4096, 4096, shared_tile_min_k=8192).tile_cand == (128, 128)
    assert plan_grids(8192, 117, 1024, 1024, 1024, 132, H200_CLUSTERS, DEFAULT_RULES, fp8=True).tile_cand != shared
    user, cand = linear_configs(BF16, torch.int32, (128, 128), shared, "relu", True, 2)
    assert (cand.consumers_per_tile, user.consumers_per_tile) == (2, 1)
    assert linear_configs(BF16, torch.int32, (128, 128), (128, 128), None, False)[1].consumers_per_tile == 1
    assert _grids(300, 3, 200, 64, 1000, cand_split=(shared, 1)).tile_cand == shared


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=BF16, out_dtype=None), "promote needs FP8 operands"),
    (dict(split_k=2, tile_n=64, consumers_per_tile=1), "promote needs FP8 operands, no split_k"),
    (dict(tile_n=128, consumers_per_tile=1), "at most 8192 outputs a consumer"),
    (dict(promote=1), "LinearConfig.promote must be a bool"),
])
def test_promote_config_errors(kwargs, match):
    base = dict(dtype=torch.float8_e4m3fn, idx_dtype=torch.int32, tile_m=128, tile_n=128, phase="cand",
                out_dtype=BF16, consumers_per_tile=2, promote=True)
    with pytest.raises((ValueError, TypeError), match=match):
        LinearConfig(**dict(base, **kwargs))


def test_fp8_promote_plan():
    """PlanRules.fp8_promote: FP8 calls promote in both phases, the 128 x 128 candidate tile shared
    by both consumers (narrower ones ping-pong), user tiles of at most 64 x 128 outputs; 16-bit
    calls keep their plan."""
    from ikbo_gemm.config import LINEAR_PROMOTE_TILES, linear_configs
    from ikbo_gemm.linear import DEFAULT_RULES, FP8_PROMOTE_RULES, _grids as plan_grids

    for B, U, N, K_user, K_cand in ((2048, 30, 1024, 2048, 2048), (8192, 117, 4096, 512, 1024),
                                    (65536, 4096, 100, 50, 500), (1, 1, 1, 16, 16), (256, 3, 256, 2048, 2048)):
        g = plan_grids(B, U, N, K_cand, K_user, 132, H200_CLUSTERS, FP8_PROMOTE_RULES, fp8=True)
        plain = plan_grids(B, U, N, K_cand, K_user, 132, H200_CLUSTERS, DEFAULT_RULES, fp8=True)
        assert g.tile_user in LINEAR_PROMOTE_TILES and (g.split_cand, g.split_user) == (1, 1)
        assert g.tile_cand == plain.tile_cand  # the same tiles, shared or not
        user, cand = linear_configs(torch.float8_e4m3fn, torch.int32, g.tile_user, g.tile_cand, "relu", True,
                                    g.cluster, out_dtype=BF16, promote=True)
        assert user.promote and cand.promote
        assert cand.consumers_per_tile == (2 if g.tile_cand == (128, 128) else 1)
    bf16 = plan_grids(2048, 30, 1024, 2048, 2048, 132, H200_CLUSTERS, FP8_PROMOTE_RULES)
    assert bf16 == plan_grids(2048, 30, 1024, 2048, 2048, 132, H200_CLUSTERS, DEFAULT_RULES)
    wide = plan_grids(512, 7, 4096, 1024, 1024, 132, H200_CLUSTERS, ikbo_gemm.PlanRules(fp8_promote=True,
                                                                                         wide_user=True), fp8=True)
    assert wide.tile_user == (64, 128) and wide.splits > 1


def test_a_split_with_an_empty_slice_is_refused():
    forced = dict(cand_split=((128, 128), 4))
    with pytest.raises(ValueError, match="3 k-blocks leave a CTA of a 4-way K split none"):
        _grids(300, 3, 200, 64, 192, **forced)
    assert _grids(300, 3, 200, 64, 256, **forced).split_cand == 4  # one k-block each


def test_user_cluster_split_plan():
    """user_cluster_split (None, the default: on, but for FP8 calls under fp8_promote): the user
    phase's K slices as one K-split cluster a tile (one slab), in a tile a K split takes; as
    before where there is one slice and where the user phase takes the spare SMs."""
    from ikbo_gemm.config import LINEAR_SPLIT_TILES
    from ikbo_gemm.linear import DEFAULT_RULES, NO_USER_CLUSTER_SPLIT_RULES, _grids as plan_grids

    assert DEFAULT_RULES.user_cluster_split is None and NO_USER_CLUSTER_SPLIT_RULES.user_cluster_split is False
    for B, N, K in ((8192, 1024, 1024), (8192, 4096, 2048), (2048, 4096, 4096), (512, 4096, 4096)):
        plain = _grids(B, -(-B // 70), N, K, 1024, user_cluster_split=False)
        g = _grids(B, -(-B // 70), N, K, 1024)
        assert plain.splits > 1 and plain.split_user == 1
        assert g.splits == 1 and g.split_user == min(4, plain.splits) >= 2
        assert g.grid_user % g.split_user == 0 and g.tile_user in LINEAR_SPLIT_TILES
        assert (g.tile_cand, g.cluster, g.split_cand, g.grid_cand) == (
            plain.tile_cand, plain.cluster, plain.split_cand, plain.grid_cand)
    # 8 wide slices (B 2048, N 1024, K 4096): 4-CTA clusters on 64 x 128 tiles, 8 of them
    g = _grids(2048, 29, 1024, 4096, 4096, wide_user=True, split_k=False, user_pairs=False)
    assert (g.tile_user, g.split_user, g.splits, g.grid_user) == ((64, 128), 4, 1, 32)
    # 2 slices (K_user 250: 4 k-blocks): pairs
    g = _grids(300, 3, 200, 250, 64, split_k=False, user_pairs=False)
    assert (g.split_user, g.splits, g.grid_user) == (2, 1, 2)
    # a 128 x 192 user tile (N 1152) is too wide for a K split: 128 x 128 clusters
    assert _grids(8192, 117, 1152, 4096, 1024, user_cluster_split=False).tile_user == (128, 192)
    assert _grids(8192, 117, 1152, 4096, 1024).tile_user == (128, 128)
    assert _grids(8192, 117, 1024, 128, 1024).splits == 1  # one slice: as before
    # the spare SMs' user CTAs (B 2048, N 1024: 4 user CTAs of the whole K): as before
    assert _grids(2048, 29, 1024, 1024, 2048, split_k=False, user_pairs=False) == _grids(
        2048, 29, 1024, 1024, 2048, split_k=False, user_pairs=False, user_cluster_split=False)
    # FP8 operands: the same (the default plan is that of both rules True), slabs when off
    from ikbo_gemm.linear import FP8_PROMOTE_RULES, PlanRules
    from ikbo_gemm.config import LINEAR_SHIPPED_CONFIGS, linear_configs
    fp8 = plan_grids(8192, 117, 4096, 1024, 512, 132, H200_CLUSTERS, DEFAULT_RULES, fp8=True)
    assert fp8.splits == 1 and fp8.split_user == 4 and fp8.tile_user in LINEAR_SPLIT_TILES
    both = PlanRules(user_cluster_split=True, spare_by_time=True)
    for B, N, K_user, K_cand in itertools.product((2048, 4096, 8192), (256, 1024, 4096),
                                                  (1024, 4096), (1024, 2048, 4096)):
        args = (B, -(-B // 70), N, K_cand // 2, K_user // 2, 132, H200_CLUSTERS)  # 64-element k-blocks
        assert plan_grids(*args, DEFAULT_RULES, fp8=True) == plan_grids(*args, both, fp8=True)
    slabs = plan_grids(8192, 117, 4096, 1024, 512, 132, H200_CLUSTERS, NO_USER_CLUSTER_SPLIT_RULES, fp8=True)
    assert slabs.splits > 1 and slabs.split_user == 1
    user_cfg, _ = linear_configs(torch.float8_e4m3fn, torch.int32, fp8.tile_user, fp8.tile_cand, "relu", True,
                                 fp8.cluster, fp8.split_cand, fp8.split_user, torch.bfloat16)
    assert user_cfg in LINEAR_SHIPPED_CONFIGS
    # ... and never with promotion (no promoting K-split configurations): there the default is
    # both rules off
    promote = dataclasses.replace(FP8_PROMOTE_RULES, user_cluster_split=True)
    assert plan_grids(8192, 117, 4096, 1024, 512, 132, H200_CLUSTERS, promote, fp8=True).split_user == 1
    off = dataclasses.replace(FP8_PROMOTE_RULES, user_cluster_split=False, spare_by_time=False)
    for B, N, K in itertools.product((2048, 4096, 8192), (256, 1024, 4096), (512, 1024, 2048)):
        args = (B, -(-B // 70), N, K, K, 132, H200_CLUSTERS)
        assert plan_grids(*args, FP8_PROMOTE_RULES, fp8=True) == plan_grids(*args, off, fp8=True)
    # 16-bit calls: None and True the same
    assert _grids(8192, 117, 4096, 1024, 512, user_cluster_split=True) == _grids(8192, 117, 4096, 1024, 512)


def test_wide_user_phase_plan():
    """PlanRules.wide_user: where the user grid runs before candidate CTAs, 64 x 128 user tiles
    and up to 8 K slices make its CTAs many and short; it never takes the spare SMs alone (the
    slices as workspace slabs: user_cluster_split off)."""
    from ikbo_gemm.linear import WIDE_USER_SLICES

    plain = dict(split_k=False, user_pairs=False, user_cluster_split=False)
    # B 512, N 4096, K 4096: 128 candidate CTAs; 32 user tiles x 4 slices (was 16 x 4)
    g = _grids(512, 7, 4096, 4096, 4096, wide_user=True, **plain)
    assert (g.tile_user, g.splits, g.grid_user, g.grid_cand) == ((64, 128), 4, 128, 128)
    # B 2048, N 1024, K 4096: 4 user CTAs of the whole K on the spare SMs before; now 8 x 8 slices
    old = _grids(2048, 29, 1024, 4096, 4096, spare_by_time=False, **plain)
    assert (old.grid_user, old.splits) == (4, 1)
    g = _grids(2048, 29, 1024, 4096, 4096, wide_user=True, **plain)
    assert (g.tile_user, g.splits, g.grid_user, g.tile_cand, g.grid_cand) == ((64, 128), 8, 64, (128, 128), 128)
    # with the candidate K split, the split candidate grid as before
    g = _grids(1024, 15, 1024, 4096, 4096, wide_user=True, split_k=True, user_pairs=False,
               user_cluster_split=False)
    assert (g.split_cand, g.grid_cand, g.splits, g.grid_user) == (2, 128, 8, 64)
    # more users than one 64-row tile: the usual tile; every slice has a k-block
    assert _grids(8192, 117, 1024, 4096, 4096, wide_user=True, **plain).tile_user == (128, 128)
    for B, U, N, K in itertools.product((1, 300, 2048), (1, 7, 65, 300), (8, 1000, 4096), (8, 136, 1000, 4096)):
        g = _grids(B, U, N, K, K, wide_user=True, **plain)
        kb = -(-K // 64)
        assert 1 <= g.splits <= WIDE_USER_SLICES and (g.splits - 1) * -(-kb // g.splits) < kb
        assert g.grid_user <= 132 and g.split_user == 1


def test_wide_user_phase_by_size():
    """The op's rules take the wide user phase from N 4096 on (wide_user_min_n), as wide_user does
    everywhere; None keeps it to wide_user."""
    plain = dict(split_k=False, user_pairs=False, user_cluster_split=False)
    for B, U, N in ((512, 7, 4096), (2048, 29, 8192), (8192, 117, 4096)):
        assert _grids(B, U, N, 4096, 4096, **plain) == _grids(B, U, N, 4096, 4096, wide_user=True, **plain)
    g = _grids(512, 7, 4096, 4096, 4096, wide_user_min_n=None, **plain)
    assert (g.tile_user, g.grid_user) == ((64, 256), 64) and _grids(512, 7, 4096, 4096, 4096, **plain).grid_user == 128
    for B, U, N in ((512, 7, 1024), (2048, 29, 1024), (2048, 29, 4095)):
        assert _grids(B, U, N, 4096, 4096, **plain) == _grids(B, U, N, 4096, 4096, wide_user_min_n=None, **plain)


@pytest.mark.parametrize("rules, error, match", [
    (dict(cand_split=((128, 100), 2)), ValueError, "PlanRules.cand_split must be"),
    (dict(cand_split=((128, 128), 3)), ValueError, "PlanRules.cand_split must be"),
    (dict(cand_clusters=0), ValueError, "PlanRules.cand_clusters must be a positive int"),
    (dict(wide_user_min_n=0), ValueError, "PlanRules.wide_user_min_n must be a positive int or None"),
    (dict(shared_tile_min_k=True), ValueError, "PlanRules.shared_tile_min_k must be a positive int or None"),
    (dict(shared_tile_max_n=0), ValueError, "PlanRules.shared_tile_max_n must be a positive int or None"),
    (dict(cand_split=((128, 256), 2)), ValueError, "PlanRules.cand_split must be"),
    (dict(user_splits=0), ValueError, "PlanRules.user_splits must be a positive int or None"),
    (dict(user_splits=True), ValueError, "PlanRules.user_splits must be a positive int or None"),
    (dict(user_tile=(32, 128)), ValueError, "PlanRules.user_tile must be one of"),
    (dict(split_k=1), TypeError, "PlanRules.split_k must be a bool"),
    (dict(user_cluster_split=1), TypeError, "PlanRules.user_cluster_split must be None or a bool"),
    (dict(spare_by_time=0), TypeError, "PlanRules.spare_by_time must be None or a bool"),
    (dict(fp8_promote=1), TypeError, "PlanRules.fp8_promote must be a bool"),
    (dict(cand_band_rows=0), ValueError, "PlanRules.cand_band_rows must be a positive int or None"),
    (dict(cand_band_rows=True), ValueError, "PlanRules.cand_band_rows must be a positive int or None"),
    (dict(cand_cluster_n=4), ValueError, "PlanRules.cand_cluster_n must be None, 1 or 2"),
    (dict(cand_cluster_n=True), ValueError, "PlanRules.cand_cluster_n must be None, 1 or 2"),
    (dict(fp8_promote=True, split_k=True), ValueError, "PlanRules.fp8_promote takes no K split"),
    (dict(fp8_promote=True, user_pairs=True), ValueError, "PlanRules.fp8_promote takes no K split"),
    (dict(fp8_promote=True, cand_split=((128, 128), 2)), ValueError, "PlanRules.fp8_promote takes no K split"),
    (dict(fp8_promote=True, user_tile=(128, 128)), ValueError, "user tiles of"),
])
def test_plan_rules_check_their_fields(rules, error, match):
    from ikbo_gemm.linear import PlanRules

    with pytest.raises(error, match=match):
        PlanRules(**rules)


def test_forced_choices_of_the_plan_rules():
    """cand_split, cand_clusters, user_tile and user_splits force what the plan would pick."""
    g = _grids(300, 3, 200, 64, 1000, cand_split=((64, 128), 2), cand_clusters=1)
    assert (g.tile_cand, g.split_cand, g.grid_cand) == ((64, 128), 2, 2)
    g = _grids(300, 3, 200, 64, 1000, split_k=False, cand_split=((128, 64), 1))
    assert (g.tile_cand, g.split_cand) == ((128, 64), 1)
    assert _grids(2048, 29, 1024, 4096, 4096, user_tile=(64, 128)).tile_user == (64, 128)
    for B, N in ((8192, 1024), (2048, 4096), (512, 4096)):
        slabs = dict(user_cluster_split=False)
        assert _grids(B, B // 70, N, 4096, 4096, **slabs).splits > 2
        assert _grids(B, B // 70, N, 4096, 4096, user_splits=1, **slabs).splits == 1
        assert _grids(B, B // 70, N, 4096, 4096, user_splits=2, **slabs).splits == 2
        g = _grids(B, B // 70, N, 4096, 4096, user_splits=1)
        assert (g.splits, g.split_user) == (1, 1)
        g = _grids(B, B // 70, N, 4096, 4096, user_splits=2)
        assert (g.splits, g.split_user) == (1, 2)


def test_rules_argument_is_checked():
    args = _inputs(3, 3, 2, 16, 8, 8)
    with pytest.raises(TypeError, match="rules must be PlanRules or None, got str"):
        ikbo_gemm.linear(**args, rules="small")


def test_the_op_leaves_the_small_grid_rules_off_until_timed():
    from ikbo_gemm.linear import DEFAULT_RULES, SMALL_GRID_RULES

    assert not DEFAULT_RULES.split_k and not DEFAULT_RULES.user_pairs
    assert SMALL_GRID_RULES.split_k and SMALL_GRID_RULES.user_pairs
    assert _grids(1024, 15, 1024, 4096, 4096, split_k=False, user_pairs=False).split_cand == 1


@pytest.mark.parametrize("rules, slabs, B, U, N, K_user, K_cand, split_cand, split_user, slices", [
    ("SMALL_GRID_RULES", False, 1024, 15, 1024, 4096, 4096, 2, 4, 1),  # 64 tiles: 2-CTA K splits
    ("SMALL_GRID_RULES", True, 1024, 15, 1024, 4096, 4096, 2, 1, 4),  # ... the user K in 4 slabs
    ("SMALL_GRID_RULES", False, 1024, 15, 256, 1024, 2048, 4, 4, 1),  # 16 tiles: 4-CTA K splits
    ("SMALL_GRID_RULES", True, 1024, 15, 256, 1024, 2048, 4, 1, 4),
    ("SMALL_GRID_RULES", False, 2048, 29, 1024, 1000, 4096, 1, 2, 1),  # 2-CTA candidate clusters: user pairs
    ("WIDE_USER_RULES", False, 2048, 29, 1024, 1000, 4096, 1, 4, 1),  # 16 user k-blocks over 4-CTA clusters
    ("WIDE_USER_RULES", True, 2048, 29, 1024, 1000, 4096, 1, 1, 8),  # 8 user slices of 2 k-blocks, the last short
    ("SPLIT_WIDE_USER_RULES", False, 1024, 15, 256, 1000, 2048, 4, 4, 1),
    ("SPLIT_WIDE_USER_RULES", True, 1024, 15, 256, 1000, 2048, 4, 1, 8),
    ("DEFAULT_RULES", False, 2048, 29, 4096, 1000, 4096, 1, 4, 1),  # N 4096: the wide user phase
    ("DEFAULT_RULES", False, 300, 3, 200, 250, 64, 1, 2, 1),  # 4 user k-blocks: pairs
    ("NO_USER_CLUSTER_SPLIT_RULES", False, 300, 3, 200, 250, 64, 1, 1, 2),
])
def test_gpu_path_with_plan_rules(monkeypatch, rules, slabs, B, U, N, K_user, K_cand, split_cand, split_user,
                                  slices):
    """The op's host side with launch-plan rules on (``slabs``: the user K slices as workspace slabs,
    user_cluster_split off), its kernel emulated: the configurations and grids it launches, and the
    result."""
    from linear_emulation import install

    kernels = install(monkeypatch)
    linear_mod = importlib.import_module("ikbo_gemm.linear")
    args = _inputs(21, B, U, N, K_user, K_cand)
    rules = getattr(linear_mod, rules)
    if slabs:
        rules = dataclasses.replace(rules, user_cluster_split=False)
    out = ikbo_gemm.linear(**args, activation="relu", rules=rules)
    user, cand = (launch["cfg"] for launch in kernels.launches)
    assert (cand.split_k, user.split_k, kernels.launches[0]["splits"]) == (split_cand, split_user, slices)
    d = {k: v.double() for k, v in args.items() if k != "idx"}
    ref = torch.relu(d["x_cand"] @ d["w_cand"].T + (d["x_user"] @ d["w_user"].T)[args["idx"].long()] + d["bias"])
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def _band_tile(r: int, n_tiles: int, m_groups: int, band_rows: int) -> tuple:
    """LinearSm90.decode's band order (one K slice): walk position r -> (row group, column tile)."""
    band = r // (band_rows * n_tiles)
    in_band = r - band * band_rows * n_tiles
    rows = min(band_rows, m_groups - band * band_rows)
    n = in_band // rows
    return band * band_rows + in_band - n * rows, n


@pytest.mark.parametrize("n_tiles, m_groups", [(8, 8), (8, 16), (3, 7), (1, 5), (5, 1), (16, 33)])
@pytest.mark.parametrize("band_rows", [1, 2, 3, 8, 64])
def test_candidate_walk_bands_cover_every_tile_once(n_tiles, m_groups, band_rows):
    """PlanRules.cand_band_rows: every (row group, column tile) once, row group fastest within a
    band of band_rows row groups (the last band narrower), bands in order; band_rows 1 is the
    column-fastest order the kernel had before."""
    order = [_band_tile(r, n_tiles, m_groups, band_rows) for r in range(n_tiles * m_groups)]
    assert sorted(order) == [(m, n) for m in range(m_groups) for n in range(n_tiles)]
    if band_rows == 1:
        assert order == [(r // n_tiles, r % n_tiles) for r in range(n_tiles * m_groups)]
    width = min(band_rows, m_groups)
    assert order[:width] == [(m, 0) for m in range(width)]
    assert all(m // band_rows == r // (band_rows * n_tiles) for r, (m, _) in enumerate(order))


def test_candidate_bands_reach_the_launch(monkeypatch):
    """cand_band_rows parses from a spec and reaches the candidate launch only (the user walk keeps
    its order), with the same result. None (the default): bands of BAND_ROWS row groups where a
    band over every column tile fits the resident clusters (few column tiles), else 1; never on a
    configuration that is not banded (tiles wider than 128 x 128 a consumer)."""
    from linear_emulation import install
    from ikbo_gemm.config import LinearConfig, linear_configs
    from ikbo_gemm.linear import COLUMN_WALK_RULES, DEFAULT_RULES, BAND_ROWS, PlanRules
    assert DEFAULT_RULES.cand_band_rows is None and BAND_ROWS == 8
    rules = PlanRules.parse("cand_band_rows=3")
    assert rules.cand_band_rows == 3 and rules.spec() == "cand_band_rows=3" and rules != DEFAULT_RULES
    assert PlanRules.parse("cand_band_rows=1") == COLUMN_WALK_RULES
    kernels = install(monkeypatch)
    args = _inputs(23, 2048, 29, 1024, 1000, 4096)
    outs = [ikbo_gemm.linear(**args, activation="relu", rules=r) for r in (DEFAULT_RULES, rules, COLUMN_WALK_RULES)]
    assert [(launch["cfg"].phase, launch["band_rows"]) for launch in kernels.launches] == [
        ("user", 1), ("cand", 8), ("user", 1), ("cand", 3), ("user", 1), ("cand", 1)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    # Many column tiles (N 4096 in 128-wide tiles): a band of 8 over all of them outgrows a wave.
    kernels.launches.clear()
    ikbo_gemm.linear(**_inputs(24, 2048, 29, 4096, 512, 1024), activation="relu")
    cand = kernels.launches[1]
    assert cand["cfg"].banded and cand["cfg"].tile_n == 128 and cand["band_rows"] == 1
    # Banded configurations: candidate tiles of at most 128 x 128 a consumer.
    assert not LinearConfig(torch.bfloat16, torch.int32, 128, 128, "user").banded
    assert not LinearConfig(torch.bfloat16, torch.int32, 128, 192, "cand").banded
    assert linear_configs(torch.bfloat16, torch.int32, (128, 128), (128, 256), "relu", True, 2)[1].banded
    with pytest.raises(ValueError, match="PlanRules.cand_band_rows must be a positive int or None"):
        PlanRules(cand_band_rows=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(cluster_n=4), "cluster_n must be 1 or 2"),
    (dict(cluster_n=2, cluster_m=1), "needs the candidate phase, cluster_m 2"),
    (dict(cluster_n=2, phase="user"), "needs the candidate phase, cluster_m 2"),
    (dict(cluster_n=2, cluster_m=1, split_k=2), "needs the candidate phase, cluster_m 2"),
    (dict(cluster_n=2, tile_n=192), "at most 16384 outputs a consumer"),
])
def test_cluster_n_config_errors(kwargs, match):
    base = dict(dtype=BF16, idx_dtype=torch.int32, tile_m=128, tile_n=128, phase="cand", cluster_m=2)
    with pytest.raises(ValueError, match=match):
        LinearConfig(**dict(base, **kwargs))


def test_two_by_two_cluster_plan():
    """PlanRules.cand_cluster_n = 2: the candidate phase's 2-CTA clusters become 2 x 2 ones (grid a
    multiple of 4, at most the 4-CTA clusters resident), wherever it has 2-CTA clusters and 2
    column tiles or more; never with a K split, one row tile or one column tile; off by default."""
    from ikbo_gemm.config import linear_configs
    from ikbo_gemm.linear import CLUSTER_2X2_RULES, DEFAULT_RULES, PlanRules

    assert DEFAULT_RULES.cand_cluster_n is None and PlanRules.parse("cand_cluster_n=2") == CLUSTER_2X2_RULES
    g = _grids(10240, 147, 1024, 4096, 4096, cand_cluster_n=2)
    assert (g.tile_cand, g.cluster, g.cluster_n, g.grid_cand) == ((128, 128), 2, 2, 4 * H200_CLUSTERS(4))
    assert _grids(10240, 147, 1024, 4096, 4096).cluster_n == 1
    g = _grids(8192, 117, 1024, 4096, 4096, cand_cluster_n=2)  # the shared 128 x 256 tile
    assert (g.tile_cand, g.cluster_n) == ((128, 256), 2)
    assert _grids(64, 2, 1024, 64, 64, cand_cluster_n=2).cluster_n == 1  # one row tile: no cluster
    assert _grids(4096, 59, 128, 64, 1024, cand_cluster_n=2).cluster_n == 1  # one column tile
    g = _grids(4096, 59, 384, 64, 1024, cand_cluster_n=2)  # 128 x 192: the 2 x 2 loads would spill
    assert (g.tile_cand, g.cluster, g.cluster_n) == ((128, 192), 2, 1)
    g = _grids(2048, 29, 1024, 64, 1024, cand_cluster_n=2, cand_split=((128, 128), 2))
    assert (g.split_cand, g.cluster, g.cluster_n) == (2, 1, 1)  # a K split
    g = _grids(4096, 59, 640, 64, 1024, cand_cluster_n=2)  # 5 column tiles: 3 groups, the last half past N
    assert g.cluster_n == 2 and g.tile_cand == (128, 128) and g.grid_cand == 4 * H200_CLUSTERS(4)
    cand = linear_configs(BF16, torch.int32, (128, 128), (128, 128), "relu", True, 2, cluster_n_cand=2)[1]
    assert (cand.cluster_m, cand.cluster_n, cand.cluster, str(cand)) == (
        2, 2, 4, "linear-cand-bfloat16-int32-m128-n128-c2x2-relu-bias")


@pytest.mark.parametrize("N", [640, 1000, 1024])
def test_two_by_two_clusters_reach_the_launch(monkeypatch, N):
    """The candidate launch gets the 2 x 2 configuration and a grid of whole 4-CTA clusters, the
    workspace whole column groups (a column tile past N reads its columns), the same result."""
    from linear_emulation import install
    from ikbo_gemm.linear import CLUSTER_2X2_RULES, DEFAULT_RULES

    kernels = install(monkeypatch)
    ws_widths = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (ws_widths.append(a[0]) if k.get("dtype") == torch.float32
                                                         and isinstance(a[0], tuple) and len(a[0]) == 3 else None)
                        or real_empty(*a, **k))
    args = _inputs(25, 4096, 59, N, 64, 1024)
    base = ikbo_gemm.linear(**args, activation="relu", rules=DEFAULT_RULES)
    out = ikbo_gemm.linear(**args, activation="relu", rules=CLUSTER_2X2_RULES)
    cand = [launch for launch in kernels.launches if launch["cfg"].phase == "cand"]
    assert [(c["cfg"].cluster_n, c["grid"] % c["cfg"].cluster) for c in cand] == [(1, 0), (2, 0)]
    group = 2 * cand[1]["cfg"].tile_n
    assert ws_widths[1][2] == -(-N // group) * group >= ws_widths[0][2]
    torch.testing.assert_close(out, base, rtol=0, atol=0)
