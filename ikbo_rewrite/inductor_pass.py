"""The pass as Inductor's custom post-grad pass. Its ``uuid`` (the pass's source, its
``validate``, and whether the linear op exists) keys Inductor's FX graph cache, so a cached graph compiled
without the pass, or by another version of it, is never reused."""
from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

from torch._inductor import custom_graph_pass

from . import linear
from .passes import run

# Where torch tells the pass whether it sees an inference graph (newer torch), the pass
# takes the flag; elsewhere it assumes one (a training forward graph stays correct: the
# rewrites replace values, never the saved tensors backward reads).
_Base = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", custom_graph_pass.CustomGraphPass)

_SINKS: dict = {}  # sink id -> list of reports (the pass object may be copied with the config)
_ids = itertools.count()


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


class IkboPass(_Base):
    def __init__(self, validate=None):
        self.validate = validate
        self.sink = f"ikbo-{next(_ids)}"
        _SINKS[self.sink] = []

    @property
    def reports(self) -> list:
        return _SINKS[self.sink]

    def __call__(self, graph, is_inference: bool = True) -> None:
        _SINKS.setdefault(self.sink, []).append(run(graph.owning_module, is_inference=is_inference, guards=True,
                                                  validate=self.validate))

    def uuid(self):
        return f"ikbo_rewrite-{_source_hash()}-validate{self.validate}-linear{int(linear.available())}"
