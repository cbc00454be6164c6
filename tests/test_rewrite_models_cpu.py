"""The reference models (examples/) through ``ikbo_rewrite.export`` and ``ikbo_rewrite.compile``:
what each rewrite takes, outputs against float64 references and against the hand-written
IKBO version, no recompiles across batch sizes, and the reports."""
from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import ikbo_rewrite
from examples import combined, din, multi_seed, wukong
from ikbo_rewrite import linear
from rewrite_helpers import check_close, exported, has

MODELS = {
    "wukong": (wukong, wukong.WukongBlock, wukong.WukongBlockIkbo, {"lce"}),
    "din": (din, din.DinBlock, din.DinBlockIkbo, {"attention", "hoist", "linear"}),
    "multi_seed": (multi_seed, multi_seed.MultiSeedBlock, multi_seed.MultiSeedBlockIkbo, {"attention", "hoist"}),
    "combined": (combined, combined.CombinedRanker, combined.CombinedRankerIkbo,
                 {"lce", "attention", "hoist", "linear"}),
}


def _build(name, seed=0):
    mod, cls, hand_cls, kinds = MODELS[name]
    torch.manual_seed(seed)
    model = cls(mod.TINY).bfloat16().eval()
    if not linear.available():
        kinds = kinds - {"linear"}
    return mod, model, hand_cls(model), kinds


def _args(mod, B, U, seed):
    return mod.make_inputs(mod.TINY, B, U, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(seed))


def _only_linear_left(report) -> bool:
    return all(all("linear: op not available" in why for why in x.reasons) for x in report.left)


@pytest.mark.parametrize("name", MODELS)
def test_export_rewrites_each_model(name):
    mod, model, hand, kinds = _build(name)
    args = _args(mod, 11, 3, seed=1)
    module, report = exported(model, args)
    assert set(report.kinds()) == kinds, str(report)
    assert report.left == [] if linear.available() else _only_linear_left(report), str(report)
    with torch.no_grad():
        check_close(module(*args), model, args)
        check_close(hand(*args), model, args)
    assert ikbo_rewrite.last_reports() == [report]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", MODELS)
def test_compile_rewrites_each_model_without_recompiling(name, fresh_dynamo):
    mod, model, hand, kinds = _build(name, seed=2)
    with torch.no_grad():
        compiled = ikbo_rewrite.compile(model, dynamic=True)
        for B, U, seed in ((13, 3, 3), (20, 4, 4), (6, 6, 5)):
            args = _args(mod, B, U, seed)
            check_close(compiled(*args), model, args)
    assert len(compiled.reports) == 1, [str(r) for r in compiled.reports]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    report = compiled.report
    assert set(report.kinds()) == kinds, str(report)
    assert ikbo_rewrite.last_reports() == [report]
    text = str(report)
    assert text.startswith("ikbo_rewrite:") and all(k in text for k in kinds)


def test_a_single_user_request(fresh_dynamo):
    """U = 1 is specialized by torch (0/1 specialization): still a broadcast."""
    mod, model, _, kinds = _build("wukong", seed=6)
    args = _args(mod, 7, 1, seed=7)
    with torch.no_grad():
        compiled = ikbo_rewrite.compile(model, dynamic=True)
        check_close(compiled(*args), model, args)
    assert compiled.report.kinds() == ["lce"]


def test_compile_with_grad_on_leaves_the_weights_and_says_why(fresh_dynamo):
    mod, model, _, _ = _build("wukong", seed=8)
    args = _args(mod, 9, 2, seed=9)
    compiled = ikbo_rewrite.compile(model)
    out = compiled(*args)
    text = str(compiled.report)  # a training graph where torch says so, else unfrozen weights
    assert compiled.report.rewrites == [] and ("training graph" in text or "not a constant" in text), text
    check_close(out, model, args)


