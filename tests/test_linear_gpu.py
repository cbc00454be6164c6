"""ikbo_gemm.linear on an sm_90 GPU, against an fp32 reference.

The cases cover every value of each axis at least once (B, ratio B/U, K_user, K_cand, N,
activation, bias, dtype, idx dtype and order) rather than their cross product.
"""
from __future__ import annotations

import math

import pytest
import torch

import ikbo_gemm
from ikbo_gemm.reference import apply_activation

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}



def make_inputs(B, U, N, K_user, K_cand, dtype, *, bias=True, idx_dtype=torch.int32, shuffle=True, seed=0):
    """Fresh random operands; idx gives each user about B / U candidates (every user at least one
    when U <= B), shuffled unless ``shuffle`` is False."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = 1.0 / math.sqrt(K_user + K_cand)

    def randn(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * s).to(dtype)

    idx = torch.arange(B, device=DEVICE) * U // max(B, 1)
    if shuffle:
        idx = idx[torch.randperm(B, generator=g, device=DEVICE)]
    return dict(
        x_cand=randn(B, K_cand),
        x_user=randn(U, K_user),
        idx=idx.to(idx_dtype),
        w_cand=randn(N, K_cand, s=scale),
        w_user=randn(N, K_user, s=scale),
        bias=randn(N, s=0.5) if bias else None,
    )


def fp32_reference(x_cand, x_user, idx, w_cand, w_user, bias, activation):
    acc = x_cand.float() @ w_cand.float().T + (x_user.float() @ w_user.float().T)[idx.long()]
    if bias is not None:
        acc = acc + bias.float()
    return apply_activation(acc, activation)


def torch_decomposition(x_cand, x_user, idx, w_cand, w_user, bias, activation):
    """What a user writes in PyTorch, in the inputs' dtype."""
    acc = x_cand @ w_cand.T + (x_user @ w_user.T)[idx.long()]
    if bias is not None:
        acc = acc + bias
    return apply_activation(acc, activation)


def rel_err(x, ref):
    den = ref.double().norm()
    return float((x.double() - ref.double()).norm() / den) if den > 0 else float((x.double()).norm())


def assert_matches_reference(out, args, activation):
    dtype = args["x_cand"].dtype
    ref = fp32_reference(**args, activation=activation)
    mine = torch_decomposition(**args, activation=activation)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
    # One rounding costs u * |x|; the slack covers fp32 accumulation order (and the activation).
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + 2.0**-13 * ref.abs().max() + 1e-6
    bad = ~((out.float() - ref).abs() <= bound)
    if bad.any():
        first = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} outputs off; first at {first}: "
                             f"got {float(out[first])}, expected {float(ref[first])}")
    err, torch_err = rel_err(out, ref), rel_err(mine, ref)
    assert err <= 1.02 * torch_err + 1e-6, f"error {err:.3e} vs torch decomposition {torch_err:.3e}"


