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

Jagged histories: with ``kv_offsets`` [R + 1] (int32 or int64; R the K/V
batch), k and v are [total_L, H_kv, D] (or kv [total_L, 2, H_kv, D]) and row
r's keys are rows kv_offsets[r] : kv_offsets[r + 1], as FA varlen's
``cu_seqlens_k`` and FBGEMM's jagged tensors lay them out; nothing is padded.
``max_kv_len`` (optional) bounds every row's length (keys past it are not
read). With validation on, offsets that do not start at 0, decrease or end past
total_L raise, naming the first bad position; with it off they are clamped
into k and v (``attention_reference`` says how).

``scale`` defaults to 1/sqrt(D); any finite value is accepted whose product with
log2(e) fits in float32 (ValueError past it, and for inf or NaN). The kernel needs scale > 0, so a
scale <= 0 runs it on -q (or on zeros for 0) with |scale| (or 1): the same scores,
for one extra pass over q. A |scale| * log2(e) below float32's normal range runs
as scale 0 (the scaled scores round to 0 there).

Speed depends on the scores only in one extreme: a query row whose scaled scores
in some block of keys (128, or 192 at D 64 over long padded K/V) exceed every
score processed before them by more than about 83 (blocks run from the last keys
to the first) is recomputed exactly on the CUDA cores: correct, but slow.

On every device the op takes what the sm_90 kernel takes: fp16 or bf16, D in {64, 128}
(``attention_reference`` also takes float32 and any D). A batch of 0 candidates gives
empty results.

KV broadcast groups the candidates by user before the kernel (the work list, one small
launch). ``work_list(idx, U, S_q)`` builds that grouping once for several calls on the same idx
(``attention(..., work_list=)``), which then launch only the kernel.

An index outside the broadcast side's batch raises ``IndexError`` with
validation on (``validate=True`` or ``IKBO_VALIDATE=1``); with it off, that
candidate's output and log-sum-exp are NaN, nothing is read out of bounds,
and no other candidate is affected.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import weakref
from typing import Optional

import torch

from cute_kernels import checks
from cute_kernels.arch import max_active_clusters, on_device, require_sm90, sm_count
from cute_kernels.compile import kernel_cache
from cute_kernels.interop import copy_back, forward_only, into_out, library_op, store_target, tma_ready
from cute_kernels.plans import PlanCache, on_gpu, plan_key

from .checks import (
    F32_MIN_NORMAL,
    LOG2E,
    check_max_kv_len,
    check_offsets,
    check_given_work_list,
    check_idx,
    check_ranges,
    check_return_lse,
    check_scale,
    check_work_list,
    check_work_list_fresh,
    check_work_list_values,
    kv_arg,
    kv_list,
    resolve_problem,
)
from .config import MAX_PREFETCH_BLOCKS, MAX_SPLITS, SUPPORTED_HEAD_DIMS, WHOLE_ROW, kernel_config, row_packing
from .fwd_args import FwdScalars, FwdTensors, FwdWorkList, WorkListScalars
from .fwd_compile import compile_config
from .policy import DEFAULT_POLICY, AttentionPolicy
from .reference import evaluate, jagged_rows
from .worklist import TILE_ROWS, WALK_WORDS, WorkList, kv_tile_order, kv_worklist, max_tiles_per_head

