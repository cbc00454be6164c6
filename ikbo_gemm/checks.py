"""Input checks of ``ikbo_gemm.lce`` and its reference: every error names the
argument, its shape and the expected layout.

    w_cand [M, K_cand], w_user [M, K_user], e_cand [B, K_cand, N],
    e_user [U, K_user, N], idx [B] (int32 or int64), out [B, M, N]
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

SCHEDULES = ("fused", "two_launch")

_W_CAND = "[M, K_cand]"
_W_USER = "[M, K_user]"
_E_CAND = "[B, K_cand, N]"
_E_USER = "[U, K_user, N]"


def check_lce_inputs(
    w_cand,
    w_user,
    e_cand,
    e_user,
    idx,
    out: Optional[torch.Tensor],
    validate: Optional[bool],
) -> tuple[int, int, int, int, int, int]:
    """Validate one LCE call; return ``(B, U, M, N, K_cand, K_user)``.

    Raises TypeError for a non-tensor or a wrong dtype, ValueError for a wrong
    rank, size or device or an empty tensor, and, when validation is enabled
    (``validate=True`` or ``IKBO_VALIDATE=1``), IndexError for the first idx
    outside [0, U). The range check reads idx back to the host.
    """
    check_tensor("w_cand", w_cand, ndim=2, dtypes=FLOAT_DTYPES, layout=_W_CAND)
    check_tensor("w_user", w_user, ndim=2, dtypes=FLOAT_DTYPES, layout=_W_USER)
    check_tensor("e_cand", e_cand, ndim=3, dtypes=FLOAT_DTYPES, layout=_E_CAND, empty_batch=True)
    check_tensor("e_user", e_user, ndim=3, dtypes=FLOAT_DTYPES, layout=_E_USER)
    operands = ("w_cand", "w_user", "e_cand", "e_user")
    dtype = check_same_dtype(operands, (w_cand, w_user, e_cand, e_user))

    M, K_cand = w_cand.shape
    K_user = w_user.shape[1]
    B, U, N = e_cand.shape[0], e_user.shape[0], e_cand.shape[2]
    check_index("idx", idx, B, "B", empty=True)
    device = check_same_device(operands + ("idx",), (w_cand, w_user, e_cand, e_user, idx))

    check_dim("w_user", w_user, 0, M, "M (w_cand.shape[0])", _W_USER)
    check_dim("e_cand", e_cand, 1, K_cand, "K_cand (w_cand.shape[1])", _E_CAND)
    check_dim("e_user", e_user, 1, K_user, "K_user (w_user.shape[1])", _E_USER)
    check_dim("e_user", e_user, 2, N, "N (e_cand.shape[2])", _E_USER)

    if out is not None:
        check_output("out", out, (B, M, N), dtype, device)
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
                        validate: Optional[bool]) -> tuple[int, int, int, int, int]:
    """Validate one linear call; return ``(B, U, N, K_cand, K_user)``.

    Raises TypeError for a non-tensor or a wrong dtype, ValueError for a wrong rank, size,
    device or activation or an empty tensor (B = 0 is allowed), and, when validation is enabled,
    IndexError for the first idx outside [0, U) (reading idx back to the host)."""
    check_tensor("x_cand", x_cand, ndim=2, dtypes=FLOAT_DTYPES, layout=_X_CAND, empty_batch=True)
    check_tensor("x_user", x_user, ndim=2, dtypes=FLOAT_DTYPES, layout=_X_USER)
    check_tensor("w_cand", w_cand, ndim=2, dtypes=FLOAT_DTYPES, layout=_WL_CAND)
    check_tensor("w_user", w_user, ndim=2, dtypes=FLOAT_DTYPES, layout=_WL_USER)
    names = ["x_cand", "x_user", "w_cand", "w_user"]
    tensors = [x_cand, x_user, w_cand, w_user]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, layout="[N]")
        names.append("bias")
        tensors.append(bias)
    dtype = check_same_dtype(names, tensors)
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
    if out is not None:
        check_output("out", out, (B, N), dtype, device)
    if validation_enabled(validate):
        check_index_range("idx", idx, U, "U", "the batch of x_user")
    return B, U, N, K_cand, K_user
