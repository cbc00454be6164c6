"""Compile once per static configuration, at first use, and never again in the process.

``cute.compile`` does not cache. ``kernel_cache.get(key, build)`` keys a
compiled kernel by everything that changes the generated code (kernel name,
dtypes, static tile configuration, target architecture); ``build`` runs
only on a miss. Compiles are serialized: the DSL is not thread-safe.

Across processes. Given ``package`` (the package the kernel's source lives
in), ``get`` also keeps the compiled kernel on disk as an object file and a
later process loads it in milliseconds instead of compiling for seconds. The
file name hashes the key, every ``.py`` file of that package and of
``cute_kernels``, the DSL and TVM-FFI versions and the target, so any change
to the code compiles afresh. The directory is ``$CUTE_KERNELS_CACHE_DIR``,
else ``$XDG_CACHE_HOME/cute_kernels`` (``~/.cache/cute_kernels``); an empty
``CUTE_KERNELS_CACHE_DIR`` turns it off. A file that cannot be written or read
is warned about and the kernel compiled as without the cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import io
import os
import platform
import re
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Hashable, Optional

import cutlass.cute as cute

from .arch import TARGET_ARCH
from .dsl_lock import DSL_LOCK


@dataclasses.dataclass
class CompiledKernel:
    fn: Callable[..., Any]
    seconds: float  # compile time, or load time where ``loaded``
    ptx: str | None = None
    ptxas_log: str | None = None
    loaded: bool = False  # loaded from the disk cache, not compiled in this process

    def __call__(self, *args):
        return self.fn(*args)

    def _report(self) -> str:
        if self.ptxas_log is None:
            raise ValueError("compiled without ptxas_report=True")
        return self.ptxas_log

    @property
    def spill_bytes(self) -> int:
        """Spill stores + loads that ptxas reported (needs ``ptxas_report=True``)."""
        found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", self._report())
        if not found:
            raise ValueError("no ptxas resource report in the compile log")
        return sum(int(s) + int(l) for s, l in found)

    @property
    def wgmma_notes(self) -> list[str]:
        """ptxas's notes on wgmma (codes C75xx): fences or waits it had to insert, or wgmmas it
        serialized (needs ``ptxas_report=True``). Empty for a kernel whose wgmma pipeline is
        exactly as written."""
        return re.findall(r"\(C75\d\d\)[^\n]*", self._report())


_compile_lock = DSL_LOCK  # compiles are serialized


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


_FORMAT = "1"  # bump when the file layout below changes
_EXPORTED_NAME = "kernel"


def cache_dir() -> Optional[Path]:
    """The disk cache's directory, or None where it is turned off."""
    configured = os.environ.get("CUTE_KERNELS_CACHE_DIR")
    if configured is not None:
        return Path(configured) if configured.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cute_kernels"


@functools.lru_cache(maxsize=None)
def source_fingerprint(package: str) -> str:
    """Hash of every ``.py`` file (path and content) of ``package`` and of cute_kernels."""
    digest = hashlib.sha256()
    for name in sorted({package, __package__}):
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _toolchain() -> str:
    versions = [importlib.metadata.version(d) for d in ("nvidia-cutlass-dsl", "apache-tvm-ffi")]
    return "|".join([_FORMAT, TARGET_ARCH, platform.machine(), *versions])


def disk_path(key: Hashable, package: str) -> Optional[Path]:
    """The object file that holds ``key``'s kernel, or None where the disk cache is off."""
    root = cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256("\0".join((repr(key), source_fingerprint(package), _toolchain())).encode())
    return root / f"{package}-{digest.hexdigest()[:32]}.o"


def _disk_path_or_none(key: Hashable, package: Optional[str]) -> Optional[Path]:
    if package is None:
        return None
    try:
        return disk_path(key, package)
    except Exception as e:  # e.g. a package without source files: memory only
        warnings.warn(f"cute_kernels: no disk cache for {package} ({e})", stacklevel=4)
        return None


def _load(path: Path) -> Optional[CompiledKernel]:
    if not path.is_file():
        return None
    start = time.perf_counter()
    try:
        fn = cute.runtime.load_module(str(path), enable_tvm_ffi=True)[_EXPORTED_NAME]
    except Exception as e:  # a truncated or foreign file: compile instead, and replace it
        warnings.warn(f"cute_kernels: cannot load cached kernel {path} ({e}); compiling it", stacklevel=3)
        return None
    return CompiledKernel(fn=fn, seconds=time.perf_counter() - start, loaded=True)


def _store(kernel: CompiledKernel, path: Path) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kernel.fn.export_to_c(str(tmp), _EXPORTED_NAME)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    except Exception as e:
        warnings.warn(f"cute_kernels: cannot write the kernel cache {path} ({e})", stacklevel=3)
        with contextlib.suppress(OSError):
            tmp.unlink()


class KernelCache:
    """In-memory map from a static-configuration key to its compiled kernel, backed by
    the disk cache for the kernels that name their ``package``."""

    def __init__(self):
        self._kernels: dict[Hashable, CompiledKernel] = {}

    def get(self, key: Hashable, build: Callable[[], CompiledKernel], package: Optional[str] = None) -> CompiledKernel:
        """The kernel for ``key``: from memory, else from the disk cache (with ``package``),
        else ``build()`` (then stored on disk with ``package``)."""
        kernel = self._kernels.get(key)
        if kernel is None:
            with _compile_lock:
                kernel = self._kernels.get(key)
                if kernel is None:
                    path = _disk_path_or_none(key, package)
                    kernel = _load(path) if path is not None else None
                    if kernel is None:
                        kernel = build()
                        if path is not None:
                            _store(kernel, path)
                    self._kernels[key] = kernel
        return kernel

    def values(self) -> list[CompiledKernel]:
        """The kernels held in memory."""
        return list(self._kernels.values())

    def compile_seconds(self, key: Hashable) -> float | None:
        kernel = self._kernels.get(key)
        return None if kernel is None else kernel.seconds

    def clear(self) -> None:
        self._kernels.clear()

    def __len__(self) -> int:
        return len(self._kernels)


kernel_cache = KernelCache()
