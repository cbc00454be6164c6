"""IKBO attention: the public op (validation, broadcast direction, dispatch).

``attention(q, kv, idx)`` computes, for each output row b,
``out[b] = softmax(scale * Q_b K_b^T) V_b`` (non-causal), where one side is
looked up through ``idx`` inside the kernel instead of being materialized:

- KV broadcast (target attention): q [B, S_q, H, D] per candidate, k/v
  [U, L, H_kv, D] per user; Q_b = q[b], K_b = k[idx[b]].
- Q broadcast: q [U, S_q, H, D] per user, k/v [B, L, H_kv, D] per candidate;
  Q_b = q[idx[b]], K_b = k[b].

The side whose batch differs from ``len(idx)`` is the broadcast one; when
both match, ``broadcast="kv"`` or ``"q"`` must say which.

``kv_lengths`` (optional) holds one entry per K/V batch row (U for KV
broadcast, B for Q broadcast): only the first ``kv_lengths[r]`` keys of row r
take part. A length of 0 gives output 0 and log-sum-exp -inf. With
validation on, lengths outside [0, L] raise; with it off they are clamped.

``scale`` defaults to 1/sqrt(D); any finite value is accepted whose product with
log2(e) fits in float32 (ValueError past it). The kernel needs scale > 0, so a
scale <= 0 runs it on -q (or on zeros for 0) with |scale| (or 1): the same scores,
for one extra pass over q. A |scale| * log2(e) below float32's normal range runs
as scale 0 (the scaled scores round to 0 there).

Speed depends on the scores only in one extreme: a query row whose scaled scores
in some block of 128 keys exceed every score processed before them by more than
about 83 (blocks run from the last keys to the first) is recomputed exactly on
the CUDA cores: correct, but slow.

An index outside the broadcast side's batch raises ``IndexError`` with
validation on (``validate=True`` or ``IKBO_VALIDATE=1``); with it off, that
candidate's output and log-sum-exp are NaN, nothing is read out of bounds,
and no other candidate is affected.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Optional

import torch

from cute_kernels import checks
from cute_kernels.arch import on_device, require_sm90, sm_count
from cute_kernels.interop import copy_back, forward_only, into_out, library_op, store_target, tma_ready
from cute_kernels.plans import PlanCache

from .worklist import kv_worklist, max_tiles_per_head

SUPPORTED_HEAD_DIMS = (64, 128)
_REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def _kv_list(kv) -> list:
    """kv's tensors: [packed kv] or [k, v] (empty for what is neither; the checks name it)."""
    return [kv] if isinstance(kv, torch.Tensor) else list(kv) if isinstance(kv, (tuple, list)) else []


def _kv_arg(kv_list: list):
    """The ``kv`` argument that :func:`_kv_list` took apart."""
    return kv_list[0] if len(kv_list) == 1 else tuple(kv_list)


def _split_kv(kv):
    if isinstance(kv, torch.Tensor):
        checks.check_tensor("kv", kv, ndim=5, dtypes=_REFERENCE_DTYPES, layout="[batch, L, 2, H_kv, D]")
        if kv.shape[2] != 2:
            raise ValueError(
                f"kv packed as one tensor must have shape [batch, L, 2, H_kv, D], got dimension 2 = {kv.shape[2]}"
            )
        return kv[:, :, 0], kv[:, :, 1]
    if isinstance(kv, (tuple, list)) and len(kv) == 2:
        k, v = kv
        checks.check_tensor("k", k, ndim=4, dtypes=_REFERENCE_DTYPES, layout="[batch, L, H_kv, D]")
        checks.check_tensor("v", v, ndim=4, dtypes=_REFERENCE_DTYPES, layout="[batch, L, H_kv, D]")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        return k, v
    raise TypeError(
        "kv must be a (k, v) pair of [batch, L, H_kv, D] tensors or one packed [batch, L, 2, H_kv, D] tensor, "
        f"got {type(kv).__name__}"
    )


