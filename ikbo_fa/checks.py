"""Input checks of ``ikbo_fa.attention`` and its reference: every error names the argument, its
shape and the expected layout, and works out the broadcast direction.

    KV broadcast: q [B, S_q, H, D], k / v [U, L, H_kv, D] (or kv [U, L, 2, H_kv, D])
    Q broadcast:  q [U, S_q, H, D], k / v [B, L, H_kv, D]
    idx [B] (int32 or int64), kv_lengths [k/v batch], out [B, S_q, H, D]
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch

from cute_kernels import checks

from .config import SUPPORTED_HEAD_DIMS

# The op (on every device) takes what the kernel takes; the reference also takes float32.
OP_DTYPES = checks.FLOAT_DTYPES
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

LOG2E = 1.4426950408889634
F32_MIN_NORMAL = 2.0**-126
F32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass
class Problem:
    """A validated call: tensors as the kernel sees them plus the sizes."""

    q: torch.Tensor
    k: torch.Tensor  # [kv_batch, L, H_kv, D] (a view into packed kv when packed)
    v: torch.Tensor
    idx: torch.Tensor
    kv_lengths: Optional[torch.Tensor]
    direction: str  # "kv": K/V broadcast (looked up by idx); "q": Q broadcast
    batch: int  # B = len(idx) = output batch
    kv_batch: int
    s_q: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_len: int
    scale: float

    @property
    def broadcast_batch(self) -> int:
        """Size of the side that idx indexes (U)."""
        return self.kv_batch if self.direction == "kv" else self.q.shape[0]

    @property
    def broadcast_side(self) -> str:
        """What idx indexes, for messages."""
        return "the batch of k and v" if self.direction == "kv" else "the batch of q"


def kv_list(kv) -> list:
    """kv's tensors: [packed kv] or [k, v] (empty for what is neither; the checks name it)."""
    return [kv] if isinstance(kv, torch.Tensor) else list(kv) if isinstance(kv, (tuple, list)) else []


def kv_arg(tensors: list):
    """The ``kv`` argument that :func:`kv_list` took apart."""
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def split_kv(kv, dtypes=REFERENCE_DTYPES):
    """(k, v) from a (k, v) pair or one packed [batch, L, 2, H_kv, D] tensor (checked)."""
    if isinstance(kv, torch.Tensor):
        checks.check_tensor("kv", kv, ndim=5, dtypes=dtypes, layout="[batch, L, 2, H_kv, D]", empty_batch=True)
        if kv.shape[2] != 2:
            raise ValueError(
                f"kv packed as one tensor must have shape [batch, L, 2, H_kv, D], got dimension 2 = {kv.shape[2]}"
            )
        return kv[:, :, 0], kv[:, :, 1]
    if isinstance(kv, (tuple, list)) and len(kv) == 2:
        k, v = kv
        checks.check_tensor("k", k, ndim=4, dtypes=dtypes, layout="[batch, L, H_kv, D]", empty_batch=True)
        checks.check_tensor("v", v, ndim=4, dtypes=dtypes, layout="[batch, L, H_kv, D]", empty_batch=True)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        return k, v
    raise TypeError(
        "kv must be a (k, v) pair of [batch, L, H_kv, D] tensors or one packed [batch, L, 2, H_kv, D] tensor, "
        f"got {type(kv).__name__}"
    )


