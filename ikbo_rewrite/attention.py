"""attention: SDPA whose K and V are gathered by one index (or whose Q is) becomes
``ikbo_fa.attention`` on the per-user tensors, in its [batch, seq, heads, dim] layout.

Every spelling of SDPA in an ATen graph is read (the op itself in an exported graph; the
backend ops Inductor's graphs carry: flash, efficient, cuDNN, the CPU flash kernel), and so
is the hand-written softmax(QK^T)V (:mod:`.softmax_attention`).
Rewritten only where the op computes the same: no dropout, not causal, fp16/bf16, head dim
64 or 128 (a symbolic one guarded to its value where the graph is compiled), and no mask or a
key-padding prefix mask (which becomes ``kv_lengths``; under a finite fill, rows without keys
keep eager's mean of their V rows)."""
from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Optional

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import guard_bool, statically_known_true

from . import softmax_attention
from .broadcast import index_node
from .context import Context
from .fx_utils import Builder, aten, bound_args, example_value, replace, same, shape, tensor_val
from .masks import drops, prefix_lengths

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)

# op -> (name of its mask argument or None, whether it returns a tuple whose [0] is the output)
_SDPA = {
    "scaled_dot_product_attention": ("attn_mask", False),
    "_scaled_dot_product_flash_attention_for_cpu": ("attn_mask", True),
    "_scaled_dot_product_flash_attention": (None, True),
    "_scaled_dot_product_efficient_attention": ("attn_bias", True),
    "_scaled_dot_product_cudnn_attention": ("attn_bias", True),
    "_scaled_dot_product_attention_math": ("attn_mask", True),
}


@dataclasses.dataclass
class Sdpa:
    node: Node
    out: Node  # the node holding the attention output [B, H, S_q, D]
    q: Node
    k: Node
    v: Node
    mask: Optional[Node]
    dropout: float
    causal: bool
    scale: Optional[float]
    mask_drops: bool = False  # a bool mask that drops keys where True (masked_fill's), not keeps
    fill: Optional[float] = None  # the value masked scores take, where the model writes one
    guards: list = dataclasses.field(default_factory=list)  # on symbols the scale was computed from
    name: str = ""  # how the report names a hand-written attention
    mask_scale: float = 1.0  # a scale applied to the masked scores (the fill included)


def read_sdpa(n: Node) -> tuple[Optional[Sdpa], str]:
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return None, ""
    name = n.target.overloadpacket.__name__
    if n.target.namespace != "aten" or name not in _SDPA:
        return None, ""
    mask_arg, is_tuple = _SDPA[name]
    a = bound_args(n)
    out = n
    if is_tuple:
        outs = [u for u in n.users]
        if any(u.target is not operator.getitem for u in outs):
            return None, "SDPA's outputs are used whole"
        used = [u for u in outs if u.users]
        if any(u.args[1] != 0 for u in used):
            return None, "SDPA's log-sum-exp or other side outputs are used"
        if not used:
            return None, ""
        out = used[0]
    return Sdpa(n, out, a["query"], a["key"], a["value"], a.get(mask_arg) if mask_arg else None,
                float(a.get("dropout_p") or 0.0), bool(a.get("is_causal")), a.get("scale")), ""


def _check(ctx: Context, s: Sdpa) -> tuple[str, list]:
    """Why the op would not compute this call (or ""), and the guards on symbolic sizes that
    make it take the call (the head dim's value, H divisible by H_kv), to install on rewriting."""
    if s.dropout != 0.0:
        return f"dropout_p {s.dropout}", []
    if s.causal:
        return "causal attention", []
    q, k, v = (tensor_val(x) for x in (s.q, s.k, s.v))
    if any(t is None or t.dim() != 4 for t in (q, k, v)):
        return "q, k and v are not [batch, heads, seq, dim]", []
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        return f"dtype {q.dtype}: the op takes fp16 or bf16", []
    guards = []
    if not all(_equal_guarded(ctx, a, b, guards) for a, b in zip((*k.shape, q.shape[3]), (*v.shape, k.shape[3]))):
        return "k and v differ in shape, or q's head dim differs from k's", []
    d = q.shape[3]
    if not any(same(d, x) for x in HEAD_DIMS):
        value = example_value(d)
        if value not in HEAD_DIMS or not ctx.guards:
            return (f"head dim {d}: the kernel takes {' or '.join(map(str, HEAD_DIMS))}"
                    + (f" (symbolic, {value} here, in a graph that cannot be guarded: export with a static "
                       "head dim)" if value in HEAD_DIMS else ""), [])
        guards.append(d == value)  # the head dim is fixed in this compile; another recompiles
    h, h_kv = q.shape[1], k.shape[1]
    divides = h % h_kv == 0
    if not isinstance(divides, bool) and not statically_known_true(divides):
        values = example_value(h), example_value(h_kv)
        if not ctx.guards or None in values or values[0] % values[1]:
            return f"{h} query heads are not provably a multiple of {h_kv} key heads", []
        guards.append(divides)
    elif not divides:
        return f"{h} query heads are not a multiple of {h_kv} key heads", []
    if s.scale is not None and not isinstance(s.scale, (int, float)):
        return "the scale is not a number", []
    return "", guards


