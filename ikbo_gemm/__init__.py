"""IKBO linear compression: the decomposed GEMM with the broadcast fused into its epilogue."""
from .lce import SHIPPED_CONFIGS, LceConfig, compile_config, lce
from .reference import lce_reference

__all__ = ["SHIPPED_CONFIGS", "LceConfig", "compile_config", "lce", "lce_reference"]