def resolve_problem(q, kv, idx, *, scale, kv_lengths, broadcast, out, validate, op: str) -> Problem:
    """Check every argument (errors name it) and work out the broadcast direction.

    ``op`` is "attention" (the op: on every device only what the sm_90 kernel takes, fp16 / bf16
    and D in SUPPORTED_HEAD_DIMS) or "attention_reference" (also float32 and any D)."""
    dtypes = OP_DTYPES if op == "attention" else REFERENCE_DTYPES
    checks.check_tensor("q", q, ndim=4, dtypes=dtypes, layout="[batch, S_q, H, D]", empty_batch=True)
    k, v = split_kv(kv, dtypes)
    checks.check_same_dtype(["q", "k", "v"], [q, k, v])
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor [B] of int32 or int64, got {type(idx).__name__}")
    checks.check_tensor("idx", idx, ndim=1, dtypes=checks.INDEX_DTYPES, layout="[B]", empty_batch=True)
    tensors, names = [q, k, v, idx], ["q", "k", "v", "idx"]
    if kv_lengths is not None:
        tensors.append(kv_lengths)
        names.append("kv_lengths")
    checks.check_same_device(names, tensors)

    n_q, s_q, heads, head_dim = q.shape
    kv_batch, kv_len, kv_heads, kv_dim = k.shape
    if kv_dim != head_dim:
        raise ValueError(f"k/v head dimension {kv_dim} differs from q's {head_dim}: q [.., D], k/v [.., D]")
    if op == "attention" and head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head dimension D = {head_dim} is not supported by the sm_90 kernel (D must be one of "
            f"{SUPPORTED_HEAD_DIMS}); call ikbo_fa.attention_reference for other head dimensions"
        )
    if heads % kv_heads != 0:
        raise ValueError(f"q has H = {heads} heads, not a multiple of k/v's H_kv = {kv_heads}")
    batch = idx.shape[0]

    if broadcast is not None and broadcast not in ("kv", "q"):
        raise ValueError(f"broadcast must be None, 'kv' or 'q', got {broadcast!r}")
    q_matches, kv_matches = n_q == batch, kv_batch == batch
    if broadcast is None:
        if q_matches and not kv_matches:
            direction = "kv"
        elif kv_matches and not q_matches:
            direction = "q"
        elif q_matches and kv_matches:
            raise ValueError(
                f"q and k/v both have batch {batch} = len(idx): pass broadcast='kv' (k/v looked up by idx) "
                "or broadcast='q' (q looked up by idx)"
            )
        else:
            raise ValueError(
                f"idx has length {batch} but neither q (batch {n_q}) nor k/v (batch {kv_batch}) has that batch: "
                "one side must be per candidate (batch = len(idx))"
            )
    else:
        direction = broadcast
        per_candidate = ("q", n_q) if direction == "kv" else ("k/v", kv_batch)
        if per_candidate[1] != batch:
            raise ValueError(
                f"broadcast={direction!r} needs {per_candidate[0]} batch = len(idx) = {batch}, got {per_candidate[1]}"
            )
    looked_up = ("k/v", kv_batch) if direction == "kv" else ("q", n_q)
    if looked_up[1] == 0:
        raise ValueError(f"{looked_up[0]} must not be empty: idx looks its batch up, got batch 0")

    if kv_lengths is not None:
        checks.check_index("kv_lengths", kv_lengths, kv_batch, "k/v batch")
    if out is not None:
        checks.check_output("out", out, (batch, s_q, heads, head_dim), q.dtype, q.device)

    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale(scale)

    p = Problem(q=q, k=k, v=v, idx=idx, kv_lengths=kv_lengths, direction=direction, batch=batch,
                kv_batch=kv_batch, s_q=s_q, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                kv_len=kv_len, scale=float(scale))
    if checks.validation_enabled(validate):
        check_ranges(idx, kv_lengths, p.broadcast_batch, p.broadcast_side, kv_len)
    return p


def check_ranges(idx, kv_lengths, n_users: int, side: str, kv_len: int) -> None:
    """idx in [0, U) and kv_lengths in [0, L] (synchronizes with the device)."""
    checks.check_index_range("idx", idx, n_users, "U", side)
    if kv_lengths is not None:
        checks.check_index_range("kv_lengths", kv_lengths, kv_len + 1, "L + 1", "one more than the keys per row")


def check_scale(scale) -> float:
    """``scale`` as a float: a finite real (TypeError for what is no real number, ValueError for
    inf or NaN) whose product with log2(e) fits in float32 (the kernel takes it in float32)."""
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except OverflowError:  # an int past float's range
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {scale!r}")
    if abs(value) * LOG2E > F32_MAX:
        raise ValueError(f"scale {scale!r} is outside float32's range: |scale| * log2(e) must be <= {F32_MAX:g}")
    return value
