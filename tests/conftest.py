import contextlib
import fcntl
import functools
import os
import tempfile
import time

import pytest

os.environ.setdefault("IKBO_VALIDATE", "1")
# Kernels compile afresh in each test session, into a disk cache of its own (removed at exit;
# an empty CUTE_KERNELS_CACHE_DIR keeps it off). Under pytest-xdist each worker takes a
# subdirectory of the directory the session's process chose, so no worker loads what another
# compiled.
if "CUTE_KERNELS_CACHE_DIR" not in os.environ:
    _KERNEL_CACHE = tempfile.TemporaryDirectory(prefix="cute-kernels-tests-")
    os.environ["CUTE_KERNELS_CACHE_DIR"] = _KERNEL_CACHE.name
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... in an xdist worker
if _WORKER and os.environ["CUTE_KERNELS_CACHE_DIR"].strip():
    os.environ["CUTE_KERNELS_CACHE_DIR"] = os.path.join(os.environ["CUTE_KERNELS_CACHE_DIR"], _WORKER)


@functools.lru_cache(maxsize=None)
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


# GPU tests of every worker (and of any other session on the machine) share the device's memory.
_GPU_LOCK = os.path.join(tempfile.gettempdir(), f"ikbo-gpu-tests-{os.getuid()}.lock")


@pytest.fixture(autouse=True)
def _gpu_memory_turns(request):
    """A GPU test holds a shared lock on the device while it runs and returns the allocator's
    cached blocks after it; one marked ``gpu_exclusive`` holds the lock alone, so that memory
    other workers' tests hold does not make it fail for want of memory."""
    if "gpu" not in request.keywords or not _sm90_available():
        yield
        return
    import torch

    with open(_GPU_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if "gpu_exclusive" in request.keywords else fcntl.LOCK_SH)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def cpu_bench_ms(fn, *, warmup=1, rep=3, rotate=None):
    """Stand-in for perf.harness.bench_ms in CPU dry runs of the benchmarks: wall-clock median."""
    sets = list(rotate) if rotate else [None]
    times = []
    for i in range(warmup + rep):
        start = time.perf_counter()
        fn(sets[i % len(sets)]) if rotate else fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[warmup:])[rep // 2]


def cpu_bench_interleaved(fns, *, warmup=1, rep=3, rotate=None):
    """Stand-in for perf.harness.bench_interleaved: each function on its own, wall clock; an
    exception becomes the function's entry, as in the real one."""
    result = {}
    for name, fn in fns.items():
        try:
            result[name] = cpu_bench_ms(fn, warmup=warmup, rep=rep, rotate=rotate)
        except Exception as e:
            result[name] = e
    return result


class FakePowerSampler:
    """Stands in for perf.harness.PowerSampler in CPU dry runs: a board held at its power limit."""
    WATTS, MHZ = 700.0, 1500.0

    def __init__(self, period_ms=100):
        self.samples = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.samples = [(self.WATTS, self.MHZ, 0x4)] * 12


@pytest.fixture
def cpu_timing(monkeypatch):
    """perf.harness timing on the CPU (dry runs of the benchmarks): wall clock, graph = half;
    sustained timing runs as it is (wall clock for a CPU device) under FakePowerSampler."""
    from perf import harness

    monkeypatch.setattr(harness, "bench_ms", cpu_bench_ms)
    monkeypatch.setattr(harness, "bench_interleaved", cpu_bench_interleaved)
    monkeypatch.setattr(harness, "bench_graph_interleaved", lambda fns, **k: {
        n: (0.5 * v if isinstance(v, float) else None) for n, v in cpu_bench_interleaved(fns, **k).items()})
    monkeypatch.setattr(harness, "PowerSampler", FakePowerSampler)


@pytest.fixture
def compile_eagerly(monkeypatch):
    """torch.compile replaced by the function itself (dry runs need no Inductor); returns the
    keyword arguments of each call, with the function under "fn"."""
    import torch

    calls = []

    def compile(fn, **kwargs):
        calls.append({"fn": fn, **kwargs})
        return fn

    monkeypatch.setattr(torch, "compile", compile)
    # The benchmarks turn Inductor's disk caches off for the process; the test session keeps its
    # setting (set back by hand: monkeypatch's undo deletes a config module's entry).
    caches_off = torch.compiler.config.force_disable_caches
    yield calls
    torch.compiler.config.force_disable_caches = caches_off


@pytest.fixture
def gemm_benchmarks_on_cpu(monkeypatch, cpu_timing):
    """bench_lce's and bench_linear's main() on the CPU: no Hopper check, a 64 KiB L2, and fixed
    same-run ceilings (cuBLAS 700 TFLOP/s, FP8 1400)."""
    from perf import bench_lce, bench_linear, fp8_peers, harness

    for module in (bench_lce, bench_linear):
        monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "require_hopper_or_exit", lambda *a, **k: None)
    monkeypatch.setattr(harness, "l2_bytes", lambda: 2**16)
    monkeypatch.setattr(harness, "cublas_ceiling_tflops", lambda dtype: 700.0)
    monkeypatch.setattr(fp8_peers, "fp8_ceiling_tflops", lambda: 1400.0)


@pytest.fixture
def devices_made_current(monkeypatch):
    """``patch(module)`` replaces the module's ``on_device`` with a recorder and returns the
    stack of devices made current (empty outside the op's guard)."""
    current = []

    @contextlib.contextmanager
    def on_device(device):
        current.append(device)
        yield
        current.pop()

    def patch(module):
        monkeypatch.setattr(module, "on_device", on_device)
        return current

    return patch


@pytest.fixture(autouse=True, scope="session")
def _ieee_fp32_matmul():
    """The fp32 references must not run on TF32 (CUDA matmuls; a no-op on the CPU)."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.fixture
def fresh_attention_plans():
    """ikbo_fa.attention's plan cache emptied before and after the test: for tests that change what
    a plan holds (the device's SM count or clusters, the configuration picked, the kernels), so
    that no plan built under the change outlives the test."""
    import importlib

    plans = importlib.import_module("ikbo_fa.attention")._plans
    plans.clear()
    yield plans
    plans.clear()
