"""Compile once per static configuration, at first use, and never again in the process.

``cute.compile`` does not cache. ``kernel_cache.get(key, build)`` keys a
compiled kernel by everything that changes the generated code (kernel name,
dtypes, static tile configuration, target architecture); ``build`` runs
only on a miss. Compiles are serialized: the DSL is not thread-safe.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Hashable

import cutlass.cute as cute

from .arch import TARGET_ARCH


@dataclasses.dataclass
class CompiledKernel:
    fn: Callable[..., Any]
    seconds: float
    ptx: str | None = None
    ptxas_log: str | None = None

    def __call__(self, *args):
        return self.fn(*args)

    @property
    def spill_bytes(self) -> int:
        """Spill stores + loads that ptxas reported (needs ``ptxas_report=True``)."""
        if self.ptxas_log is None:
            raise ValueError("compiled without ptxas_report=True")
        found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", self.ptxas_log)
        if not found:
            raise ValueError("no ptxas resource report in the compile log")
        return sum(int(s) + int(l) for s, l in found)


_compile_lock = threading.RLock()


def compile_kernel(jit_fn, *args, keep_ptx: bool = False, ptxas_report: bool = False) -> CompiledKernel:
    """Compile a ``@cute.jit`` function for sm_90a (no GPU needed), TVM-FFI calling convention."""
    options = f"--enable-tvm-ffi --gpu-arch {TARGET_ARCH}"
    dump_dir = None
    if keep_ptx:
        # The PTX file is written to disk as a side effect: keep it out of the caller's directory.
        dump_dir = tempfile.mkdtemp(prefix="cute-kernels-")
        options += f" --keep-ptx --dump-dir={dump_dir}"
    if ptxas_report:
        options += " remarks{ptx}"
    log = io.StringIO()
    with _compile_lock:
        start = time.perf_counter()
        if ptxas_report:
            with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
                fn = cute.compile(jit_fn, *args, options=options)
        else:
            fn = cute.compile(jit_fn, *args, options=options)
        seconds = time.perf_counter() - start
    if dump_dir is not None:
        shutil.rmtree(dump_dir, ignore_errors=True)
    return CompiledKernel(
        fn=fn,
        seconds=seconds,
        ptx=fn.artifacts.PTX if keep_ptx else None,
        ptxas_log=log.getvalue() if ptxas_report else None,
    )


class KernelCache:
    """In-memory map from a static-configuration key to its compiled kernel."""

    def __init__(self):
        self._kernels: dict[Hashable, CompiledKernel] = {}

    def get(self, key: Hashable, build: Callable[[], CompiledKernel]) -> CompiledKernel:
        kernel = self._kernels.get(key)
        if kernel is None:
            with _compile_lock:
                kernel = self._kernels.get(key)
                if kernel is None:
                    kernel = build()
                    self._kernels[key] = kernel
        return kernel

    def compile_seconds(self, key: Hashable) -> float | None:
        kernel = self._kernels.get(key)
        return None if kernel is None else kernel.seconds

    def clear(self) -> None:
        self._kernels.clear()

    def __len__(self) -> int:
        return len(self._kernels)


kernel_cache = KernelCache()
