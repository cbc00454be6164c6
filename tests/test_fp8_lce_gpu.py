"""ikbo_gemm.lce with FP8 operands (e K-major, [B, N, K]) on an sm_90 GPU, against float64 of the
formula on the dequantized operands."""
from __future__ import annotations

import pytest
import torch

import ikbo_gemm
import lce_emulation
from fp8_inputs import assert_fp8_kernel_rounding, lce_fp8_accumulation, lce_fp8_f64, lce_fp8_problem

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16, F16 = torch.bfloat16, torch.float16

CASES = [  # B, U, M, N, K_user, K_cand, per_tensor, out_dtype, schedule
    (1, 1, 1, 1, 1, 1, False, BF16, "fused"),
    (3, 3, 7, 7, 100, 7, True, F16, "fused"),  # ratio 1
    (1024, 15, 433, 256, 1184, 872, False, BF16, "fused"),  # the published shape
    (1024, 15, 433, 256, 1184, 872, True, BF16, "two_launch"),
    (4096, 1, 100, 1000, 7, 100, False, BF16, "fused"),  # one user
    (65536, 7, 64, 16, 1000, 64, False, F16, "fused"),  # ratio about 10,000
]


@pytest.fixture
def kernel_only(monkeypatch):
    """The op's kernel path: a call that falls back to the reference fails."""
    def refused(*args, **kwargs):
        raise AssertionError("lce ran lce_reference on an sm_90 GPU")

    monkeypatch.setattr(lce_emulation.lce_mod, "lce_reference", refused)


@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_matches_the_dequantized_formula(case):
    B, U, M, N, K_user, K_cand, per_tensor, out_dtype, schedule = case
    kw = lce_fp8_problem(B, U, M, N, K_user, K_cand, seed=B + N, device=DEVICE, per_tensor=per_tensor)
    out = torch.full((B, M, N), float("nan"), dtype=out_dtype, device=DEVICE)  # poisoned
    assert ikbo_gemm.lce(**kw, out=out, out_dtype=out_dtype, schedule=schedule, validate=False) is out
    assert_fp8_kernel_rounding(out, lce_fp8_f64(**kw), lce_fp8_accumulation(**kw), out_dtype)


FP8_TILINGS = sorted({((c.tile_n, c.tile_w, c.cluster_n, c.cluster_b), c.promote) for c in ikbo_gemm.SHIPPED_CONFIGS
                      if isinstance(c, ikbo_gemm.LceConfig) and c.dtype == torch.float8_e4m3fn})


@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("tiling, promote", FP8_TILINGS,
                         ids=lambda t: "n{}-w{}-c{}x{}".format(*t) if isinstance(t, tuple) else f"promote{int(t)}")
def test_each_shipped_fp8_tiling(tiling, promote):
    """Every shipped FP8 tile and cluster (promoting or not), on sizes that are not multiples of it
    (rows of w past M, columns past N, candidates past a cluster's batch depth, K past a
    128-element k-block, K of 1 to 7 k-blocks: every promotion group shape)."""
    B, U, M, N, K_user, K_cand = 301, 7, 433, 200, 300, 850
    kw = lce_fp8_problem(B, U, M, N, K_user, K_cand, seed=sum(tiling), device=DEVICE)
    out = torch.full((B, M, N), float("nan"), dtype=BF16, device=DEVICE)
    ikbo_gemm.lce(**kw, out=out, validate=False, policy=ikbo_gemm.LcePolicy(tiling=tiling, fp8_promote=promote))
    assert_fp8_kernel_rounding(out, lce_fp8_f64(**kw), lce_fp8_accumulation(**kw), BF16)


