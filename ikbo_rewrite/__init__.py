"""ikbo_rewrite: an inference-time pass that puts the IKBO ops into unmodified models.

- ``ikbo_rewrite.compile(model, *, validate=None, **torch_compile_kwargs)``: torch.compile
  with the pass as Inductor's custom post-grad pass; the result's ``reports`` (and
  :func:`last_reports`) say what each compiled graph got.
- ``ikbo_rewrite.export(model, args, kwargs=None, *, dynamic_shapes="batch", validate=None)``:
  ``(module, report)`` from torch.export (dynamic batch dims by default) with the pass applied
  before decomposition. ``validate=True``: the new ops raise IndexError for an index out of
  range, as eager's gather does (else that candidate's rows are NaN).
- ``ikbo_rewrite.rewrite(graph_module)``: the pass on an ATen FX graph; returns the report.

The pass finds broadcasts (a gather along dim 0 by an index of another batch; see
:mod:`ikbo_rewrite.broadcast`), hoists row-wise work before them (:mod:`.hoist`), and
rewrites what the IKBO ops compute: :mod:`.lce`, :mod:`.linear`, :mod:`.attention`.
What it cannot prove equal stays as it is, and the report says why.
"""
import ikbo_fa  # noqa: F401  (registers torch.ops.ikbo_fa.attention)
import ikbo_gemm  # noqa: F401  (registers torch.ops.ikbo_gemm.*)

from .entry_points import CompiledModel, compile, export, last_reports
from .passes import rewrite
from .report import Left, Report, Rewrite

__all__ = ["CompiledModel", "Left", "Report", "Rewrite", "compile", "export", "last_reports", "rewrite"]
