"""The compile step of the package's kernels: a configuration (``config``) compiled for sm_90a,
no GPU needed, from fake arguments of the kernel's own argument bundles."""
from __future__ import annotations

import cutlass

from cute_kernels.compile import CompiledKernel, compile_kernel
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

from .config import LceConfig, LinearConfig
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
    kernel = LceSm90(cfg)
    operand = dict(divisibility=8, align=16)
    args = (
        LceOperands(
            w_cand=fake_tensor(dt, (1, None, None), **operand),
            w_user=fake_tensor(dt, (1, None, None), **operand),
            e_cand=fake_tensor(dt, (None, None, None), **operand),
            e_user=fake_tensor(dt, (None, None, None), **operand),
            idx=fake_tensor(cutlass_dtype(cfg.idx_dtype), (None,), align=cfg.idx_dtype.itemsize),
        ),
        LceEpilogue(
            out=fake_tensor(dt, (None, None, None), **operand),
            workspace=fake_tensor(cutlass.Float32, (None, cfg.tile_n * cfg.tile_w), divisibility=512, align=16),
            flags=fake_tensor(cutlass.Int32, (None,), align=4),
        ),
        LceLaunch(tile_begin=cutlass.Int32(0), tile_end=cutlass.Int32(1), grid_size=cutlass.Int32(1),
                  wait_prior=cutlass.Int32(1), cooperative=cutlass.Int32(1)),
        fake_stream(),
    )
    return compile_kernel(kernel, *args, keep_ptx=keep_ptx, ptxas_report=ptxas_report)


def compile_linear_config(cfg: LinearConfig, *, keep_ptx: bool = False, ptxas_report: bool = False) -> CompiledKernel:
    """Compile one linear configuration for sm_90a (no GPU needed) -> CompiledKernel."""
    dt = cutlass_dtype(cfg.dtype)
    operand = dict(divisibility=8, align=16)
    ws = fake_tensor(cutlass.Float32, (None, None, None), divisibility=8, align=16)
    args = (
        LinearOperands(
            a=fake_tensor(dt, (None, None), **operand),
            b=fake_tensor(dt, (None, None), **operand),
            idx=fake_tensor(cutlass_dtype(cfg.idx_dtype), (None,), align=cfg.idx_dtype.itemsize),
        ),
        LinearEpilogue(
            out=ws if cfg.phase == "user" else fake_tensor(dt, (None, None), **operand),
            ws=ws,
            bias=fake_tensor(dt, (None,), align=2) if cfg.has_bias else None,
        ),
        LinearLaunch(*(cutlass.Int32(1) for _ in LinearLaunch._fields)),
        fake_stream(),
    )
    return compile_kernel(LinearSm90(cfg), *args, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