@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("promote, ratio", [(True, 1.01), (False, 1.3)], ids=["promote", "default"])
def test_error_against_scaled_mm(promote, ratio):
    """Error against the fp32 formula on the dequantized operands, the published shape: with
    ``fp8_promote`` no worse than torch._scaled_mm's (row-wise, per batch entry, fp32 out, then
    bf16) on the same operands, within 1%; without, within 1.3x."""
    B, U, M, N, K_user, K_cand = 64, 4, 433, 256, 1184, 872
    kw = lce_fp8_problem(B, U, M, N, K_user, K_cand, seed=9, device=DEVICE)
    exact = lce_fp8_f64(**kw)

    def mm(w8, sw, e8, se):  # w8 [M, K], e8 [N, K] (K-major): [M, N] in fp32
        return torch._scaled_mm(w8, e8.t(), sw[:, None], se.expand(1, e8.shape[0]).contiguous(),
                                out_dtype=torch.float32)

    def pad(t):  # _scaled_mm's K: a multiple of 16 (zeros past K)
        z = torch.zeros(*t.shape[:-1], -(-t.shape[-1] // 16) * 16, dtype=t.dtype, device=t.device)
        z[..., :t.shape[-1]] = t
        return z

    idx = kw["idx"].long()
    peer = torch.stack([
        mm(pad(kw["w_cand"]), kw["w_cand_scale"], pad(kw["e_cand"][b]), kw["e_cand_scale"][b:b + 1])
        + mm(pad(kw["w_user"]), kw["w_user_scale"], pad(kw["e_user"][idx[b]]), kw["e_user_scale"][idx[b]:idx[b] + 1])
        for b in range(B)]).to(BF16)
    ours = ikbo_gemm.lce(**kw, policy=ikbo_gemm.LcePolicy(fp8_promote=promote))

    def err(o):
        return float((o.double() - exact).norm() / exact.norm())

    assert err(ours) <= err(peer) * ratio + 1e-6, (err(ours), err(peer))


@pytest.mark.usefixtures("kernel_only")
def test_nan_and_out_of_range_stay_in_their_candidates():
    B, U, M, N, K = 200, 5, 64, 32, 64
    kw = lce_fp8_problem(B, U, M, N, K, K, seed=3, device=DEVICE)
    idx = kw["idx"].clone()
    idx[[4, 50]] = torch.tensor([U, -3], dtype=idx.dtype, device=DEVICE)
    kw["idx"] = idx
    kw["e_user"] = kw["e_user"].clone()
    kw["e_user"][1, 3, 0] = float("nan")  # e [U, N, K]: column 3 of every candidate of user 1
    out = ikbo_gemm.lce(**kw, validate=False)
    lost, poisoned = (idx < 0) | (idx >= U), idx == 1
    assert out[lost].isnan().all() and out[poisoned][:, :, 3].isnan().all()
    assert not out[poisoned][:, :, torch.arange(N, device=DEVICE) != 3].isnan().any()
    assert not out[~(lost | poisoned)].isnan().any()


@pytest.mark.usefixtures("kernel_only")
def test_cuda_graph_replays_new_inputs():
    B, U, M, N, K = 256, 4, 128, 64, 256
    kw = lce_fp8_problem(B, U, M, N, K, K, seed=1, device=DEVICE)
    ikbo_gemm.lce(**kw, validate=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ikbo_gemm.lce(**kw, validate=False)
    fresh = lce_fp8_problem(B, U, M, N, K, K, seed=2, device=DEVICE)
    for name in ("e_cand", "e_user", "e_cand_scale", "e_user_scale"):
        kw[name].copy_(fresh[name])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_fp8_kernel_rounding(out, lce_fp8_f64(**kw), lce_fp8_accumulation(**kw), BF16)


def test_in_a_compiled_model_with_dynamic_shapes():
    pytest.importorskip("triton")
    torch._dynamo.reset()
    M, N, K = 96, 40, 80
    w = {n: v for n, v in lce_fp8_problem(1, 1, M, N, K, K, seed=0, device=DEVICE).items() if n.startswith("w_")}

    def model(e_cand, e_user, idx, sec, seu):
        y = ikbo_gemm.lce(w["w_cand"], w["w_user"], e_cand, e_user, idx, e_cand_scale=sec, e_user_scale=seu,
                          w_cand_scale=w["w_cand_scale"], w_user_scale=w["w_user_scale"])
        return y.float() + 1

    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for B, U in ((300, 5), (77, 2)):
        kw = lce_fp8_problem(B, U, M, N, K, K, seed=B, device=DEVICE) | w
        res = compiled(kw["e_cand"], kw["e_user"], kw["idx"], kw["e_cand_scale"], kw["e_user_scale"])
        exact = lce_fp8_f64(**kw) + 1
        assert float((res.double() - exact).norm() / exact.norm()) < 1e-2
