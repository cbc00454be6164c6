"""ikbo_gemm.linear with FP8 operands on an sm_90 GPU, against float64 of the formula on the
dequantized operands and against torch._scaled_mm on the same operands.

The cases cover every value of each axis at least once (B, ratio, K, N, scales per row or per
tensor, activation, out dtype) rather than their cross product."""
from __future__ import annotations

import pytest
import torch

import ikbo_gemm
from fp8_inputs import assert_fp8_kernel_rounding, linear_fp8_accumulation, linear_fp8_f64, linear_fp8_problem

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16, F16 = torch.bfloat16, torch.float16

CASES = [  # B, U, N, K_user, K_cand, per_tensor, activation, out_dtype
    (1, 1, 1, 1, 1, False, None, BF16),  # one candidate, one user
    (3, 3, 7, 7, 100, True, "relu", BF16),  # ratio 1
    (4096, 64, 1000, 1000, 7, False, "gelu", F16),
    (4096, 4096, 100, 100, 1000, False, "silu", BF16),  # ratio 1
    (65536, 7, 128, 1024, 2048, False, "relu", BF16),  # ratio about 10,000
    (65536, 65536 // 16, 1000, 7, 1, True, "sigmoid", F16),
    (2048, 30, 1024, 4096, 4096, False, "gelu_tanh", BF16),  # compute-bound
    (2048, 1, 4096, 1024, 2048, True, None, BF16),  # one user
]


PROMOTE = ikbo_gemm.PlanRules(fp8_promote=True)
# The user phase's K slices each a workspace slab (the default runs them as K-split clusters).
SLABS = ikbo_gemm.PlanRules(user_cluster_split=False, spare_by_time=True)


@pytest.mark.parametrize("rules", [None, PROMOTE, SLABS], ids=["default", "promote", "slabs"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_matches_the_dequantized_layer(case, rules):
    B, U, N, K_user, K_cand, per_tensor, activation, out_dtype = case
    kw = linear_fp8_problem(B, U, N, K_user, K_cand, seed=B + N, device=DEVICE, per_tensor=per_tensor)
    out = torch.full((B, N), float("nan"), dtype=out_dtype, device=DEVICE)  # poisoned
    res = ikbo_gemm.linear(**kw, activation=activation, out=out, out_dtype=out_dtype, validate=False, rules=rules)
    assert res is out
    exact = linear_fp8_f64(**kw, activation=activation)
    assert_fp8_kernel_rounding(out, exact, linear_fp8_accumulation(**kw), out_dtype)


def _error_against_scaled_mm(B, U, N, K, rules) -> tuple:
    """(ours, _scaled_mm's) relative error against the fp32 layer on the dequantized operands
    (the peer: the decomposition through row-wise torch._scaled_mm, fp32 out, then bf16)."""
    kw = linear_fp8_problem(B, U, N, K, K, seed=5, device=DEVICE)
    exact = linear_fp8_f64(**kw, activation="relu")

    def mm(x8, sx, w8, sw):
        return torch._scaled_mm(x8, w8.t(), sx[:, None], sw[None, :], out_dtype=torch.float32)

    peer = torch.relu(mm(kw["x_cand"], kw["x_cand_scale"], kw["w_cand"], kw["w_cand_scale"])
                      + mm(kw["x_user"], kw["x_user_scale"], kw["w_user"], kw["w_user_scale"])[kw["idx"].long()]
                      + kw["bias"]).to(BF16)
    ours = ikbo_gemm.linear(**kw, activation="relu", rules=rules)

    def err(o):
        return float((o.double() - exact).norm() / exact.norm())

    return err(ours), err(peer)


@pytest.mark.xfail(strict=True, reason="without promotion the FP8 kernels sum all of K in the 8-bit wgmma's "
                   "accumulator: 1.12x _scaled_mm's error on the H100 (0.00185 against 0.00166)")
def test_no_less_accurate_than_scaled_mm():
    ours, peer = _error_against_scaled_mm(2048, 30, 1024, 2048, None)
    assert ours <= peer * 1.01 + 1e-6


@pytest.mark.parametrize("B, U, N, K", [(2048, 30, 1024, 2048), (2048, 30, 1024, 4096), (8192, 117, 4096, 2048),
                                        (333, 5, 1008, 1040)])
def test_promoted_sums_as_accurate_as_scaled_mm(B, U, N, K):
    """With ``fp8_promote`` each k-block's sum is added in fp32: _scaled_mm's error, within 1%
    (K and N multiples of 16, as _scaled_mm needs; K 1040: 9 k-blocks, a group of 4 and singles)."""
    ours, peer = _error_against_scaled_mm(B, U, N, K, PROMOTE)
    assert ours <= peer * 1.01 + 1e-6


def test_nan_and_out_of_range_stay_in_their_rows():
    B, U, N, K = 300, 6, 100, 64
    kw = linear_fp8_problem(B, U, N, K, K, seed=3, device=DEVICE)
    idx = kw["idx"].clone()
    idx[[5, 77]] = torch.tensor([U, -1], dtype=idx.dtype, device=DEVICE)  # out of range
    kw["idx"] = idx
    kw["x_user"] = kw["x_user"].clone()
    kw["x_user"][2, 0] = float("nan")  # user 2: every candidate of it
    kw["x_cand"] = kw["x_cand"].clone()
    kw["x_cand"][9, 3] = float("nan")  # candidate 9 alone
    out = ikbo_gemm.linear(**kw, validate=False)
    bad = (idx == 2) | (idx < 0) | (idx >= U)
    bad[9] = True
    assert out[bad].isnan().all() and not out[~bad].isnan().any()
    with pytest.raises(IndexError, match=r"idx\[5\]"):
        ikbo_gemm.linear(**kw, validate=True)


def test_cuda_graph_replays_new_inputs():
    B, U, N, K = 512, 8, 256, 512
    kw = linear_fp8_problem(B, U, N, K, K, seed=1, device=DEVICE)
    ikbo_gemm.linear(**kw, validate=False)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ikbo_gemm.linear(**kw, activation="relu", validate=False)
    fresh = linear_fp8_problem(B, U, N, K, K, seed=2, device=DEVICE)
    for name in ("x_cand", "x_user", "x_cand_scale", "x_user_scale"):
        kw[name].copy_(fresh[name])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_fp8_kernel_rounding(out, linear_fp8_f64(**kw, activation="relu"), linear_fp8_accumulation(**kw),
                               BF16)


def test_in_a_compiled_model_with_dynamic_shapes():
    pytest.importorskip("triton")
    torch._dynamo.reset()
    N, K = 200, 96
    weights = linear_fp8_problem(1, 1, N, K, K, seed=0, device=DEVICE)
    w = {n: weights[n] for n in ("w_cand", "w_user", "w_cand_scale", "w_user_scale", "bias")}

    def model(x_cand, x_user, idx, sxc, sxu):
        y = ikbo_gemm.linear(x_cand, x_user, idx, w["w_cand"], w["w_user"], w["bias"], activation="silu",
                             x_cand_scale=sxc, x_user_scale=sxu, w_cand_scale=w["w_cand_scale"],
                             w_user_scale=w["w_user_scale"])
        return y.float() * 2

    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for B, U in ((300, 5), (77, 2), (1000, 9)):
        kw = linear_fp8_problem(B, U, N, K, K, seed=B, device=DEVICE) | w
        res = compiled(kw["x_cand"], kw["x_user"], kw["idx"], kw["x_cand_scale"], kw["x_user_scale"])
        exact = linear_fp8_f64(**kw, activation="silu") * 2
        assert float((res.double() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.parametrize("rules", [dict(cand_split=((128, 128), 2)), dict(cand_split=((64, 128), 4)),
                                   dict(split_k=True, user_pairs=True), dict(wide_user=True),
                                   dict(fp8_promote=True, wide_user=True),
                                   dict(fp8_promote=True, cand_split=((128, 64), 1), user_tile=(128, 64))],
                         ids=["split2", "split4", "small-grid", "wide-user", "promote-wide-user", "promote-narrow"])
def test_launch_rules_keep_the_result(rules):
    """FP8 under the plan rules the op leaves off: K split over clusters (the partial sums added
    before the scales), K-split user pairs, the wide user phase (its K slices as K-split clusters;
    promoted, as up to 8 workspace slabs)."""
    B, U, N, K = 256, 3, 256, 4096
    kw = linear_fp8_problem(B, U, N, K, K, seed=11, device=DEVICE)
    out = ikbo_gemm.linear(**kw, activation="relu", rules=ikbo_gemm.PlanRules(**rules))
    assert_fp8_kernel_rounding(out, linear_fp8_f64(**kw, activation="relu"), linear_fp8_accumulation(**kw),
                               BF16)
