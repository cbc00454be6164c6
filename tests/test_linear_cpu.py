"""CPU tests of ikbo_gemm.linear: the reference against a float64 evaluation of the
un-decomposed concatenation, argument validation, split_weight, the tile pick, and sm_90a
compiles of every shipped configuration."""
from __future__ import annotations

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


def test_the_user_phase_takes_the_idle_sms_of_a_partial_candidate_wave():
    from ikbo_gemm.linear import _spare_user_grid

    # B 2048, N 1024: 128 candidate tiles on 132 SMs; 4 user tiles of 64 x 256, one per idle SM
    assert _spare_user_grid(4, (64, 256), 4096, 128, (128, 128), 4096, 128, 132) == 4
    assert _spare_user_grid(4, (64, 256), 1024, 128, (128, 128), 2048, 128, 132) == 4
    # a user tile more work than a candidate tile: the split user grid as before
    assert _spare_user_grid(4, (64, 256), 8192, 128, (128, 128), 4096, 128, 132) == 0
    # several waves of candidate tiles, or no idle SM
    assert _spare_user_grid(4, (64, 256), 1024, 512, (128, 128), 2048, 132, 132) == 0
    assert _spare_user_grid(4, (64, 256), 1024, 132, (128, 128), 2048, 132, 132) == 0
