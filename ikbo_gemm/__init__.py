"""IKBO GEMMs: the user/candidate decomposition with the broadcast fused into the kernel.

- ``lce``: linear compression, ``out[b] = w_cand @ e_cand[b] + w_user @ e_user[idx[b]]``;
- ``linear``: a linear layer on concatenated user and candidate features,
  ``out[b] = act(x_cand[b] @ w_cand.T + x_user[idx[b]] @ w_user.T + bias)``;
- ``quantize_fp8``: FP8 (e4m3) operands and their scales for both, in the layouts they take.
"""
from .config import LceConfig, LinearConfig
from .config import compile_config as _compile_lce
from .config import compile_linear_config as _compile_linear
from .config import LINEAR_SHIPPED_CONFIGS as _LINEAR_SHIPPED
from .config import SHIPPED_CONFIGS as _LCE_SHIPPED
from .lce import lce
from .linear import linear, split_weight
from .quantize import quantize_fp8
from .reference import lce_reference, linear_reference

SHIPPED_CONFIGS = tuple(_LCE_SHIPPED) + tuple(_LINEAR_SHIPPED)


def compile_config(cfg, *, keep_ptx: bool = False, ptxas_report: bool = False):
    """Compile one shipped configuration (LceConfig or LinearConfig) for sm_90a -> CompiledKernel."""
    if isinstance(cfg, LinearConfig):
        return _compile_linear(cfg, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
    if isinstance(cfg, LceConfig):
        return _compile_lce(cfg, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
    raise TypeError(f"compile_config takes an LceConfig or a LinearConfig, got {type(cfg).__name__}")


__all__ = ["SHIPPED_CONFIGS", "LceConfig", "LinearConfig", "compile_config", "lce", "lce_reference", "linear",
           "linear_reference", "quantize_fp8", "split_weight"]
