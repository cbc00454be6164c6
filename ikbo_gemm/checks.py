"""Input checks of ``ikbo_gemm.lce``, ``ikbo_gemm.linear`` and their references: every error
names the argument, its shape and the expected layout.

    lce:    w_cand [M, K_cand], w_user [M, K_user], e_cand [B, K_cand, N],
            e_user [U, K_user, N], idx [B] (int32 or int64), out [B, M, N]
            FP8: e_cand [B, N, K_cand], e_user [U, N, K_user] (K-major, as 8-bit wgmma reads
            its B operand); scales w_* [M], e_cand [B], e_user [U]
    linear: x_cand [B, K_cand], x_user [U, K_user], w_cand [N, K_cand], w_user [N, K_user],
            bias [N], out [B, N]; FP8 scales x_cand [B], x_user [U], w_* [N]

FP8 operands are float8_e4m3fn, all of them, each with a float32 scale: one per row as above,
or a 0-d tensor for the whole operand.
"""
from __future__ import annotations

from typing import Optional

import torch

from cute_kernels.checks import (
    FLOAT_DTYPES,
    check_dim,
    check_index,
    check_index_range,
    check_output,
    check_same_device,
    check_same_dtype,
    check_tensor,
    validation_enabled,
)

from .config import ACTIVATIONS

FP8 = torch.float8_e4m3fn
# Other 8-bit floats torch has: refused by name rather than as an unknown dtype.
_OTHER_FP8 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
_OPERAND_DTYPES = FLOAT_DTYPES + (FP8,)
_ALL_FP8 = (FP8,) + _OTHER_FP8
# Output dtypes of an FP8 call (bf16 by default).
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)
BIAS_DTYPES = FLOAT_DTYPES + (torch.float32,)

SCHEDULES = ("fused", "two_launch")

_W_CAND = "[M, K_cand]"
_W_USER = "[M, K_user]"
_E_CAND = "[B, K_cand, N]"
_E_USER = "[U, K_user, N]"
_E8_CAND = "[B, N, K_cand]"
_E8_USER = "[U, N, K_user]"


def check_lce_inputs(
    w_cand,
    w_user,
    e_cand,
    e_user,
    idx,
    out: Optional[torch.Tensor],
    validate: Optional[bool],
    *,
    w_cand_scale=None,
    w_user_scale=None,
    e_cand_scale=None,
    e_user_scale=None,
    out_dtype=None,
) -> tuple[int, int, int, int, int, int]:
    """Validate one LCE call; return ``(B, U, M, N, K_cand, K_user)``.

    Raises TypeError for a non-tensor or a wrong dtype, ValueError for a wrong
    rank, size or device, an empty tensor or a missing or misplaced scale, and,
    when validation is enabled (``validate=True`` or ``IKBO_VALIDATE=1``),
    IndexError for the first idx outside [0, U). The range check reads idx back
    to the host.
    """
    fp8 = _fp8_call(("w_cand", "w_user", "e_cand", "e_user"), (w_cand, w_user, e_cand, e_user))
    e_cand_layout, e_user_layout = (_E8_CAND, _E8_USER) if fp8 else (_E_CAND, _E_USER)
    check_tensor("w_cand", w_cand, ndim=2, dtypes=_OPERAND_DTYPES, layout=_W_CAND)
    check_tensor("w_user", w_user, ndim=2, dtypes=_OPERAND_DTYPES, layout=_W_USER)
    check_tensor("e_cand", e_cand, ndim=3, dtypes=_OPERAND_DTYPES, layout=e_cand_layout, empty_batch=True)
    check_tensor("e_user", e_user, ndim=3, dtypes=_OPERAND_DTYPES, layout=e_user_layout)
    operands = ("w_cand", "w_user", "e_cand", "e_user")
    dtype = check_operand_dtypes(operands, (w_cand, w_user, e_cand, e_user))

    M, K_cand = w_cand.shape
    K_user = w_user.shape[1]
    # FP8 e is K-major ([B, N, K]), 16-bit e N-major ([B, K, N]).
    k_dim, n_dim = (2, 1) if fp8 else (1, 2)
    B, U, N = e_cand.shape[0], e_user.shape[0], e_cand.shape[n_dim]
    check_index("idx", idx, B, "B", empty=True)
    device = check_same_device(operands + ("idx",), (w_cand, w_user, e_cand, e_user, idx))

    check_dim("w_user", w_user, 0, M, "M (w_cand.shape[0])", _W_USER)
    check_dim("e_cand", e_cand, k_dim, K_cand, "K_cand (w_cand.shape[1])", e_cand_layout)
    check_dim("e_user", e_user, k_dim, K_user, "K_user (w_user.shape[1])", e_user_layout)
    check_dim("e_user", e_user, n_dim, N, f"N (e_cand.shape[{n_dim}])", e_user_layout)
    check_scales(fp8, device, (
        ("w_cand_scale", w_cand_scale, "w_cand", M, "[M]"),
        ("w_user_scale", w_user_scale, "w_user", M, "[M]"),
        ("e_cand_scale", e_cand_scale, "e_cand", B, "[B]"),
        ("e_user_scale", e_user_scale, "e_user", U, "[U]"),
    ))
    result_dtype = check_out_dtype(out_dtype, dtype)

    if out is not None:
        check_output("out", out, (B, M, N), result_dtype, device)
    if validation_enabled(validate):
        check_index_range("idx", idx, U, "U", "the batch of e_user")
    return B, U, M, N, K_cand, K_user


