"""A CPU dry run of perf/bench_models.py: every version of a tiny model built, checked,
timed (wall clock) and written out, as on the GPU."""
from __future__ import annotations

import json
import os

import pytest
import torch

from examples import wukong
from perf import bench_models, harness
from perf.providers import LIBS


@pytest.fixture
def bench_on_cpu(monkeypatch, cpu_timing):
    monkeypatch.setattr(bench_models, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "require_hopper_or_exit", lambda *a, **k: None)
    spec = bench_models.MODELS["wukong"]
    monkeypatch.setitem(bench_models.MODELS, "wukong", bench_models.ModelSpec(
        spec.module, spec.model, spec.hand, wukong.WukongConfig(M=5, N=8, K_user=6, K_cand=7, mlp=(4, 1))))
    import torch._dynamo

    for var in ("IKBO_VALIDATE", "CUTE_KERNELS_CACHE_DIR"):  # main() sets them: restored after
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.delenv(var, raising=False)
    torch._dynamo.reset()
    # main() turns the compile caches off; config.patch puts them back (monkeypatch would
    # delete the attribute on undo, which hides a config entry)
    with torch.compiler.config.patch(force_disable_caches=torch.compiler.config.force_disable_caches):
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
    assert torch.compiler.config.force_disable_caches  # every version's first call compiled afresh


def test_without_the_rewrite_its_rows_are_skipped_with_a_note(bench_on_cpu, tmp_path, monkeypatch):
    monkeypatch.setitem(LIBS.modules, "ikbo_rewrite", None)
    monkeypatch.setitem(LIBS.notes, "ikbo_rewrite", "ikbo_rewrite not importable")
    assert bench_models.main(["--models", "wukong", "--B", "12", "--ratio", "4", "--versions", "eager", "rewrite",
                              "--warmup", "1", "--rep", "2", "--out-dir", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench_models-latest.json").read_text())
    rows = {r["version"]: r for r in payload["rows"]}
    assert rows["eager"]["status"] == "ok" and rows["rewrite"]["status"] == "skipped"
    assert payload["notes"] == [rows["rewrite"]["note"]] == ["ikbo_rewrite not importable"]
    assert payload["summaries"][0]["rewrite_left"] is None


def test_shapes_of_each_config_set():
    args = bench_models.parse_args([])
    assert bench_models.shapes(args) == [(1024, 70)]
    grid = bench_models.shapes(bench_models.parse_args(["--configs", "grid"]))
    assert len(grid) == 9 and (4096, 1000) in grid


def test_sustained_timing_beside_interleaved(bench_on_cpu, tmp_path, capsys):
    assert bench_models.main(["--models", "wukong", "--B", "12", "--ratio", "4", "--warmup", "1", "--rep", "2",
                              "--timing", "both", "--sustained-warmup-s", "0.01", "--sustained-s", "0.02",
                              "--out-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    payload = json.loads((tmp_path / "bench_models-latest.json").read_text())
    assert payload["settings"]["timing"] == "both"
    rows = {r["version"]: r for r in payload["rows"]}
    for r in rows.values():
        assert r["status"] == "ok" and r["ms"] > 0 and r["ms_sustained"] > 0 and r["graph_ms"] > 0, r
    assert rows["rewrite"]["x_compile_sustained"] == pytest.approx(
        rows["compile"]["ms_sustained"] / rows["rewrite"]["ms_sustained"])
    summary = payload["summaries"][0]
    assert summary["x_latency_vs_compile_sustained"] == pytest.approx(
        rows["compile"]["ms_sustained"] / rows["rewrite"]["ms_sustained"])
    assert summary["rewrite_vs_hand_sustained"] > 0 and summary["rewrite_vs_hand"] > 0
    assert "sustained" in text and "x_latency_vs_compile_sustained" in text


def test_sustained_only_times_no_graphs(bench_on_cpu, tmp_path):
    assert bench_models.main(["--models", "wukong", "--B", "5", "--ratio", "5", "--versions", "compile", "rewrite",
                              "--timing", "sustained", "--sustained-warmup-s", "0.01", "--sustained-s", "0.02",
                              "--out-dir", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench_models-latest.json").read_text())
    rows = {r["version"]: r for r in payload["rows"]}
    assert set(rows) == {"compile", "rewrite"}
    assert all("ms" not in r and "graph_ms" not in r and r["ms_sustained"] > 0 for r in rows.values()), rows
    summary = payload["summaries"][0]
    assert "x_latency_vs_compile" not in summary and summary["x_latency_vs_compile_sustained"] > 0
