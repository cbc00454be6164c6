"""Input checks of ``ikbo_fa.attention`` and its reference: every error names the argument, its
shape and the expected layout, and works out the broadcast direction.

    KV broadcast: q [B, S_q, H, D], k / v [U, L, H_kv, D] (or kv [U, L, 2, H_kv, D])
    Q broadcast:  q [U, S_q, H, D], k / v [B, L, H_kv, D]
    idx [B] (int32 or int64), kv_lengths [k/v batch], out [B, S_q, H, D]

Jagged K/V (``kv_offsets``): k / v [total_L, H_kv, D] (or kv [total_L, 2, H_kv, D]) and
kv_offsets [R + 1], R being the k/v batch (U for KV broadcast, B for Q broadcast): row r's keys
are k[kv_offsets[r] : kv_offsets[r + 1]].
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch

from cute_kernels import checks

from .config import SUPPORTED_HEAD_DIMS
from .worklist import TILE_ROWS, WorkList, group_tiles, kv_worklist

# The op (on every device) takes what the kernel takes; the reference also takes float32.
OP_DTYPES = checks.FLOAT_DTYPES
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

LOG2E = 1.4426950408889634
F32_MIN_NORMAL = 2.0**-126
F32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass
class Problem:
    """A validated call: tensors as the kernel sees them plus the sizes."""

    q: torch.Tensor
    # Padded: [kv_batch, L, H_kv, D]; jagged: [total_kv, H_kv, D] (views into packed kv when packed).
    k: torch.Tensor
    v: torch.Tensor
    idx: torch.Tensor
    kv_lengths: Optional[torch.Tensor]
    direction: str  # "kv": K/V broadcast (looked up by idx); "q": Q broadcast
    batch: int  # B = len(idx) = output batch
    kv_batch: int  # K/V rows: k.shape[0] padded, R = len(kv_offsets) - 1 jagged
    s_q: int
    heads: int
    kv_heads: int
    head_dim: int
    # Upper bound of every row's length: L padded; jagged, max_kv_len where given, else total_kv
    # (a bound known without reading the offsets back).
    kv_len: int
    total_kv: int  # key rows k holds: kv_batch * L padded, total_L = k.shape[0] jagged
    scale: float
    kv_offsets: Optional[torch.Tensor] = None  # [R + 1] int32 / int64 (as given); None: padded

    @property
    def jagged(self) -> bool:
        return self.kv_offsets is not None

    @property
    def broadcast_batch(self) -> int:
        """Size of the side that idx indexes (U)."""
        return self.kv_batch if self.direction == "kv" else self.q.shape[0]

    @property
    def broadcast_side(self) -> str:
        """What idx indexes, for messages."""
        return "the batch of k and v" if self.direction == "kv" else "the batch of q"


def kv_list(kv) -> list:
    """kv's tensors: [packed kv] or [k, v] (empty for what is neither; the checks name it)."""
    return [kv] if isinstance(kv, torch.Tensor) else list(kv) if isinstance(kv, (tuple, list)) else []


def kv_arg(tensors: list):
    """The ``kv`` argument that :func:`kv_list` took apart."""
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _check_kv_tensor(name: str, t, dtypes, *, packed: bool, jagged: bool) -> None:
    """One of kv's tensors has the layout that kv_offsets asks for (jagged) or not (padded);
    the other layout's rank gets a message that names both."""
    two = "2, " if packed else ""
    padded_layout, jagged_layout = f"[batch, L, {two}H_kv, D]", f"[total_L, {two}H_kv, D]"
    ndim = (3 if jagged else 4) + packed
    if isinstance(t, torch.Tensor) and t.dim() == (ndim + 1 if jagged else ndim - 1):
        if jagged:
            raise ValueError(
                f"{name} has shape {checks._shape(t)}, the padded layout {padded_layout}: with kv_offsets "
                f"{name} must be jagged {jagged_layout} (row r's keys at kv_offsets[r] : kv_offsets[r + 1])"
            )
        raise ValueError(
            f"{name} must have {ndim} dimensions {padded_layout}, got shape {checks._shape(t)}; the jagged "
            f"layout {jagged_layout} needs kv_offsets [R + 1]"
        )
    checks.check_tensor(name, t, ndim=ndim, dtypes=dtypes, layout=jagged_layout if jagged else padded_layout,
                        empty_batch=True)


