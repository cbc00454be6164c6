"""IKBO flash attention forward for Hopper: target attention where one side
(K/V per user, or Q per user) is looked up through an index inside the kernel."""
from .attention import attention, work_list
from .config import SHIPPED_CONFIGS, AttentionConfig, compile_config
from .reference import attention_reference
from .worklist import WorkList

__all__ = ["SHIPPED_CONFIGS", "AttentionConfig", "WorkList", "attention", "attention_reference", "compile_config",
           "work_list"]
