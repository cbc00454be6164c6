"""IKBO GEMMs: the user/candidate decomposition with the broadcast fused into the kernel.

- ``lce``: linear compression, ``out[b] = w_cand @ e_cand[b] + w_user @ e_user[idx[b]]``;
- ``linear``: a linear layer on concatenated user and candidate features,
  ``out[b] = act(x_cand[b] @ w_cand.T + x_user[idx[b]] @ w_user.T + bias)``.
"""
from .config import LceConfig, LinearConfig
from .config import compile_config as _compile_lce
from .config import compile_linear_config as _compile_linear
from .config import LINEAR_SHIPPED_CONFIGS as _LINEAR_SHIPPED
from .config import SHIPPED_CONFIGS as _LCE_SHIPPED
from .lce import LcePolicy, lce
from .linear import PlanRules, linear, split_weight
from .reference import lce_reference, linear_reference

SHIPPED_CONFIGS = tuple(_LCE_SHIPPED) + tuple(_LINEAR_SHIPPED)


def compile_config(cfg, *, keep_ptx: bool = False, ptxas_report: bool = False):
    """Compile one shipped configuration (LceConfig or LinearConfig) for sm_90a -> CompiledKernel."""
    if isinstance(cfg, LinearConfig):
        return _compile_linear(cfg, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
    if isinstance(cfg, LceConfig):
        return _compile_lce(cfg, keep_ptx=keep_ptx, ptxas_report=ptxas_report)
    raise TypeError(f"compile_config takes an LceConfig or a LinearConfig, got {type(cfg).__name__}")


__all__ = ["SHIPPED_CONFIGS", "LceConfig", "LcePolicy", "LinearConfig", "PlanRules", "compile_config", "lce",
           "lce_reference", "linear", "linear_reference", "split_weight"]
