"""CPU tests of the FP8 references (``linear_reference`` and ``lce_reference`` with float8_e4m3fn
operands and scales) against float64 of the un-decomposed formula on the dequantized inputs,
and of the ops on CPU tensors, which run them."""
from __future__ import annotations

import pytest
import torch

import ikbo_gemm
from fp8_inputs import lce_fp8_f64, lce_fp8_problem, linear_fp8_f64, linear_fp8_problem
from ikbo_gemm.config import ACTIVATIONS

BF16, F16 = torch.bfloat16, torch.float16
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}

LINEAR_CASES = [  # B, U, N, K_user, K_cand
    (1, 1, 1, 1, 1),  # one candidate, one user
    (9, 9, 7, 5, 3),  # ratio 1
    (40, 4, 33, 17, 64),
    (100, 1, 8, 7, 1000),  # one user
    (64, 3, 100, 64, 7),
]


def _within_one_rounding(out, exact, dtype, slack=1e-4):
    """Each element within the output dtype's unit roundoff of float64 (plus fp32 slack)."""
    assert out.dtype == dtype and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= UNIT_ROUNDOFF[dtype] * exact.abs() + slack).all()


@pytest.mark.parametrize("per_tensor", [False, True], ids=["rowwise", "per_tensor"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: "-".join(map(str, c)))
def test_linear_reference_matches_the_dequantized_layer(case, activation, per_tensor):
    kw = linear_fp8_problem(*case, seed=sum(case), per_tensor=per_tensor)
    out = ikbo_gemm.linear_reference(**kw, activation=activation)
    _within_one_rounding(out, linear_fp8_f64(**kw, activation=activation), BF16)


@pytest.mark.parametrize("bias_dtype", [torch.float32, BF16, F16, None], ids=["fp32", "bf16", "fp16", "none"])
@pytest.mark.parametrize("out_dtype", [F16, BF16])
def test_linear_reference_out_dtype_and_bias(out_dtype, bias_dtype):
    kw = linear_fp8_problem(30, 4, 24, 16, 40, seed=3, bias=bias_dtype is not None,
                            bias_dtype=bias_dtype or torch.float32, idx_dtype=torch.int64)
    out = ikbo_gemm.linear_reference(**kw, activation="gelu", out_dtype=out_dtype)
    _within_one_rounding(out, linear_fp8_f64(**kw, activation="gelu"), out_dtype)


def test_linear_scales_apply_per_row_and_column():
    """Scaling one row of x_cand (and its scale back) or one column's weight scale moves exactly
    that row or column of the result."""
    kw = linear_fp8_problem(12, 3, 10, 8, 16, seed=5, bias=False)
    base = ikbo_gemm.linear_reference(**kw).double()
    row = dict(kw, x_cand_scale=kw["x_cand_scale"].clone())
    row["x_cand_scale"][4] *= 2
    col = dict(kw, w_user_scale=kw["w_user_scale"].clone(), w_cand_scale=kw["w_cand_scale"].clone())
    col["w_user_scale"][7] *= 2
    col["w_cand_scale"][7] *= 2
    got_row, got_col = ikbo_gemm.linear_reference(**row).double(), ikbo_gemm.linear_reference(**col).double()
    others = torch.arange(12) != 4
    assert torch.equal(got_row[others], base[others]) and not torch.equal(got_row[4], base[4])
    torch.testing.assert_close(got_col[:, 7], 2 * base[:, 7], rtol=2**-7, atol=1e-3)
    assert torch.equal(got_col[:, :7], base[:, :7])


def test_linear_out_of_range_rows_are_nan_and_isolated():
    kw = linear_fp8_problem(20, 4, 9, 8, 8, seed=2)
    kw["idx"][[3, 11]] = torch.tensor([-1, 4], dtype=kw["idx"].dtype)
    out = ikbo_gemm.linear_reference(**kw, validate=False)
    bad = torch.zeros(20, dtype=torch.bool)
    bad[[3, 11]] = True
    assert out[bad].isnan().all() and not out[~bad].isnan().any()
    good = dict(kw, idx=kw["idx"].clamp(0, 3))
    assert torch.equal(out[~bad], ikbo_gemm.linear_reference(**good)[~bad])


def test_linear_empty_batch():
    kw = linear_fp8_problem(0, 3, 9, 8, 8, seed=2)
    out = ikbo_gemm.linear(**kw)
    assert out.shape == (0, 9) and out.dtype == BF16


def test_linear_op_on_cpu_is_the_reference_and_fills_out():
    kw = linear_fp8_problem(30, 4, 24, 16, 40, seed=1)
    out = torch.full((30, 24), float("nan"), dtype=F16)
    res = ikbo_gemm.linear(**kw, activation="relu", out=out, out_dtype=F16)
    assert res is out
    assert torch.equal(out, ikbo_gemm.linear_reference(**kw, activation="relu", out_dtype=F16))


LCE_CASES = [  # B, U, M, N, K_user, K_cand
    (1, 1, 1, 1, 1, 1),
    (9, 9, 7, 5, 3, 6),  # ratio 1
    (40, 4, 33, 17, 64, 20),
    (50, 1, 8, 100, 7, 300),  # one user
]


@pytest.mark.parametrize("per_tensor", [False, True], ids=["rowwise", "per_tensor"])
@pytest.mark.parametrize("case", LCE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_lce_reference_matches_the_dequantized_formula(case, per_tensor):
    kw = lce_fp8_problem(*case, seed=sum(case), per_tensor=per_tensor)
    out = ikbo_gemm.lce_reference(**kw)
    _within_one_rounding(out, lce_fp8_f64(**kw), BF16)


def test_lce_reference_chunks_take_their_own_scales(monkeypatch):
    """Candidates evaluated in several chunks each take their own rows of e_cand_scale."""
    import ikbo_gemm.reference as reference

    kw = lce_fp8_problem(23, 3, 5, 6, 4, 7, seed=9)
    whole = ikbo_gemm.lce_reference(**kw, out_dtype=F16)
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 100)  # chunks of 1 or 2 candidates
    assert torch.equal(ikbo_gemm.lce_reference(**kw, out_dtype=F16), whole)
    _within_one_rounding(whole, lce_fp8_f64(**kw), F16)


def test_lce_out_of_range_is_nan_and_isolated():
    kw = lce_fp8_problem(10, 3, 4, 5, 6, 7, seed=4)
    kw["idx"][2] = 3
    out = ikbo_gemm.lce(**kw, validate=False)
    assert out[2].isnan().all() and not out[torch.arange(10) != 2].isnan().any()


def test_lce_op_on_cpu_is_the_reference_and_fills_out():
    kw = lce_fp8_problem(12, 3, 9, 10, 8, 16, seed=1)
    out = torch.full((12, 9, 10), float("nan"), dtype=BF16)
    assert ikbo_gemm.lce(**kw, out=out, schedule="two_launch") is out
    assert torch.equal(out, ikbo_gemm.lce_reference(**kw))
