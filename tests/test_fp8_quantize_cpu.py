"""CPU tests of ikbo_gemm.quantize_fp8: the round trip, the scales' shapes and layouts, the
rows that hold zeros or non-finite values, and argument validation."""
from __future__ import annotations

import pytest
import torch

from fp8_inputs import assert_fp8_layout
from ikbo_gemm import quantize_fp8
from ikbo_gemm.quantize import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX, quantize_fp8_reference
from ikbo_gemm.quantize_staged_sm90 import STAGE_BYTES

FP8 = torch.float8_e4m3fn


def _expand(scale, x):
    return scale.reshape(scale.shape + (1,) * (x.dim() - scale.dim()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, dim, layout, scale_shape", [
    ((7, 33), -1, "same", (7,)),  # linear's x and w: one scale per row
    ((1, 1), -1, "same", (1,)),
    ((5, 9, 12), (1, 2), "transposed", (5,)),  # lce's e [B, K, N] -> [B, N, K], one per batch entry
    ((5, 9, 12), -1, "transposed", (5, 9)),
    ((6, 20), None, "same", ()),  # per-tensor
    ((6, 20), 0, "same", (20,)),
])
def test_round_trip(shape, dim, layout, scale_shape, dtype):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    # rows of very different magnitudes: one scale per row must follow each
    x = (torch.randn(shape, generator=g) * torch.rand(shape[:1] + (1,) * (len(shape) - 1), generator=g)
         .mul(20).sub(10).exp2()).to(dtype)
    x8, scale = quantize_fp8(x, dim=dim, layout=layout)
    assert x8.dtype == FP8 and scale.dtype == torch.float32
    assert_fp8_layout(x8, layout)
    assert tuple(scale.shape) == scale_shape
    if layout == "transposed":
        x8 = x8.transpose(-1, -2)
    assert x8.shape == x.shape
    xf = x.float()
    back = x8.float() * _expand(scale, x8) if dim != 0 else x8.float() * scale
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormals spaced 2^-9 times the scale
    step = (_expand(scale, x8) if dim != 0 else scale) * 2.0**-10
    assert ((back - xf).abs() <= 2.0**-4 * xf.abs() + step).all()
    # the largest magnitude of each scale's elements lands on e4m3's largest, 448
    reduced = tuple(range(x.dim())) if dim is None else dim
    amax = x8.float().abs().amax(dim=reduced)
    assert torch.equal(amax, torch.full_like(amax, FP8_MAX))


def test_transposed_is_the_transpose_of_same():
    x = torch.randn(4, 6, 10, dtype=torch.bfloat16)
    a8, sa = quantize_fp8(x, dim=(1, 2))
    t8, st = quantize_fp8(x, dim=(1, 2), layout="transposed")
    assert torch.equal(sa, st) and torch.equal(t8.view(torch.uint8), a8.transpose(1, 2).contiguous().view(torch.uint8))


def test_zero_rows_keep_a_finite_nonzero_scale_and_nan_stays_in_its_row():
    x = torch.randn(4, 8)
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 5] = float("inf")
    x8, scale = quantize_fp8(x)
    assert scale[1] == torch.tensor(AMAX_FLOOR) * INV_FP8_MAX and not x8[1].float().any()
    assert scale[2].isnan() and scale[3].isinf()
    deq = x8.float() * scale[:, None]
    assert deq[2:].isnan().all() and deq[:2].isfinite().all()


def test_empty_batch():
    x8, scale = quantize_fp8(torch.randn(0, 5))
    assert x8.shape == (0, 5) and scale.shape == (0,)
    e8, se = quantize_fp8(torch.randn(0, 5, 3), dim=(1, 2), layout="transposed")
    assert e8.shape == (0, 3, 5) and se.shape == (0,)


def test_the_op_is_its_reference_on_cpu():
    x = torch.randn(9, 14, dtype=torch.bfloat16)
    a, b = quantize_fp8(x), quantize_fp8_reference(x)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("x, kw, err, match", [
    (torch.ones(3, 4, dtype=torch.int32), {}, TypeError, "x must be float16, bfloat16 or float32"),
    ([1.0, 2.0], {}, TypeError, "x must be a dense torch.Tensor"),
    (torch.tensor(1.0), {}, ValueError, "1 dimension at least"),
    (torch.ones(3, 4), {"layout": "k_major"}, ValueError, "layout must be one of"),
    (torch.ones(4), {"layout": "transposed"}, ValueError, "needs 2 at least"),
    (torch.ones(3, 4), {"dim": 2}, ValueError, "out of range"),
    (torch.ones(3, 4), {"dim": (1, -1)}, ValueError, "names a dimension twice"),
    (torch.ones(3, 4), {"dim": True}, TypeError, "dim must be an int"),
    (torch.ones(3, 4), {"dim": ()}, TypeError, "dim must be an int"),
    (torch.ones(3, 0), {}, ValueError, "cannot cover an empty dimension"),
])
def test_bad_arguments(x, kw, err, match):
    with pytest.raises(err, match=match):
        quantize_fp8(x, **kw)


