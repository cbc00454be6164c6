"""IKBO linear compression on an sm_90 GPU, against an fp32 reference.

The cases cover every value of each axis at least once (B, ratio B/U, M, N,
K_user, K_cand, schedule, dtype, idx dtype, idx order) rather than their cross
product, with few distinct kernel configurations so that first-call compiles
stay short.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

from cute_kernels.compile import kernel_cache
from ikbo_gemm.lce import lce

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}
NORM_TOL = {F16: 2e-3, BF16: 1e-2}  # sanity bound, norm-wise relative error


@pytest.fixture(autouse=True, scope="module")
def _ieee_fp32_matmul():
    """The fp32 reference must not run on TF32."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def make_inputs(B, ratio, M, N, K_user, K_cand, dtype, idx_dtype=torch.int32, shuffle=False, seed=0):
    """Fresh random operands; idx groups ``ratio`` consecutive candidates per user (U = ceil(B / ratio))."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    U = -(-B // ratio)
    scale = 1.0 / math.sqrt(K_user + K_cand)

    def randn(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32) * s).to(dtype)

    idx = torch.arange(B, device=DEVICE) // ratio
    if shuffle:
        idx = idx[torch.randperm(B, generator=g, device=DEVICE)]
    return dict(
        w_cand=randn(M, K_cand, s=scale),
        w_user=randn(M, K_user, s=scale),
        e_cand=randn(B, K_cand, N),
        e_user=randn(U, K_user, N),
        idx=idx.to(idx_dtype),
    )


def fp32_reference(w_cand, w_user, e_cand, e_user, idx):
    """fp32 user GEMMs + fp32 candidate bmm + gather, not rounded."""
    user = torch.matmul(w_user.float(), e_user.float())
    return torch.matmul(w_cand.float(), e_cand.float()) + user[idx.long()]


def torch_decomposition(w_cand, w_user, e_cand, e_user, idx):
    """What a user writes in PyTorch, in the inputs' dtype."""
    return torch.matmul(w_cand, e_cand) + torch.matmul(w_user, e_user)[idx.long()]


def rel_err(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def assert_matches_reference(out, args, rows=None):
    """Every element within one rounding of the fp32 reference, and norm-wise no worse than torch."""
    dtype = args["e_cand"].dtype
    ref = fp32_reference(**args)
    mine = torch_decomposition(**args)
    if rows is not None:
        out, ref, mine = out[rows], ref[rows], mine[rows]
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
    # One rounding costs u * |x|; the slack covers fp32 accumulation order.
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + 2.0**-14 * ref.abs().max()
    bad = ~((out.float() - ref).abs() <= bound)
    if bad.any():
        first = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} outputs off; first at {first}: "
            f"got {float(out[first])}, expected {float(ref[first])}"
        )
    err, torch_err = rel_err(out, ref), rel_err(mine, ref)
    assert err <= 1.25 * torch_err + 1e-5, f"error {err:.3e} vs torch decomposition {torch_err:.3e}"
    assert err <= NORM_TOL[dtype], f"error {err:.3e}"


def poisoned(B, M, N, dtype):
    return torch.full((B, M, N), float("nan"), dtype=dtype, device=DEVICE)