def check_schedule(schedule) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    return schedule


# ---------------------------------------------------------------------------------- linear
_X_CAND = "[B, K_cand]"
_X_USER = "[U, K_user]"
_WL_CAND = "[N, K_cand]"
_WL_USER = "[N, K_user]"


def check_activation(activation) -> Optional[str]:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    return activation


def check_linear_inputs(x_cand, x_user, idx, w_cand, w_user, bias, activation, out: Optional[torch.Tensor],
                        validate: Optional[bool], *, x_cand_scale=None, x_user_scale=None, w_cand_scale=None,
                        w_user_scale=None, out_dtype=None) -> tuple[int, int, int, int, int]:
    """Validate one linear call; return ``(B, U, N, K_cand, K_user)``.

    Raises TypeError for a non-tensor or a wrong dtype, ValueError for a wrong rank, size,
    device or activation, an empty tensor (B = 0 is allowed) or a missing or misplaced scale,
    and, when validation is enabled, IndexError for the first idx outside [0, U) (reading idx
    back to the host). A bias is of the operands' dtype, or (FP8 operands) bf16, fp16 or fp32."""
    names = ["x_cand", "x_user", "w_cand", "w_user"]
    tensors = [x_cand, x_user, w_cand, w_user]
    fp8 = _fp8_call(names, tensors)
    check_tensor("x_cand", x_cand, ndim=2, dtypes=_OPERAND_DTYPES, layout=_X_CAND, empty_batch=True)
    check_tensor("x_user", x_user, ndim=2, dtypes=_OPERAND_DTYPES, layout=_X_USER)
    check_tensor("w_cand", w_cand, ndim=2, dtypes=_OPERAND_DTYPES, layout=_WL_CAND)
    check_tensor("w_user", w_user, ndim=2, dtypes=_OPERAND_DTYPES, layout=_WL_USER)
    dtype = check_operand_dtypes(names, tensors)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=BIAS_DTYPES if fp8 else FLOAT_DTYPES, layout="[N]")
        if not fp8:
            check_same_dtype(names + ["bias"], tensors + [bias])
        names.append("bias")
        tensors.append(bias)
    B, K_cand = x_cand.shape
    U, K_user = x_user.shape
    N = w_cand.shape[0]
    check_index("idx", idx, B, "B", empty=True)
    device = check_same_device(names + ["idx"], tensors + [idx])
    check_dim("w_cand", w_cand, 1, K_cand, "K_cand (x_cand.shape[1])", _WL_CAND)
    check_dim("w_user", w_user, 0, N, "N (w_cand.shape[0])", _WL_USER)
    check_dim("w_user", w_user, 1, K_user, "K_user (x_user.shape[1])", _WL_USER)
    if bias is not None:
        check_dim("bias", bias, 0, N, "N (w_cand.shape[0])", "[N]")
    check_activation(activation)
    check_scales(fp8, device, (
        ("x_cand_scale", x_cand_scale, "x_cand", B, "[B]"),
        ("x_user_scale", x_user_scale, "x_user", U, "[U]"),
        ("w_cand_scale", w_cand_scale, "w_cand", N, "[N]"),
        ("w_user_scale", w_user_scale, "w_user", N, "[N]"),
    ))
    result_dtype = check_out_dtype(out_dtype, dtype)
    if out is not None:
        check_output("out", out, (B, N), result_dtype, device)
    if validation_enabled(validate):
        check_index_range("idx", idx, U, "U", "the batch of x_user")
    return B, U, N, K_cand, K_user


