"""The state one run of the pass shares between its steps."""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from torch.fx import Graph, GraphModule, Node

from .broadcast import Broadcast, find_broadcasts
from .report import Report


@dataclasses.dataclass
class HoistStep:
    """Row-wise work moved before a broadcast: ``originals[i]`` is now ``gathers[i]``."""

    kind: str  # "matmul", "reduction" (both pay alone), "pointwise", "view", "pad", "norm", "cat"
    originals: list
    gathers: list
    inputs: list = dataclasses.field(default_factory=list)  # the gathers it read
    parent: Optional["HoistStep"] = None
    children: list = dataclasses.field(default_factory=list)
    undone: bool = False

    @property
    def pays(self) -> bool:
        return self.kind in ("matmul", "reduction")


class Context:
    """``guards``: whether the pass may specialize a symbolic size to its value (inside
    torch.compile, where the guard becomes part of the compiled graph's guards and another
    value recompiles); an exported graph is final, so there it may not. ``validate``: what the
    new op calls pass as theirs (None: ``IKBO_VALIDATE`` decides at each call)."""

    def __init__(self, gm: GraphModule, guards: bool = False, validate: Optional[bool] = None):
        self.gm = gm
        self.guards = guards
        self.validate = validate
        self.graph: Graph = gm.graph
        self.report = Report()
        self.broadcasts: dict[Node, Broadcast] = find_broadcasts(self.graph)
        self.found = list(self.broadcasts.values())
        self.steps: list[HoistStep] = []
        self.step_of: dict[Node, HoistStep] = {}  # a hoisted gather -> the step that made it
        self.replaced: set = set()  # nodes whose uses a rewrite took (erased even where impure)
        self.absorbed: set = set()  # gathers an IKBO op now reads at the user batch
        self.reasons: dict[Node, list] = collections.defaultdict(list)  # gather -> why left

    def leave(self, gather: Node, reason: str) -> None:
        if reason not in self.reasons[gather]:
            self.reasons[gather].append(reason)

    def broadcast(self, n) -> Optional[Broadcast]:
        return self.broadcasts.get(n) if isinstance(n, Node) else None