# id -> (dtype, B, ratio, M, N, K_user, K_cand, schedule, idx dtype, shuffled, pass out=)
CASES = {
    "published-fp16-fused": (F16, 1024, 70, 433, 256, 1184, 872, "fused", torch.int32, False, True),
    "published-fp16-two_launch": (F16, 1024, 70, 433, 256, 1184, 872, "two_launch", torch.int32, False, True),
    "published-bf16-fused": (BF16, 1024, 70, 433, 256, 1184, 872, "fused", torch.int32, False, True),
    "one-candidate-k1-m1-n8": (F16, 1, 1, 1, 8, 1, 1, "fused", torch.int32, False, False),
    "b3-ratio1-n260": (BF16, 3, 1, 64, 260, 1025, 8, "two_launch", torch.int32, True, True),
    "b256-ratio2-n8": (F16, 256, 2, 433, 8, 8, 1025, "fused", torch.int32, True, True),
    "b256-ratio10-m1": (F16, 256, 10, 1, 256, 1025, 1, "two_launch", torch.int32, True, True),
    "b4096-ratio1000-int64": (BF16, 4096, 1000, 64, 256, 872, 1184, "fused", torch.int64, True, True),
    "b1024-one-user-n260": (F16, 1024, 10000, 433, 260, 1184, 872, "two_launch", torch.int32, False, True),
    # K that ends on a k-block boundary (1024) or fills most of one lone block (56), and lone
    # short blocks (24, 40).
    "k1024-k56": (BF16, 300, 3, 200, 136, 1024, 56, "fused", torch.int32, True, True),
    "k24-k40": (F16, 200, 5, 433, 64, 24, 40, "two_launch", torch.int64, True, True),
    # 128-column tiles: one batch (cluster 2 x 1), and N of one such tile (cluster 1 x 4, B not
    # a multiple of 4).
    "one-candidate-n256": (F16, 1, 1, 433, 256, 872, 1184, "fused", torch.int32, False, True),
    "b100-n128": (BF16, 100, 7, 433, 128, 200, 300, "fused", torch.int64, True, True),
    # Tile heights that 32 does not divide (a shorter last w chunk; the last epilogue sub-tile
    # overlaps the one before it): 152 rows unclustered and 168 rows; and the tallest tile,
    # 192 rows.
    "one-candidate-n100-w152": (BF16, 1, 1, 433, 100, 300, 200, "fused", torch.int32, False, True),
    "b64-m1000-w168": (F16, 64, 8, 1000, 256, 300, 200, "fused", torch.int32, True, True),
    "b10-m384-w192": (BF16, 10, 3, 384, 256, 200, 136, "two_launch", torch.int64, True, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_lce_matches_reference(case):
    dtype, B, ratio, M, N, K_user, K_cand, schedule, idx_dtype, shuffle, pass_out = case
    args = make_inputs(B, ratio, M, N, K_user, K_cand, dtype, idx_dtype, shuffle)
    out = poisoned(B, M, N, dtype) if pass_out else None
    got = lce(**args, out=out, schedule=schedule)
    if pass_out:
        assert got is out
    assert got.shape == (B, M, N) and got.dtype == dtype and got.is_contiguous()
    assert_matches_reference(got, args)


@pytest.mark.parametrize("schedule", ["fused", "two_launch"])
def test_nan_and_inf_stay_where_they_belong(schedule):
    """Non-finite values in unused users and in some candidates reach only their own outputs.

    K = 131 / 1025 and N = 200 leave tails in K, N and M (433), so a kernel that
    read past one batch's rows into the next (a 2-D view of e) would pick them up.
    """
    B, M, N, K_user, K_cand = 64, 433, 200, 131, 1025
    args = make_inputs(B, 8, M, N, K_user, K_cand, F16, shuffle=True)
    used = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9], device=DEVICE)  # users 4 and 7 unused
    args["idx"] = used[args["idx"].long()].to(torch.int32)
    e_user = torch.randn(10, K_user, N, device=DEVICE).to(F16)
    e_user[4] = float("nan")
    e_user[7] = float("inf")
    args["e_user"] = e_user
    args["e_cand"][10] = float("nan")
    args["e_cand"][11] = float("inf")

    buf = torch.full((B + 2, M, N), 7.0, dtype=F16, device=DEVICE)  # guards either side of out
    out = buf[1 : B + 1]
    out.fill_(float("nan"))
    lce(**args, out=out, schedule=schedule)
    assert (buf[0] == 7).all() and (buf[-1] == 7).all(), "wrote outside out"
    assert not torch.isfinite(out[10:12]).any()
    assert_matches_reference(out, args, rows=[b for b in range(B) if b not in (10, 11)])