def rewrite_attention(ctx: Context) -> None:
    found = []
    for n in list(ctx.graph.nodes):
        s, why = read_sdpa(n)
        gathers = [x for x in ((s.q, s.k, s.v) if s else n.args[:3]) if ctx.broadcast(x)]
        if s is None and not why:
            s, gathers, why = softmax_attention.read(ctx, n)
        if s is None:
            for x in gathers if why else ():
                ctx.leave(x, f"attention: {why}")
            continue
        if gathers:
            found.append((s, gathers))
    # KV-broadcast calls on one index (same U, S_q and tile order) share one work list.
    shared = collections.Counter(k for k in (_work_list_key(ctx, s) for s, _ in found) if k is not None)
    work_lists = {k: None for k, n in shared.items() if n > 1}
    for s, gathers in found:
        why = _rewrite_one(ctx, s, work_lists)
        if why:
            for g in gathers:
                ctx.leave(g, f"attention: {s.name + ': ' if s.name else ''}{why}")


def _work_list_key(ctx: Context, s: Sdpa):
    """What a KV-broadcast call's work list depends on, or None (a Q broadcast, a call the
    op would not take): the index, U, S_q, whether a mask orders the tiles, and at D 64 the
    heads (D 64 calls may run 192-row tiles, chosen with H: ``ikbo_fa.work_list``'s head_dim)."""
    if _check(ctx, s)[0]:
        return None
    direction, bc = _direction(ctx, s)
    if direction != "kv":
        return None
    tiles = ("D 64", _size_key(shape(s.q)[1])) if _head_dim(s) == 64 else None
    return bc.key, _size_key(shape(bc.source)[0]), _size_key(shape(s.q)[2]), s.mask is not None, tiles


def _head_dim(s: Sdpa):
    """The calls' D as an int where it has a value (the pass guards a symbolic one), else None."""
    d = shape(s.q)[3]
    return d if isinstance(d, int) else example_value(d)


def _size_key(size):
    """A size as a key: its value where it has one here (equal sizes of two inputs may carry two
    symbols; the calls that share a work list then guard or check them equal), else its symbol."""
    if isinstance(size, int):
        return size
    value = example_value(size)
    return str(size) if value is None else value


def _direction(ctx: Context, s: Sdpa):
    bq, bk, bv = (ctx.broadcast(x) for x in (s.q, s.k, s.v))
    if bk and bv and bk.key == bv.key and not (bq and bq.key == bk.key):
        return "kv", bk
    if bq and not bk and not bv:
        return "q", bq
    return None, None


def _rewrite_one(ctx: Context, s: Sdpa, work_lists: dict) -> str:
    why, guards = _check(ctx, s)
    if why:
        return why
    direction, bc = _direction(ctx, s)
    if direction is None:
        return "q, k and v are not one side gathered, the other per candidate"
    lengths = None
    if s.mask is not None:
        lengths, why = prefix_lengths(ctx, s.mask, shape(s.k)[2], drop=s.mask_drops)
        if lengths is None:
            return why
        lengths.fills = [f * s.mask_scale for f in lengths.fills + ([] if s.fill is None else [s.fill])]
        soft = [f for f in lengths.fills if not drops(f)]
        if soft:
            return f"the masked scores are set to {soft[0]:g}: a soft mask (a dropped key needs <= -65504)"
        if direction == "kv" and (lengths.broadcast is None or lengths.broadcast.key != bc.key):
            return "the mask's lengths are per candidate, not per user"
        if direction == "q" and lengths.broadcast is not None and lengths.broadcast.key != bc.key:
            return "the mask is gathered by another index"
    for g in guards + s.guards:
        guard_bool(g)
    b = Builder(ctx.graph, s.out)
    idx = index_node(bc, b)
    bhsd = lambda x: b.call(aten.permute.default, x, [0, 2, 1, 3])  # noqa: E731  [B, H, S, D] <-> [B, S, H, D]
    if direction == "kv":
        q, k, v = bhsd(s.q), bhsd(ctx.broadcast(s.k).source), bhsd(ctx.broadcast(s.v).source)
    else:
        q, k, v = bhsd(bc.source), bhsd(s.k), bhsd(s.v)
    kv_lengths = None
    if lengths is not None:
        kv_lengths = lengths.node
        if direction == "q" and lengths.broadcast is not None:
            kv_lengths = b.call(aten.index.Tensor, kv_lengths, [idx])
        if not _equal(ctx, b, (kv_lengths, 0), (k, 0), "the mask's lengths and k/v have one row per user"):
            return "the mask's lengths do not have one entry per key/value row"
    scale = None if s.scale is None else float(s.scale)
    wl_args, shared = (), ""
    key = _work_list_key(ctx, s) if direction == "kv" else None
    if key in work_lists:
        if work_lists[key] is None:  # the first call of the group builds it, before itself
            s_q = b.size(q, 1)
            # At D 64 the list counts the tiles the calls' D and H choose; they then pass tile rows 0.
            d64 = _head_dim(s) == 64
            wl = b.call(torch.ops.ikbo_fa.work_list.default, idx, b.size(k, 0), s_q, kv_lengths, None, None,
                        ctx.validate, *((64, b.size(q, 2)) if d64 else ()))
            arrays = [b.call(operator.getitem, wl, i) for i in range(5)]
            work_lists[key] = (q, k), (s_q, *arrays[:4], arrays[4] if kv_lengths is not None else None,
                                       0 if d64 else 128)
        (q0, k0), args = work_lists[key]
        if q0 is q or (_equal(ctx, b, (k, 0), (k0, 0), "the attention calls on one index have one U")
                       and _equal(ctx, b, (q, 1), (q0, 1), "the attention calls on one index have one S_q")
                       and (args[-1] != 0 or _equal(ctx, b, (q, 2), (q0, 2),
                                                    "the attention calls on one index have one H"))):
            wl_args, shared = (None, None, *args), ", one work list for the calls on this index"
    res = b.call(torch.ops.ikbo_fa.attention.default, q, [k, v], idx, scale, kv_lengths, direction, False, ctx.validate,
                 *wl_args)
    o = b.call(operator.getitem, res, 0)
    fill = lengths.finite_fill if lengths is not None else None
    if fill is not None:
        o = _rows_without_keys(b, o, v, kv_lengths, idx if direction == "kv" else None)
    replace(s.out, bhsd(o))
    ctx.replaced.add(s.node)  # SDPA counts as impure (its dropout draws random numbers)
    ctx.absorbed.update(x for x in (s.q, s.k, s.v) if ctx.broadcast(x))
    if lengths is not None:
        ctx.absorbed.update(lengths.gathers)
    qv, kv = tensor_val(q), tensor_val(k)
    ctx.report.add("attention", [s.node], f"{direction.upper()} broadcast, S_q {qv.shape[1]}, L {kv.shape[1]}, "
                   f"H {qv.shape[2]}, H_kv {kv.shape[2]}, D {example_value(qv.shape[3]) or qv.shape[3]}"
                   + (", kv_lengths from the key-padding mask" if lengths is not None else "") + shared
                   + _no_keys_note(s, lengths, fill))
    return ""