def test_compile_leaves_the_global_config_as_it_was(fresh_dynamo):
    import torch._inductor.config as cfg

    before = (cfg.post_grad_custom_pre_pass, cfg.freezing, cfg.cpp.weight_prepack)
    mod, model, _, _ = _build("wukong")
    with torch.no_grad():
        ikbo_rewrite.compile(model)(*_args(mod, 5, 2, seed=10))
    assert (cfg.post_grad_custom_pre_pass, cfg.freezing, cfg.cpp.weight_prepack) == before
    with pytest.raises(ValueError, match="post_grad_custom_pre_pass"):
        ikbo_rewrite.compile(model, options={"post_grad_custom_pre_pass": None})


def test_export_with_dynamic_batches_serves_other_sizes():
    mod, model, _, kinds = _build("din", seed=11)
    b, u = Dim("B"), Dim("U")
    module, report = exported(model, _args(mod, 12, 3, seed=12),
                              dynamic_shapes=({0: u}, {0: u}, {0: b}, {0: b}, {0: b}))
    assert set(report.kinds()) == kinds
    with torch.no_grad():
        for B, U, seed in ((5, 5, 13), (17, 2, 14)):
            args = _args(mod, B, U, seed)
            check_close(module(*args), model, args)
    assert has(module, "ikbo_fa.attention")


def test_duck_sized_batches_are_still_a_broadcast(fresh_dynamo):
    """First traced with U == B (one symbol for both), then with U < B (torch recompiles,
    its guard on U == B fails): both graphs rewritten, both right."""
    mod, model, _, _ = _build("wukong", seed=15)
    with torch.no_grad():
        compiled = ikbo_rewrite.compile(model, dynamic=True)
        for B, U, seed in ((5, 5, 16), (12, 3, 17)):
            args = _args(mod, B, U, seed)
            check_close(compiled(*args), model, args)
    assert [r.kinds() for r in compiled.reports] == [["lce"]] * len(compiled.reports)


def test_the_pass_keys_the_fx_graph_cache():
    """One uuid for every instance of the same pass; it names the pass's source, its validate
    and whether the linear op exists (all change what the pass does)."""
    from ikbo_rewrite.inductor_pass import IkboPass

    a, b = IkboPass(), IkboPass()
    assert a.uuid() == b.uuid() and a.uuid().endswith(f"linear{int(linear.available())}")
    assert a.reports is not b.reports
    assert IkboPass(validate=True).uuid() != a.uuid()


@pytest.fixture
def gpu_alignment_padding(monkeypatch, fresh_dynamo):
    """Inductor's pad_mm as it runs on the GPU, where it pads a matmul's sizes to aligned
    ones (zero rows or columns, frozen into the weight constants) and slices the result
    back: forced on, and let run on the CPU."""
    pad_mm = pytest.importorskip("torch._inductor.fx_passes.pad_mm")
    if not all(hasattr(pad_mm, a) for a in ("check_device", "has_triton")):
        pytest.skip("this torch's pad_mm has another shape")
    import torch._inductor.config as cfg

    monkeypatch.setattr(pad_mm, "check_device", lambda a, b: True)
    monkeypatch.setattr(pad_mm, "has_triton", lambda: True)
    with cfg.patch(force_shape_pad=True):
        yield


@pytest.mark.parametrize("B", [16, 11])
@pytest.mark.parametrize("name", MODELS)
def test_compile_under_gpu_alignment_padding(name, B, gpu_alignment_padding):
    """B 11: the rows of the matmuls are padded too (the lce's rows, B x N, are not)."""
    mod, model, _, kinds = _build(name, seed=18)
    args = _args(mod, B, 3, seed=19)
    with torch.no_grad():
        compiled = ikbo_rewrite.compile(model, dynamic=False)
        check_close(compiled(*args), model, args)
    report = compiled.report
    assert set(report.kinds()) == kinds, str(report)
    assert report.left == [] if linear.available() else _only_linear_left(report), str(report)
    for r in report.rewrites:
        if r.kind == "lce":  # the padded rows are not computed, and no copy follows
            assert r.detail.startswith(f"M {mod.TINY.M if name == 'wukong' else mod.TINY.lce.M},"), str(report)
    if "lce" in kinds:
        assert any("collapsed" in n for n in report.notes), str(report)