def resolve_problem(q, kv, idx, *, scale, kv_lengths, broadcast, out, validate, op: str) -> Problem:
    """Check every argument (errors name it) and work out the broadcast direction."""
    checks.check_tensor("q", q, ndim=4, dtypes=_REFERENCE_DTYPES, layout="[batch, S_q, H, D]")
    k, v = _split_kv(kv)
    checks.check_same_dtype(["q", "k", "v"], [q, k, v])
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor [B] of int32 or int64, got {type(idx).__name__}")
    checks.check_tensor("idx", idx, ndim=1, dtypes=checks.INDEX_DTYPES, layout="[B]")
    tensors, names = [q, k, v, idx], ["q", "k", "v", "idx"]
    if kv_lengths is not None:
        tensors.append(kv_lengths)
        names.append("kv_lengths")
    checks.check_same_device(names, tensors)

    n_q, s_q, heads, head_dim = q.shape
    kv_batch, kv_len, kv_heads, kv_dim = k.shape
    if kv_dim != head_dim:
        raise ValueError(f"k/v head dimension {kv_dim} differs from q's {head_dim}: q [.., D], k/v [.., D]")
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

    if kv_lengths is not None:
        checks.check_index("kv_lengths", kv_lengths, kv_batch, "k/v batch")
    if out is not None:
        checks.check_output("out", out, (batch, s_q, heads, head_dim), q.dtype, q.device)

    scale = 1.0 / math.sqrt(head_dim) if scale is None else _check_scale(scale)

    p = Problem(q=q, k=k, v=v, idx=idx, kv_lengths=kv_lengths, direction=direction, batch=batch,
                kv_batch=kv_batch, s_q=s_q, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                kv_len=kv_len, scale=float(scale))
    if checks.validation_enabled(validate):
        side = "k/v batch (U)" if direction == "kv" else "q batch (U)"
        checks.check_index_range("idx", idx, p.broadcast_batch, side)
        if kv_lengths is not None:
            checks.check_index_range("kv_lengths", kv_lengths, kv_len + 1, "L + 1")
    return p


def _check_scale(scale) -> float:
    """``scale`` as a float: a finite real whose product with log2(e) fits in float32 (the
    kernel takes it in float32)."""
    value = math.nan
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        try:
            value = float(scale)
        except OverflowError:  # an int past float's range
            pass
    if not math.isfinite(value):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    if abs(value) * _LOG2E > _F32_MAX:
        raise ValueError(f"scale {scale!r} is outside float32's range: |scale| * log2(e) must be <= {_F32_MAX:g}")
    return value


# ------------------------------------------------------------------ launch plan
_LOG2E = 1.4426950408889634
_F32_MIN_NORMAL = 2.0**-126
_F32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a call needs that depends only on the argument signature:
    the compiled kernels, the grid, what to allocate and which inputs need a copy."""

    config: object  # FwdConfig: the forward kernel's compile key
    kernel: object  # the compiled forward kernel (TVM-FFI callable)
    worklist: object  # the compiled work-list kernel; None: torch work list (KV) or none needed (Q)
    direction: str
    packed: bool
    copy_q: bool  # strides TMA cannot use (checked once; the base alignment is checked per call)
    copy_k: bool
    copy_v: bool
    idx_contiguous: bool
    idx_int32: bool
    kvl_int32: bool  # kv_lengths is a contiguous int32 vector (usable as is once range-checked)
    out_shape: tuple
    lse_shape: tuple
    dtype: torch.dtype
    device: torch.device
    n_users: int  # U: the batch that idx indexes
    kv_len: int  # L
    cands_per_tile: int
    chunks: int
    n_ctas: int
    default_scale: float
    # int32 work buffers, carved from one allocation: work list or idx copy, then the
    # clamped kv_lengths (absent when the lengths are range-checked int32)
    buf_sizes: tuple
    buf_sizes_kvl: tuple
    buf_len: int
    buf_len_kvl: int


_plans = PlanCache()


def _key(q, kv, idx, kv_lengths, broadcast, return_lse, out, default_scale):
    """The plan's cache key (raises AttributeError/TypeError for arguments no plan is built for)."""
    if isinstance(kv, torch.Tensor):
        kv_key = (kv.dtype, kv.shape, kv.stride(), kv.device)
    elif isinstance(kv, (tuple, list)) and len(kv) == 2:
        k, v = kv
        kv_key = (k.dtype, k.shape, k.stride(), k.device, v.dtype, v.shape, v.stride(), v.device)
    else:
        raise TypeError
    return (
        q.dtype, q.shape, q.stride(), q.device, kv_key, idx.dtype, idx.shape, idx.stride(), idx.device,
        None if kv_lengths is None else (kv_lengths.dtype, kv_lengths.shape, kv_lengths.stride(), kv_lengths.device),
        None if out is None else (out.dtype, out.shape, out.stride(), out.device),
        broadcast, bool(return_lse), default_scale,
    )


def _on_gpu(q) -> bool:
    return isinstance(q, torch.Tensor) and q.is_cuda