def split_kv(kv, dtypes=REFERENCE_DTYPES, *, jagged: bool = False):
    """(k, v) from a (k, v) pair or one packed tensor (checked): padded [batch, L, 2, H_kv, D],
    or with ``jagged`` (kv_offsets given) [total_L, 2, H_kv, D]."""
    if isinstance(kv, torch.Tensor):
        _check_kv_tensor("kv", kv, dtypes, packed=True, jagged=jagged)
        pair_dim = 1 if jagged else 2
        if kv.shape[pair_dim] != 2:
            layout = "[total_L, 2, H_kv, D]" if jagged else "[batch, L, 2, H_kv, D]"
            raise ValueError(
                f"kv packed as one tensor must have shape {layout}, got dimension {pair_dim} = {kv.shape[pair_dim]}"
            )
        return kv.select(pair_dim, 0), kv.select(pair_dim, 1)
    if isinstance(kv, (tuple, list)) and len(kv) == 2:
        k, v = kv
        _check_kv_tensor("k", k, dtypes, packed=False, jagged=jagged)
        _check_kv_tensor("v", v, dtypes, packed=False, jagged=jagged)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        return k, v
    raise TypeError(
        "kv must be a (k, v) pair of [batch, L, H_kv, D] tensors or one packed [batch, L, 2, H_kv, D] tensor "
        f"(jagged with kv_offsets: [total_L, H_kv, D] and [total_L, 2, H_kv, D]), got {type(kv).__name__}"
    )


