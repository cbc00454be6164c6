"""Input checks shared by the ops: clear errors that name the argument, its
shape and what was expected, and the optional index range check.

The range check reads the index tensor back to the host (a synchronization),
so it runs only when asked: ``validate=True`` on the op, or ``IKBO_VALIDATE=1``
in the environment, and never inside a CUDA-graph capture.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def validation_enabled(validate: Optional[bool]) -> bool:
    """Whether to range-check the indices: ``validate`` where given (a bool), else the
    IKBO_VALIDATE environment variable ("", "0", "false", "no", "off", "n": off). Inside a
    CUDA-graph capture the check cannot run (it reads the indices back to the host):
    ``validate=True`` raises there, and IKBO_VALIDATE does not apply to captured calls."""
    if validate is not None:
        if not isinstance(validate, (bool, int)):  # a string such as "0" or "false" is truthy
            raise TypeError(f"validate must be a bool or None, got {type(validate).__name__} {validate!r}")
        if validate and capturing():
            raise RuntimeError(
                "validate=True reads the indices back to the host, which a CUDA-graph capture forbids: "
                "capture with validate=False (and validate the indices before, outside the capture)"
            )
        return bool(validate)
    enabled = os.environ.get("IKBO_VALIDATE", "0").strip().lower() not in ("", "0", "false", "no", "off", "n")
    return enabled and not capturing()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(
    name: str,
    t,
    *,
    ndim: int,
    dtypes: Iterable[torch.dtype],
    layout: str,
    empty_batch: bool = False,
) -> torch.Tensor:
    """``t`` is a tensor of rank ``ndim``, one of ``dtypes``, with no empty dimension (but its
    first, with ``empty_batch``: a batch of 0 candidates gives an empty result).

    ``layout`` spells the expected dimensions for the message, e.g. ``"[B, K_cand, N]"``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor {layout}, got layout {t.layout}")
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {names}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        dims = "1 dimension" if ndim == 1 else f"{ndim} dimensions"
        raise ValueError(f"{name} must have {dims} {layout}, got shape {_shape(t)}")
    if any(n == 0 for n in t.shape[1 if empty_batch else 0:]):
        which = "every size but the first" if empty_batch else "every size"
        raise ValueError(f"{name} must not be empty: expected {layout} with {which} >= 1, got {_shape(t)}")
    return t


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str, layout: str) -> None:
    """Dimension ``dim`` of ``t`` (laid out as ``layout``) is ``expected``; ``what`` says where
    that size comes from, e.g. ``"K_cand (w_cand.shape[1])"``."""
    if t.shape[dim] != expected:
        dim_name = layout.strip("[]").split(", ")[dim] if layout.count(",") >= dim else str(dim)
        raise ValueError(
            f"{name} has shape {_shape(t)}, expected {layout}: its {dim_name} (dimension {dim}) must be "
            f"{what} = {expected}, got {t.shape[dim]}"
        )


def check_same_dtype(names: Iterable[str], tensors: Iterable[torch.Tensor]) -> torch.dtype:
    names, tensors = list(names), list(tensors)
    dtype = tensors[0].dtype
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != dtype:
            raise TypeError(
                f"{n} is {str(t.dtype).replace('torch.', '')} but {names[0]} is "
                f"{str(dtype).replace('torch.', '')}: all operands must share one dtype"
            )
    return dtype


def check_same_device(names: Iterable[str], tensors: Iterable[torch.Tensor]) -> torch.device:
    names, tensors = list(names), list(tensors)
    device = tensors[0].device
    for n, t in zip(names[1:], tensors[1:]):
        if t.device != device:
            raise ValueError(f"{n} is on {t.device} but {names[0]} is on {device}: all tensors must share one device")
    return device


def check_index(name: str, idx, length: int, length_what: str, empty: bool = False):
    """``idx`` is an int32/int64 vector of ``length`` entries (0 allowed with ``empty``)."""
    check_tensor(name, idx, ndim=1, dtypes=INDEX_DTYPES, layout=f"[{length_what}]", empty_batch=empty)
    if idx.shape[0] != length:
        raise ValueError(f"{name} has shape {_shape(idx)}: expected [{length_what}] = [{length}]")
    return idx


def check_index_range(name: str, idx: torch.Tensor, upper: int, upper_name: str, meaning: str = "") -> None:
    """Every entry of ``idx`` lies in [0, upper). Synchronizes with the device. ``upper_name``
    names the bound (``"U"``), ``meaning`` says what it is (``"the batch of k and v"``)."""
    bad = (idx < 0) | (idx >= upper)
    if bool(bad.any()):
        pos = int(torch.nonzero(bad)[0, 0])
        what = f", {upper_name} being {meaning}" if meaning else ""
        raise IndexError(
            f"{name}[{pos}] = {int(idx[pos])} is out of range: values must lie in [0, {upper_name}) = "
            f"[0, {upper}){what}"
        )


def check_output(name: str, out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if out.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {out.layout}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {_shape(out)}, expected [{', '.join(map(str, shape))}]")
    if out.dtype != dtype:
        raise TypeError(f"{name} must be {str(dtype).replace('torch.', '')}, got {str(out.dtype).replace('torch.', '')}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}, expected {device}")
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return out


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes that ``t`` can address (non-empty ``t``)."""
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.nbytes
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def check_no_overlap(out_name: str, out: torch.Tensor, names: Iterable[str], tensors: Iterable) -> None:
    """``out`` shares no memory with any of ``tensors`` (None entries are skipped).

    The kernels read their inputs while they write the output, in an order that depends on
    the schedule, so an output that overlaps an input would give wrong values. Byte ranges
    are compared (one address space for all devices), so views that interleave without
    touching are refused too.
    """
    if out.device.type == "meta" or out.layout != torch.strided:
        return  # no storage to overlap (meta), or refused by the shape checks (sparse)
    o0, o1 = _byte_span(out)
    for name, t in zip(names, tensors):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            t0, t1 = _byte_span(t)
            if t0 < o1 and o0 < t1:
                raise ValueError(
                    f"{out_name} overlaps {name} in memory: the kernel reads {name} while it writes "
                    f"{out_name}; pass an {out_name} that shares no memory with the inputs"
                )


def check_writable(name: str, out: torch.Tensor) -> None:
    """The checks torch makes before writing ``out`` in place. A kernel stores through the
    pointer, past autograd's and inference mode's own checks, so they are made here."""
    if out.requires_grad and out.is_leaf and torch.is_grad_enabled():
        raise RuntimeError(f"{name} is a leaf tensor that requires grad: it cannot be written in place")
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name} is an inference tensor: it can be written only under torch.inference_mode()")


def check_out_target(out_name: str, out: torch.Tensor, names: Iterable[str], tensors: Iterable) -> None:
    """``out`` may take a kernel's stores: it shares no memory with the inputs
    (:func:`check_no_overlap`) and torch would let it be written in place (:func:`check_writable`)."""
    check_no_overlap(out_name, out, names, tensors)
    check_writable(out_name, out)


def policy_or_default(op: str, name: str, value, cls: type, default):
    """An op's launch-policy argument: ``value`` where it is a ``cls``, ``default`` where it is
    None; TypeError naming the argument otherwise."""
    if value is None:
        return default
    if not isinstance(value, cls):
        raise TypeError(f"{op}: {name} must be {cls.__name__} or None, got {type(value).__name__}")
    return value
