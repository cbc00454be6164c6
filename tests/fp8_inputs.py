"""Random FP8 problems of ``ikbo_gemm.linear`` and ``ikbo_gemm.lce`` (operands quantized with
``quantize_fp8``) and their float64 formulas, for the CPU and GPU tests."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ikbo_gemm import quantize_fp8
from ikbo_gemm.reference import apply_activation


def _randn(g, *shape, s=1.0, device="cpu"):
    return torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * s


def _per_tensor(t8, scale, per_tensor: bool):
    """(t8, scale) as given, or requantized with one scale for the whole tensor."""
    if not per_tensor:
        return t8, scale
    return quantize_fp8(t8.float() * scale.reshape(scale.shape + (1,) * (t8.dim() - scale.dim())), dim=None)


def assert_fp8_layout(x8: torch.Tensor, layout: str):
    """quantize_fp8's result layout: "same" contiguous; "transposed" rows 16 bytes apart (rows
    padded to 16 elements), dense otherwise."""
    if layout == "same":
        assert x8.is_contiguous(), x8.stride()
        return
    pitch = -(-x8.shape[-1] // 16) * 16
    dense = [1, pitch]
    for n in reversed(x8.shape[1:-1]):
        dense.append(dense[-1] * n)
    assert x8.dim() < 2 or tuple(x8.stride()) == tuple(reversed(dense[: x8.dim()])) or x8.numel() == 0, x8.stride()


def idx_of(B, U, g, device="cpu", idx_dtype=torch.int32):
    """About B / U candidates per user (each user one at least where B >= U), shuffled."""
    idx = (torch.arange(B, device=device) * U // max(B, 1))[torch.randperm(B, generator=g, device=device)]
    return idx.to(idx_dtype)


def linear_fp8_problem(B, U, N, K_user, K_cand, *, seed=0, device="cpu", per_tensor=False, bias=True,
                       bias_dtype=torch.float32, idx_dtype=torch.int32) -> dict:
    """Keyword arguments of ``linear``: FP8 operands with row-wise (or per-tensor) scales,
    outputs of order 1; rows of x at different magnitudes, so a scale applied to the wrong row
    shows."""
    g = torch.Generator(device=device).manual_seed(seed)
    s = 1 / math.sqrt(K_user + K_cand)
    x_cand = _randn(g, B, K_cand, device=device) * torch.rand(B, 1, generator=g, device=device).mul(4).exp2()
    x_user = _randn(g, U, K_user, device=device) * torch.rand(U, 1, generator=g, device=device).mul(4).exp2()
    kw = {}
    for name, t in (("x_cand", x_cand), ("x_user", x_user), ("w_cand", _randn(g, N, K_cand, s=s, device=device)),
                    ("w_user", _randn(g, N, K_user, s=s, device=device))):
        t8, scale = _per_tensor(*quantize_fp8(t), per_tensor)
        kw[name], kw[name + "_scale"] = t8, scale
    kw["idx"] = idx_of(B, U, g, device, idx_dtype)
    kw["bias"] = (_randn(g, N, s=0.5, device=device)).to(bias_dtype) if bias else None
    return kw


def lce_fp8_problem(B, U, M, N, K_user, K_cand, *, seed=0, device="cpu", per_tensor=False,
                    idx_dtype=torch.int32) -> dict:
    """Keyword arguments of ``lce``: FP8 operands, e K-major ([B, N, K]) with one scale per batch
    entry, w with one per row (or per-tensor scales)."""
    g = torch.Generator(device=device).manual_seed(seed)
    s = 1 / math.sqrt(K_user + K_cand)
    kw = {}
    for name, t in (("w_cand", _randn(g, M, K_cand, s=s, device=device)),
                    ("w_user", _randn(g, M, K_user, s=s, device=device))):
        kw[name], kw[name + "_scale"] = _per_tensor(*quantize_fp8(t), per_tensor)
    for name, t in (("e_cand", _randn(g, B, K_cand, N, device=device)), ("e_user", _randn(g, U, K_user, N, device=device))):
        t = t * torch.rand(t.shape[0], 1, 1, generator=g, device=device).mul(4).exp2()
        kw[name], kw[name + "_scale"] = _per_tensor(*quantize_fp8(t, dim=(1, 2), layout="transposed"), per_tensor)
    kw["idx"] = idx_of(B, U, g, device, idx_dtype)
    return kw


UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def assert_one_rounding(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, slack: float = 1e-4) -> None:
    """``out`` is of ``dtype``, NaN-free, and each element within its unit roundoff of the float64
    ``exact`` (plus fp32 accumulation slack relative to the largest element, at least 1)."""
    assert out.dtype == dtype and out.shape == exact.shape and not out.isnan().any()
    bound = UNIT_ROUNDOFF[dtype] * exact.abs() + slack * exact.abs().max().clamp_min(1.0)
    bad = (out.double() - exact).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, the worst by {float((out.double() - exact).abs().max())}"


def _deq64(t8, scale):
    return t8.double() * scale.double().reshape(scale.shape + (1,) * (t8.dim() - scale.dim()))


def linear_fp8_f64(x_cand, x_user, idx, w_cand, w_user, bias=None, activation: Optional[str] = None, *,
                   x_cand_scale, x_user_scale, w_cand_scale, w_user_scale) -> torch.Tensor:
    """The FP8 layer as its formula reads, on cat(user features gathered by idx, candidate
    features) dequantized, in float64."""
    x = torch.cat([_deq64(x_user, x_user_scale)[idx.long()], _deq64(x_cand, x_cand_scale)], dim=1)
    w = torch.cat([_deq64(w_user, w_user_scale), _deq64(w_cand, w_cand_scale)], dim=1)
    y = x @ w.T + (0 if bias is None else bias.double())
    return apply_activation(y, activation)


def lce_fp8_f64(w_cand, w_user, e_cand, e_user, idx, *, w_cand_scale, w_user_scale, e_cand_scale,
                e_user_scale) -> torch.Tensor:
    """out[b] = cat(w_user, w_cand) @ cat(e_user[idx[b]], e_cand[b]) along K, dequantized, in
    float64 (e given K-major: [b, N, K])."""
    e = torch.cat([_deq64(e_user, e_user_scale)[idx.long()], _deq64(e_cand, e_cand_scale)], dim=2)
    w = torch.cat([_deq64(w_user, w_user_scale), _deq64(w_cand, w_cand_scale)], dim=1)
    return torch.matmul(w, e.transpose(1, 2))


# Hopper's 8-bit wgmma adds each instruction's 32 products into an accumulator that keeps about
# 14 mantissa bits, not fp32's 24, and the FP8 kernels do not promote partial sums to fp32
# registers. Each of an output's K / 32 additions may then lose 2^-14 of a partial sum, which is
# at most the sum of the |products| that entered it: the per-element bound is one rounding of the
# output plus (K / 32) 2^-14 of that sum (times 1.2, the steepest activation's slope). Over the
# whole output the error may exceed one rounding's by at most 2^-9 of its norm: a wrong or
# missing product or term fails either check.
FP8_ACCUMULATOR_BITS = 14


def assert_fp8_kernel_rounding(out: torch.Tensor, exact: torch.Tensor, accumulation: torch.Tensor, dtype: torch.dtype,
                               slack: float = 1e-4) -> None:
    """``out`` of ``dtype``, NaN-free, each element within one rounding of the float64 ``exact``
    plus ``accumulation`` (the FP8 accumulator's bound, ``*_fp8_accumulation``), and the whole
    within one rounding's relative error plus 2^-9."""
    assert out.dtype == dtype and out.shape == exact.shape and not out.isnan().any()
    bound = UNIT_ROUNDOFF[dtype] * exact.abs() + 1.2 * accumulation + slack * exact.abs().max().clamp_min(1.0)
    err = (out.double() - exact).abs()
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, the worst by {float(err.max())}"
    norm = exact.norm().clamp_min(1e-30)
    rel, once = float(err.norm() / norm), float((exact.to(dtype).double() - exact).norm() / norm)
    assert rel <= once + 2.0**-9, f"relative error {rel:.3g} against {once:.3g} for one rounding"


def _abs_operands(kw: dict) -> dict:
    return {n: (t.double().abs() if n != "idx" and isinstance(t, torch.Tensor) else t) for n, t in kw.items()}


def linear_fp8_accumulation(x_cand, x_user, idx, w_cand, w_user, bias=None, **scales) -> torch.Tensor:
    """The FP8 accumulator's error bound per output of the layer (before bias and activation)."""
    k = x_cand.shape[1] + x_user.shape[1]
    terms = linear_fp8_f64(idx=idx, **_abs_operands(dict(x_cand=x_cand, x_user=x_user, w_cand=w_cand, w_user=w_user,
                                                          **scales)))
    return terms * (-(-k // 32) * 2.0**-FP8_ACCUMULATOR_BITS)


def lce_fp8_accumulation(w_cand, w_user, e_cand, e_user, idx, **scales) -> torch.Tensor:
    """The FP8 accumulator's error bound per output of lce."""
    k = w_cand.shape[1] + w_user.shape[1]
    terms = lce_fp8_f64(idx=idx, **_abs_operands(dict(w_cand=w_cand, w_user=w_user, e_cand=e_cand, e_user=e_user,
                                                       **scales)))
    return terms * (-(-k // 32) * 2.0**-FP8_ACCUMULATOR_BITS)
