"""IKBO GEMMs: linear compression (``lce``), the decomposed GEMM with the broadcast fused into
its epilogue."""
from .config import SHIPPED_CONFIGS, LceConfig, compile_config
from .lce import lce
from .reference import lce_reference

__all__ = ["SHIPPED_CONFIGS", "LceConfig", "compile_config", "lce", "lce_reference"]