@pytest.mark.parametrize(
    "dtype, idx_dtype, schedule",
    [(F16, torch.int32, "fused"), (BF16, torch.int64, "two_launch")],
)
def test_out_of_range_index(dtype, idx_dtype, schedule):
    B, M, N, K_user, K_cand = 96, 64, 256, 872, 1184
    args = make_inputs(B, 8, M, N, K_user, K_cand, dtype, idx_dtype, shuffle=True)
    U = args["e_user"].shape[0]
    huge = (1 << 31) - 1 if idx_dtype == torch.int32 else 1 << 40
    bad = {5: U, 17: -1, 40: huge, 95: U + 1}
    good_idx = args["idx"].clone()
    for b, v in bad.items():
        args["idx"][b] = v
    inputs = {k: v.clone() for k, v in args.items()}

    with pytest.raises(IndexError, match=r"idx\[5\]"):
        lce(**args, validate=True, schedule=schedule)

    buf = torch.full((B + 2, M, N), 7.0, dtype=dtype, device=DEVICE)
    out = buf[1 : B + 1]
    out.fill_(float("nan"))
    lce(**args, out=out, validate=False, schedule=schedule)
    torch.cuda.synchronize()
    assert (buf[0] == 7).all() and (buf[-1] == 7).all(), "wrote outside out"
    assert all(torch.equal(args[k], inputs[k]) for k in args), "an input changed"
    assert torch.isnan(out[list(bad)]).all()
    good = [b for b in range(B) if b not in bad]
    assert_matches_reference(out, {**args, "idx": good_idx}, rows=good)


def test_non_contiguous_inputs():
    B, M, N, K_user, K_cand = 128, 433, 256, 1025, 872
    args = make_inputs(B, 4, M, N, K_user, K_cand, F16, shuffle=True)
    views = dict(
        w_cand=args["w_cand"].t().contiguous().t(),  # column-major
        w_user=torch.stack([args["w_user"], args["w_user"]], dim=-1)[..., 0],  # stride 2 along K
        e_cand=args["e_cand"].transpose(1, 2).contiguous().transpose(1, 2),  # K fastest
        e_user=torch.stack([args["e_user"], args["e_user"]], dim=1)[:, 0],  # gaps between users
        idx=torch.stack([args["idx"], args["idx"]], dim=-1)[:, 0],  # stride 2
    )
    assert not any(v.is_contiguous() for v in views.values())
    out = poisoned(B, M, N, F16)
    lce(**views, out=out)
    assert_matches_reference(out, args)


def test_output_and_workspace_past_2_31_elements():
    """20,000 users and candidates at M 433, N 256: the output holds 2.2e9 elements and the
    fp32 user tiles 2.3e9, so any 32-bit element offset would wrap (K is small to keep it quick)."""
    B = 20_000  # and U, at ratio 1
    M, N, K_user, K_cand = 433, 256, 40, 24
    args = make_inputs(B, 1, M, N, K_user, K_cand, F16, shuffle=True)
    out = poisoned(B, M, N, F16)
    assert out.numel() > 2**31
    lce(**args, out=out)
    assert torch.isfinite(out).all()
    g = torch.Generator(device=DEVICE).manual_seed(1)
    rows = torch.cat([torch.randperm(B, generator=g, device=DEVICE)[:192], torch.arange(B - 64, B, device=DEVICE)])
    picked = {**args, "e_cand": args["e_cand"][rows], "e_user": args["e_user"][args["idx"][rows].long()]}
    picked["idx"] = torch.arange(len(rows), device=DEVICE, dtype=torch.int32)
    assert_matches_reference(out[rows], picked)


def test_out_at_any_alignment():
    B, M, N = 32, 433, 256
    args = make_inputs(B, 4, M, N, 200, 136, F16, shuffle=True)
    out = torch.full((B * M * N + 1,), float("nan"), dtype=F16, device=DEVICE)[1:].view(B, M, N)
    assert out.data_ptr() % 16
    assert lce(**args, out=out) is out
    assert_matches_reference(out, args)


def _unit_stride_on_dim0(t):
    """The same values with dim 0 (of size 1) given a stride of one element: torch still calls
    it contiguous, and the launcher does not check that stride."""
    return torch.empty(*t.shape[1:], 1, dtype=t.dtype, device=t.device).movedim(-1, 0).copy_(t)