def _equal_guarded(ctx: Context, a, b, guards: list) -> bool:
    """Sizes ``a`` and ``b`` are equal: provably, or (where the pass may guard) by their values
    here, the guard appended to ``guards``."""
    if same(a, b):
        return True
    if ctx.guards and example_value(a) is not None and example_value(a) == example_value(b):
        guards.append(a == b)
        return True
    return False


def _equal(ctx: Context, b: Builder, x: tuple, y: tuple, what: str) -> bool:
    """Sizes ``x`` and ``y`` ((node, dim)) are equal: provably, or by their values here (dynamic
    shapes give equal sizes of different inputs their own symbols), then guarded where the
    graph is compiled (another value recompiles), else checked at run time (``what`` says it)."""
    a, c = shape(x[0])[x[1]], shape(y[0])[y[1]]
    if same(a, c):
        return True
    if example_value(a) is None or example_value(a) != example_value(c):
        return False
    if ctx.guards:
        return guard_bool(a == c)
    b.check_equal(b.size(*x), b.size(*y), f"ikbo_rewrite assumed that {what}")
    return True


def _rows_without_keys(b: Builder, o: Node, v: Node, kv_lengths: Node, idx: Optional[Node]) -> Node:
    """``o`` [B, S_q, H, D] with eager's result where a K/V row keeps no key under a finite fill:
    its scores all equal the fill, so softmax weighs every key alike, and the row gets the mean
    of its V rows (the op gives 0). ``idx`` gathers the per-user rows (KV broadcast)."""
    mean = b.call(aten.mean.dim, v, [1], False, dtype=torch.float32)  # [R, H_kv, D]
    empty = b.call(aten.eq.Scalar, kv_lengths, 0)  # [R]
    if idx is not None:
        mean, empty = b.call(aten.index.Tensor, mean, [idx]), b.call(aten.index.Tensor, empty, [idx])
    heads, kv_heads = shape(o)[2], shape(v)[2]
    if not same(heads, kv_heads):
        mean = b.call(aten.repeat_interleave.self_int, mean, b.call(operator.floordiv, b.size(o, 2), b.size(v, 2)), 1)
    mean = b.call(torch.ops.prims.convert_element_type.default, mean, tensor_val(o).dtype)
    mean = b.call(aten.unsqueeze.default, mean, 1)
    return b.call(aten.where.self, b.call(aten.reshape.default, empty, [-1, 1, 1, 1]), mean, o)


def _no_keys_note(s: Sdpa, lengths, fill: Optional[float]) -> str:
    """What a row without keys gets, where the model's own spelling says (the report's assumption)."""
    if fill is not None:
        return f"; a row without keys gets the mean of its V rows, as eager under the finite fill {fill:g}"
    if lengths is not None and s.fill is not None:
        return "; a row without keys gets 0 (eager's softmax over -inf: NaN)"
    return ""