# ------------------------------------------------------------------ launch plan
@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a call needs that depends only on the argument signature:
    the compiled kernels, the grid, what to allocate and which inputs need a copy."""

    config: object  # AttentionConfig: the forward kernel's compile key
    policy: AttentionPolicy  # the launch choices it was built with
    kernel: object  # the compiled forward kernel (TVM-FFI callable)
    worklist: object  # the compiled work-list kernel; None: torch work list (KV) or none needed (Q)
    ordered: bool  # KV over histories of their own lengths: the tiles longest first (a perm buffer)
    direction: str
    packed: bool
    copy_q: bool  # strides TMA cannot use (checked once; the base alignment is checked per call)
    copy_k: bool
    copy_v: bool
    pair_dim: int  # the k / v dimension of packed kv
    total_kv: int  # key rows of jagged k / v
    idx_contiguous: bool
    idx_int32: bool
    rows_int32: bool  # kv_lengths / kv_offsets is a contiguous int32 vector (usable as is once range-checked)
    out_shape: tuple
    lse_shape: tuple
    dtype: torch.dtype
    device: torch.device
    n_users: int  # U: the batch that idx indexes
    kv_len: int  # L
    rows_per_cand: int  # KV: query rows of a candidate in its user's run (S_q)
    tile_rows: int  # KV: query rows of a tile (the configuration's tile_m), as the work list counts them
    n_ctas: int
    merge: object  # split_kv: the compiled merge of the splits (SplitMergeSm90); None otherwise
    n_splits: int  # splits of each row's keys (1: no split; split_pair: 2, merged in the kernel)
    split_keys: int  # keys per split (a multiple of 128; 0 without split)
    prefetch_blocks: int  # K/V blocks per CTA prefetched into L2 before the work list is done
    default_scale: float
    # int32 work buffers, carved from one allocation: work list or idx copy, then kv_lengths
    # (clamped) or kv_offsets as int32 where the given vector cannot be used as it is
    buf_sizes: tuple
    buf_sizes_rows: tuple
    buf_len: int
    buf_len_rows: int


_plans = PlanCache()


def attention(
    q: torch.Tensor,
    kv,
    idx: torch.Tensor,
    *,
    scale: Optional[float] = None,
    kv_lengths: Optional[torch.Tensor] = None,
    kv_offsets: Optional[torch.Tensor] = None,
    max_kv_len: Optional[int] = None,
    broadcast: Optional[str] = None,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
    work_list: Optional[WorkList] = None,
    policy: Optional[AttentionPolicy] = None,
):
    """IKBO flash attention forward; see the module docstring for the semantics.

    Returns ``out`` [B, S_q, H, D] in q's dtype, and with ``return_lse`` also
    the fp32 log-sum-exp [B, H, S_q] (natural log). CPU tensors are evaluated
    by the PyTorch reference; CUDA tensors need an sm_90 GPU. ``out``
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
    ``work_list`` (KV broadcast): the grouping of idx's candidates by user, built once by
    :func:`work_list` for several calls on the same idx; the call then launches none of its own.
    ``policy``: the launch choices (``ikbo_fa.AttentionPolicy``; None: ``DEFAULT_POLICY``), for
    benchmarks and tests of a variant; the results agree to rounding whatever it holds (traced by
    torch.compile, the registered op runs DEFAULT_POLICY).
    """
    check_return_lse(return_lse)
    policy = _check_policy(policy)
    if torch.compiler.is_compiling():
        # Traced by torch.compile: the registered op (one node), out= filled by a copy.
        wl = () if work_list is None else (work_list.rows_per_cand, work_list.order, work_list.cand_start,
                                           work_list.tile_start, work_list.grouped, work_list.perm,
                                           work_list.tile_rows)
        o, lse = torch.ops.ikbo_fa.attention(q, kv_list(kv), idx, scale, kv_lengths, broadcast, return_lse, validate,
                                             kv_offsets, max_kv_len, *wl)
        return into_out(out, (o, lse) if return_lse else o)
    if isinstance(out, torch.Tensor):
        k_v = kv_list(kv)
        names = ("q", "kv") if len(k_v) == 1 else ("q", "k", "v")
        checks.check_out_target("out", out, (*names, "idx", "kv_lengths", "kv_offsets"),
                                (q, *k_v, idx, kv_lengths, kv_offsets))
    if not on_gpu(q) or (isinstance(idx, torch.Tensor) and idx.shape[0] == 0) or _no_keys(kv, kv_offsets):
        # The reference, on what the kernel takes; on the GPU only for an empty batch or jagged
        # K/V without a key (nothing to launch, no TMA box to describe).
        p = resolve_problem(q, kv, idx, scale=scale, kv_lengths=kv_lengths, kv_offsets=kv_offsets,
                            max_kv_len=max_kv_len, broadcast=broadcast, out=out, validate=validate, op="attention",
                            return_lse=return_lse)
        require_sm90(p.q.device, "attention")
        if work_list is not None:
            check_given_work_list(work_list, p, validate)
        return evaluate(p, return_lse, out)
    plan = _plan_for(q, kv, idx, scale, kv_lengths, kv_offsets, max_kv_len, broadcast, return_lse, out, work_list,
                     policy)
    if work_list is not None:
        check_work_list_fresh(work_list, idx)
    scale = plan.default_scale if scale is None else check_scale(scale)
    if abs(scale) * LOG2E < F32_MIN_NORMAL:
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
        side = "the batch of k and v" if plan.direction == "kv" else "the batch of q"
        check_ranges(idx, kv_lengths, plan.n_users, side, plan.kv_len)
        if kv_offsets is not None:
            check_offsets(kv_offsets, plan.total_kv, max_kv_len)
        if work_list is not None:
            check_work_list_values(work_list, idx)

    k, v = kv.unbind(plan.pair_dim) if plan.packed else kv
    if kv_offsets is not None:  # the kernel reads jagged K/V as one packed batch row
        k, v = k.unsqueeze(0), v.unsqueeze(0)
    with on_device(plan.device):
        return forward_only(
            "ikbo_fa.attention",
            "ikbo_fa.attention_reference",
            lambda q, k, v, out: _run(plan, q, k, v, idx, kv_lengths, kv_offsets, scale, validated, return_lse,
                                      out, work_list),
            (q, k, v),
            out,
        )


def _plan_for(q, kv, idx, scale, kv_lengths, kv_offsets, max_kv_len, broadcast, return_lse, out, work_list,
              policy: AttentionPolicy) -> "_Plan":
    """The cached launch plan of a call's signature and policy (built, with the full checks, at
    the first call)."""
    try:
        # The policy beside the signature, as one tuple (not walked item by item: 0.2 us).
        key = (plan_key(q, kv, idx, kv_lengths, kv_offsets, max_kv_len, out, broadcast, bool(return_lse),
                        scale is None), policy, _work_list_key(work_list))
        plan = _plans.get(key)
    except TypeError:
        key = plan = None  # unhashable options: the full checks raise
    if plan is None:
        plan = _make_plan(q, kv, idx, scale, kv_lengths, kv_offsets, max_kv_len, broadcast, return_lse, out,
                          work_list, policy)
        if key is not None:
            _plans.keep(key, plan)
    return plan


def launch_plan(q, kv, idx, *, scale=None, kv_lengths=None, kv_offsets=None, max_kv_len=None, broadcast=None,
                return_lse=False, out=None, work_list=None, policy=None) -> "_Plan":
    """The launch plan :func:`attention` uses for these arguments on the GPU path (what it
    compiled, the grid, the splits), from the same cache; for tests and tools."""
    return _plan_for(q, kv, idx, scale, kv_lengths, kv_offsets, max_kv_len, broadcast, return_lse, out, work_list,
                     _check_policy(policy))


def _check_policy(policy) -> AttentionPolicy:
    if policy is None:
        return DEFAULT_POLICY
    if not isinstance(policy, AttentionPolicy):
        raise TypeError(f"policy must be an ikbo_fa.AttentionPolicy or None, got {type(policy).__name__}")
    return policy


def _work_list_key(work_list) -> Optional[tuple]:
    """A given work list's part of a plan's key: what check_work_list compares with the call (a
    WorkList's arrays are contiguous int32 vectors on one device by construction)."""
    if work_list is None:
        return None
    if not isinstance(work_list, WorkList):
        raise TypeError("not a WorkList")  # the full checks name it
    return (work_list.rows_per_cand, work_list.order.shape[0], work_list.cand_start.shape[0],
            work_list.perm is None, work_list.order.device, work_list.tile_rows)


def work_list(
    idx: torch.Tensor,
    num_users: int,
    s_q: int = 1,
    *,
    kv_lengths: Optional[torch.Tensor] = None,
    kv_offsets: Optional[torch.Tensor] = None,
    max_kv_len: Optional[int] = None,
    validate: Optional[bool] = None,
    policy: Optional[AttentionPolicy] = None,
    head_dim: Optional[int] = None,
    heads: Optional[int] = None,
) -> WorkList:
    """The candidates of ``idx`` grouped by user, for KV-broadcast :func:`attention` calls on that
    idx (``work_list=``): the grouping each such call otherwise launches before its kernel. Build
    it once where several calls share idx, U and S_q (layers, head groups, behaviour sequences of
    one user batch) and pass it to each.

    ``num_users``: U, the batch of k and v (jagged: ``len(kv_offsets) - 1``); ``s_q``: query rows
    per candidate. Calls with ``kv_lengths`` or ``kv_offsets`` run their tiles longest first: pass
    the same kind here (with ``max_kv_len`` where the calls have it). Their values set only that
    order, so a call whose lengths differ gets the same results from it, in another tile order.
    With validation on (``validate=True`` or ``IKBO_VALIDATE=1``), an index outside [0, U) raises
    IndexError, as attention does; otherwise its candidates form the group that writes NaN.

    Calls that share a work list built with lengths or offsets take their tiles from a counter
    it holds: run them one after another on a stream (as layers do), not on two streams at once.

    It holds the grouping of idx's values now: rebuild it after writing idx. A call checks that
    it was not built from the same tensor before an in-place write (where torch counts versions)
    and, with validation on, that it groups idx as idx holds then. Asynchronous, no host
    synchronization; CUDA-graph capturable (capture it with the calls that use it). On a CUDA
    device one launch of the work-list kernel where U + 1 groups fit its shared memory (else a few
    torch ops); elsewhere the torch definition (``ikbo_fa.worklist.kv_worklist``). ``policy``:
    as in :func:`attention` (its ``worklist_kernel``, and the tile rows below).

    ``head_dim``, ``heads``: the D and H of the calls that will share it (``heads`` required with
    ``head_dim``). A D 64 call on its own may run tiles of 192 query rows
    (``AttentionPolicy.d64_tile_m``, chosen with H); with ``head_dim=64`` the work list counts the
    tiles such calls of ``heads`` heads run (``WorkList.tile_rows``); a list of 192-row tiles only
    D 64 calls take. Without ``head_dim``, it counts 128-row tiles, which every call takes and D 64
    calls then keep.
    """
    policy = _check_policy(policy)
    n_users, s_q = _count("num_users", num_users, 1), _count("s_q", s_q, 1)
    check_idx(idx)
    if head_dim is not None and (isinstance(head_dim, bool) or head_dim not in SUPPORTED_HEAD_DIMS):
        raise ValueError(f"head_dim must be None or one of {SUPPORTED_HEAD_DIMS} (the calls' D), got {head_dim!r}")
    if head_dim is not None and heads is None:
        raise ValueError("head_dim goes with heads, the H of the calls (their tiles are chosen with it)")
    heads = 1 if heads is None else _count("heads", heads, 1)
    tile_rows = _list_tile_rows(idx, n_users, s_q, head_dim, heads, policy)
    if kv_lengths is not None and kv_offsets is not None:
        raise ValueError("kv_lengths and kv_offsets were both given: pass the kind the attention calls take")
    if check_max_kv_len(max_kv_len) is not None and kv_offsets is None:
        raise ValueError(f"max_kv_len = {max_kv_len} goes with kv_offsets (jagged k/v), as in attention")
    rows = kv_lengths if kv_lengths is not None else kv_offsets
    if rows is not None:
        name, n, what = ("kv_lengths", n_users, "U") if kv_lengths is not None else ("kv_offsets", n_users + 1, "U + 1")
        checks.check_index(name, rows, n, what)
        checks.check_same_device(["idx", name], [idx, rows])
    if checks.validation_enabled(validate):
        checks.check_index_range("idx", idx, n_users, "U", "the batch of k and v")
    kernel = None
    if on_gpu(idx) and policy.worklist_kernel and _worklist_fits(n_users) and idx.shape[0] > 0:
        require_sm90(idx.device, "work_list")
        kernel = _worklist_kernel(idx.dtype, None if rows is None else "lengths" if kv_lengths is not None
                                  else "offsets", tile_rows)
    b = idx.shape[0]
    with on_device(idx.device):
        rows32, parts = rows, None
        if kernel is not None:
            # Separate tensors (no views of one buffer): the registered op returns them as they are.
            sizes = [b, n_users + 2, n_users + 2, 1] + ([] if rows is None else [n_users + 1 + WALK_WORDS,
                                                                                 rows.shape[0]])
            parts = [torch.empty(n, dtype=torch.int32, device=idx.device) for n in sizes]
            if rows is not None:  # the kernel takes int32 (values only order the tiles)
                rows32 = parts[-1]
                rows32.copy_(rows.clamp(0, _INT32_MAX))
        found = _group(idx.contiguous(), n_users, s_q, kernel, parts, rows32, kv_lengths is not None, _INT32_MAX,
                       _INT32_MAX if max_kv_len is None else min(int(max_kv_len), _INT32_MAX), tile_rows)
    version = None if torch.is_inference(idx) else idx._version
    # WorkList makes its own view of the counter
    return WorkList(*found[:5], s_q, tile_rows=tile_rows, source=weakref.ref(idx), version=version)


_INT32_MAX = 2**31 - 1


def _list_tile_rows(idx: torch.Tensor, n_users: int, s_q: int, head_dim: Optional[int], heads: int,
                    policy: AttentionPolicy) -> int:
    """The tile rows a work list counts: what a KV-broadcast call of ``head_dim`` (None: any D)
    and ``heads`` on this idx would run (problem_tile_rows at D 64 on the GPU; else 128, and on
    the CPU, whose path reads no tiles)."""
    if head_dim == 64 and on_gpu(idx):
        return problem_tile_rows(idx.shape[0], n_users, s_q, heads, sm_count(idx.device), policy)
    return TILE_ROWS


def _count(name: str, value, least: int) -> int:
    """``value`` as an int >= ``least`` (TypeError for what is no integer, bools included)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if int(value) < least:
        raise ValueError(f"{name} must be >= {least}, got {int(value)}")
    return int(value)


def _no_keys(kv, kv_offsets) -> bool:
    """Jagged K/V of no key rows at all (every output row is 0)."""
    if kv_offsets is None:
        return False
    k = kv_list(kv)[:1]
    return bool(k) and isinstance(k[0], torch.Tensor) and k[0].dim() >= 1 and k[0].shape[0] == 0


def _attention_shapes(q, kv, idx, scale=None, kv_lengths=None, broadcast=None, return_lse=False, validate=None,
                      kv_offsets=None, max_kv_len=None, work_list_rows=0, wl_order=None, wl_cand_start=None,
                      wl_tile_start=None, wl_grouped=None, wl_perm=None, work_list_tile_rows=128):
    p = resolve_problem(q, kv_arg(kv), idx, scale=scale, kv_lengths=kv_lengths, kv_offsets=kv_offsets,
                        max_kv_len=max_kv_len, broadcast=broadcast, out=None, validate=False, op="attention")
    lse_shape = (p.batch, p.heads, p.s_q) if return_lse else (0,)
    return q.new_empty((p.batch, p.s_q, p.heads, p.head_dim)), q.new_empty(lse_shape, dtype=torch.float32)


def _work_list_shapes(idx, num_users, s_q, kv_lengths=None, kv_offsets=None, max_kv_len=None, validate=None,
                      head_dim=None, heads=None):
    ordered = kv_lengths is not None or kv_offsets is not None
    return tuple(idx.new_empty((n,), dtype=torch.int32)
                 for n in (idx.shape[0], num_users + 2, num_users + 2, 1, num_users + 1 + WALK_WORDS if ordered else 0))


@library_op("ikbo_fa::work_list", "ikbo_fa.work_list", "ikbo_fa.worklist.kv_worklist", _work_list_shapes)
def _work_list_op(
    idx: torch.Tensor,
    num_users: int,
    s_q: int,
    kv_lengths: Optional[torch.Tensor] = None,
    kv_offsets: Optional[torch.Tensor] = None,
    max_kv_len: Optional[int] = None,
    validate: Optional[bool] = None,
    head_dim: Optional[int] = None,
    heads: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.ikbo_fa.work_list``: :func:`work_list` as one graph node (the rewrite pass
    shares one between attention calls on one idx): its arrays, perm empty where it has none.
    The attention calls given them pass ``work_list_tile_rows=0`` where it was built with
    ``head_dim`` and ``heads`` (the tile rows then follow from those, as here)."""
    wl = work_list(idx, num_users, s_q, kv_lengths=kv_lengths, kv_offsets=kv_offsets, max_kv_len=max_kv_len,
                   validate=validate, head_dim=head_dim, heads=heads)
    perm = wl.perm if wl.perm is not None else idx.new_empty((0,), dtype=torch.int32)
    return wl.order, wl.cand_start, wl.tile_start, wl.grouped, perm


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
    kv_offsets: Optional[torch.Tensor] = None,
    max_kv_len: Optional[int] = None,
    work_list_rows: int = 0,
    wl_order: Optional[torch.Tensor] = None,
    wl_cand_start: Optional[torch.Tensor] = None,
    wl_tile_start: Optional[torch.Tensor] = None,
    wl_grouped: Optional[torch.Tensor] = None,
    wl_perm: Optional[torch.Tensor] = None,
    work_list_tile_rows: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.ikbo_fa.attention``: what torch.compile traces a call of :func:`attention` as.
    ``kv`` is [packed kv] or [k, v]; a work list comes as its S_q (``work_list_rows``, 0: none),
    its arrays and its tile rows (0: those ``torch.ops.ikbo_fa.work_list`` counts when given this
    call's D and H, as the rewrite pass builds a shared one); without ``return_lse`` the second
    result is empty."""
    wl = None
    if work_list_rows:
        tile_rows = work_list_tile_rows
        if tile_rows == 0:
            users = kv_offsets.shape[0] - 1 if kv_offsets is not None else kv_list(kv_arg(kv))[0].shape[0]
            tile_rows = _list_tile_rows(idx, users, work_list_rows, q.shape[-1], q.shape[-2], DEFAULT_POLICY)
        wl = WorkList(wl_order, wl_cand_start, wl_tile_start, wl_grouped, wl_perm, work_list_rows,
                      tile_rows=tile_rows)
    res = attention(q, kv_arg(kv), idx, scale=scale, kv_lengths=kv_lengths, kv_offsets=kv_offsets,
                    max_kv_len=max_kv_len, broadcast=broadcast, return_lse=return_lse, validate=validate,
                    work_list=wl)
    return res if return_lse else (res, q.new_empty((0,), dtype=torch.float32))


def _run(plan: _Plan, q, k, v, idx, kv_lengths, kv_offsets, scale: float, validated: bool, return_lse: bool, out,
         work_list: Optional[WorkList]):
    """Launch the plan's kernels on checked inputs (k, v unpacked, jagged ones as one batch row;
    scale > 0)."""
    q = tma_ready(q, not plan.copy_q)
    k = tma_ready(k, not plan.copy_k)
    v = tma_ready(v, not plan.copy_v)
    device = plan.device
    if out is None:
        out = torch.empty(plan.out_shape, dtype=plan.dtype, device=device)
    target = store_target(out, plan.out_shape)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=device) if return_lse else None

    # The per-row vector of K/V (kv_lengths or kv_offsets) as the kernels take it: contiguous
    # int32, lengths clamped to [0, L] (the kernels clamp offsets themselves).
    rows = kv_lengths if kv_lengths is not None else kv_offsets
    convert_rows = rows is not None and not (plan.rows_int32 and (validated or kv_offsets is not None))
    sizes, n = (plan.buf_sizes_rows, plan.buf_len_rows) if convert_rows else (plan.buf_sizes, plan.buf_len)
    bufs = None
    if n:
        buf = torch.empty(n, dtype=torch.int32, device=device)
        bufs = buf.split_with_sizes(sizes) if len(sizes) > 1 else (buf,)
    if convert_rows:
        bound = plan.kv_len if kv_lengths is not None else plan.total_kv
        src = rows
        rows = bufs[-1]
        if validated:
            rows.copy_(src)
        elif plan.rows_int32:
            torch.clamp(src, 0, bound, out=rows)
        else:  # int64 values past int32 clamped before they convert
            rows.copy_(src.clamp(0, bound))
    cand_start = tile_start = grouped = perm = walk = None
    if work_list is not None:
        wl = work_list
        cand, cand_start, tile_start, grouped, perm, walk = (wl.order, wl.cand_start, wl.tile_start, wl.grouped,
                                                             wl.perm, wl.walk)
    elif plan.direction == "kv":
        cand, cand_start, tile_start, grouped, perm, walk = _group(
            idx if plan.idx_contiguous else idx.contiguous(), plan.n_users, plan.rows_per_cand, plan.worklist, bufs,
            rows if plan.ordered else None, kv_lengths is not None, plan.total_kv, plan.kv_len, plan.tile_rows)
    elif plan.idx_int32 and plan.idx_contiguous:
        cand = idx  # the kernel writes NaN for entries outside [0, U)
    else:
        # A contiguous int32 copy. int64: range-checked values convert exactly; otherwise
        # out-of-range entries become -1 (or U) first, so the kernel writes NaN for them.
        cand = bufs[0]
        cand.copy_(idx if validated or plan.idx_int32 else idx.clamp(-1, plan.n_users))
    kvl, offsets = (rows, None) if kv_lengths is not None else (None, rows)
    # A tile of a grouped idx is consecutive rows of q and out where their batch stride is
    # S_q rows (one row per candidate: any stride); the kernel then moves it in one box a warpgroup.
    s_q = plan.out_shape[1]
    # split_kv: the splits' partial results go to a workspace the merge launch reads
    workspace = plan.merge is not None
    whole_rows = plan.config.whole_rows_out
    scratch = None
    if workspace:
        # whole_rows_out: the kernel writes the lse of whole rows even where none is asked for
        dest, dest_lse, scratch = _split_workspace(plan, lse_scratch=whole_rows and lse is None)
    else:
        dest, dest_lse = target, lse
    q_flat = s_q == 1 or (q.stride(0) == s_q * q.stride(1) and dest.stride(0) == s_q * dest.stride(1))
    final = (target, lse if lse is not None else scratch) if whole_rows else (None, None)
    plan.kernel(FwdTensors(q, k, v, dest, dest_lse, kvl, offsets, *final),
                FwdWorkList(cand, cand_start, tile_start, grouped, perm, walk if plan.config.dynamic_walk else None),
                FwdScalars(int(q_flat), plan.kv_len, plan.n_splits, plan.split_keys, plan.prefetch_blocks,
                           scale * LOG2E, scale),
                plan.n_ctas)
    if workspace:
        plan.merge(dest, dest_lse, target, lse, plan.n_splits)
    copy_back(out, target)
    return (out, lse) if return_lse else out


def _prefetch_blocks(cfg, policy: AttentionPolicy, k: torch.Tensor, v: torch.Tensor) -> int:
    """FwdScalars.prefetch_blocks (KV broadcast): policy.prefetch_blocks, or over rows of their own
    lengths whose K and V together take at most policy.prefetch_kv_bytes, the most (every block
    of rows up to MAX_PREFETCH_BLOCKS blocks, as far as the grid's lanes reach)."""
    if cfg.direction != "kv":
        return 0
    if cfg.own_lengths and k.numel() * k.element_size() + v.numel() * v.element_size() <= policy.prefetch_kv_bytes:
        return MAX_PREFETCH_BLOCKS
    return policy.prefetch_blocks


def _group(idx, n_users: int, rows_per_cand: int, kernel, parts, rows, lengths: bool, total_keys: int,
           max_keys: int, tile_rows: int = TILE_ROWS) -> tuple:
    """(order, cand_start, tile_start, grouped, perm, walk) of a contiguous idx: by the work-list kernel
    into the int32 ``parts`` (order, cand_start, tile_start, grouped[, perm]), else (``kernel``
    None) by the torch definition. ``rows`` (int32 kv_lengths, or kv_offsets with ``lengths``
    False): the tiles longest first by them, perm then followed by the tile counter's two words,
    zero (``walk``, a view of them); None: in user order (perm and walk None). ``tile_rows``: the
    query rows of an attention tile (the kernel's is compiled for them)."""
    if kernel is not None:
        perm = parts[4] if rows is not None else None
        groups, walk = (None, None) if perm is None else (perm[:n_users + 1], perm[n_users + 1:])
        kernel(idx, FwdWorkList(parts[0], parts[1], parts[2], parts[3], groups, walk), rows,
               WorkListScalars(n_users, rows_per_cand, total_keys, max_keys))
        return parts[0], parts[1], parts[2], parts[3], perm, walk
    order, cand_start, tile_start, grouped = kv_worklist(idx, n_users, rows_per_cand, tile_rows)
    perm = walk = None
    if rows is not None:
        keys = rows if lengths else jagged_rows(rows, total_keys, max_keys)[1]
        perm, tile_start = kv_tile_order(cand_start, keys, rows_per_cand, tile_rows)
        perm = torch.cat([perm, perm.new_zeros(WALK_WORDS)])  # the tile counter, zero
        walk = perm[n_users + 1:]
    return order, cand_start, tile_start, grouped, perm, walk


def _split_workspace(plan: _Plan, lse_scratch: bool = False) -> tuple:
    """(ws_o [B, S_q, n x H, D] in q's dtype, ws_lse [B, n x H, S_q] fp32, scratch), split-major
    heads, in one allocation (ws_o from a 16-byte boundary, as its TMA store needs). ``scratch``:
    with ``lse_scratch``, a [B, H, S_q] fp32 lse that nothing reads (whole_rows_out's final lse
    where the caller asks for none), else None."""
    B, s_q, H, D = plan.out_shape
    n_scratch = B * H * s_q if lse_scratch else 0
    n_lse = B * plan.n_splits * H * s_q
    start = -(-(n_scratch + n_lse) // 4) * 4
    n_o = B * s_q * plan.n_splits * H * D * plan.dtype.itemsize // 4  # D is even
    ws = torch.empty(start + n_o, dtype=torch.float32, device=plan.device)
    scratch = ws[:n_scratch].view(B, H, s_q) if lse_scratch else None
    ws_lse = ws[n_scratch:n_scratch + n_lse].view(B, plan.n_splits * H, s_q)
    ws_o = ws[start:].view(plan.dtype).view(B, s_q, plan.n_splits * H, D)
    return ws_o, ws_lse, scratch


def merge_splits(ws_o: torch.Tensor, ws_lse: torch.Tensor, n_splits: int, out: torch.Tensor,
                 lse: Optional[torch.Tensor] = None) -> None:
    """The outputs of a row's key splits merged: out = sum_i exp(lse_i - lse) o_i, in fp32, with
    lse = logsumexp_i lse_i (``ws_o`` [B, S_q, n x H, D], ``ws_lse`` [B, n x H, S_q], split-major
    heads). A row with no key in any split gets 0 and -inf; NaN stays NaN; the output of a split
    of lse -inf is not read (it may never have been written). A row whose split-0 lse holds the
    bits of ``WHOLE_ROW`` (written to ``out`` and ``lse`` by the attention kernel) is left as it
    is. The definition the merge kernel (merge_sm90.py) is tested against."""
    B, S, nH, D = ws_o.shape
    H = nH // n_splits
    parts = ws_lse.view(B, n_splits, H, S)
    total = torch.logsumexp(parts, dim=1)  # [B, H, S]
    w = torch.exp(parts - total[:, None]).masked_fill_(torch.isneginf(total)[:, None], 0.0)
    o = ws_o.view(B, S, n_splits, H, D).float()
    o = o.masked_fill(torch.isneginf(parts).permute(0, 3, 1, 2)[..., None], 0.0)  # splits of no key
    merged = torch.einsum("bnhs,bsnhd->bshd", w, o)
    whole = parts[:, 0].contiguous().view(torch.int32) == WHOLE_ROW  # [B, H, S]
    out.copy_(torch.where(whole.permute(0, 2, 1)[..., None], out, merged.to(out.dtype)))
    if lse is not None:
        lse.copy_(torch.where(whole, lse, total))


def problem_splits(batch: int, users: int, s_q: int, heads: int, keys: int, sms: int,
                   policy: AttentionPolicy = DEFAULT_POLICY, total_keys: Optional[int] = None,
                   tile_rows: int = TILE_ROWS) -> tuple:
    """(splits, keys per split, split pair?) of a KV-broadcast problem: ``kv_splits`` for ``batch``
    candidates of ``users`` users, ``s_q`` queries each, rows of up to ``keys`` keys (``total_keys``
    together, where the rows are jagged). Tiles per head lie between the dense count and its bound
    (a partly filled tile per user): the plan takes their mean. Jagged rows shorter than ``keys``
    on average, where the walk is dynamic (``policy.walks_dynamically``), split without pairs
    (whose walk is static). Tiles of ``tile_rows`` query rows (192: three consumer warpgroups)
    split without pairs too."""
    tiles = mean_tiles_per_head(batch, users, s_q, tile_rows)
    if tile_rows != TILE_ROWS:
        policy = dataclasses.replace(policy, split_pair=False)
    uneven = None
    dynamic = policy.walks_dynamically(keys)
    if total_keys is not None and policy.split_by_total_keys and total_keys < users * keys:
        uneven = (users, total_keys)
        if dynamic:
            policy = dataclasses.replace(policy, split_pair=False)
    n, per = kv_splits(tiles, heads, keys, sms, policy, uneven, dynamic)
    return n, per, policy.split_pair and n == 2


def kv_splits(tiles: int, heads: int, keys: int, sms: int, policy: AttentionPolicy = DEFAULT_POLICY,
              uneven: Optional[tuple] = None, dynamic: bool = False) -> tuple:
    """(splits, keys per split) for a KV-broadcast problem of about ``tiles`` tiles per head
    whose rows have up to ``keys`` keys: where the tiles fill at most half the SMs, each row's
    keys go over as many CTAs as fill them, each with at least ``policy.split_min_keys`` keys.
    With ``policy.split_by_cost``, the split count of least ``split_cost`` instead; for ``uneven``
    = (rows, their total keys), the count of least ``uneven_split_cost`` where the walk is
    ``dynamic`` (each piece to the first CTA free: the cost's two bounds are what that
    walk reaches), else the fewer of that and the other (the static walk can hand one CTA two
    long pieces: docs/perf/2026-12-06-attention-uneven-splits.md)."""
    work = max(1, tiles * heads)
    if not policy.split_kv:
        return 1, 0
    if policy.split_by_cost:
        n = min(range(1, MAX_SPLITS + 1), key=lambda n: (split_cost(work, keys, sms, n, policy), n))
        if uneven is not None:
            least = min(range(1, MAX_SPLITS + 1),
                        key=lambda n: (uneven_split_cost(work, *uneven, keys, sms, n, policy), n))
            n = least if dynamic else min(n, least)
    else:
        n = 1 if 2 * work > sms else min(sms // work, keys // policy.split_min_keys, MAX_SPLITS)
    if n < 2:
        return 1, 0
    per = -(-keys // (n * 128)) * 128
    return -(-keys // per), per


def split_cost(work: int, keys: int, sms: int, n: int, policy: AttentionPolicy = DEFAULT_POLICY) -> float:
    """The time of ``work`` tiles of ``keys`` keys, each split n ways, on ``sms`` SMs, in key
    blocks of the busiest SM: rounds of the persistent grid times (blocks per split + a tile's
    fixed cost), plus the merge (in the cluster for two splits; a second launch beyond), costs
    from ``policy``; inf where a split would hold fewer than ``policy.split_min_keys`` keys."""
    if n > 1 and keys // n < policy.split_min_keys:
        return math.inf
    rounds = -(-work * n // sms)
    return rounds * (_piece_blocks(keys, n) + policy.tile_blocks) + _merge_blocks(n, policy)


def _piece_blocks(keys: int, n: int) -> int:
    """Key blocks (128 keys) of one of n splits of ``keys`` keys."""
    return -(-(-(-keys // 128)) // n)


def _merge_blocks(n: int, policy: AttentionPolicy) -> int:
    """The merge of n splits: none, in the cluster (a split pair), or a second launch."""
    return 0 if n == 1 else policy.pair_merge_blocks if n == 2 and policy.split_pair else policy.merge_blocks


def tail_split_cost(work: int, keys: int, sms: int, n: int, policy: AttentionPolicy = DEFAULT_POLICY) -> float:
    """``split_cost`` of ``tail_split``: the tiles of the grid's whole rounds whole, the last
    round's split n ways, and the merge launch."""
    rounds, tail = divmod(work, sms)
    blocks = -(-keys // 128)
    return (rounds * (blocks + policy.tile_blocks) + -(-tail * n // sms) * (_piece_blocks(keys, n) + policy.tile_blocks)
            + policy.tail_merge_blocks)


def problem_tile_rows(batch: int, users: int, s_q: int, heads: int, sms: int,
                      policy: AttentionPolicy = DEFAULT_POLICY) -> int:
    """Query rows per tile of a D 64 KV-broadcast problem: ``policy.d64_tile_m`` (192, three consumer
    warpgroups) where its tiles cost less than 128-row ones: rounds of the grid of ``sms`` (the
    split plan's mean tile count over ``heads`` heads) times a tile's rows, 192-row tiles being
    ``policy.d64_tall_gain`` percent faster a row; else 128. Where both fit one round the shorter
    tiles win (S_q 1 to 3 at ratio 64)."""
    if policy.d64_tile_m == TILE_ROWS:
        return TILE_ROWS

    def rounds(rows: int) -> int:
        return -(-mean_tiles_per_head(batch, users, s_q, rows) * heads // sms)

    tall = rounds(policy.d64_tile_m) * policy.d64_tile_m * 100
    short = rounds(TILE_ROWS) * TILE_ROWS * (100 + policy.d64_tall_gain)
    return policy.d64_tile_m if tall < short else TILE_ROWS


def mean_tiles_per_head(batch: int, users: int, s_q: int, tile_rows: int = TILE_ROWS) -> int:
    """The tiles per head the plans count on: the mean of the dense count and its bound (a partly
    filled tile per user)."""
    return (-(-batch * s_q // tile_rows) + max_tiles_per_head(batch, users, s_q, tile_rows)) // 2


def tail_splits(batch: int, users: int, s_q: int, heads: int, keys: int, sms: int, out_bytes: int,
                policy: AttentionPolicy = DEFAULT_POLICY, chosen: tuple = (1, False), wide: bool = False,
                tile_rows: int = TILE_ROWS) -> tuple:
    """(splits, keys per split) of the last round (``AttentionConfig.tail_split``) for a KV-broadcast
    problem over padded K/V, or (1, 0) where it does not beat ``chosen`` = (splits, split pair?),
    the plan of ``problem_splits``, by ``tail_split_cost`` and ``policy.tail_split_min_gain``
    (``wide``: that plan runs 192-key blocks, ``policy.d64_wide_gain`` percent faster), or where
    that plan splits fewer than ``policy.tail_split_from`` ways.
    Only where the tiles (the mean of their bounds, as ``problem_splits`` counts them) fill at least
    one round of ``sms`` and part of another, with a workspace of ``out_bytes`` a split within
    ``policy.tail_split_bytes``; tiles of ``tile_rows`` query rows (192: only with
    ``policy.tail_split_tall``)."""
    tiles = mean_tiles_per_head(batch, users, s_q, tile_rows)
    work = max(1, tiles * heads)
    n0, pair = chosen
    if not (policy.split_kv and policy.tail_split) or work < sms or work % sms == 0 or n0 < policy.tail_split_from:
        return 1, 0
    if tile_rows != TILE_ROWS and not policy.tail_split_tall:
        return 1, 0
    base = split_cost(work, keys, sms, n0, dataclasses.replace(policy, split_pair=pair, split_min_keys=1))
    if wide and n0 == 1:
        base = base * 100 / (100 + policy.d64_wide_gain)
    best = (base * (100 - policy.tail_split_min_gain) / 100, 1, 0)
    for n in range(2, MAX_SPLITS + 1):
        per = -(-keys // (n * 128)) * 128
        m = -(-keys // per)
        if m < 2 or m * out_bytes > policy.tail_split_bytes:
            continue
        best = min(best, (tail_split_cost(work, keys, sms, m, policy), m, per))
    return best[1], best[2]


def uneven_split_cost(work: int, rows: int, total_keys: int, keys: int, sms: int, n: int,
                      policy: AttentionPolicy = DEFAULT_POLICY) -> float:
    """``split_cost`` where ``rows`` rows of up to ``keys`` keys hold ``total_keys`` together and
    ``work`` tiles share them evenly: each tile's row is cut into pieces of keys / n keys (a short
    row stays whole), and the busiest SM holds at least the mean of every piece's key blocks and
    fixed cost, and at least the longest piece (the walk takes the longest first)."""
    if n > 1 and keys // n < policy.split_min_keys:
        return math.inf
    piece = _piece_blocks(keys, n)
    per_row = work / rows  # tiles over one row's keys
    pieces = per_row * (rows + total_keys / (piece * 128))  # a row's pieces: at most one past its share
    mean = (per_row * total_keys / 128 + pieces * policy.tile_blocks) / sms
    return max(mean, piece + policy.tile_blocks) + _merge_blocks(n, policy)


def _tma_ok(t: torch.Tensor) -> bool:
    """Last dim contiguous, other strides multiples of 16 bytes (the base alignment is checked
    per call; size-1 dims get dense strides from ``tma_ready``)."""
    return t.stride(-1) == 1 and all(
        n == 1 or (s * t.element_size()) % 16 == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1])
    )


def _fwd_kernel(cfg):
    return kernel_cache.get(("ikbo_fa.fwd_sm90", cfg), lambda: compile_config(cfg), package="ikbo_fa").fn


def _merge_kernel(dtype: torch.dtype, with_lse: bool):
    from .merge_sm90 import merge_kernel

    return merge_kernel(dtype, with_lse).fn


def _worklist_kernel(idx_dtype: torch.dtype, keys: Optional[str], tile_rows: int = TILE_ROWS):
    from .worklist_sm90 import worklist_kernel  # imports the DSL's kernel modules at first use

    return worklist_kernel(idx_dtype, keys, tile_rows).fn


def _worklist_fits(num_users: int) -> bool:
    from .worklist_sm90 import fits

    return fits(num_users)


def _make_plan(q, kv, idx, scale, kv_lengths, kv_offsets, max_kv_len, broadcast, return_lse, out, work_list,
               policy: AttentionPolicy) -> _Plan:
    """Check every argument (the first call with a signature) and build its launch plan."""
    p = resolve_problem(q, kv, idx, scale=scale, kv_lengths=kv_lengths, kv_offsets=kv_offsets,
                        max_kv_len=max_kv_len, broadcast=broadcast, out=out, validate=False, op="attention",
                        return_lse=return_lse)
    device = p.q.device
    require_sm90(device, "attention")
    if work_list is not None:
        check_work_list(work_list, p)
    if p.batch * p.s_q >= 2**31 or p.total_kv >= 2**31:
        raise ValueError(f"attention indexes query rows (B * S_q = {p.batch * p.s_q}) and key rows "
                         f"({p.total_kv}) with int32: each must stay below 2**31")
    n_splits, split_keys, pair = 1, 0, False
    # Query rows per tile: 192 at D 64 in KV broadcast where they pay (problem_tile_rows); those a
    # given work list counts
    tile_m = TILE_ROWS
    if work_list is not None:
        tile_m = work_list.tile_rows
    elif p.head_dim == 64 and p.direction == "kv":
        tile_m = problem_tile_rows(p.batch, p.broadcast_batch, p.s_q, p.heads, sm_count(device), policy)
    if p.direction == "kv" and (not p.jagged or max_kv_len is not None):
        n_splits, split_keys, pair = problem_splits(p.batch, p.broadcast_batch, p.s_q, p.heads, p.kv_len,
                                                    sm_count(device), policy, p.total_kv if p.jagged else None,
                                                    tile_m)
    tail = False
    if p.direction == "kv" and not (p.jagged or p.kv_lengths is not None):
        out_bytes = p.batch * p.s_q * p.heads * p.head_dim * p.q.element_size()
        wide = (p.head_dim == 64 and tile_m == TILE_ROWS and policy.d64_key_block != 128
                and p.kv_len >= policy.d64_wide_min_keys)
        tail_n, tail_keys = tail_splits(p.batch, p.broadcast_batch, p.s_q, p.heads, p.kv_len, sm_count(device),
                                        out_bytes, policy, (n_splits, pair), wide, tile_m)
        if tail_n > 1:
            n_splits, split_keys, pair, tail = tail_n, tail_keys, False, True
    n_users = p.broadcast_batch
    use_worklist_kernel = (p.direction == "kv" and work_list is None and policy.worklist_kernel
                           and _worklist_fits(n_users))
    cfg = kernel_config(p.q.dtype, p.head_dim, p.s_q, p.direction, p.kv_lengths is not None, return_lse,
                        jagged=p.jagged, split_kv=n_splits > 1 and not pair, split_pair=pair,
                        dynamic_walk=policy.walks_dynamically(p.kv_len), whole_rows_out=policy.whole_rows_out,
                        # a given work list of rows of their own lengths holds their order (perm)
                        longest_first=work_list is not None or policy.orders(p.kv_len),
                        d64_key_block=policy.d64_key_block if p.kv_len >= policy.d64_wide_min_keys else 128,
                        tail_split=tail, d64_tile_m=tile_m)
    _, _, chunks = row_packing(p.s_q)
    idx_contiguous = p.idx.is_contiguous()
    idx_int32 = p.idx.dtype == torch.int32
    worklist = None
    sizes = []
    if p.direction == "kv":
        bound = max_tiles_per_head(p.batch, n_users, p.s_q, cfg.tile_m)
        if use_worklist_kernel:
            worklist = _worklist_kernel(p.idx.dtype, ("lengths" if p.kv_lengths is not None else "offsets")
                                        if cfg.ordered else None, cfg.tile_m)
            sizes += [p.batch, n_users + 2, n_users + 2, 1]  # order, cand_start, tile_start, grouped
            if cfg.ordered:
                sizes.append(n_users + 1 + WALK_WORDS)  # perm, then the tile counter
    else:
        bound = p.batch * chunks
        if not (idx_int32 and idx_contiguous):
            sizes.append(p.batch)  # int32 copy of idx
    rows = p.kv_lengths if p.kv_lengths is not None else p.kv_offsets
    rows_int32 = rows is not None and rows.dtype == torch.int32 and rows.is_contiguous()
    n_rows = p.kv_batch + 1 if p.jagged else p.kv_batch
    return _Plan(
        config=cfg,
        policy=policy,
        kernel=_fwd_kernel(cfg),
        worklist=worklist,
        ordered=cfg.ordered,
        direction=p.direction,
        packed=isinstance(kv, torch.Tensor),
        copy_q=not _tma_ok(p.q),
        copy_k=not _tma_ok(p.k),
        copy_v=not _tma_ok(p.v),
        pair_dim=1 if p.jagged else 2,
        total_kv=p.total_kv,
        idx_contiguous=idx_contiguous,
        idx_int32=idx_int32,
        rows_int32=rows_int32,
        out_shape=(p.batch, p.s_q, p.heads, p.head_dim),
        lse_shape=(p.batch, p.heads, p.s_q),
        dtype=p.q.dtype,
        device=device,
        n_users=n_users,
        kv_len=p.kv_len,
        rows_per_cand=p.s_q,
        tile_rows=cfg.tile_m,
        n_ctas=(2 * max(1, min(max_active_clusters(device, 2), bound * p.heads)) if pair
                else max(1, min(sm_count(device), bound * p.heads * n_splits))),
        merge=_merge_kernel(p.q.dtype, return_lse) if n_splits > 1 and not pair else None,
        n_splits=n_splits,
        split_keys=split_keys,
        prefetch_blocks=_prefetch_blocks(cfg, policy, p.k, p.v),
        default_scale=1.0 / math.sqrt(p.head_dim),
        buf_sizes=tuple(sizes),
        buf_sizes_rows=(*sizes, n_rows),
        buf_len=sum(sizes),
        buf_len_rows=sum(sizes) + n_rows,
    )
