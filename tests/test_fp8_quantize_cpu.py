"""CPU tests of ikbo_gemm.quantize_fp8: the round trip, the scales' shapes and layouts, the
rows that hold zeros or non-finite values, and argument validation."""
from __future__ import annotations

import pytest
import torch

from fp8_inputs import assert_fp8_layout
from ikbo_gemm import quantize_fp8
from ikbo_gemm.quantize import AMAX_FLOOR, FP8_MAX, quantize_fp8_reference

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
    assert scale[1] == AMAX_FLOOR / FP8_MAX and not x8[1].float().any()
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


@pytest.mark.parametrize("shape, dim, layout, kernel", [
    ((7, 33), -1, "same", True),
    ((3, 5, 9), -1, "same", True),  # rows of a 3-D x
    ((5, 9, 12), (1, 2), "transposed", True),  # lce's e
    ((5, 9, 12), (1, 2), "same", True),
    ((0, 9, 12), (1, 2), "transposed", True),  # no candidates: nothing launched
    ((6, 20), None, "same", True),  # one group
    ((5, 9, 12), -1, "transposed", False),  # rows, transposed: the reference
    ((6, 20), 0, "same", False),  # columns: the reference
])
def test_gpu_path_host_side(shape, dim, layout, kernel, monkeypatch):
    import contextlib

    import ikbo_gemm.quantize as quantize

    launched = []
    monkeypatch.setattr(quantize, "on_gpu", lambda x: True)
    monkeypatch.setattr(quantize, "require_sm90", lambda device, op: None)
    monkeypatch.setattr(quantize, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(quantize, "quantize_kernel",
                        lambda dtype, transposed: launched.append(transposed) or _emulated_kernel(dtype, transposed))
    x = torch.randn(shape, dtype=torch.bfloat16)
    x8, scale = quantize_fp8(x, dim=dim, layout=layout)
    r8, rscale = quantize_fp8_reference(x, dim=dim, layout=layout)
    assert x8.shape == r8.shape and scale.shape == rscale.shape and x8.stride() == r8.stride()
    assert_fp8_layout(x8, layout)
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(scale, rscale)
    assert launched == ([layout == "transposed"] if kernel and shape[0] else [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True], ids=["same", "transposed"])
def test_kernel_compiles_for_sm90a(dtype, transposed):
    from ikbo_gemm.quantize_sm90 import compile_quantize

    kernel = compile_quantize(dtype, transposed, keep_ptx=True, ptxas_report=True)
    assert ".target sm_90a" in kernel.ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in kernel.ptx  # round to nearest even, saturated
    assert "div.rn.f32" in kernel.ptx  # IEEE division, as torch's
    assert "shfl.sync.bfly" in kernel.ptx and kernel.spill_bytes == 0