def resolve_problem(q, kv, idx, *, scale, kv_lengths, broadcast, out, validate, op: str,
                    kv_offsets=None, max_kv_len=None, return_lse=False) -> Problem:
    """Check every argument (errors name it) and work out the broadcast direction.

    ``op`` is "attention" (the op: on every device only what the sm_90 kernel takes, fp16 / bf16
    and D in SUPPORTED_HEAD_DIMS) or "attention_reference" (also float32 and any D).
    ``kv_offsets`` makes k / v jagged (see the module docstring); ``max_kv_len`` bounds its rows."""
    check_return_lse(return_lse)
    dtypes = OP_DTYPES if op == "attention" else REFERENCE_DTYPES
    jagged = kv_offsets is not None
    if jagged and kv_lengths is not None:
        raise ValueError(
            "kv_lengths and kv_offsets were both given: pass kv_lengths with padded k/v [batch, L, H_kv, D], "
            "or kv_offsets with jagged k/v [total_L, H_kv, D], not both"
        )
    max_kv_len = check_max_kv_len(max_kv_len)
    if max_kv_len is not None and not jagged:
        raise ValueError(
            f"max_kv_len = {max_kv_len} bounds the rows of jagged k/v: pass it with kv_offsets (padded k/v "
            "[batch, L, H_kv, D] take kv_lengths)"
        )
    checks.check_tensor("q", q, ndim=4, dtypes=dtypes, layout="[batch, S_q, H, D]", empty_batch=True)
    k, v = split_kv(kv, dtypes, jagged=jagged)
    checks.check_same_dtype(["q", "k", "v"], [q, k, v])
    check_idx(idx)
    if kv_lengths is not None:  # its kind here; its length once the k/v batch is known
        checks.check_tensor("kv_lengths", kv_lengths, ndim=1, dtypes=checks.INDEX_DTYPES, layout="[k/v batch]",
                            empty_batch=True)
    if jagged:
        checks.check_tensor("kv_offsets", kv_offsets, ndim=1, dtypes=checks.INDEX_DTYPES, layout="[R + 1]")
        if kv_offsets.shape[0] < 2:
            raise ValueError(
                f"kv_offsets has shape {checks._shape(kv_offsets)}: expected [R + 1] with R >= 1 rows "
                "(row r's keys at kv_offsets[r] : kv_offsets[r + 1])"
            )
    tensors, names = [q, k, v, idx], ["q", "k", "v", "idx"]
    for name, t in (("kv_lengths", kv_lengths), ("kv_offsets", kv_offsets)):
        if t is not None:
            tensors.append(t)
            names.append(name)
    checks.check_same_device(names, tensors)

    n_q, s_q, heads, head_dim = q.shape
    if jagged:
        total_kv, kv_heads, kv_dim = k.shape
        kv_batch = kv_offsets.shape[0] - 1
        kv_len = total_kv if max_kv_len is None else max_kv_len
        kv_desc = f"k/v (R = len(kv_offsets) - 1 = {kv_batch} rows)"
    else:
        kv_batch, kv_len, kv_heads, kv_dim = k.shape
        total_kv = kv_batch * kv_len
        kv_desc = f"k/v (batch {kv_batch})"
    if kv_dim != head_dim:
        raise ValueError(f"k/v head dimension {kv_dim} differs from q's {head_dim}: q [.., D], k/v [.., D]")
    if op == "attention" and head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head dimension D = {head_dim} is not supported by the sm_90 kernel (D must be one of "
            f"{SUPPORTED_HEAD_DIMS}); call ikbo_fa.attention_reference for other head dimensions"
        )
    if heads % kv_heads != 0:
        raise ValueError(f"q has H = {heads} heads, not a multiple of k/v's H_kv = {kv_heads}")
    batch = idx.shape[0]

    if broadcast is not None and broadcast not in ("kv", "q"):
        raise ValueError(f"broadcast must be None, 'kv' or 'q', got {broadcast!r}")
    q_matches, kv_matches = n_q == batch, kv_batch == batch
    if broadcast is None:
        if q_matches and not kv_matches:
            direction = "kv"
        elif kv_matches and not q_matches:
            direction = "q"
        elif q_matches and kv_matches:
            raise ValueError(
                f"q and k/v both have batch {batch} = len(idx): pass broadcast='kv' (k/v looked up by idx) "
                "or broadcast='q' (q looked up by idx)"
            )
        else:
            raise ValueError(
                f"idx has length {batch} but neither q (batch {n_q}) nor {kv_desc} has that batch: "
                "one side must be per candidate (batch = len(idx))"
            )
    else:
        direction = broadcast
        per_candidate = ("q", n_q) if direction == "kv" else ("k/v", kv_batch)
        if per_candidate[1] != batch:
            rows = " (R = len(kv_offsets) - 1)" if jagged and direction == "q" else ""
            raise ValueError(
                f"broadcast={direction!r} needs {per_candidate[0]} batch = len(idx) = {batch}, got "
                f"{per_candidate[1]}{rows}"
            )
    looked_up = ("k/v", kv_batch) if direction == "kv" else ("q", n_q)
    if looked_up[1] == 0:
        raise ValueError(f"{looked_up[0]} must not be empty: idx looks its batch up, got batch 0")

    if kv_lengths is not None:
        checks.check_index("kv_lengths", kv_lengths, kv_batch, "k/v batch")
    if out is not None:
        checks.check_output("out", out, (batch, s_q, heads, head_dim), q.dtype, q.device)

    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale(scale)

    p = Problem(q=q, k=k, v=v, idx=idx, kv_lengths=kv_lengths, direction=direction, batch=batch,
                kv_batch=kv_batch, s_q=s_q, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                kv_len=kv_len, total_kv=total_kv, scale=float(scale), kv_offsets=kv_offsets)
    if checks.validation_enabled(validate):
        check_ranges(idx, kv_lengths, p.broadcast_batch, p.broadcast_side, kv_len)
        if jagged:
            check_offsets(kv_offsets, total_kv, max_kv_len)
    return p


def check_return_lse(return_lse) -> None:
    """``return_lse`` is True or False (a truthy string or 1 would pass a plan's key as True)."""
    if type(return_lse) is not bool:
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__} {return_lse!r}")


