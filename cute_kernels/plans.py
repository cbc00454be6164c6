"""Launch plans kept per call signature (shapes, dtypes, strides, devices, options), and the key
of a signature."""
from __future__ import annotations

import torch


class PlanCache(dict):
    """A dict of launch plans holding at most ``limit`` of them. Past that it starts over:
    a signature that keeps changing (a batch size per request) must not grow it without end,
    and rebuilding a plan costs only host checks, never a compile."""

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit

    def keep(self, key, plan):
        """Store ``plan`` under ``key`` (clearing the cache first if it is full); return it."""
        if key not in self and len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan


def plan_key(*parts) -> tuple:
    """A hashable key of an op call's signature: each tensor by dtype, shape, strides, device and
    layout (a non-strided tensor by layout alone: the full checks then refuse it), tuples and
    lists item by item, anything else as it is."""
    return tuple(_key_of(p) for p in parts)


def _key_of(x):
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            return ("tensor", x.layout)
        return ("tensor", x.dtype, tuple(x.shape), x.stride(), x.device)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, *(_key_of(v) for v in x))
    return x


def on_gpu(x) -> bool:
    """Whether ``x`` is a tensor on a CUDA device (the ops' kernels run there, the references elsewhere)."""
    return isinstance(x, torch.Tensor) and x.is_cuda
