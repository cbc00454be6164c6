"""IKBO flash attention forward for Hopper: target attention where one side
(K/V per user, or Q per user) is looked up through an index inside the kernel."""
from .attention import attention
from .reference import attention_reference

__all__ = ["attention", "attention_reference"]
