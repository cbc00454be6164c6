"""ikbo_gemm.lce: IKBO linear compression on Hopper.

    out[b] = w_cand @ e_cand[b] + w_user @ e_user[idx[b]]

Alignment. TMA needs 16-byte row pitches, so inside the op:
  - w_cand / w_user with K not a multiple of 8 are copied into zero-padded
    [M, K8] buffers (the weights are small); e_cand / e_user need no copy for
    that, their K tail is read as zeros within each batch;
  - N not a multiple of 8 pads e_cand, e_user and the output along N (a copy
    of each, then one copy of the result into ``out``): a slow path;
  - non-contiguous inputs, or inputs not 16-byte aligned, are copied to
    contiguous ones; FP8 operands are taken as they are wherever their rows
    start 16 bytes apart (quantize_fp8's e), else copied into padded rows.
The output is always a contiguous [B, M, N] tensor.

Memory: besides the output, each call allocates the fp32 user tiles, 4 bytes per
element of [U, M, N] with each size rounded up to the tile and cluster (7.5 MB at
U 15, M 433, N 256), and one int32 ready flag per user tile. The output and the
user tiles may each pass 2^31 elements.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch

from cute_kernels import (
    CompiledKernel,
    PlanCache,
    context_sm_count,
    copy_back,
    forward_only,
    into_out,
    k_major_operand,
    kernel_cache,
    library_op,
    max_active_clusters,
    on_device,
    on_gpu,
    plan_key,
    require_sm90,
    sm_count,
    store_target,
    tma_ready,
)

from cute_kernels.checks import (
    capturing,
    check_index_range,
    check_out_target,
    policy_or_default,
    validation_enabled,
)

from .checks import FP8, check_lce_inputs, check_out_dtype, check_schedule
from .compile import compile_lce_config
from .config import CLUSTERS, LOAD_BOUND_COST, PROMOTE_TILES, TILES, LceConfig, LceGeometry, pick_config, round_up
from .lce_sm90 import LceEpilogue, LceLaunch, LceOperands
from .linear import _scale_vector
from .reference import lce_reference


@dataclasses.dataclass(frozen=True)
class LcePolicy:
    """The launch policy of :func:`lce` (its ``policy`` argument; part of the plan key). The op's
    is ``DEFAULT_POLICY``; a test or a benchmark runs an alternative by passing its own. A policy
    changes which kernels run where, not what they compute (fp32 sums, rounded once)."""

    spare_sms: bool = True  # a second launch on the SMs that batch-deep clusters leave idle (_spare_sm_split)
    load_bound_cost: float = LOAD_BOUND_COST  # the weight of a load-bound tile's work (config.tile_cost)
    tiling: Optional[tuple] = None  # (tile_n, tile_w, cluster_n, cluster_b) forced; None: config.pick_config's
    # FP8 calls: each k-block's sum added into fp32 registers (LceConfig.promote), as accurate as
    # torch._scaled_mm; tiles of PROMOTE_TILES only. 16-bit calls: no effect.
    fp8_promote: bool = False

    def __post_init__(self):
        for name in ("spare_sms", "fp8_promote"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LcePolicy.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.load_bound_cost, bool) or not isinstance(self.load_bound_cost, (int, float)) \
                or not self.load_bound_cost >= 1:
            raise ValueError(f"LcePolicy.load_bound_cost must be a number >= 1, got {self.load_bound_cost!r}")
        t = self.tiling
        if t is not None and not (isinstance(t, tuple) and len(t) == 4 and t[:2] in TILES
                                  and t[2:] in CLUSTERS[t[0]]):
            raise ValueError(f"LcePolicy.tiling must be (tile_n, tile_w, cluster_n, cluster_b) of a shipped "
                             f"configuration (config.TILES, config.CLUSTERS), got {t!r}")
        if self.fp8_promote and t is not None and t[:2] not in PROMOTE_TILES:
            raise ValueError(f"LcePolicy.fp8_promote takes tiles of {PROMOTE_TILES} only, got tiling {t!r}")

    def config(self, dtype, idx_dtype, m: int, n: int, b: int, out_dtype=None) -> LceConfig:
        """The configuration of a problem (``out_dtype``: FP8's output): the forced tiling, else
        pick_config's (promoting with ``fp8_promote`` and FP8 operands)."""
        promote = self.fp8_promote and dtype == torch.float8_e4m3fn
        if self.tiling is None:
            return pick_config(dtype, idx_dtype, m, n, b, self.load_bound_cost, out_dtype, promote)
        tile_n, tile_w, cn, cb = self.tiling
        return LceConfig(dtype, idx_dtype, tile_w, cn, cb, tile_n, out_dtype, promote)


DEFAULT_POLICY = LcePolicy()
# FP8 calls with promotion (docs/perf/2026-12-07-fp8-accumulator-promotion.md).
FP8_PROMOTE_POLICY = LcePolicy(fp8_promote=True)


def _kernel(cfg: LceConfig) -> CompiledKernel:
    return kernel_cache.get(("ikbo_gemm.lce", cfg), lambda: compile_lce_config(cfg), package="ikbo_gemm")


def _pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.shape[-1] == size:
        return tma_ready(t)
    return torch.nn.functional.pad(t, (0, size - t.shape[-1]))


@dataclasses.dataclass(frozen=True)
class _Launch:
    kernel: CompiledKernel
    batches: tuple  # (first, end): the candidates this launch sees
    tiles: tuple  # (tile_begin, tile_end): cluster tiles of its own tile walk
    grid: int  # CTAs
    wait_prior: int  # 1: waits for the previous grid before it starts; 0: before it ends
    cooperative: int  # 1: its candidate tiles wait on user tiles of its own grid (all CTAs resident)


def _spare_sm_split(cfg: LceConfig, device, geom: LceGeometry):
    """(B_spare, spare CTAs) where a batch-deep cluster leaves SMs idle, else None.

    Clusters of 4 or 8 CTAs fit on fewer SMs than the GPU has (120 of 132 on an H200).
    The fused launch then runs the user tiles and candidates [B_spare, B), and a second
    launch of the same tile with clusters one batch deep takes candidates [0, B_spare)
    on the SMs left over: with candidates sorted by user, their user tiles are the first
    to be ready. It is launched dependent on the first (PDL), so it starts once every CTA
    of the first is resident, and spins on the user tiles' ready flags like the first
    launch's own candidate tiles. The candidates are split in proportion to the SMs, in
    k-blocks of work."""
    if cfg.cluster_b == 1 or cfg.cluster_n > 2:
        return None  # only pairs fit in what an 8-CTA grid leaves
    sms = max_active_clusters(device, 1)
    spare = sms - max_active_clusters(device, cfg.cluster) * cfg.cluster
    spare -= spare % cfg.cluster_n
    if spare <= 0:
        return None
    B, kb_cand = geom.n_cands, geom.k_blocks_cand
    work = geom.n_users * geom.k_blocks_user + B * kb_cand
    b_main = -(-(B - round(work * spare / sms / kb_cand)) // cfg.cluster_b) * cfg.cluster_b
    if not 0 < b_main < B:
        return None
    return B - b_main, spare


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a call needs that depends only on shapes, dtypes and device."""

    out_shape: tuple
    dtype: torch.dtype  # the output's
    fp8: bool  # FP8 operands: e K-major (rows 16 bytes apart for TMA), fp32 scales
    n8: int
    k8_cand: int  # K padded to 16 bytes (where an operand is copied into padded rows)
    k8_user: int
    ws_shape: tuple
    n_flags: int
    launches: tuple  # of _Launch
    policy: LcePolicy


_plans = PlanCache()
_INPUT_NAMES = ("w_cand", "w_user", "e_cand", "e_user", "idx")


def _plan(w_cand, w_user, e_cand, e_user, idx, out, schedule, policy: LcePolicy, scales: dict,
          out_dtype) -> _Plan | None:
    """The launch plan for these shapes (None on CPU); inputs are fully checked once per signature."""
    # A plan holds compiled kernels: the key names where they come from (``_kernel``).
    key = plan_key(w_cand, w_user, e_cand, e_user, idx, out, schedule, policy, tuple(scales.values()), out_dtype,
                   _kernel)
    plan = _plans.get(key, False)
    if plan is not False:
        return plan
    B, U, M, N, K_cand, K_user = check_lce_inputs(w_cand, w_user, e_cand, e_user, idx, out, False,
                                                  out_dtype=out_dtype, **scales)
    device = e_cand.device
    fp8 = e_cand.dtype == FP8
    result_dtype = check_out_dtype(out_dtype, e_cand.dtype)
    plan = None
    if on_gpu(e_cand):
        require_sm90(device, "lce")
        cfg = policy.config(e_cand.dtype, idx.dtype, M, N, B, result_dtype if fp8 else None)
        n8 = round_up(N, 8)

        def geometry(c: LceConfig, batch: int) -> LceGeometry:
            return LceGeometry.of(c, M=M, N=n8, U=U, B=batch, K_user=K_user, K_cand=K_cand)

        def launch(c, b0, b1, phases, wait_prior):
            """A launch of config c over candidates [b0, b1): its user tiles, candidate tiles or both."""
            g = geometry(c, b1 - b0)
            begin = 0 if "user" in phases else g.user_tiles
            end = g.user_tiles + g.cand_tiles() if "cand" in phases else g.user_tiles
            clusters = min(max_active_clusters(device, c.cluster), end - begin)
            if end + 2 * clusters >= 2**31:  # the kernel's tile walk is 32-bit
                raise ValueError(
                    f"lce: {end} cluster tiles (B {B}, U {U}, M {M}, N {N}) pass the kernel's 32-bit "
                    f"tile index; call it on fewer candidates at a time"
                )
            cooperative = int(phases == ("user", "cand"))
            return _Launch(_kernel(c), (b0, b1), (begin, end), clusters * c.cluster, wait_prior, cooperative)

        geom = geometry(cfg, B)
        split = _spare_sm_split(cfg, device, geom) if schedule == "fused" and B > 0 and policy.spare_sms else None
        if B == 0:
            launches = ()  # an empty result: nothing to launch
        elif split is None and schedule == "fused":
            launches = (launch(cfg, 0, B, ("user", "cand"), 1),)
        elif split is None:
            launches = (launch(cfg, 0, B, ("user",), 1), launch(cfg, 0, B, ("cand",), 1))
        else:
            b_spare, spare = split
            # The same tile and column slices (so the same workspace layout), one batch deep.
            second = launch(dataclasses.replace(cfg, cluster_b=1), 0, b_spare, ("cand",), 0)
            launches = (
                launch(cfg, b_spare, B, ("user", "cand"), 1),
                dataclasses.replace(second, grid=min(second.grid, spare)),
            )
        k_align = 16 if fp8 else 8
        plan = _Plan(
            out_shape=(B, M, N),
            dtype=result_dtype,
            fp8=fp8,
            n8=n8,
            k8_cand=round_up(K_cand, k_align),
            k8_user=round_up(K_user, k_align),
            # fp32 user tiles, in the kernel's fragment order, and their ready flags.
            ws_shape=(geom.workspace_tiles(), cfg.tile_n * cfg.tile_w),
            n_flags=geom.workspace_tiles(),
            launches=launches,
            policy=policy,
        )
    return _plans.keep(key, plan)


def lce(w_cand, w_user, e_cand, e_user, idx, *, out=None, validate=None, schedule="fused", policy=None,
        w_cand_scale=None, w_user_scale=None, e_cand_scale=None, e_user_scale=None, out_dtype=None):
    """IKBO linear compression: ``out[b] = w_cand @ e_cand[b] + w_user @ e_user[idx[b]]``.

    Shapes: w_cand [M, K_cand], w_user [M, K_user], e_cand [B, K_cand, N],
    e_user [U, K_user, N], idx [B] (int32 or int64, values in [0, U), any
    order). fp16 or bf16, all operands one dtype; fp32 accumulation, the user
    and candidate partial sums added in fp32 and rounded once.

    FP8: all four operands float8_e4m3fn, e K-major: e_cand [B, N, K_cand], e_user
    [U, N, K_user] (8-bit wgmma reads both operands K-major; ``quantize_fp8(e, dim=(1, 2),
    layout="transposed")`` makes them from [B, K, N] in its one pass), with float32 scales
    ``w_cand_scale`` [M], ``w_user_scale`` [M] (one per row of w), ``e_cand_scale`` [B],
    ``e_user_scale`` [U] (one per batch entry), or 0-d for one per tensor: ``out[b] =
    sw_c * se_c[b] * (w_cand8 @ e_cand8[b].T) + sw_u * se_u[idx[b]] * (w_user8 @
    e_user8[idx[b]].T)``, the scales applied to the fp32 sums, one rounding to ``out_dtype``
    (bf16 by default, or fp16). (TMA needs rows 16 bytes apart: ``quantize_fp8``'s e8 has
    them whatever K; a contiguous e or w whose K is not a multiple of 16 is copied into padded
    rows. A 0-d scale is repeated per row: small copies.)

    ``out`` (optional): a contiguous [B, M, N] tensor of the output dtype, any
    alignment, sharing no memory with the inputs (ValueError otherwise); written as
    torch writes in place (its version counter moves; a leaf that requires grad or an
    inference tensor outside inference mode raises RuntimeError; with an autograd node,
    out takes the result by a recorded copy).

    ``validate`` (default: the IKBO_VALIDATE environment variable) checks that
    every idx lies in [0, U), raising IndexError at the first bad position;
    it synchronizes with the device (inside a CUDA-graph capture validate=True
    raises and IKBO_VALIDATE does not apply). Without it an out-of-range index
    never reads or writes outside the tensors: that candidate's output is NaN.

    ``schedule``: "fused" (one persistent launch: user tiles first, candidate
    tiles wait on per-tile ready flags; where its clusters leave SMs idle, a second
    launch on those SMs takes the first candidates, see ``_spare_sm_split``) or
    "two_launch" (the same kernel run over the user tiles, then over the candidate
    tiles). The fused grid waits on itself, so it is a cooperative launch: where it
    can never be resident whole (a green context or an MPS SM limit smaller than the
    device) the driver refuses it, and the call runs "two_launch" instead (a
    RuntimeWarning once per process). A CUDA-graph capture records the launch
    without that check, so there the op captures "two_launch" where the current
    context has fewer SMs than the device (a green context); under an MPS SM
    limit, capture with schedule="two_launch".

    ``policy``: the launch policy, an :class:`LcePolicy` (default: ``DEFAULT_POLICY``, the
    shipped plan); a benchmark times an alternative by passing it. Eager calls only: under
    torch.compile a policy other than the ``DEFAULT_POLICY`` object raises ValueError.

    Under torch.compile a call is traced as one node, ``torch.ops.ikbo_gemm.lce``
    (``out`` is then filled by a copy of its result).

    CPU tensors run :func:`lce_reference`; a CUDA GPU other than sm_90 raises.
    No host synchronization (unless validating); CUDA-graph capturable. The
    kernel has no backward: with grad mode on and an operand that requires
    grad, the output's backward raises (use :func:`lce_reference` for gradients).
    """
    scales = dict(w_cand_scale=w_cand_scale, w_user_scale=w_user_scale, e_cand_scale=e_cand_scale,
                  e_user_scale=e_user_scale)
    if torch.compiler.is_compiling():
        if policy is not None and policy is not DEFAULT_POLICY:  # identity: nothing for the tracer to evaluate
            raise ValueError("lce: a policy other than DEFAULT_POLICY is for eager calls (the op torch.compile "
                             "traces takes the shipped plan)")
        # Traced by torch.compile: the registered op (one node), out= filled by a copy.
        return into_out(out, torch.ops.ikbo_gemm.lce(w_cand, w_user, e_cand, e_user, idx, validate, schedule,
                                                     *scales.values(), out_dtype))
    policy = policy_or_default("lce", "policy", policy, LcePolicy, DEFAULT_POLICY)
    check_schedule(schedule)
    plan = _plan(w_cand, w_user, e_cand, e_user, idx, out, schedule, policy, scales, out_dtype)
    if out is not None:
        check_out_target("out", out, _INPUT_NAMES, (w_cand, w_user, e_cand, e_user, idx))
    if validation_enabled(validate):
        check_index_range("idx", idx, e_user.shape[0], "U", "the batch of e_user")
    if plan is None:
        return lce_reference(w_cand, w_user, e_cand, e_user, idx, out=out, validate=False, out_dtype=out_dtype,
                             **scales)
    with on_device(e_cand.device):
        return forward_only(
            "ikbo_gemm.lce",
            "ikbo_gemm.lce_reference",
            lambda wc, wu, ec, eu, out: _run(plan, wc, wu, ec, eu, idx, out, scales),
            (w_cand, w_user, e_cand, e_user),
            out,
        )


def _lce_shape(w_cand, w_user, e_cand, e_user, idx, validate=None, schedule="fused", w_cand_scale=None,
               w_user_scale=None, e_cand_scale=None, e_user_scale=None, out_dtype=None):
    check_schedule(schedule)
    scales = dict(w_cand_scale=w_cand_scale, w_user_scale=w_user_scale, e_cand_scale=e_cand_scale,
                  e_user_scale=e_user_scale)
    B, _, M, N, _, _ = check_lce_inputs(w_cand, w_user, e_cand, e_user, idx, None, False, out_dtype=out_dtype,
                                        **scales)
    return e_cand.new_empty((B, M, N), dtype=check_out_dtype(out_dtype, e_cand.dtype))


@library_op("ikbo_gemm::lce", "ikbo_gemm.lce", "ikbo_gemm.lce_reference", _lce_shape)
def _lce_op(
    w_cand: torch.Tensor,
    w_user: torch.Tensor,
    e_cand: torch.Tensor,
    e_user: torch.Tensor,
    idx: torch.Tensor,
    validate: Optional[bool] = None,
    schedule: str = "fused",
    w_cand_scale: Optional[torch.Tensor] = None,
    w_user_scale: Optional[torch.Tensor] = None,
    e_cand_scale: Optional[torch.Tensor] = None,
    e_user_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``torch.ops.ikbo_gemm.lce``: what torch.compile traces a call of :func:`lce` as."""
    return lce(w_cand, w_user, e_cand, e_user, idx, validate=validate, schedule=schedule,
               w_cand_scale=w_cand_scale, w_user_scale=w_user_scale, e_cand_scale=e_cand_scale,
               e_user_scale=e_user_scale, out_dtype=out_dtype)


def _run(plan: _Plan, w_cand, w_user, e_cand, e_user, idx, out, scales: dict) -> torch.Tensor:
    """Launch the plan's kernels (on checked inputs) and return ``out``."""
    device = e_cand.device
    if not plan.launches:  # no candidates: an empty result
        return out if out is not None else torch.empty(plan.out_shape, dtype=plan.dtype, device=device)
    n8 = plan.n8
    w_c = k_major_operand(w_cand, plan.k8_cand).unsqueeze(0)
    w_u = k_major_operand(w_user, plan.k8_user).unsqueeze(0)
    # 16-bit e [B, K, N] pads N; FP8 e [B, N, K] is K-major (its N tail is read as zeros).
    e_c = k_major_operand(e_cand, plan.k8_cand) if plan.fp8 else _pad_last(e_cand, n8)
    e_u = k_major_operand(e_user, plan.k8_user) if plan.fp8 else _pad_last(e_user, n8)
    idx_k = idx if idx.is_contiguous() else idx.contiguous()
    if out is None:
        out = torch.empty(plan.out_shape, dtype=plan.dtype, device=device)
    target = store_target(out, (*plan.out_shape[:2], n8))
    workspace = torch.empty(plan.ws_shape, dtype=torch.float32, device=device)
    flags = torch.zeros(plan.n_flags, dtype=torch.int32, device=device)
    vectors = {}
    if plan.fp8:  # one fp32 scale per row of w and batch entry of e (a 0-d scale repeated)
        B, M, _ = plan.out_shape
        rows = dict(w_cand_scale=M, w_user_scale=M, e_cand_scale=B, e_user_scale=e_user.shape[0])
        vectors = {name: _scale_vector(scales[name], rows[name]) for name in rows}
    args = (LceOperands(w_c, w_u, e_c, e_u, idx_k), LceEpilogue(target, workspace, flags, **vectors))
    call = ((w_cand, w_user, e_cand, e_user, idx), plan.policy, scales, plan.dtype)
    launches = plan.launches
    too_few = _context_too_small(launches, device)
    if too_few:
        launches = _two_launch(call, too_few)
    refused = _launch_all(launches, args)
    if refused:
        # The fused grid was refused before anything ran (the flags are still zero): the
        # launches that wait on nothing within their grid give the same result.
        _launch_all(_two_launch(call, refused), args)
    return copy_back(out, target)


_warned_fallback = False


def _two_launch(call, why: str) -> tuple:
    """The launches of schedule "two_launch" (the same tile, workspace and flags as "fused"),
    run where the fused grid cannot be resident whole; warns once per process. ``call``:
    (inputs, policy, scales, output dtype) of the call."""
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"lce: the fused grid cannot be resident whole here ({why}; a green context or an MPS SM "
            f"limit): running schedule='two_launch' instead; pass it to skip the check.",
            RuntimeWarning,
            stacklevel=2,
        )
    inputs, policy, scales, out_dtype = call
    return _plan(*inputs, None, "two_launch", policy, scales, out_dtype).launches


def _context_too_small(launches, device) -> str:
    """Why a fused grid cannot be captured here, or "". Eager, the driver refuses a grid that
    cannot be resident whole; a capture records the cooperative launch unchecked (replayed in
    a green context of fewer SMs it hangs), so inside one the op checks the context itself: a
    fused grid is captured only where the context has every SM of the device."""
    if not any(launch.cooperative for launch in launches) or not capturing():
        return ""
    sms = context_sm_count()
    if sms is None or sms >= sm_count(device):
        return ""
    return f"the current context has {sms} of the device's {sm_count(device)} SMs"


def _launch_all(launches, args) -> str:
    """Issue every launch of a plan. Returns why the driver refused the cooperative (fused)
    grid, which can never be resident whole in this context, or "" when all launched."""
    operands, epilogue = args
    # Every launch's arguments first: a second launch (the spare SMs') can start only once the
    # host has issued it, so nothing else runs on the host between the launches.
    calls = []
    for launch in launches:
        part = slice(*launch.batches)
        calls.append((launch, (
            operands._replace(e_cand=operands.e_cand[part], idx=operands.idx[part]),
            epilogue._replace(out=epilogue.out[part], e_cand_scale=None if epilogue.e_cand_scale is None
                              else epilogue.e_cand_scale[part]),
            LceLaunch(*launch.tiles, launch.grid, launch.wait_prior, launch.cooperative),
        )))
    for launch, call_args in calls:
        try:
            launch.kernel(*call_args)
        except Exception as e:
            if not launch.cooperative:
                raise
            why = f"the driver refused its {launch.grid} CTAs as one cooperative launch: {type(e).__name__}: {e}"
            if capturing():
                raise RuntimeError(f"lce: {why}. Capture lce(..., schedule='two_launch') there.") from e
            return why
    return ""
