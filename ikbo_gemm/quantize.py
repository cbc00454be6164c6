"""ikbo_gemm.quantize_fp8: FP8 (e4m3) operands with their scales, in the layouts the FP8 ops take.

    scale = max(amax(|x|) over ``dim``, AMAX_FLOOR) * (1 / 448)  (float32)
    x8    = e4m3(clamp(x * (1 / scale), -448, 448))               (round to nearest even)

so that ``x8.float() * scale`` approximates x (relative error at most 2^-4 per element, for
elements above e4m3's subnormal range times the scale). The floor keeps a row of zeros (or of
values below it) at a finite, nonzero scale: its x8 is 0 or small, never NaN. A row holding
NaN or inf gets a non-finite scale, and dequantizes to NaN.

Layouts: ``"same"`` keeps x's shape (a contiguous result); ``"transposed"`` swaps the last two
dimensions, which is how the FP8 lce takes e: e [B, K, N] -> e8 [B, N, K], K-major, since 8-bit
wgmma reads both operands K-major. Transposing while quantizing costs nothing beyond the pass
the quantization makes anyway. The transposed result's rows start 16 bytes apart (a view of
rows padded to a multiple of 16 elements where K is not one), the pitch TMA needs: the op takes
it as it is, where a contiguous e8 of such a K would cost a padded copy per call.
"""
from __future__ import annotations

import math
from typing import Union

import torch

from cute_kernels import on_device, on_gpu, require_sm90

from .checks import FP8
from .config import round_up
from .quantize_sm90 import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX, quantize_kernel
from .quantize_staged_sm90 import MAX_CTAS, STAGE_BYTES, QuantizeArgs, quantize_staged_kernel

# On an H100, rows of 1 KB ran 38 us two-pass against 57 us read once (16,384 rows), rows of 2 KB
# level (17 and 18 us, 4,096 rows), rows of 4 KB 15 against 12 us.
MIN_STAGED_BYTES = 2048

LAYOUTS = ("same", "transposed")
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _reduced_dims(x: torch.Tensor, dim) -> tuple:
    """``dim`` (an int, a tuple of ints or None: all) as sorted non-negative dims of x."""
    if dim is None:
        return tuple(range(x.dim()))
    dims = (dim,) if isinstance(dim, int) and not isinstance(dim, bool) else dim
    if not isinstance(dims, (tuple, list)) or not dims or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"dim must be an int, a tuple of ints or None, got {dim!r}")
    if any(not -x.dim() <= d < x.dim() for d in dims):
        raise ValueError(f"dim {dim!r} is out of range for x of {x.dim()} dimensions")
    result = tuple(sorted({d % x.dim() for d in dims}))
    if len(result) != len(dims):
        raise ValueError(f"dim {dim!r} names a dimension twice")
    return result


def check_quantize_args(x, dim, layout) -> tuple:
    """Validate a quantize_fp8 call; return the reduced dims (sorted, non-negative)."""
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
        raise TypeError(f"x must be a dense torch.Tensor, got {type(x).__name__ if not isinstance(x, torch.Tensor) else x.layout}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {str(x.dtype).replace('torch.', '')}")
    if x.dim() < 1:
        raise ValueError("x must have 1 dimension at least, got a 0-d tensor")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if layout == "transposed" and x.dim() < 2:
        raise ValueError(f"layout 'transposed' swaps the last two dimensions: x needs 2 at least, got shape "
                         f"{list(x.shape)}")
    dims = _reduced_dims(x, dim)
    if any(x.shape[d] == 0 for d in dims):
        raise ValueError(f"x has shape {list(x.shape)}: a scale cannot cover an empty dimension (dim {dim!r})")
    return dims