# id -> (dtype, B, U, N, K_user, K_cand, activation, bias, idx dtype, shuffled)
CASES = {
    "one-candidate": (BF16, 1, 1, 8, 64, 64, None, True, torch.int32, False),
    "b3-ratio1-k7-k1-n1": (F16, 3, 3, 1, 7, 1, "relu", True, torch.int32, True),
    "b1000-ratio10-k1000-n100": (BF16, 1000, 100, 100, 1000, 1000, "gelu", True, torch.int64, True),
    "b4096-ratio70-k64-k4096-n1024": (F16, 4096, 59, 1024, 64, 4096, None, False, torch.int32, True),
    "b4096-ratio1000-k4096-k64-n4096": (BF16, 4096, 4, 4096, 4096, 64, "silu", True, torch.int32, False),
    "b10000-one-user-k1-k7-n100": (F16, 10000, 1, 100, 1, 7, "sigmoid", True, torch.int32, True),
    "b65536-ratio70-n1024": (BF16, 65536, 937, 1024, 1000, 1000, "relu", True, torch.int32, True),
    "b1000-ratio1-k4096-k7-n8": (F16, 1000, 1000, 8, 4096, 7, "gelu_tanh", False, torch.int64, True),
    "b4096-ratio10-n4096": (BF16, 4096, 410, 4096, 1000, 4096, "relu", True, torch.int32, False),
    "b2048-ratio70-n4096-fp16": (F16, 2048, 30, 4096, 512, 512, None, True, torch.int32, True),
    "b2048-ratio70-k4096-k4096-n1024": (BF16, 2048, 30, 1024, 4096, 4096, "relu", True, torch.int32, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_linear_matches_reference(case):
    dtype, B, U, N, K_user, K_cand, activation, bias, idx_dtype, shuffle = case
    args = make_inputs(B, U, N, K_user, K_cand, dtype, bias=bias, idx_dtype=idx_dtype, shuffle=shuffle)
    out = torch.full((B, N), float("nan"), dtype=dtype, device=DEVICE)
    res = ikbo_gemm.linear(**args, activation=activation, out=out)
    assert res is out
    assert_matches_reference(out, args, activation)
    fresh = ikbo_gemm.linear(**args, activation=activation)  # its own output buffer
    torch.testing.assert_close(fresh, out, rtol=0, atol=0)


@pytest.mark.parametrize("band_rows", [3, 8])
@pytest.mark.parametrize("name", ["b1000-ratio10-k1000-n100", "b4096-ratio70-k64-k4096-n1024", "b4096-ratio10-n4096",
                                  "b65536-ratio70-n1024"])
def test_candidate_bands_keep_the_bits(name, band_rows):
    """PlanRules.cand_band_rows changes only which CTA runs a tile when: every tile's sums, and so
    every output bit, stay those of the column-fastest walk (bands narrower at the end included)."""
    dtype, B, U, N, K_user, K_cand, activation, bias, idx_dtype, shuffle = CASES[name]
    args = make_inputs(B, U, N, K_user, K_cand, dtype, bias=bias, idx_dtype=idx_dtype, shuffle=shuffle)
    base = ikbo_gemm.linear(**args, activation=activation, rules=ikbo_gemm.PlanRules(cand_band_rows=1))
    out = torch.full((B, N), float("nan"), dtype=dtype, device=DEVICE)
    ikbo_gemm.linear(**args, activation=activation, out=out, rules=ikbo_gemm.PlanRules(cand_band_rows=band_rows))
    torch.testing.assert_close(out, base, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", None])
def test_every_activation(activation):
    args = make_inputs(777, 11, 272, 300, 200, BF16, seed=3)
    assert_matches_reference(ikbo_gemm.linear(**args, activation=activation), args, activation)


def test_nan_stays_in_its_user_and_its_row():
    args = make_inputs(2000, 20, 256, 128, 192, BF16, seed=4)
    u_bad, b_bad = 7, 5
    args["x_user"][u_bad, 3] = float("nan")
    args["x_cand"][b_bad, 0] = float("nan")
    b_bad_user = int(args["idx"][b_bad])
    out = ikbo_gemm.linear(**args, activation="relu")
    nan_rows = torch.isnan(out).any(dim=1)
    expected = args["idx"].long() == u_bad
    expected[b_bad] = True
    assert torch.equal(nan_rows, expected), "a NaN row outside the poisoned user and candidate"
    assert torch.isnan(out[expected]).all()
    keep = ~expected
    ref = fp32_reference(**args, activation="relu")
    assert rel_err(out[keep], ref[keep]) < 1e-2 and b_bad_user >= 0


def test_out_of_range_index_gives_a_nan_row_without_validation():
    args = make_inputs(500, 9, 64, 64, 64, F16, seed=5)
    args["idx"][[3, 17]] = torch.tensor([9, -1], dtype=args["idx"].dtype, device=DEVICE)
    with pytest.raises(IndexError, match=r"idx\[3\] = 9"):
        ikbo_gemm.linear(**args, validate=True)
    out = ikbo_gemm.linear(**args, validate=False)
    bad = torch.zeros(500, dtype=torch.bool, device=DEVICE)
    bad[[3, 17]] = True
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()
    good = dict(args, idx=torch.where(bad, 0, args["idx"]))
    torch.testing.assert_close(out[~bad], ikbo_gemm.linear(**good)[~bad], rtol=0, atol=0)


def test_unaligned_out_and_n_not_a_multiple_of_8():
    args = make_inputs(300, 3, 100, 40, 24, BF16, seed=6)
    buf = torch.full((300 * 100 + 1,), float("nan"), dtype=BF16, device=DEVICE)
    out = buf[1:].view(300, 100)  # 2 bytes off 16-byte alignment
    ikbo_gemm.linear(**args, activation="gelu", out=out)
    assert_matches_reference(out, args, "gelu")


def test_empty_batch():
    args = make_inputs(0, 3, 64, 64, 64, BF16)
    out = ikbo_gemm.linear(**args)
    assert out.shape == (0, 64) and out.device.type == "cuda"


def test_cuda_graph_replay_with_new_inputs():
    args = make_inputs(1500, 15, 512, 256, 320, F16, seed=7)
    static = {k: (v.clone() if v is not None else None) for k, v in args.items()}
    out = torch.empty(1500, 512, dtype=F16, device=DEVICE)
    ikbo_gemm.linear(**static, activation="relu", out=out)  # compiles and plans outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ikbo_gemm.linear(**static, activation="relu", out=out, validate=False)
    fresh = make_inputs(1500, 15, 512, 256, 320, F16, seed=8)
    for k, v in fresh.items():
        if v is not None:
            static[k].copy_(v)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, fresh, "relu")


def test_in_a_compiled_model():
    pytest.importorskip("triton")
    torch._dynamo.reset()
    args = make_inputs(640, 8, 256, 128, 192, BF16, seed=9)
    w_cand, w_user, bias = args["w_cand"], args["w_user"], args["bias"]

    def model(x_cand, x_user, idx):
        return ikbo_gemm.linear(x_cand, x_user, idx, w_cand, w_user, bias, activation="silu").float() * 2

    res = torch.compile(model, fullgraph=True, dynamic=True)(args["x_cand"], args["x_user"], args["idx"])
    ref = fp32_reference(**args, activation="silu") * 2
    assert rel_err(res, ref) < 1e-2


def test_split_weight_matches_the_concatenated_layer():
    g = torch.Generator(device=DEVICE).manual_seed(10)
    layer = torch.nn.Linear(96 + 160, 384).to(DEVICE, BF16)
    x_user = torch.randn(12, 96, device=DEVICE, generator=g).to(BF16)
    x_cand = torch.randn(900, 160, device=DEVICE, generator=g).to(BF16)
    idx = torch.randint(0, 12, (900,), device=DEVICE, generator=g)
    with torch.no_grad():
        w_cand, w_user = ikbo_gemm.split_weight(layer.weight, 96)
        out = ikbo_gemm.linear(x_cand, x_user, idx, w_cand, w_user, layer.bias, activation="relu")
        ref = torch.relu(torch.nn.functional.linear(torch.cat([x_user[idx], x_cand], 1).float(),
                                                    layer.weight.float(), layer.bias.float()))
    assert rel_err(out, ref) < 1e-2
