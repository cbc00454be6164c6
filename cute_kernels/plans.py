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
    layout (a layout without strides by its shape alone: the full checks then refuse it), tuples
    and lists item by item, anything else as it is. It runs on every call of the ops, so it stays
    a flat loop."""
    key = []
    for x in parts:
        if isinstance(x, torch.Tensor):
            try:
                key.append((x.dtype, x.shape, x.stride(), x.device, x.layout))
            except RuntimeError:  # a layout without strides
                key.append((x.layout, x.shape))
        elif isinstance(x, (tuple, list)):
            key.append((type(x), plan_key(*x)))
        else:
            key.append(x)
    return tuple(key)


def on_gpu(x) -> bool:
    """Whether ``x`` is a tensor on a CUDA device (the ops' kernels run there, the references elsewhere)."""
    return isinstance(x, torch.Tensor) and x.is_cuda
