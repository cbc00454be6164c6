"""IKBO GEMMs: the user/candidate decomposition with the broadcast fused into the kernel.

- ``lce``: linear compression, ``out[b] = w_cand @ e_cand[b] + w_user @ e_user[idx[b]]``;
- ``linear``: a linear layer on concatenated user and candidate features,
  ``out[b] = act(x_cand[b] @ w_cand.T + x_user[idx[b]] @ w_user.T + bias)``;
- ``quantize_fp8``: FP8 (e4m3) operands and their scales for both, in the layouts they take.
"""
from .compile import compile_config
from .config import LINEAR_SHIPPED_CONFIGS as _LINEAR_SHIPPED
from .config import SHIPPED_CONFIGS as _LCE_SHIPPED
from .config import LceConfig, LinearConfig
from .lce import LcePolicy, lce
from .linear import PlanRules, linear, split_weight
from .quantize import quantize_fp8
from .reference import lce_reference, linear_reference

SHIPPED_CONFIGS = tuple(_LCE_SHIPPED) + tuple(_LINEAR_SHIPPED)


__all__ = ["SHIPPED_CONFIGS", "LceConfig", "LcePolicy", "LinearConfig", "PlanRules", "compile_config", "lce",
           "lce_reference", "linear", "linear_reference", "quantize_fp8", "split_weight"]
