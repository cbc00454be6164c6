"""The compile step of the package's kernels: a configuration (``config``) compiled for sm_90a,
no GPU needed, from fake arguments of the kernel's own argument bundles."""
from __future__ import annotations

import cutlass

from cute_kernels.compile import CompiledKernel, compile_kernel
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

from .config import FP8, LceConfig, LinearConfig
from .lce_sm90 import LceEpilogue, LceLaunch, LceOperands, LceSm90
from .linear_sm90 import LinearEpilogue, LinearLaunch, LinearOperands, LinearSm90


def compile_config(cfg, *, keep_ptx: bool = False, ptxas_report: bool = False) -> CompiledKernel:
    """Compile one shipped configuration (LceConfig or LinearConfig) for sm_90a -> CompiledKernel."""
    if isinstance(cfg, LinearConfig):
        return compile_linear_config(cfg, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
    if isinstance(cfg, LceConfig):
        return compile_lce_config(cfg, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
    raise TypeError(f"compile_config takes an LceConfig or a LinearConfig, got {type(cfg).__name__}")


def compile_lce_config(cfg: LceConfig, *, keep_ptx: bool = False, ptxas_report: bool = False) -> CompiledKernel:
    """Compile one LCE configuration for sm_90a (no GPU needed) -> CompiledKernel."""
    dt = cutlass_dtype(cfg.dtype)
    fp8 = cfg.dtype == FP8
    kernel = LceSm90(cfg)
    operand = dict(divisibility=16 if fp8 else 8, align=16)  # 16-byte row pitches

    def scale():  # FP8: one per row of w or batch entry of e (sizes of their own)
        return fake_tensor(cutlass.Float32, (None,), align=4) if fp8 else None

    args = (
        LceOperands(
            w_cand=fake_tensor(dt, (1, None, None), **operand),
            w_user=fake_tensor(dt, (1, None, None), **operand),
            e_cand=fake_tensor(dt, (None, None, None), **operand),
            e_user=fake_tensor(dt, (None, None, None), **operand),
            idx=fake_tensor(cutlass_dtype(cfg.idx_dtype), (None,), align=cfg.idx_dtype.itemsize),
        ),
        LceEpilogue(
            out=fake_tensor(cutlass_dtype(cfg.out_dtype or cfg.dtype), (None, None, None), divisibility=8, align=16),
            workspace=fake_tensor(cutlass.Float32, (None, cfg.tile_n * cfg.tile_w), divisibility=512, align=16),
            flags=fake_tensor(cutlass.Int32, (None,), align=4),
            w_cand_scale=scale(), w_user_scale=scale(), e_cand_scale=scale(), e_user_scale=scale(),
        ),
        LceLaunch(tile_begin=cutlass.Int32(0), tile_end=cutlass.Int32(1), grid_size=cutlass.Int32(1),
                  wait_prior=cutlass.Int32(1), cooperative=cutlass.Int32(1)),
        fake_stream(),
    )
    return compile_kernel(kernel, *args, keep_ptx=keep_ptx, ptxas_report=ptxas_report)


def compile_linear_config(cfg: LinearConfig, *, keep_ptx: bool = False, ptxas_report: bool = False) -> CompiledKernel:
    """Compile one linear configuration for sm_90a (no GPU needed) -> CompiledKernel."""
    dt = cutlass_dtype(cfg.dtype)
    fp8 = cfg.dtype == FP8
    out_dt = cutlass_dtype(cfg.out_dtype or cfg.dtype)
    operand = dict(divisibility=16 if fp8 else 8, align=16)  # 16-byte row pitches
    ws = fake_tensor(cutlass.Float32, (None, None, None), divisibility=8, align=16)

    def scale():  # FP8: one per row of the operand (rows and N are sizes of their own)
        return fake_tensor(cutlass.Float32, (None,), align=4) if fp8 else None

    args = (
        LinearOperands(
            a=fake_tensor(dt, (None, None), **operand),
            b=fake_tensor(dt, (None, None), **operand),
            idx=fake_tensor(cutlass_dtype(cfg.idx_dtype), (None,), align=cfg.idx_dtype.itemsize),
        ),
        LinearEpilogue(
            out=ws if cfg.phase == "user" else fake_tensor(out_dt, (None, None), divisibility=8, align=16),
            ws=ws,
            # FP8: the bias in fp32 (the op converts it, whatever its dtype).
            bias=fake_tensor(cutlass.Float32 if fp8 else dt, (None,), align=2) if cfg.has_bias else None,
            a_scale=scale(),
            b_scale=scale(),
        ),
        LinearLaunch(*(cutlass.Int32(1) for _ in LinearLaunch._fields)),
        fake_stream(),
    )
    return compile_kernel(LinearSm90(cfg), *args, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