def attention(
    q: torch.Tensor,
    kv,
    idx: torch.Tensor,
    *,
    scale: Optional[float] = None,
    kv_lengths: Optional[torch.Tensor] = None,
    broadcast: Optional[str] = None,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
):
    """IKBO flash attention forward; see the module docstring for the semantics.

    Returns ``out`` [B, S_q, H, D] in q's dtype, and with ``return_lse`` also
    the fp32 log-sum-exp [B, H, S_q] (natural log). CPU tensors are evaluated
    by :func:`attention_reference`; CUDA tensors need an sm_90 GPU. ``out``
    (optional): contiguous, any alignment, sharing no memory with the inputs
    (ValueError otherwise); written as torch writes in place (its version counter
    moves; a leaf that requires grad or an inference tensor outside inference mode
    raises RuntimeError; with an autograd node, out takes the result by a recorded copy).

    The arguments are fully checked at the first call with a given signature
    (dtypes, shapes, strides, devices, options); later calls with the same
    signature reuse the launch plan and only check the index ranges (when
    validating; not inside a CUDA-graph capture, where validate=True raises and
    IKBO_VALIDATE does not apply). No host synchronization otherwise; CUDA-graph
    capturable. Under torch.compile a call is traced as one node,
    ``torch.ops.ikbo_fa.attention`` (``out`` is then filled by a copy of its result).
    A ``scale`` <= 0 costs one extra pass over q (see the module docstring).
    The kernel has no backward: with grad mode on and q, k or v requiring grad,
    the outputs' backward raises (use :func:`attention_reference` for gradients).
    """
    if torch.compiler.is_compiling():
        # Traced by torch.compile: the registered op (one node), out= filled by a copy.
        o, lse = torch.ops.ikbo_fa.attention(q, _kv_list(kv), idx, scale, kv_lengths, broadcast, return_lse, validate)
        return into_out(out, (o, lse) if return_lse else o)
    if isinstance(out, torch.Tensor):
        k_v = _kv_list(kv)
        names = ("q", "kv") if len(k_v) == 1 else ("q", "k", "v")
        checks.check_out_target("out", out, (*names, "idx", "kv_lengths"), (q, *k_v, idx, kv_lengths))
    if not _on_gpu(q):
        from .reference import attention_reference

        return attention_reference(q, kv, idx, scale=scale, kv_lengths=kv_lengths, broadcast=broadcast,
                                   return_lse=return_lse, out=out, validate=validate)
    try:
        key = _key(q, kv, idx, kv_lengths, broadcast, return_lse, out, scale is None)
        plan = _plans.get(key)
    except (AttributeError, TypeError, RuntimeError):
        key = plan = None  # not dense tensors (or unhashable options): the full checks raise
    if plan is None:
        plan = _make_plan(q, kv, idx, scale, kv_lengths, broadcast, return_lse, out)
        if key is not None:
            _plans.keep(key, plan)
    scale = plan.default_scale if scale is None else _check_scale(scale)
    if abs(scale) * _LOG2E < _F32_MIN_NORMAL:
        # The kernel takes scale * log2(e) in float32: below its normal range that is 0 (or
        # flushed), and exp2(-inf * 0) is NaN. Every scaled score is 0 there: run it as scale 0.
        scale = 0.0
    if scale <= 0.0:
        # The kernel takes each row's running max over the raw scores, so it needs scale > 0:
        # softmax(scale Q K^T) = softmax(-scale (-Q) K^T), and scale 0 is Q = 0 with scale 1.
        q = torch.zeros_like(q) if scale == 0.0 else torch.neg(q)
        scale = 1.0 if scale == 0.0 else -scale

    validated = checks.validation_enabled(validate)
    if validated:
        side = "k/v batch (U)" if plan.direction == "kv" else "q batch (U)"
        checks.check_index_range("idx", idx, plan.n_users, side)
        if kv_lengths is not None:
            checks.check_index_range("kv_lengths", kv_lengths, plan.kv_len + 1, "L + 1")

    k, v = kv.unbind(2) if plan.packed else kv
    with on_device(plan.device):
        return forward_only(
            "ikbo_fa.attention",
            "ikbo_fa.attention_reference",
            lambda q, k, v, out: _run(plan, q, k, v, idx, kv_lengths, scale, validated, return_lse, out),
            (q, k, v),
            out,
        )


def _attention_shapes(q, kv, idx, scale=None, kv_lengths=None, broadcast=None, return_lse=False, validate=None):
    p = resolve_problem(q, _kv_arg(kv), idx, scale=scale, kv_lengths=kv_lengths,
                        broadcast=broadcast, out=None, validate=False, op="attention")
    lse_shape = (p.batch, p.heads, p.s_q) if return_lse else (0,)
    return q.new_empty((p.batch, p.s_q, p.heads, p.head_dim)), q.new_empty(lse_shape, dtype=torch.float32)


