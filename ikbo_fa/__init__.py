"""IKBO flash attention forward for Hopper: target attention where one side
(K/V per user, or Q per user) is looked up through an index inside the kernel."""
from .attention import attention, work_list
from .config import SHIPPED_CONFIGS, AttentionConfig
from .fwd_compile import compile_config
from .policy import DEFAULT_POLICY, AttentionPolicy
from .reference import attention_reference
from .worklist import WorkList

__all__ = ["DEFAULT_POLICY", "SHIPPED_CONFIGS", "AttentionConfig", "AttentionPolicy", "WorkList", "attention",
           "attention_reference", "compile_config", "work_list"]
