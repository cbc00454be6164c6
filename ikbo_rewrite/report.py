"""What the pass did: every rewrite (its kind and the nodes it replaced) and every
broadcast left in place, with the reason."""
from __future__ import annotations

import dataclasses

KINDS = ("lce", "linear", "attention", "hoist")


@dataclasses.dataclass
class Rewrite:
    kind: str  # one of KINDS
    replaced: list  # names of the nodes whose results the rewrite now computes
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind:9s} {', '.join(self.replaced)}" + (f"  ({self.detail})" if self.detail else "")


@dataclasses.dataclass
class Left:
    node: str  # the gather left in the graph
    form: str  # how it gathers (index, index_select, gather, expand+reshape)
    shape: str  # [U, ...] -> [B, ...]
    reasons: list

    def __str__(self) -> str:
        return f"{self.node} ({self.form}, {self.shape}): " + "; ".join(self.reasons)


@dataclasses.dataclass
class Report:
    rewrites: list = dataclasses.field(default_factory=list)
    left: list = dataclasses.field(default_factory=list)
    broadcasts: int = 0  # broadcasts found in the graph as given
    notes: list = dataclasses.field(default_factory=list)

    def kinds(self) -> list:
        return [r.kind for r in self.rewrites]

    def add(self, kind: str, replaced, detail: str = "") -> None:
        assert kind in KINDS, kind
        self.rewrites.append(Rewrite(kind, [getattr(n, "name", str(n)) for n in replaced], detail))

    def __str__(self) -> str:
        lines = [f"ikbo_rewrite: {self.broadcasts} broadcast(s) found, {len(self.rewrites)} rewrite(s), "
                 f"{len(self.left)} broadcast(s) left"]
        lines += [f"  rewrite {r}" for r in self.rewrites if r.kind != "hoist"]
        hoists = [r for r in self.rewrites if r.kind == "hoist"]
        if hoists:  # one line: they are many and small
            lines.append(f"  rewrite hoist     {len(hoists)} op(s) now at U rows: "
                         + ", ".join(n for r in hoists for n in r.replaced))
        lines += [f"  left    {x}" for x in self.left]
        lines += [f"  note    {n}" for n in self.notes]
        return "\n".join(lines)
