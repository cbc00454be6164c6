"""Which devices the kernels run on, and clear errors for the others."""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from .dsl_lock import DSL_LOCK

TARGET_ARCH = "sm_90a"


def is_sm90(device: torch.device) -> bool:
    """True for a CUDA device of compute capability 9.0 (H100, H200, H20, GH200)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def on_device(device: torch.device):
    """A context in which ``device`` is the current CUDA device (no-op where it already is, or
    for a CPU device). A kernel launches in the current device's context, on the current stream
    of its first tensor's device: operands on another GPU need their own device current."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


def cuda_sm90_available() -> bool:
    return torch.cuda.is_available() and is_sm90(torch.device("cuda", torch.cuda.current_device()))


def require_sm90(device: torch.device, op: str) -> None:
    """Raise a clear error when ``device`` is a CUDA GPU the kernels were not built for."""
    if device.type == "cuda" and not is_sm90(device):
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"{op}: the kernel is built for Hopper (sm_90); {name} is sm_{major}{minor}. "
            f"Call {op}_reference for a PyTorch evaluation on this device."
        )


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors (cached: a property query costs microseconds)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.lru_cache(maxsize=None)
def _max_active_clusters(index: int, cluster_size: int) -> int:
    from cutlass.utils import HardwareInfo

    # The occupancy query compiles and loads a probe kernel, and the DSL is not thread-safe:
    # it runs under the lock that every compile takes.
    with DSL_LOCK, torch.cuda.device(index), _primary_context(index):
        return HardwareInfo(index).get_max_active_clusters(cluster_size)


@contextlib.contextmanager
def _primary_context(index: int):
    """The device's primary context pushed as the current one. The occupancy query reports
    for the current context: a green context's share of the SMs, or nothing in a thread that
    has made no CUDA runtime call yet (it has no current context). Launch plans are made per
    device, so they are sized for the whole device, whatever context is current."""
    from cuda.bindings import driver

    err, device = driver.cuDeviceGet(index)
    if err == driver.CUresult.CUDA_SUCCESS:
        err, ctx = driver.cuDevicePrimaryCtxRetain(device)
    if err == driver.CUresult.CUDA_SUCCESS:
        (err,) = driver.cuCtxPushCurrent(ctx)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot make the primary CUDA context of device {index} current: {err}")
    try:
        yield
    finally:
        driver.cuCtxPopCurrent()


def context_sm_count() -> Optional[int]:
    """SMs that the current CUDA context may use: a green context's share, else the device's.
    None where the driver cannot say (no current context, a driver without the query)."""
    try:
        from cuda.bindings import driver

        err, ctx = driver.cuCtxGetCurrent()
        if err != driver.CUresult.CUDA_SUCCESS or int(ctx) == 0:
            return None
        err, resource = driver.cuCtxGetDevResource(ctx, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        return int(resource.sm.smCount)
    except Exception:  # noqa: BLE001 - an older cuda-python or driver: unknown
        return None


def max_active_clusters(device: torch.device, cluster_size: int) -> int:
    """Clusters of ``cluster_size`` CTAs (one CTA per SM) that can be resident at once.

    Persistent kernels whose CTAs wait on each other launch at most this many,
    so every CTA they wait on is running.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if cluster_size == 1:
        return _sm_count(index)
    return _max_active_clusters(index, cluster_size)
