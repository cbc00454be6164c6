"""ikbo_gemm.quantize_fp8 on an sm_90 GPU: both kernels bit for bit against the reference, the kernel that
reads x once (groups over clusters of 1 to 8 CTAs) against the two-pass kernel bit for bit,
non-finite values kept in their group, and CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

import ikbo_gemm
from fp8_inputs import assert_fp8_layout
from ikbo_gemm.quantize import AMAX_FLOOR, INV_FP8_MAX, quantize_fp8_reference, staged_plan
from ikbo_gemm.quantize_sm90 import quantize_kernel

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

SHAPES = [  # shape, dim, layout
    ((1, 1), -1, "same"), ((4096, 1000), -1, "same"), ((65536, 7), -1, "same"), ((3, 100, 1000), -1, "same"),
    ((1024, 872, 256), (1, 2), "transposed"), ((15, 1184, 256), (1, 2), "transposed"),
    ((5, 7, 3), (1, 2), "transposed"), ((64, 33), None, "same"),
    ((4096, 1024), -1, "same"), ((5, 60000), -1, "same"), ((2, 400000), -1, "same"),
    ((3, 50000), -1, "same"), ((7, 129, 48), (1, 2), "transposed"), ((3, 4000, 64), (1, 2), "transposed"),
    ((2, 33, 1000), (1, 2), "transposed"), ((3, 40, 32), (1, 2), "same"),
]
# Groups the kernel that reads x once takes, in clusters of 1 to 8 CTAs and each stage size; (2, 33,
# 1000) in fp32 leaves one CTA of its cluster of 4 without rows.
STAGED = [s for s in SHAPES if s[0] not in ((1, 1), (4096, 1000), (65536, 7), (3, 100, 1000), (5, 7, 3))]


def _x(shape, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    # groups of very different magnitudes, one zero among the values
    x = torch.randn(shape, generator=g, device=DEVICE) * torch.rand(shape[:1] + (1,) * (len(shape) - 1),
                                                                      generator=g, device=DEVICE).mul(16).sub(8).exp2()
    x = x.to(dtype)
    x.view(-1)[0] = 0
    return x


def _poison_allocator(nbytes):
    """Fill the blocks the caching allocator hands out next with 0x7f (e4m3 NaN)."""
    torch.full((nbytes + (1 << 20),), 0x7F, dtype=torch.uint8, device=DEVICE)


def _groups(shape, dim, layout):
    nd = len(shape)
    dims = tuple(range(nd)) if dim is None else (dim % nd,) if isinstance(dim, int) else dim
    G = 1
    for n in shape[: nd - len(dims)]:
        G *= n
    if layout == "transposed":
        return G, shape[-2], shape[-1]
    E = 1
    for n in shape[nd - len(dims):]:
        E *= n
    return G, 1, E


@pytest.mark.parametrize("shape, dim, layout", SHAPES)
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_matches_its_reference(shape, dim, layout, dtype):
    x = _x(shape, dtype, sum(shape))
    _poison_allocator(x.numel())
    x8, scale = ikbo_gemm.quantize_fp8(x, dim=dim, layout=layout)
    r8, rscale = quantize_fp8_reference(x, dim=dim, layout=layout)
    assert x8.shape == r8.shape and scale.shape == rscale.shape and x8.stride() == r8.stride()
    assert_fp8_layout(x8, layout)
    # every step of the formula is one correctly rounded fp32 operation: the same bits
    assert torch.equal(scale, rscale)
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8))


@pytest.mark.parametrize("shape, dim, layout", STAGED)
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_read_once_is_the_two_pass_bits(shape, dim, layout, dtype):
    x = _x(shape, dtype, 7 * sum(shape))
    G, R, C = _groups(shape, dim, layout)
    if staged_plan(G, R, C, x.element_size(), layout == "transposed", x.data_ptr()) is None:
        pytest.skip("the two-pass kernel takes these groups")  # (2, 400000) in fp32: 1.6 MB a group
    _poison_allocator(x.numel())
    x8, scale = ikbo_gemm.quantize_fp8(x, dim=dim, layout=layout)
    t8 = torch.full_like(x8, float("nan"))
    tscale = torch.full_like(scale, float("nan"))
    quantize_kernel(dtype, layout == "transposed")(x.view(G, R, C), t8.view(G, C, R) if layout == "transposed"
                                                  else t8.view(G, R, C), tscale.view(G))
    assert torch.equal(scale, tscale)
    assert torch.equal(x8.view(torch.uint8), t8.view(torch.uint8))


@pytest.mark.parametrize("shape, dim, layout", [((4, 300000), -1, "same"), ((6, 1184, 256), (1, 2), "transposed"),
                                                ((9, 4096), -1, "same")])
def test_non_finite_values_stay_in_their_group(shape, dim, layout):
    """A NaN or inf in the last CTA's chunk of a cluster reaches its group's scale, and no other."""
    x = _x(shape, BF16, 3)
    flat = x.view(shape[0], -1)
    flat[1, -1] = float("nan")
    flat[2, -5] = float("inf")
    flat[3] = 0
    x8, scale = ikbo_gemm.quantize_fp8(x, dim=dim, layout=layout)
    scale = scale.view(-1)
    assert scale[1].isnan() and scale[2].isinf()
    assert scale[3] == torch.tensor(AMAX_FLOOR) * INV_FP8_MAX and not x8[3].float().any()
    keep = torch.ones(shape[0], dtype=torch.bool, device=DEVICE)
    keep[1:3] = False
    _, rscale = quantize_fp8_reference(x[keep], dim=dim, layout=layout)
    assert torch.equal(scale[keep], rscale.view(-1))


@pytest.mark.parametrize("shape, dim, layout", [((2048, 2048), -1, "same"), ((64, 1184, 256), (1, 2), "transposed")])
def test_cuda_graph_replay(shape, dim, layout):
    x = _x(shape, BF16, 11)
    ikbo_gemm.quantize_fp8(x, dim=dim, layout=layout)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x8, scale = ikbo_gemm.quantize_fp8(x, dim=dim, layout=layout)
    for seed in (12, 13):
        x.copy_(_x(shape, BF16, seed))
        graph.replay()
        r8, rscale = quantize_fp8_reference(x, dim=dim, layout=layout)
        assert torch.equal(scale, rscale) and torch.equal(x8.view(torch.uint8), r8.view(torch.uint8))
