"""PyTorch references of the package's ops: the definitions the kernels are tested against.

Linear compression (``lce_reference``):

    out[b] = w_cand @ e_cand[b] + (w_user @ e_user)[idx[b]]

Evaluated as the decomposition the kernel fuses: one user GEMM per user, one
candidate GEMM per candidate, a gather by idx, all in fp32; the two partial
sums are added in fp32 and rounded once to the input dtype. A candidate whose
index lies outside [0, U) (possible only with validation off) gets a NaN
output slice; no other candidate is affected. Runs on any device.
"""
from __future__ import annotations

from typing import Optional

import torch

from .checks import FP8, check_lce_inputs, check_linear_inputs, check_out_dtype, check_schedule

# Candidates per chunk: bounds the fp32 copy of e_cand the reference makes.
_CHUNK_ELEMENTS = 1 << 26


def dequantize(t: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``t`` in fp32: an FP8 tensor times its ``scale`` (0-d, or one per entry of dimension 0),
    a 16-bit one as it is."""
    if t.dtype != FP8:
        return t.to(torch.float32)
    return t.to(torch.float32) * scale.reshape(scale.shape + (1,) * (t.dim() - scale.dim()))


def _rows(scale: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    """The scales of ``rows`` of an operand: all of a 0-d (or absent) scale."""
    return scale if scale is None or scale.dim() == 0 else scale[rows]


def lce_reference(
    w_cand: torch.Tensor,
    w_user: torch.Tensor,
    e_cand: torch.Tensor,
    e_user: torch.Tensor,
    idx: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
    schedule: str = "fused",
    w_cand_scale: Optional[torch.Tensor] = None,
    w_user_scale: Optional[torch.Tensor] = None,
    e_cand_scale: Optional[torch.Tensor] = None,
    e_user_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Same signature and result as :func:`ikbo_gemm.lce`; ``schedule`` is checked and ignored."""
    B, U, M, N, K_cand, K_user = check_lce_inputs(
        w_cand, w_user, e_cand, e_user, idx, out, validate, w_cand_scale=w_cand_scale, w_user_scale=w_user_scale,
        e_cand_scale=e_cand_scale, e_user_scale=e_user_scale, out_dtype=out_dtype)
    check_schedule(schedule)
    fp8 = e_cand.dtype == FP8

    def e_f32(e, scale):  # [b, K, N] in fp32 (FP8 e is [b, N, K])
        e = dequantize(e, scale)
        return e.transpose(1, 2) if fp8 else e

    user = torch.matmul(dequantize(w_user, w_user_scale), e_f32(e_user, e_user_scale))  # [U, M, N], once per user
    idx = idx.long()
    valid = (idx >= 0) & (idx < U)
    safe = torch.where(valid, idx, torch.zeros_like(idx))

    result = torch.empty((B, M, N), dtype=check_out_dtype(out_dtype, e_cand.dtype), device=e_cand.device)
    w_c = dequantize(w_cand, w_cand_scale)
    chunk = max(1, _CHUNK_ELEMENTS // (K_cand * N + M * N))
    for start in range(0, B, chunk):
        sl = slice(start, min(B, start + chunk))
        acc = torch.matmul(w_c, e_f32(e_cand[sl], _rows(e_cand_scale, sl)))  # [b, M, N]
        acc += user.index_select(0, safe[sl])
        acc.masked_fill_(~valid[sl, None, None], float("nan"))
        result[sl] = acc  # the one rounding
    if out is not None:
        out.copy_(result)
        return out
    return result


def apply_activation(x: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """``activation`` of ikbo_gemm.linear on ``x`` (evaluated in x's dtype)."""
    if activation is None:
        return x
    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu":
        return torch.nn.functional.gelu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(x)
    if activation == "sigmoid":
        return torch.sigmoid(x)
    raise ValueError(f"unknown activation {activation!r}")


def linear_reference(
    x_cand: torch.Tensor,
    x_user: torch.Tensor,
    idx: torch.Tensor,
    w_cand: torch.Tensor,
    w_user: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    activation: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
    x_cand_scale: Optional[torch.Tensor] = None,
    x_user_scale: Optional[torch.Tensor] = None,
    w_cand_scale: Optional[torch.Tensor] = None,
    w_user_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Same signature and result as :func:`ikbo_gemm.linear`, evaluated with PyTorch (any device):

        out[b] = act(x_cand[b] @ w_cand.T + x_user[idx[b]] @ w_user.T + bias)

    as the decomposition the kernel fuses: the user GEMM once per user, the candidate GEMM, the
    gather, the bias and the activation all in fp32, rounded once. FP8 operands enter
    dequantized (``x8.float() * scale``). A candidate whose index lies outside [0, U) (possible
    only with validation off) gets a NaN row."""
    B, U, N, _, _ = check_linear_inputs(
        x_cand, x_user, idx, w_cand, w_user, bias, activation, out, validate, x_cand_scale=x_cand_scale,
        x_user_scale=x_user_scale, w_cand_scale=w_cand_scale, w_user_scale=w_user_scale, out_dtype=out_dtype)
    user = dequantize(x_user, x_user_scale) @ dequantize(w_user, w_user_scale).T  # [U, N], once per user
    idx = idx.long()
    valid = (idx >= 0) & (idx < U)
    acc = dequantize(x_cand, x_cand_scale) @ dequantize(w_cand, w_cand_scale).T
    acc += user.index_select(0, torch.where(valid, idx, torch.zeros_like(idx)))
    if bias is not None:
        acc += bias.to(torch.float32)
    acc = apply_activation(acc, activation)
    acc.masked_fill_(~valid[:, None], float("nan"))
    result = acc.to(check_out_dtype(out_dtype, x_cand.dtype))  # the one rounding
    if out is not None:
        out.copy_(result)
        return out
    return result