@library_op("ikbo_fa::attention", "ikbo_fa.attention", "ikbo_fa.attention_reference", _attention_shapes)
def _attention_op(
    q: torch.Tensor,
    kv: list[torch.Tensor],
    idx: torch.Tensor,
    scale: Optional[float] = None,
    kv_lengths: Optional[torch.Tensor] = None,
    broadcast: Optional[str] = None,
    return_lse: bool = False,
    validate: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.ikbo_fa.attention``: what torch.compile traces a call of :func:`attention` as.
    ``kv`` is [packed kv] or [k, v]; without ``return_lse`` the second result is empty."""
    res = attention(q, _kv_arg(kv), idx, scale=scale, kv_lengths=kv_lengths,
                    broadcast=broadcast, return_lse=return_lse, validate=validate)
    return res if return_lse else (res, q.new_empty((0,), dtype=torch.float32))


def _run(plan: _Plan, q, k, v, idx, kv_lengths, scale: float, validated: bool, return_lse: bool, out):
    """Launch the plan's kernels on checked inputs (k, v unpacked; scale > 0)."""
    q = tma_ready(q, not plan.copy_q)
    k = tma_ready(k, not plan.copy_k)
    v = tma_ready(v, not plan.copy_v)
    device = plan.device
    if out is None:
        out = torch.empty(plan.out_shape, dtype=plan.dtype, device=device)
    target = store_target(out, plan.out_shape)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=device) if return_lse else None

    convert_kvl = kv_lengths is not None and not (validated and plan.kvl_int32)
    sizes, n = (plan.buf_sizes_kvl, plan.buf_len_kvl) if convert_kvl else (plan.buf_sizes, plan.buf_len)
    bufs = None
    if n:
        buf = torch.empty(n, dtype=torch.int32, device=device)
        bufs = buf.split_with_sizes(sizes) if len(sizes) > 1 else (buf,)
    cand_start = tile_start = None
    if plan.direction == "kv":
        idx_k = idx if plan.idx_contiguous else idx.contiguous()
        if plan.worklist is not None:
            cand, cand_start, tile_start = bufs[0], bufs[1], bufs[2]
            plan.worklist(idx_k, cand, cand_start, tile_start, plan.n_users, plan.cands_per_tile, plan.chunks)
        else:
            cand, cand_start, tile_start = kv_worklist(idx_k, plan.n_users, plan.cands_per_tile, plan.chunks)
    elif plan.idx_int32 and plan.idx_contiguous:
        cand = idx  # the kernel writes NaN for entries outside [0, U)
    else:
        # A contiguous int32 copy. int64: range-checked values convert exactly; otherwise
        # out-of-range entries become -1 (or U) first, so the kernel writes NaN for them.
        cand = bufs[0]
        cand.copy_(idx if validated or plan.idx_int32 else idx.clamp(-1, plan.n_users))
    kvl = kv_lengths
    if convert_kvl:
        kvl = bufs[-1]
        if validated:
            kvl.copy_(kv_lengths)
        elif plan.kvl_int32:
            torch.clamp(kv_lengths, 0, plan.kv_len, out=kvl)
        else:
            kvl.copy_(kv_lengths.clamp(0, plan.kv_len))
    plan.kernel(q, k, v, target, lse, cand, cand_start, tile_start, kvl, scale * _LOG2E, scale, plan.n_ctas)
    copy_back(out, target)
    return (out, lse) if return_lse else out


def _tma_ok(t: torch.Tensor) -> bool:
    """Last dim contiguous, other strides multiples of 16 bytes (the base alignment is checked
    per call; size-1 dims get dense strides from ``tma_ready``)."""
    return t.stride(-1) == 1 and all(
        n == 1 or (s * t.element_size()) % 16 == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1])
    )


def _fwd_kernel(cfg):
    from cute_kernels.compile import kernel_cache

    return kernel_cache.get(("ikbo_fa.fwd_sm90", cfg), lambda: compile_config(cfg), package="ikbo_fa").fn


def _worklist_kernel(idx_dtype: torch.dtype):
    from .worklist_sm90 import worklist_kernel

    return worklist_kernel(idx_dtype).fn


def _worklist_fits(num_users: int) -> bool:
    from .worklist_sm90 import fits

    return fits(num_users)


