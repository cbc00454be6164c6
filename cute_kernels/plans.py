"""Launch plans kept per call signature (shapes, dtypes, strides, devices, options)."""
from __future__ import annotations


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
