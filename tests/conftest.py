import os
import time

import pytest

os.environ.setdefault("IKBO_VALIDATE", "1")


def _sm90_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if _sm90_available():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def cpu_bench_ms(fn, *, warmup=1, rep=3, rotate=None):
    """Stand-in for perf.harness.bench_ms in CPU dry runs of the benchmarks: wall-clock median."""
    sets = list(rotate) if rotate else [None]
    times = []
    for i in range(warmup + rep):
        start = time.perf_counter()
        fn(sets[i % len(sets)]) if rotate else fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[warmup:])[rep // 2]


@pytest.fixture
def cpu_ms():
    return cpu_bench_ms