def _make_plan(q, kv, idx, scale, kv_lengths, broadcast, return_lse, out) -> _Plan:
    """Check every argument (the first call with a signature) and build its launch plan."""
    from .fwd_sm90 import row_packing

    p = resolve_problem(q, kv, idx, scale=scale, kv_lengths=kv_lengths, broadcast=broadcast,
                        out=out, validate=False, op="attention")
    device = p.q.device
    require_sm90(device, "attention")
    if p.q.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"q, k, v must be float16 or bfloat16 on the GPU, got {str(p.q.dtype).replace('torch.', '')}")
    if p.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head dimension D = {p.head_dim} is not supported by the sm_90 kernel (D must be one of "
            f"{SUPPORTED_HEAD_DIMS}); call ikbo_fa.attention_reference for other head dimensions"
        )
    cfg = kernel_config(p, return_lse)
    _, slots_per_wg, chunks = row_packing(p.s_q)
    n_users = p.broadcast_batch
    idx_contiguous = p.idx.is_contiguous()
    idx_int32 = p.idx.dtype == torch.int32
    worklist = None
    sizes = []
    if p.direction == "kv":
        per_tile = 2 * slots_per_wg if p.s_q <= 64 else 1
        bound = max_tiles_per_head(p.batch, n_users, per_tile, chunks)
        # IKBO_FA_WORKLIST=torch selects the torch work list (read when a plan is built).
        if os.environ.get("IKBO_FA_WORKLIST", "kernel") != "torch" and _worklist_fits(n_users):
            worklist = _worklist_kernel(p.idx.dtype)
            sizes += [p.batch, n_users + 2, n_users + 2]  # order, cand_start, tile_start
    else:
        per_tile = 1
        bound = p.batch * chunks
        if not (idx_int32 and idx_contiguous):
            sizes.append(p.batch)  # int32 copy of idx
    kvl_int32 = p.kv_lengths is not None and p.kv_lengths.dtype == torch.int32 and p.kv_lengths.is_contiguous()
    return _Plan(
        config=cfg,
        kernel=_fwd_kernel(cfg),
        worklist=worklist,
        direction=p.direction,
        packed=isinstance(kv, torch.Tensor),
        copy_q=not _tma_ok(p.q),
        copy_k=not _tma_ok(p.k),
        copy_v=not _tma_ok(p.v),
        idx_contiguous=idx_contiguous,
        idx_int32=idx_int32,
        kvl_int32=kvl_int32,
        out_shape=(p.batch, p.s_q, p.heads, p.head_dim),
        lse_shape=(p.batch, p.heads, p.s_q),
        dtype=p.q.dtype,
        device=device,
        n_users=n_users,
        kv_len=p.kv_len,
        cands_per_tile=per_tile,
        chunks=chunks,
        n_ctas=max(1, min(sm_count(device), bound * p.heads)),
        default_scale=1.0 / math.sqrt(p.head_dim),
        buf_sizes=tuple(sizes),
        buf_sizes_kvl=(*sizes, p.kv_batch),
        buf_len=sum(sizes),
        buf_len_kvl=sum(sizes) + p.kv_batch,
    )


def kernel_config(p: Problem, return_lse: bool):
    from .fwd_sm90 import FwdConfig

    return FwdConfig(
        dtype="bf16" if p.q.dtype == torch.bfloat16 else "fp16",
        head_dim=p.head_dim,
        s_q=p.s_q,
        direction=p.direction,
        has_kv_lengths=p.kv_lengths is not None,
        return_lse=return_lse,
        # IKBO_FA_OVERLAP=0 selects the one-block-at-a-time main loop (a diagnostic switch,
        # read when a signature's launch plan is built).
        overlap=os.environ.get("IKBO_FA_OVERLAP", "1") != "0",
    )


def _shipped():
    from .fwd_sm90 import FwdConfig

    cfgs = []
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            cfgs.append(FwdConfig(dtype, d, 64, "kv", False, False))
    cfgs += [
        FwdConfig("bf16", 128, 64, "kv", True, True),
        FwdConfig("bf16", 128, 32, "kv", False, False),
        FwdConfig("bf16", 128, 128, "kv", False, False),
        FwdConfig("bf16", 128, 64, "q", False, False),
        FwdConfig("bf16", 128, 64, "kv", True, True, overlap=False),
    ]
    return tuple(cfgs)


def __getattr__(name):
    # SHIPPED_CONFIGS imports the kernel module (and cutlass) lazily.
    if name == "SHIPPED_CONFIGS":
        return _shipped()
    raise AttributeError(name)


def compile_config(cfg, keep_ptx: bool = False, ptxas_report: bool = False):
    """Compile one static configuration for sm_90a (no GPU needed) -> CompiledKernel."""
    from .fwd_sm90 import compile_fwd

    return compile_fwd(cfg, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
