"""Benchmark providers, declared once: a name, how to set one up and call it, and the libraries
it needs, which ``LIBS`` imports once per process (CPU tests put stand-ins into ``LIBS.modules``).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional, Sequence

INSTALL_HINT = "pip install -e '.[bench]'"


@dataclasses.dataclass(frozen=True)
class Library:
    module: str  # imported by name
    attr: str  # a callable the providers use (absent: an older or broken install)
    missing: str  # what the note says is lost without it


LIBRARIES = {
    "ikbo_fa": Library("ikbo_fa", "attention", "ikbo providers skipped"),
    "fa4": Library("flash_attn.cute", "flash_attn_varlen_func", f"FA4 providers skipped; `{INSTALL_HINT}`"),
    "fa3": Library("fa3_fwd_interface", "flash_attn_varlen_func",
                   "FA3 providers skipped (the fa3-fwd wheel: docs/benchmarks.md)"),
    "ikbo_gemm.lce": Library("ikbo_gemm", "lce", "ikbo rows skipped"),
    "ikbo_gemm.linear": Library("ikbo_gemm", "linear", "ikbo rows skipped"),
    "ikbo_rewrite": Library("ikbo_rewrite", "compile", "the rewrite's rows skipped"),
}


class Libraries:
    """The libraries of ``LIBRARIES`` this process imported: ``modules[key]`` is the module, or
    None with ``notes[key]`` saying why it is not there."""

    def __init__(self):
        self.modules: dict = {}
        self.notes: dict = {}

    def load(self, keys: Sequence[str]) -> list:
        """Import each library not tried yet; returns the notes of those missing (all of them)."""
        for key in keys:
            if key not in self.modules:
                self.modules[key], self.notes[key] = _import(LIBRARIES[key])
        return [self.notes[k] for k in dict.fromkeys(keys) if self.modules.get(k) is None and self.notes.get(k)]

    def get(self, key: str):
        """The module of library ``key`` (None when missing or not loaded)."""
        return self.modules.get(key)

    def skip_note(self, prov: "Provider") -> Optional[str]:
        """Why ``prov`` cannot run here (its first missing library), or None."""
        for key in prov.needs:
            if self.modules.get(key) is None:
                return self.notes.get(key) or f"{key} missing"
        return None


def _import(lib: Library) -> tuple[Any, Optional[str]]:
    try:
        module = importlib.import_module(lib.module)
    except Exception as e:  # an ImportError, or a broken install
        return None, f"{lib.module} not importable ({type(e).__name__}: {e}); {lib.missing}"
    if not callable(getattr(module, lib.attr, None)):
        return None, f"{lib.module}.{lib.attr} does not exist; {lib.missing}"
    return module, None


LIBS = Libraries()


@dataclasses.dataclass(frozen=True)
class Provider:
    """One way to compute a benchmark's output, timed against the others."""
    name: str
    setup: Callable[[Any, Any], Any]  # (problem, inputs) -> state, untimed; raises harness.Skip
    run: Callable[[Any, Any, Any], Any]  # (problem, state, inputs) -> output, timed
    needs: tuple = ()  # keys of LIBRARIES
    checked: bool = True  # its output is the op's, checked against the reference (False: a copy alone)
    tags: frozenset = frozenset()  # what a benchmark groups providers by (e.g. the peers it judges by)


def needed(provs: Sequence[Provider]) -> list:
    """The libraries ``provs`` need, in first-use order."""
    return list(dict.fromkeys(key for prov in provs for key in prov.needs))


def select(provs: Sequence[Provider], names: Optional[Sequence[str]]) -> list:
    """The providers named (when ``names`` is empty, all but the extra ones), in declaration order."""
    return [prov for prov in provs if (prov.name in names if names else not getattr(prov, "extra", False))]