def test_size1_dims_with_any_stride():
    """B = U = M = 1 with unit strides on those dims (inputs and out): the TMA descriptors still
    get strides they take."""
    args = make_inputs(1, 1, 1, 256, 200, 136, F16)
    odd = {name: _unit_stride_on_dim0(t) for name, t in args.items() if name != "idx"}
    assert all(t.is_contiguous() and t.stride(0) == 1 for t in odd.values())
    out = torch.full((256, 1, 1), float("nan"), dtype=F16, device=DEVICE).permute(1, 2, 0)  # [1, 1, 256]
    assert out.is_contiguous() and out.stride()[:2] == (1, 1)
    assert lce(**odd, idx=args["idx"], out=out) is out
    assert_matches_reference(out, args)


def test_out_version_moves():
    """The kernel writes out through its pointer: a backward that saved out before the call
    raises, as after any in-place write, instead of reading the new values."""
    args = make_inputs(64, 8, 433, 256, 200, 136, F16, shuffle=True)
    out = torch.zeros(64, 433, 256, dtype=F16, device=DEVICE)
    x = torch.ones_like(out, requires_grad=True)
    y = x * out  # saves out for backward
    assert lce(**args, out=out) is out
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()
    assert_matches_reference(out, args)


def test_inputs_that_require_grad():
    """The output is right and its backward raises: no silently missing gradient."""
    args = make_inputs(64, 8, 433, 256, 200, 136, F16, shuffle=True)
    args["w_cand"].requires_grad_(True)
    out = poisoned(64, 433, 256, F16)
    got = lce(**args, out=out)
    assert got is out and got.requires_grad
    with pytest.raises(RuntimeError, match="lce_reference"):
        got.float().sum().backward()
    with torch.no_grad():
        assert_matches_reference(lce(**args), args)


@pytest.mark.parametrize("schedule", ["fused", "two_launch"])
def test_cuda_graph_capture(schedule):
    B, ratio, M, N, K_user, K_cand = 256, 10, 433, 256, 1184, 872
    static = make_inputs(B, ratio, M, N, K_user, K_cand, F16, shuffle=True, seed=0)
    out = poisoned(B, M, N, F16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile outside the capture
        lce(**static, out=out, validate=False, schedule=schedule)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lce(**static, out=out, validate=False, schedule=schedule)

    for seed in (1, 2):  # two replays: the ready flags must be reset inside the graph
        fresh = make_inputs(B, ratio, M, N, K_user, K_cand, F16, shuffle=True, seed=seed)
        for k in static:
            static[k].copy_(fresh[k])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, fresh)


def test_validation_inside_a_graph_capture(monkeypatch):
    """The range check cannot run in a capture: IKBO_VALIDATE does not apply to captured calls,
    validate=True raises a clear error, and eager calls stay validated."""
    monkeypatch.setenv("IKBO_VALIDATE", "1")
    args = make_inputs(256, 10, 433, 256, 1184, 872, F16, shuffle=True, seed=4)
    out = poisoned(256, 433, 256, F16)
    lce(**args, out=out)  # eager and validated; compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lce(**args, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, args)
    with pytest.raises(RuntimeError, match="validate=True .* CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            lce(**args, out=out, validate=True)
    bad = dict(args, idx=args["idx"].clone())
    bad["idx"][7] = 10**6
    with pytest.raises(IndexError, match=r"idx\[7\]"):
        lce(**bad)


def test_kernels_loaded_from_the_disk_cache(tmp_path, monkeypatch):
    """A process that finds the kernels on disk loads them instead of compiling; the loaded
    kernels compute exactly what the compiled ones did."""
    lce_module = sys.modules["ikbo_gemm.lce"]
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    args = make_inputs(256, 10, 433, 256, 1184, 872, F16, shuffle=True, seed=3)

    def fresh_process_call():
        kernel_cache.clear()
        lce_module._plans.clear()
        out = poisoned(256, 433, 256, F16)
        lce(**args, out=out)
        torch.cuda.synchronize()
        return out, [k for plan in lce_module._plans.values() if plan for k in (l.kernel for l in plan.launches)]

    compiled, kernels = fresh_process_call()
    assert len(kernels) == 2 and not any(k.loaded for k in kernels)  # the main and the spare launch
    assert len(list(tmp_path.glob("ikbo_gemm-*.o"))) == 2
    loaded, kernels = fresh_process_call()
    assert len(kernels) == 2 and all(k.loaded for k in kernels)
    assert torch.equal(loaded, compiled)
    assert_matches_reference(loaded, args)