# ---------------------------------------------------------------------------------- FP8
def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fp8_call(names, tensors) -> bool:
    """Whether the call has FP8 operands; an 8-bit float other than e4m3 is refused here, by name."""
    fp8 = False
    for name, t in zip(names, tensors):
        dtype = getattr(t, "dtype", None)
        if dtype in _OTHER_FP8:
            raise TypeError(f"{name} is {_dtype_name(dtype)}: FP8 operands must be float8_e4m3fn (e4m3); "
                            f"{_dtype_name(dtype)} is not supported")
        fp8 = fp8 or dtype == FP8
    return fp8


def fp8_call(operands, scales, out_dtype) -> bool:
    """Whether a call leaves the 16-bit path: an FP8 operand, a scale, or an ``out_dtype`` other
    than the first operand's dtype (the full checks then refuse what does not fit, naming the
    argument)."""
    return (any(s is not None for s in scales) or any(getattr(t, "dtype", None) in _ALL_FP8 for t in operands)
            or (out_dtype is not None and out_dtype != getattr(operands[0], "dtype", None)))


def check_operand_dtypes(names, tensors) -> torch.dtype:
    """The one dtype of all operands; FP8 and 16-bit operands mixed are refused with what to do."""
    fp8 = [n for n, t in zip(names, tensors) if t.dtype == FP8]
    if fp8 and len(fp8) < len(names):
        name, t = next((n, t) for n, t in zip(names, tensors) if t.dtype != FP8)
        raise TypeError(f"{name} is {_dtype_name(t.dtype)} but {fp8[0]} is float8_e4m3fn: FP8 and 16-bit operands "
                        f"cannot be mixed (quantize every operand, e.g. with ikbo_gemm.quantize_fp8)")
    return check_same_dtype(names, tensors)


def check_scales(fp8: bool, device: torch.device, specs) -> None:
    """Each of ``specs``, (scale name, scale, operand name, rows, rows' layout such as "[B]"):
    with FP8 operands a float32 tensor [rows] (one per row of the operand) or 0-d (one for all
    of it) on ``device``; with 16-bit operands None."""
    for name, scale, operand, rows, layout in specs:
        if not fp8:
            if scale is not None:
                raise ValueError(f"{name} is given but {operand} is not FP8: scales apply to float8_e4m3fn "
                                 f"operands only")
            continue
        expected = f"float32 {layout} (one per row of {operand}) or 0-d (one for all of it)"
        if scale is None:
            raise ValueError(f"{operand} is float8_e4m3fn, so {name} is required: {expected}; "
                             f"ikbo_gemm.quantize_fp8 returns it")
        if not isinstance(scale, torch.Tensor) or scale.layout != torch.strided:
            raise TypeError(f"{name} must be a dense torch.Tensor, {expected}, got "
                            f"{type(scale).__name__ if not isinstance(scale, torch.Tensor) else scale.layout}")
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {_dtype_name(scale.dtype)}")
        if scale.dim() != 0 and (scale.dim() != 1 or scale.shape[0] != rows):
            raise ValueError(f"{name} has shape [{', '.join(map(str, scale.shape))}], expected {expected}: "
                             f"{layout} = [{rows}] or []")
        if scale.device != device:
            raise ValueError(f"{name} is on {scale.device} but {operand} is on {device}: all tensors must share "
                             f"one device")


def check_out_dtype(out_dtype, dtype: torch.dtype) -> torch.dtype:
    """The output dtype of a call on operands of ``dtype``: FP8 operands give bf16 (default) or
    fp16; 16-bit operands give their own dtype (``out_dtype`` None or that dtype)."""
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__} {out_dtype!r}")
    if dtype == FP8:
        if out_dtype is None:
            return torch.bfloat16
        if out_dtype not in FP8_OUT_DTYPES:
            raise TypeError(f"out_dtype must be bfloat16 or float16 for FP8 operands, got {_dtype_name(out_dtype)}")
        return out_dtype
    if out_dtype is not None and out_dtype != dtype:
        raise TypeError(f"out_dtype must be None or {_dtype_name(dtype)} for {_dtype_name(dtype)} operands (the "
                        f"output takes their dtype), got {_dtype_name(out_dtype)}")
    return dtype
