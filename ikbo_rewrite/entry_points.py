"""``compile`` and ``export``: the pass inside torch.compile and around torch.export."""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from .inductor_pass import IkboPass
from .passes import run
from .report import Report

_last: list = []

# Set on every call of a compiled model (dynamo reads them when it traces, which happens
# at a first call or a recompile):
# - freezing: weights become constants of the graph, so they can be split;
# - no CPU weight prepacking (it hides linears in mkldnn ops): only the CPU path changes,
#   and it then shows the pass the graph a GPU compile shows.
_CALL_CONFIG = {"freezing": True, "cpp.weight_prepack": False}


class CompiledModel:
    """What :func:`compile` returns: call it like the model. ``reports`` holds one report per
    graph compiled so far (a recompile adds one)."""

    def __init__(self, compiled, ikbo_pass: IkboPass, call_config: dict):
        self.compiled = compiled
        self._pass = ikbo_pass
        self._config = call_config

    @property
    def reports(self) -> list:
        return self._pass.reports

    @property
    def report(self) -> Optional[Report]:
        """The latest graph's report (None before the first call)."""
        return self.reports[-1] if self.reports else None

    def __call__(self, *args, **kwargs):
        import torch._inductor.config as cfg

        old = [_get(cfg, k) for k in self._config]
        for k, v in self._config.items():
            _set(cfg, k, v)
        try:
            return self.compiled(*args, **kwargs)
        finally:
            for k, v in zip(self._config, old):
                _set(cfg, k, v)
            _last[:] = self.reports


def _get(cfg, key: str):
    mod, _, name = key.rpartition(".")
    return getattr(getattr(cfg, mod) if mod else cfg, name)


def _set(cfg, key: str, value) -> None:
    mod, _, name = key.rpartition(".")
    setattr(getattr(cfg, mod) if mod else cfg, name, value)


def compile(model, *, validate: Optional[bool] = None, **torch_compile_kwargs) -> CompiledModel:  # noqa: A001
    """``torch.compile(model, **torch_compile_kwargs)`` with the IKBO pass as Inductor's
    custom post-grad pass. Run it under ``torch.no_grad()`` or ``torch.inference_mode()``:
    weights are frozen into the graph there (``freezing``), which the lce and linear
    rewrites need; with grad mode on they leave those layers (the report says why).

    ``validate``: what the new op calls pass as theirs. An index out of range makes eager's
    gather raise IndexError; the ops give NaN rows for it unless validating (``True``, or None
    with ``IKBO_VALIDATE=1``), which raises IndexError at a host synchronization per call
    (not inside CUDA-graph capture: mode="reduce-overhead" refuses it).

    ``options`` may hold Inductor options as for torch.compile (not
    ``post_grad_custom_pre_pass``, which the pass takes). The FX graph cache is off for
    these compiles unless ``options={"fx_graph_cache": True}``: a graph read from the cache
    brings no report. Only the inductor backend applies."""
    options = dict(torch_compile_kwargs.pop("options", None) or {})
    if "post_grad_custom_pre_pass" in options:
        raise ValueError("ikbo_rewrite.compile installs post_grad_custom_pre_pass itself")
    backend = torch_compile_kwargs.get("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"ikbo_rewrite.compile needs the inductor backend, got {backend!r}")
    ikbo_pass = IkboPass(validate)
    options["post_grad_custom_pre_pass"] = ikbo_pass
    options.setdefault("fx_graph_cache", False)
    call_config = dict(_CALL_CONFIG)
    for key in list(call_config):
        if key in options:  # the caller's choice wins
            call_config[key] = options[key]
    compiled = torch.compile(model, options=options, **torch_compile_kwargs)
    return CompiledModel(compiled, ikbo_pass, call_config)


BATCH = "batch"


def export(model, args, kwargs=None, *, dynamic_shapes=BATCH, validate: Optional[bool] = None):
    """``torch.export.export`` the model, apply the pass to the exported graph (before any
    decomposition: the default one splits SDPA into matmuls and a softmax) and return
    ``(module, report)``; ``module`` is called like the model (Python serving: the IKBO ops
    are Python custom ops, which AOTInductor cannot call).

    ``dynamic_shapes``: ``"batch"`` (the default) makes dim 0 of every tensor input dynamic
    (``Dim.AUTO``: the candidates' and the users' batches, each its own size, kept static
    where the model fixes it, as for a batch of 1 in the example); ``None``: every size as in
    the example; anything else goes to torch.export as it is. ``validate``: as for
    :func:`compile`."""
    if isinstance(dynamic_shapes, str):
        if dynamic_shapes != BATCH:
            raise ValueError(f"dynamic_shapes must be {BATCH!r}, None or torch.export's dynamic_shapes, "
                             f"got {dynamic_shapes!r}")
        dynamic_shapes = _batch_dims(model, args, kwargs)
    ep = torch.export.export(model, tuple(args), kwargs=kwargs, dynamic_shapes=dynamic_shapes)
    module = ep.module()
    report = run(module, validate=validate)
    _last[:] = [report]
    return module, report


def _batch_dims(model, args, kwargs):
    """torch.export's dynamic_shapes with dim 0 of every tensor argument ``Dim.AUTO``, by name."""
    from torch.export import Dim

    spec = lambda a: {0: Dim.AUTO} if isinstance(a, torch.Tensor) and a.dim() else None  # noqa: E731
    bound = inspect.signature(model.forward).bind(*args, **(kwargs or {}))
    return {name: torch.utils._pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def last_reports() -> list:
    """The reports of the latest :func:`export`, or of the latest call of a compiled model."""
    return list(_last)
