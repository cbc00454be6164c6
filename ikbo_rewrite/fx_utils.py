"""Small helpers over ATen FX graphs: shapes from ``node.meta["val"]``, symbolic size
comparison, and inserting nodes whose fake values are computed at once (Inductor lowers by
them, and the later steps of the pass read them)."""
from __future__ import annotations

import functools
import operator
from typing import Any, Optional, Sequence

import torch
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten


# Ops that give their input's values in another shape, and ops that give them as they are.
RESHAPES = (aten.view, aten.reshape, aten._unsafe_view)
SAME = (aten.clone, aten.alias, aten.contiguous, aten.detach)


def val(n) -> Any:
    """The fake value of a node (a tensor, a SymInt, a tuple ...); a non-node is its own value."""
    return n.meta.get("val") if isinstance(n, Node) else n


def tensor_val(n) -> Optional[torch.Tensor]:
    v = val(n)
    return v if isinstance(v, torch.Tensor) else None


def shape(n) -> Optional[tuple]:
    v = tensor_val(n)
    return None if v is None else tuple(v.shape)


def ndim(n) -> Optional[int]:
    s = shape(n)
    return None if s is None else len(s)


def same(a, b) -> bool:
    """True only when two sizes are provably equal (ints, or SymInts equal for every binding)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:
        return False


def example_value(a) -> Optional[int]:
    """The value a symbolic size has in the inputs being compiled (None for an int, or for a
    symbol without one)."""
    node = getattr(a, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if isinstance(hint, int) else None


def is_one(a) -> bool:
    return same(a, 1)


def is_op(n, *targets) -> bool:
    """``n`` calls one of ``targets`` (OpOverloads, or OpOverloadPackets matching any overload)."""
    if not isinstance(n, Node) or n.op != "call_function":
        return False
    t = n.target
    packet = getattr(t, "overloadpacket", None)
    return any(t is x or packet is x for x in targets)


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def fake_mode_of(graph: Graph):
    for n in graph.nodes:
        v = val(n)
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return None


def get_attr_value(gm: GraphModule, target: str):
    return functools.reduce(getattr, target.split("."), gm)


def is_constant(n) -> bool:
    """A tensor the graph holds (a frozen parameter, a buffer): a get_attr node."""
    return isinstance(n, Node) and n.op == "get_attr"


class Builder:
    """Inserts nodes before ``anchor`` and gives each its fake value."""

    def __init__(self, graph: Graph, anchor: Node):
        self.graph = graph
        self.anchor = anchor
        self.fake_mode = fake_mode_of(graph)
        self.created: list[Node] = []

    def call(self, target, *args, **kwargs) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = torch.fx.node.map_aggregate((args, kwargs), val)
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        else:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        self.created.append(node)
        return node

    def size(self, tensor: Node, dim: int):
        """Size ``dim`` of ``tensor`` as a call argument: an int, or a sym_size node."""
        s = shape(tensor)[dim]
        if isinstance(s, int):
            return s
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        if is_concrete_int(s):  # never int() a symbol: that would guard on its value
            return int(s)
        return self.call(aten.sym_size.int, tensor, dim)

    def check_equal(self, a, b, message: str) -> None:
        """A run-time check that sizes ``a`` and ``b`` (call arguments) are equal: RuntimeError
        with ``message`` where they are not (a graph that cannot be guarded, as export's)."""
        with self.graph.inserting_before(self.anchor):
            eq = self.graph.call_function(operator.eq, (a, b))
            eq.meta["val"] = operator.eq(val(a), val(b))
            self.graph.call_function(aten._assert_scalar.default, (eq, message))

    def mul(self, sizes: Sequence):
        """The product of size arguments, as an int where all are ints."""
        out = 1
        for s in sizes:
            if isinstance(out, int) and isinstance(s, int):
                out *= s
            else:
                out = self.call(operator.mul, out, s) if out != 1 else s
        return out

    def constant(self, gm: GraphModule, name: str, tensor: torch.Tensor) -> Node:
        """A new tensor held by the module, read by a get_attr node."""
        base, i = name, 0
        while hasattr(gm, name):
            i += 1
            name = f"{base}_{i}"
        gm.register_buffer(name, tensor, persistent=False)
        with self.graph.inserting_before(self.anchor):
            node = self.graph.get_attr(name)
        node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True) if self.fake_mode else tensor
        self.created.append(node)
        return node


def prefix_slice(s) -> Optional[tuple]:
    """(dim, kept size) for ``aten.slice`` node ``s`` keeping a static prefix of one dim of its
    input; None otherwise."""
    if not is_op(s, aten.slice) or shape(s.args[0]) is None:
        return None
    args = (list(s.args[1:]) + [None] * 4)[:4]
    dim, start, end, step = (s.kwargs.get(k, a) for k, a in zip(("dim", "start", "end", "step"), args))
    rank = len(shape(s.args[0]))
    dim = norm_dim(0 if dim is None else dim, rank)
    full = shape(s.args[0])[dim]
    if start not in (0, None) or step not in (1, None) or not isinstance(end, int) or not isinstance(full, int):
        return None
    return dim, max(0, min(end + full if end < 0 else end, full))


def replace(old: Node, new: Node) -> None:
    """Every use of ``old`` reads ``new`` (``old`` is left for dead-code elimination)."""
    old.replace_all_uses_with(new, propagate_meta=False)


def bound_args(n: Node) -> dict:
    """A call's arguments by name, defaults filled in from the op's schema."""
    schema = n.target._schema
    out = {a.name: (a.default_value if a.has_default_value() else None) for a in schema.arguments}
    out.update(zip([a.name for a in schema.arguments], n.args))
    out.update(n.kwargs)
    return out
