"""The pass: find the broadcasts, take Inductor's row padding off the matmuls behind them,
hoist row-wise work before them, rewrite what the IKBO ops
compute, undo hoists that do not pay, collapse the view chains after the new ops, and report
what is left."""
from __future__ import annotations

from torch.fx import GraphModule

from . import attention, hoist, lce, linear, padding, views
from .context import Context
from .fx_utils import aten, is_op, shape
from .report import Left, Report


def _drop_noop_slices(ctx: Context) -> None:
    """``x[:, 0:max]`` views (export writes them for ``t[:, None]``) hide patterns."""
    for n in list(ctx.graph.nodes):
        if is_op(n, aten.slice) and len(n.args) >= 3 and n.args[2] in (0, None):
            end = n.args[3] if len(n.args) > 3 else None
            step = n.args[4] if len(n.args) > 4 else 1
            if step == 1 and (end is None or (isinstance(end, int) and end >= 2**62)):
                n.replace_all_uses_with(n.args[0])


def _drop_metadata_asserts(ctx: Context) -> None:
    """Export's checks that a ``.to()`` input has the dtype its trace saw hold by the graph's own
    types; left in, they keep gathers alive that a rewrite made dead."""
    for n in list(ctx.graph.nodes):
        if is_op(n, aten._assert_tensor_metadata) and not n.users:
            ctx.graph.erase_node(n)


def _dead_code(ctx: Context, used_constants: set) -> None:
    """Erase what the rewrites left unused (a weight now split into new constants included)."""
    for n in reversed(list(ctx.graph.nodes)):
        if n.users:
            continue
        if n.op == "call_function" and (not n.is_impure() or n in ctx.replaced):
            ctx.graph.erase_node(n)
        elif n.op == "get_attr" and n in used_constants:
            ctx.graph.erase_node(n)


def _report_left(ctx: Context) -> None:
    for n in ctx.graph.nodes:
        bc = ctx.broadcast(n)
        if bc is None or not n.users:
            continue
        reasons = ctx.reasons.get(n) or [
            "its users (" + ", ".join(sorted({str(u.target).replace("aten.", "") for u in n.users}))
            + ") are not rewrite targets"]
        src, dst = shape(bc.source), shape(n)
        ctx.report.left.append(Left(n.name, bc.form, f"{list(src)} -> {list(dst)}", list(reasons)))


def run(gm: GraphModule, *, is_inference: bool = True, guards: bool = False, validate=None) -> Report:
    """Apply the pass to ``gm`` in place and return its report. ``guards``: the graph is being
    compiled, and symbolic sizes an op needs fixed may be guarded to their values. ``validate``:
    the new ops' own (True: an index out of range raises IndexError, as eager's gather does)."""
    ctx = Context(gm, guards, validate)
    ctx.report.broadcasts = len(ctx.found)
    if not is_inference:
        ctx.report.notes.append("a training graph: left as it is")
        return ctx.report
    if not ctx.found:
        return ctx.report
    used_constants = {n for n in ctx.graph.nodes if n.op == "get_attr" and n.users}
    _drop_noop_slices(ctx)
    _drop_metadata_asserts(ctx)
    padding.undo_row_padding(ctx)
    hoist.hoist_all(ctx)
    padding.undo_row_padding(ctx)  # behind the gathers the hoists made
    lce.rewrite_lce(ctx)
    linear.rewrite_linear(ctx)
    attention.rewrite_attention(ctx)
    hoist.undo_unpaid(ctx)
    views.collapse_view_chains(ctx)
    _dead_code(ctx, used_constants)
    _report_left(ctx)
    ctx.graph.lint()
    gm.recompile()
    return ctx.report


def rewrite(gm: GraphModule) -> Report:
    """The pass on an ATen FX graph (``node.meta["val"]`` set, weights as get_attr): rewrites
    ``gm`` in place and returns the report."""
    return run(gm)
