"""Named bundles of kernel arguments: what crosses from the host to a kernel, and from a kernel's
entry to its warp roles, as a few typed ``typing.NamedTuple`` classes instead of long positional
lists.

CuTeDSL takes a NamedTuple wherever it takes a value. A ``@cute.jit`` or ``@cute.kernel``
function flattens its fields in order (so a bundle whose fields keep the old order keeps the
kernel's parameter list, and its SASS), a field that is None is an absent operand fixed at
compile time (and passed as None at run time too), and the TVM-FFI calling convention takes the
same tuple, of torch tensors and ints, at run time. So one class serves the kernel's
``__call__``, the compile path's fake arguments, the op's launch and a test's stand-in for the
kernel, and a new operand (a scale vector, say) is one field, not an edit of four lists.

:func:`kernel_arguments` marks a host -> kernel bundle and checks, when the class is defined,
that every field is of a kind the calling convention converts: a tensor (optionally None), a
32/64-bit scalar, or another such bundle.
"""
from __future__ import annotations

import typing
from typing import get_type_hints

import cutlass
import cutlass.cute as cute

# Scalars a host -> kernel bundle may hold (TVM-FFI converts them from Python ints and floats).
SCALARS = (cutlass.Int32, cutlass.Int64, cutlass.Float32)


def _is_bundle(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


def _field_ok(hint) -> bool:
    if hint is cute.Tensor or hint in SCALARS:
        return True
    if _is_bundle(hint):
        return getattr(hint, "__kernel_arguments__", False)
    members = typing.get_args(hint)
    if members and type(None) in members:  # Optional[...]: absent at compile time
        return all(_field_ok(m) for m in members if m is not type(None))
    return False


def kernel_arguments(cls):
    """Class decorator: ``cls`` (a typing.NamedTuple) is a host -> kernel bundle. TypeError,
    naming the field, for a field of a kind the calling convention cannot pass."""
    if not _is_bundle(cls):
        raise TypeError(f"kernel_arguments: {cls.__name__} must be a typing.NamedTuple")
    hints = get_type_hints(cls)
    for name in cls._fields:
        if name not in hints or not _field_ok(hints[name]):
            raise TypeError(f"kernel_arguments: {cls.__name__}.{name} is annotated {hints.get(name)!r}; a kernel "
                            f"argument is a cute.Tensor (or None), one of {[s.__name__ for s in SCALARS]}, "
                            f"or another kernel_arguments bundle")
    cls.__kernel_arguments__ = True
    return cls


def bundle_items(bundle, prefix: str = ""):
    """(dotted name, value) of every leaf of ``bundle``, nested bundles flattened in order: the
    order in which the kernel receives them."""
    for name, value in zip(bundle._fields, bundle):
        if _is_bundle(type(value)):
            yield from bundle_items(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


class GemmSmemLayouts(typing.NamedTuple):
    """A GEMM kernel's MMA and the shared-memory layouts it partitions (compile-time values,
    passed from the kernel's ``__call__`` to its ``@cute.kernel``)."""

    tiled_mma: cute.TiledMma
    a: cute.ComposedLayout
    b: cute.ComposedLayout
    epi: cute.ComposedLayout