def quantize_fp8(x: torch.Tensor, dim: Union[int, tuple, None] = -1, layout: str = "same"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, scale)``: x (fp16, bf16 or fp32) in float8_e4m3fn with float32 scales.

    ``dim``: the dimension(s) one scale covers; ``scale`` has x's shape without them (a 0-d
    scale for ``dim=None``, the whole tensor). The FP8 ops' scales:
      - linear: x_cand [B, K], x_user [U, K], w [N, K]: ``dim=-1`` (one per row);
      - lce: w [M, K]: ``dim=-1``; e [B, K, N]: ``dim=(1, 2), layout="transposed"`` (one per
        batch entry, e8 [B, N, K]).
    ``layout``: "same" (x8 shaped as x, contiguous) or "transposed" (the last two dimensions
    swapped; each row 16-byte pitched: contiguous where x.shape[-2] is a multiple of 16).

    On an sm_90 GPU, scales over trailing dimensions (rows: ``dim=-1``; lce's e: ``dim=(1, 2)``,
    either layout but "transposed" rows) run one kernel (``quantize_sm90``; no host
    synchronization, CUDA-graph capturable); other dims, other devices and torch.compile
    traces run :func:`quantize_fp8_reference`, whose result the kernel's matches.
    """
    dims = check_quantize_args(x, dim, layout)
    groups = _groups(x, dims, layout)
    if groups is None or not on_gpu(x) or torch.compiler.is_compiling():
        return quantize_fp8_reference(x, dims, layout)
    require_sm90(x.device, "quantize_fp8")
    G, R, C = groups
    transposed = layout == "transposed"
    x = x.contiguous()
    padded = _padded_rows((G, C, R), x.device) if transposed else None
    x8 = padded[..., :R] if transposed else torch.empty((G, R, C), dtype=FP8, device=x.device)
    scale = torch.empty(G, dtype=torch.float32, device=x.device)
    if G:
        plan = staged_plan(G, R, C, x.element_size(), transposed, x.data_ptr())
        with on_device(x.device):
            if plan is None:
                quantize_kernel(x.dtype, transposed)(x.view(G, R, C), x8, scale)
            else:
                stage_bytes, ctas, chunk = plan
                out = padded if transposed else x8.view(G, R * C)  # its 16-byte stores fill rows' padding
                args = QuantizeArgs(x.view(G, R * C), out, scale, C if transposed else 1, chunk, ctas)
                quantize_staged_kernel(x.dtype, transposed, stage_bytes)(args)
    shape = list(x.shape)
    if transposed:
        shape[-2:] = shape[-1], shape[-2]
    return x8.view(shape), scale.view([n for d, n in enumerate(x.shape) if d not in dims])


def staged_plan(G: int, R: int, C: int, elt: int, transposed: bool, data_ptr: int, stages=STAGE_BYTES):
    """``(stage_bytes, ctas, chunk)`` of the kernel that reads x once (``quantize_staged_sm90``):
    the first of ``stages``, one CTA a group, whose chunk holds a group, else the first of the
    others and the fewest CTAs a group (a cluster) whose chunks do (a chunk: a multiple of 16
    elements; of 16 rows where transposed). None, and QuantizeSm90 runs, where no cluster holds
    a group; where the groups do not start 16 bytes apart (the bulk copy's alignment) or, for
    "same", the e4m3 groups do not (its 16-byte stores); and for groups under MIN_STAGED_BYTES,
    whose second read QuantizeSm90 takes from L1 and which it runs faster (a CTA's fixed cost
    dominates such groups in both)."""
    E = R * C
    if data_ptr % 16 or E * elt % 16 or (not transposed and E % 16) or E * elt < MIN_STAGED_BYTES:
        return None
    for stage_bytes in stages:
        for ctas in (1,) if stage_bytes == stages[0] else (1, 2, 4, MAX_CTAS):
            chunk = round_up(-(-R // ctas), 16) * C if transposed else round_up(-(-E // ctas), 16)
            if chunk * elt <= stage_bytes and G * ctas < 2**31:
                return stage_bytes, ctas, chunk
    return None


def _padded_rows(shape, device) -> torch.Tensor:
    """An FP8 tensor of ``shape`` with its last dimension padded to a multiple of 16."""
    return torch.empty((*shape[:-1], round_up(shape[-1], 16)), dtype=FP8, device=device)


def _pitched_empty(shape, device) -> torch.Tensor:
    """An FP8 tensor of ``shape`` whose rows start 16 bytes apart (a view of padded rows)."""
    return _padded_rows(shape, device)[..., : shape[-1]]


def _groups(x: torch.Tensor, dims: tuple, layout: str):
    """(G, R, C): x as the kernel's groups (one scale each, R x C elements, C contiguous), or
    None where the kernel does not take these dims: they must be the trailing ones, and with
    "transposed" the last two."""
    nd = x.dim()
    if dims != tuple(range(nd - len(dims), nd)) or (layout == "transposed" and len(dims) != 2):
        return None
    G = math.prod(x.shape[: nd - len(dims)])
    R, C = (x.shape[-2], x.shape[-1]) if layout == "transposed" else (1, math.prod(x.shape[nd - len(dims):]))
    if R * C >= 2**31 or G >= 2**31:
        return None
    return G, R, C


def quantize_fp8_reference(x: torch.Tensor, dim: Union[int, tuple, None] = -1, layout: str = "same"
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8` in PyTorch (any device): the definition the kernel is tested against."""
    dims = check_quantize_args(x, dim, layout)
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=dims, keepdim=True).clamp_min(AMAX_FLOOR) * INV_FP8_MAX  # NaN stays NaN
    x8 = (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if layout == "transposed":
        x8 = _pitched_empty(x8.transpose(-1, -2).shape, x.device).copy_(x8.transpose(-1, -2))
    return x8.contiguous() if layout == "same" else x8, scale.squeeze(dims)
