"""ikbo_rewrite: an inference-time pass that puts the IKBO ops into unmodified models."""
from .passes import rewrite
from .report import Left, Report, Rewrite

__all__ = ["Left", "Report", "Rewrite", "rewrite"]