# ------------------------------------------------------------------ the GPU path, without a GPU

def _emulated_kernel(dtype, transposed):
    """QuantizeSm90's contract on CPU tensors: x [G, R, C] -> x8, scale [G] (the reference's formula)."""
    def run(x, x8, scale):
        assert x.dtype == dtype and x.dim() == 3 and x.is_contiguous()
        assert_fp8_layout(x8, "transposed" if transposed else "same")
        q, s = quantize_fp8_reference(x, dim=(1, 2), layout="transposed" if transposed else "same")
        x8.copy_(q)
        scale.copy_(s)
    return run


def _emulated_staged(dtype, transposed, stage_bytes):
    """QuantizeStagedSm90's contract on CPU tensors, chunk by chunk as its CTAs hold them: each
    CTA's chunk must fit its stage, and the chunks together must cover the group."""
    def run(args):
        G, E = args.x.shape
        C, chunk, ctas = args.cols, args.chunk, args.ctas
        assert args.x.dtype == dtype and args.x.is_contiguous() and 1 <= ctas <= 8
        assert chunk % (16 * C if transposed else 16) == 0 and chunk * args.x.element_size() <= stage_bytes
        assert ctas * chunk >= E and (ctas - 1) * chunk < E  # every group covered, no CTA idle
        xf = args.x.float()
        amax = torch.stack([xf[:, r * chunk:(r + 1) * chunk].abs().amax(dim=1) for r in range(ctas)], 1)
        scale = amax.amax(dim=1).where(~amax.isnan().any(dim=1), float("nan"))
        scale = scale.clamp_min(AMAX_FLOOR) * INV_FP8_MAX
        args.scale.copy_(scale)
        q = (xf * scale[:, None].reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        if not transposed:
            assert args.x8.shape == (G, E) and args.x8.is_contiguous()
            args.x8.copy_(q)
            return
        R = E // C
        assert args.x8.shape == (G, C, -(-R // 16) * 16) and args.x8.is_contiguous()
        args.x8.zero_()  # the kernel stores zeros in the rows' padding
        args.x8[..., :R] = q.view(G, R, C).transpose(1, 2)
    return run


@pytest.mark.parametrize("shape, dim, layout, kernel", [
    ((7, 33), -1, "same", "two-pass"),  # rows of 33: e4m3 rows not 16 bytes apart
    ((7, 48), -1, "same", "two-pass"),  # rows of 96 bytes: below MIN_STAGED_BYTES
    ((7, 1024), -1, "same", "staged"),
    ((3, 5, 1040), -1, "same", "staged"),  # rows of a 3-D x
    ((5, 9, 12), (1, 2), "transposed", "two-pass"),  # 108 bf16 values: groups not 16 bytes apart
    ((5, 64, 16), (1, 2), "transposed", "staged"),  # lce's e
    ((5, 64, 16), (1, 2), "same", "staged"),
    ((3, 872, 256), (1, 2), "transposed", "staged"),  # lce's e at the published K_cand: a cluster
    ((2, 1184, 256), (1, 2), "transposed", "staged"),
    ((2, 3000, 256), (1, 2), "transposed", "two-pass"),  # 1.5 MB a group: no cluster holds it
    ((0, 9, 16), (1, 2), "transposed", None),  # no candidates: nothing launched
    ((6, 20), None, "same", "two-pass"),  # one group of 120 values
    ((5, 9, 12), -1, "transposed", None),  # rows, transposed: the reference
    ((6, 20), 0, "same", None),  # columns: the reference
])
def test_gpu_path_host_side(shape, dim, layout, kernel, monkeypatch):
    import contextlib

    import ikbo_gemm.quantize as quantize

    launched = []
    monkeypatch.setattr(quantize, "on_gpu", lambda x: True)
    monkeypatch.setattr(quantize, "require_sm90", lambda device, op: None)
    monkeypatch.setattr(quantize, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(quantize, "quantize_kernel", lambda dtype, transposed: launched.append(
        ("two-pass", transposed)) or _emulated_kernel(dtype, transposed))
    monkeypatch.setattr(quantize, "quantize_staged_kernel", lambda dtype, transposed, stage_bytes: launched.append(
        ("staged", transposed)) or _emulated_staged(dtype, transposed, stage_bytes))
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).mul(4).to(torch.bfloat16)
    x8, scale = quantize_fp8(x, dim=dim, layout=layout)
    r8, rscale = quantize_fp8_reference(x, dim=dim, layout=layout)
    assert x8.shape == r8.shape and scale.shape == rscale.shape and x8.stride() == r8.stride()
    assert_fp8_layout(x8, layout)
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(scale, rscale)
    assert launched == ([(kernel, layout == "transposed")] if kernel else [])


@pytest.mark.parametrize("G, R, C, elt, transposed, plan", [
    (2048, 1, 1024, 2, False, (16384, 1, 1024)),  # linear's x rows: one CTA each, small stages
    (2048, 1, 8192, 2, False, (16384, 1, 8192)),
    (2048, 1, 8192, 4, False, (57344, 1, 8192)),
    (64, 1, 200000, 2, False, (57344, 8, 25008)),
    (1024, 872, 256, 2, True, (57344, 8, 112 * 256)),  # lce's e, published K_cand and K_user
    (1024, 1184, 256, 2, True, (114688, 8, 160 * 256)),
    (16384, 1, 512, 2, False, None),  # 1 KB rows: the two-pass kernel
    (1024, 1184, 256, 4, True, None),  # 1.2 MB a group
    (8, 1, 1000, 2, False, None),  # e4m3 rows 1000 bytes apart
    (8, 7, 3, 2, True, None),  # 42 bytes a group
])
def test_staged_plan(G, R, C, elt, transposed, plan):
    from ikbo_gemm.quantize import staged_plan

    assert staged_plan(G, R, C, elt, transposed, data_ptr=256) == plan
    assert staged_plan(G, R, C, elt, transposed, data_ptr=264) is None  # x not 16-byte aligned


def test_staged_plan_covers_every_group_it_takes():
    """Random group shapes: a plan's chunks (multiples of 16 elements, of 16 rows where
    transposed) fit its stage and cover the group; it is the first option that fits, in the
    order the plan documents (the first stage alone, then each other stage over 1, 2, 4 and 8
    CTAs); no plan where none fits, where the groups are not 16 bytes apart, or under 2 KB."""
    from ikbo_gemm.quantize import MIN_STAGED_BYTES, staged_plan
    from ikbo_gemm.quantize_staged_sm90 import MAX_CTAS

    options = [(STAGE_BYTES[0], 1)] + [(s, c) for s in STAGE_BYTES[1:] for c in (1, 2, 4, MAX_CTAS)]
    g = torch.Generator().manual_seed(5)
    draw = lambda hi: int(torch.randint(1, hi, (1,), generator=g))
    seen = set()
    for _ in range(3000):
        elt, transposed = (2, 4)[draw(3) - 1], draw(3) == 1
        R, C = (draw(5000), draw(600)) if transposed else (1, draw(600000))
        E = R * C
        chunks = [(-(-(-(-R // c)) // 16) * 16 * C if transposed else -(-(-(-E // c)) // 16) * 16)
                  for _, c in options]
        fits = [i for i, ((stage, _), chunk) in enumerate(zip(options, chunks)) if chunk * elt <= stage]
        aligned = E * elt % 16 == 0 and (transposed or E % 16 == 0) and E * elt >= MIN_STAGED_BYTES
        plan = staged_plan(7, R, C, elt, transposed, data_ptr=512)
        if not aligned or not fits:
            assert plan is None
            continue
        stage, ctas, chunk = plan
        assert (stage, ctas, chunk) == (*options[fits[0]], chunks[fits[0]])
        assert chunk * elt <= stage and ctas * chunk >= E and chunk * elt % 16 == 0
        assert chunk % (16 * C if transposed else 16) == 0
        seen.add((stage, ctas))
    assert len(seen) >= 6  # most options drawn (112 KB over 1 or 2 CTAs: only few, wide rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True], ids=["same", "transposed"])
def test_kernel_compiles_for_sm90a(dtype, transposed):
    from ikbo_gemm.quantize_sm90 import compile_quantize

    kernel = compile_quantize(dtype, transposed, keep_ptx=True, ptxas_report=True)
    assert ".target sm_90a" in kernel.ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in kernel.ptx  # round to nearest even, saturated
    # the scale's reciprocal correctly rounded, then products, as the reference: no division
    assert kernel.ptx.count("rcp.rn.f32") == 1 and "div.rn.f32" not in kernel.ptx
    assert "shfl.sync.bfly" in kernel.ptx and kernel.spill_bytes == 0


@pytest.mark.parametrize("stage_bytes", STAGE_BYTES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True], ids=["same", "transposed"])
def test_staged_kernel_compiles_for_sm90a(dtype, transposed, stage_bytes):
    import re

    from ikbo_gemm.quantize_staged_sm90 import compile_quantize_staged

    kernel = compile_quantize_staged(dtype, transposed, stage_bytes, keep_ptx=True, ptxas_report=True)
    ptx = kernel.ptx
    assert ".target sm_90a" in ptx and kernel.spill_bytes == 0
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 1  # x read once
    assert "st.async" in ptx and "mapa" in ptx and "barrier.cluster.wait" in ptx  # amax across the cluster
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # the two-pass kernel's formula
    assert ptx.count("rcp.rn.f32") == 1 and "div.rn.f32" not in ptx
    # x8 leaves in 16-byte stores, the stage is read in 16-byte vectors for the amax
    assert re.findall(r"st\.global\.v4\.b32", ptx) and not re.findall(r"st\.global\.(u8|b8|v2)", ptx)
    assert re.findall(r"ld\.shared\.v4", ptx)