def check_idx(idx) -> None:
    """``idx`` is an int32 / int64 vector [B] (B = 0 allowed)."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor [B] of int32 or int64, got {type(idx).__name__}")
    checks.check_tensor("idx", idx, ndim=1, dtypes=checks.INDEX_DTYPES, layout="[B]", empty_batch=True)


def check_ranges(idx, kv_lengths, n_users: int, side: str, kv_len: int) -> None:
    """idx in [0, U) and kv_lengths in [0, L] (synchronizes with the device)."""
    checks.check_index_range("idx", idx, n_users, "U", side)
    if kv_lengths is not None:
        checks.check_index_range("kv_lengths", kv_lengths, kv_len + 1, "L + 1", "one more than the keys per row")


def check_offsets(kv_offsets: torch.Tensor, total_kv: int, max_kv_len: Optional[int] = None) -> None:
    """kv_offsets starts at 0, never decreases and ends at most at total_L (``total_kv``, k's
    first dimension); with ``max_kv_len``, no row has more keys. Raises at the first bad position:
    ValueError for the order and the row lengths, IndexError for an offset past the keys (as
    check_index_range does). Synchronizes with the device."""
    off = kv_offsets.long()
    bad = torch.zeros_like(off, dtype=torch.bool)
    bad[0] = off[0] != 0
    bad[1:] = (off[1:] < off[:-1]) | (off[1:] > total_kv)
    if bool(bad.any()):
        pos = int(torch.nonzero(bad)[0, 0])
        value = int(off[pos])
        if pos == 0:
            raise ValueError(
                f"kv_offsets[0] = {value}: kv_offsets must start at 0 (row r's keys are "
                "k[kv_offsets[r] : kv_offsets[r + 1]])"
            )
        before = int(off[pos - 1])
        if value < before:
            raise ValueError(
                f"kv_offsets[{pos}] = {value} is less than kv_offsets[{pos - 1}] = {before}: kv_offsets must "
                "not decrease"
            )
        raise IndexError(
            f"kv_offsets[{pos}] = {value} is out of range: offsets must lie in [0, total_L] = [0, {total_kv}], "
            "total_L being the keys k / v hold (their first dimension)"
        )
    if max_kv_len is not None:
        lengths = off[1:] - off[:-1]
        long_rows = lengths > max_kv_len
        if bool(long_rows.any()):
            r = int(torch.nonzero(long_rows)[0, 0])
            raise ValueError(
                f"row {r} of kv_offsets has {int(lengths[r])} keys (kv_offsets[{r + 1}] - kv_offsets[{r}] = "
                f"{int(off[r + 1])} - {int(off[r])}), more than max_kv_len = {max_kv_len}"
            )


def check_max_kv_len(max_kv_len) -> Optional[int]:
    """``max_kv_len`` as an int: None, or an integer >= 0 (TypeError for what is no integer,
    bools included; ValueError below 0)."""
    if max_kv_len is None:
        return None
    if not isinstance(max_kv_len, numbers.Integral) or isinstance(max_kv_len, bool):
        raise TypeError(f"max_kv_len must be an int or None, got {type(max_kv_len).__name__} {max_kv_len!r}")
    value = int(max_kv_len)
    if value < 0:
        raise ValueError(f"max_kv_len must be >= 0 (an upper bound of every row's keys), got {value}")
    return value


def check_scale(scale) -> float:
    """``scale`` as a float: a finite real (TypeError for what is no real number, ValueError for
    inf or NaN) whose product with log2(e) fits in float32 (the kernel takes it in float32)."""
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except OverflowError:  # an int past float's range
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {scale!r}")
    if abs(value) * LOG2E > F32_MAX:
        raise ValueError(f"scale {scale!r} is outside float32's range: |scale| * log2(e) must be <= {F32_MAX:g}")
    return value


# ------------------------------------------------------------------ work lists
def check_work_list(work_list, p: Problem) -> WorkList:
    """``work_list`` fits the call ``p`` (shapes and options only; no device access)."""
    if not isinstance(work_list, WorkList):
        raise TypeError(f"work_list must be an ikbo_fa.WorkList (from ikbo_fa.work_list) or None, "
                        f"got {type(work_list).__name__}")
    if p.direction != "kv":
        raise ValueError("work_list groups the candidates of a KV broadcast (k and v looked up by idx); this call "
                         "looks q up by idx: pass no work_list")
    ordered = p.kv_lengths is not None or p.jagged
    for what, have, want in (("candidates (len(idx))", work_list.batch, p.batch),
                             ("users (U)", work_list.num_users, p.kv_batch),
                             ("query rows per candidate (S_q)", work_list.rows_per_cand, p.s_q)):
        if have != want:
            raise ValueError(f"work_list was built for {have} {what}; this call has {want}: build one for it "
                             "with ikbo_fa.work_list")
    if work_list.order.device != p.q.device:
        raise ValueError(f"work_list is on {work_list.order.device} but q is on {p.q.device}")
    if work_list.tile_rows != TILE_ROWS and p.head_dim != 64:
        raise ValueError(f"work_list counts tiles of {work_list.tile_rows} query rows (built with head_dim=64), which "
                         f"only D 64 calls run; this call has D {p.head_dim}: build one with head_dim={p.head_dim}")
    if (work_list.perm is not None) != ordered:
        raise ValueError(
            "work_list orders the tiles longest first (built with kv_lengths or kv_offsets) but this call has "
            "neither" if work_list.perm is not None else
            "this call has kv_lengths or kv_offsets (its tiles run longest first) but work_list was built "
            "without them: pass them to ikbo_fa.work_list too")
    return work_list


def check_given_work_list(work_list, p: Problem, validate: Optional[bool]) -> None:
    """Every check of a work list given with the call ``p``: it fits, idx was not written since
    it was built and (validating; synchronizes) it groups idx as idx holds now."""
    check_work_list(work_list, p)
    check_work_list_fresh(work_list, p.idx)
    if checks.validation_enabled(validate):
        check_work_list_values(work_list, p.idx)


def check_work_list_fresh(work_list: WorkList, idx: torch.Tensor) -> None:
    """``idx`` is not the tensor ``work_list`` was built from, written in place since (where torch
    counts the tensor's versions). Runs on every call: no device access."""
    source = work_list.source() if work_list.source is not None else None
    if source is idx and work_list.version is not None and idx._version != work_list.version:
        raise ValueError("idx was written in place after work_list was built from it: the work list holds the "
                         "old grouping; build it again with ikbo_fa.work_list")


def check_work_list_values(work_list: WorkList, idx: torch.Tensor) -> None:
    """``work_list`` groups idx as idx holds now: what ikbo_fa.work_list would build, up to the
    order within a user and within a key bucket. Synchronizes with the device."""
    n_users, b = work_list.num_users, work_list.batch
    _, cand_start, tile_start, grouped = kv_worklist(idx, n_users, work_list.rows_per_cand, work_list.tile_rows)
    key = torch.remainder(idx.clamp(-1, n_users), n_users + 1).long()
    order = work_list.order.long()
    problem = None
    if not torch.equal(work_list.cand_start, cand_start):
        problem = "its users' candidate counts (cand_start) differ from idx's"
    elif not torch.equal(work_list.grouped, grouped):
        problem = "it says idx is " + ("" if int(grouped[0]) == 0 else "not ") + "grouped by user, idx says otherwise"
    elif b and not (bool(((order >= 0) & (order < b)).all())
                    and bool((torch.bincount(order.clamp(0, b - 1), minlength=b) == 1).all())
                    and torch.equal(key[order.clamp(0, b - 1)], key.sort().values)):
        problem = "its order is not idx's candidates grouped by user"
    elif int(grouped[0]) == 1 and not torch.equal(order, torch.arange(b, device=order.device)):
        problem = "idx is grouped by user, and its order is not 0, 1, ..., B - 1"
    else:
        tiles = group_tiles(cand_start, work_list.rows_per_cand, work_list.tile_rows)
        if work_list.perm is not None:
            perm = work_list.perm[:n_users + 1].long()
            if not torch.equal(perm.sort().values, torch.arange(n_users + 1, device=perm.device)):
                problem = "its perm is not a permutation of the groups"
            else:
                tiles = tiles[perm]
        if problem is None:
            starts = torch.zeros_like(tile_start)
            starts[1:] = torch.cumsum(tiles, 0)
            if not torch.equal(work_list.tile_start, starts):
                problem = "its tile_start does not count the groups' tiles"
    if problem is not None:
        raise ValueError(f"work_list does not group idx as idx holds now: {problem}. A work list holds the "
                         "grouping of the idx it was built from: build it again with ikbo_fa.work_list")
