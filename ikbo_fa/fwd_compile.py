"""The attention forward kernel's compile: one configuration for sm_90a, from fake arguments (no
GPU needed). Beside config.py (the compile key and shipped set), which the kernel imports."""
from __future__ import annotations

from cutlass import Float32, Int32

from cute_kernels.compile import compile_kernel
from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

from .config import AttentionConfig
from .fwd_args import FwdScalars, FwdTensors, FwdWorkList


def compile_config(cfg: AttentionConfig, *, keep_ptx: bool = False, ptxas_report: bool = False):
    """Compile one configuration for sm_90a from fake tensors (no GPU needed) -> CompiledKernel."""
    from .fwd_sm90 import IkboAttentionFwdSm90  # the kernel module is imported at the first compile

    dt = cutlass_dtype(cfg.dtype)
    d = cfg.head_dim
    kv = cfg.direction == "kv"
    vec = lambda: fake_tensor(Int32, (None,), align=4)  # noqa: E731
    # Sizes B, H, L, ... are symbolic; strides are multiples of 8 elements (16 B).
    tensors = FwdTensors(
        q=fake_tensor(dt, (None, cfg.s_q, None, d), divisibility=8),
        k=fake_tensor(dt, (None, None, None, d), divisibility=8),
        v=fake_tensor(dt, (None, None, None, d), divisibility=8),
        out=fake_tensor(dt, (None, cfg.s_q, None, d), divisibility=8),
        lse=fake_tensor(Float32, (None, None, cfg.s_q), align=4) if cfg.return_lse else None,
        kv_lengths=vec() if cfg.has_kv_lengths else None,
        kv_offsets=vec() if cfg.jagged else None,
        final_out=fake_tensor(dt, (None, cfg.s_q, None, d), divisibility=8) if cfg.whole_rows_out else None,
        final_lse=fake_tensor(Float32, (None, None, cfg.s_q), align=4) if cfg.whole_rows_out else None,
    )
    wl = FwdWorkList(cand=vec(), cand_start=vec() if kv else None, tile_start=vec() if kv else None,
                     grouped=fake_tensor(Int32, (1,), align=4) if kv else None, perm=vec() if cfg.ordered else None,
                     walk=fake_tensor(Int32, (2,), align=4) if cfg.dynamic_walk else None)
    scalars = FwdScalars(q_flat=Int32(0), max_keys=Int32(0), n_splits=Int32(1), split_keys=Int32(0),
                         prefetch_blocks=Int32(0), scale_log2=Float32(1.0), scale=Float32(1.0))
    return compile_kernel(IkboAttentionFwdSm90(cfg), tensors, wl, scalars, Int32(1), fake_stream(),
                          keep_ptx=keep_ptx, ptxas_report=ptxas_report)
