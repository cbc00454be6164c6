"""The FP8 peers of the GEMM benchmarks (``--dtype fp8`` of bench_linear.py and bench_lce.py):
row-wise e4m3 quantization in torch, ``torch._scaled_mm`` with the padding to 16 it needs, and
the same-run FP8 ceiling.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12  # as ikbo_gemm.quantize_fp8


def quantize_rows(x: torch.Tensor, dim=-1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, scale): e4m3 with scale = amax over ``dim`` / 448, the formula ikbo_gemm.quantize_fp8
    defines (its products by 1 / 448 and by the scale's reciprocal), as an FP8 model runs it in
    torch (a few elementwise passes)."""
    xf = x.float()
    scale = xf.abs().amax(dim=dim, keepdim=True).clamp_min(AMAX_FLOOR) * (1 / FP8_MAX)
    return (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.squeeze(dim)


def dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 of an FP8 tensor and its scale (0-d, or one per entry of dimension 0)."""
    return x8.float() * scale.reshape(scale.shape + (1,) * (x8.dim() - scale.dim()))


def rows_16_apart(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its rows (last dimension) 16 elements apart, a view of padded rows: the layout
    ikbo_gemm.quantize_fp8(layout="transposed") returns."""
    pitch = -(-t.shape[-1] // 16) * 16
    padded = torch.empty((*t.shape[:-1], pitch), dtype=t.dtype, device=t.device)
    return padded[..., : t.shape[-1]].copy_(t)


def pad16(t: torch.Tensor, dim: int = -1, value: float = 0.0) -> torch.Tensor:
    """``t`` with dimension ``dim`` padded with ``value`` to a multiple of 16 (itself if it is one;
    FP8 tensors with zeros). A row-wise scale pads with ones: its padding rows are zeros anyway."""
    size = t.shape[dim]
    if size % 16 == 0:
        return t
    if t.dtype == FP8:  # F.pad has no FP8 kernel: pad the bytes
        return pad16(t.view(torch.uint8), dim).view(FP8)
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, -size % 16], value=value)


def scaled_mm(a8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
              n: Optional[int] = None) -> torch.Tensor:
    """bf16 [M, n] = (a8 * sa) @ (w8 * sw).T: ``torch._scaled_mm`` row-wise (a8 row-major, w8 [N, K]
    row-major, so its ``.t()`` is the column-major operand _scaled_mm wants). It refuses K or N not
    divisible by 16: the operands come padded with zeros (``pad16``, the weights once, at setup);
    ``n`` is the unpadded N (a view of the leading columns)."""
    out = torch._scaled_mm(a8, w8.t(), sa.reshape(-1, 1), sw.reshape(1, -1),
                           out_dtype=torch.bfloat16)
    return out if n is None or n == out.shape[1] else out[:, :n]


def fp8_ceiling_tflops(n: int = 8192) -> float:
    """Same-run ceiling: TFLOP/s of ``torch._scaled_mm`` row-wise on random n x n e4m3 operands."""
    from perf import harness

    a8, sa = quantize_rows(torch.randn(n, n, device="cuda"))
    w8, sw = quantize_rows(torch.randn(n, n, device="cuda"))
    return harness.tflops(2.0 * n**3, harness.bench_ms(lambda: scaled_mm(a8, sa, w8, sw), rep=20))
