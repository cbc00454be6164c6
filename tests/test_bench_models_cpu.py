"""A CPU dry run of perf/bench_models.py: every version of a tiny model built, checked,
timed (wall clock) and written out, as on the GPU."""
from __future__ import annotations

import json
import os

import pytest

from examples import wukong
from perf import bench_models, harness


@pytest.fixture
def bench_on_cpu(monkeypatch, cpu_timing):
    monkeypatch.setattr(bench_models, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "require_hopper_or_exit", lambda *a, **k: None)
    spec = bench_models.MODELS["wukong"]
    monkeypatch.setitem(bench_models.MODELS, "wukong", bench_models.ModelSpec(
        spec.module, spec.model, spec.hand, wukong.WukongConfig(M=5, N=8, K_user=6, K_cand=7, mlp=(4, 1))))
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for var in ("IKBO_VALIDATE", "CUTE_KERNELS_CACHE_DIR"):  # main() sets them: restored after
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.delenv(var, raising=False)
    torch._dynamo.reset()
    # main() turns the compile caches off; config.patch puts them back (monkeypatch would
    # delete the attributes on undo, which hides a config entry)
    with inductor_config.patch(fx_graph_cache=inductor_config.fx_graph_cache), \
            functorch_config.patch(enable_autograd_cache=functorch_config.enable_autograd_cache):
        yield
    torch._dynamo.reset()


def test_main_runs_every_version_and_writes_results(bench_on_cpu, tmp_path, capsys):
    assert bench_models.main(["--models", "wukong", "--B", "12", "--ratio", "4", "--warmup", "1", "--rep", "2",
                              "--out-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    payload = json.loads((tmp_path / "bench_models-latest.json").read_text())
    rows = {r["version"]: r for r in payload["rows"]}
    assert set(rows) == set(bench_models.VERSIONS)
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["rel_err"] <= bench_models.TOL for r in rows.values()), rows
    summary = payload["summaries"][0]
    assert summary["U"] == 3 and summary["rewrite_left"] == [] and summary["rewrite_vs_hand"] > 0
    assert "wukong: B 12, ratio 4 (U 3)" in text and "broadcasts the rewrite left" in text


def test_shapes_of_each_config_set():
    args = bench_models.parse_args([])
    assert bench_models.shapes(args) == [(1024, 70)]
    grid = bench_models.shapes(bench_models.parse_args(["--configs", "grid"]))
    assert len(grid) == 9 and (4096, 1000) in grid
