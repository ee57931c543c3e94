"""Figure speed on a large synthetic run (~20k requests, ~1.6M paged tenures, 10^5 memory rows).

Target: each figure draws and saves in <= 2 s. Run with `make bench` (pytest --benchmark-enable);
skipped in ordinary test runs, where building the run folder alone takes several seconds.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from viz import FIGURES, figure_results
from viz.common import save_figure
from viz.load import load_runs

PER_RUN_FIGURES = [n for n in FIGURES if n not in ("sweep_latency", "block_size_sweep")]


def _import_by_path(path: Path):
    """A helper module of tests/ imported by its path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Imported when the file is collected, so that an ordinary (benchmark-less) test run fails if it moves.
make_fake_run = _import_by_path(Path(__file__).resolve().parents[1] / "viz" / "make_fake_run.py")


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    return make_fake_run.write_fake_run(tmp_path_factory.mktemp("viz_bench") / "fake", seed=0)


@pytest.fixture
def loaded(request, benchmark):
    if benchmark.disabled:
        pytest.skip("benchmark: run with --benchmark-enable (make bench)")
    runs = load_runs([request.getfixturevalue("fake_run")])
    for alloc in runs[0].allocators.values():
        _ = alloc.requests, alloc.memory, alloc.events
    return runs


@pytest.mark.parametrize("name", PER_RUN_FIGURES)
def test_figure_speed(benchmark, loaded, name, tmp_path):
    """Draw + save one figure from tables already in memory."""
    def draw_and_save():
        results = figure_results(loaded, [name])
        return [save_figure(r.figure, tmp_path / f"{r.name}.png", "png") for r in results]

    written = benchmark.pedantic(draw_and_save, rounds=3, iterations=1)
    assert written and all(p.stat().st_size > 0 for p in written)


def test_load_tables_speed(benchmark, request):
    """Reading summary.json, config.json and the three tables of four allocators."""
    if benchmark.disabled:
        pytest.skip("benchmark: run with --benchmark-enable (make bench)")
    fake_run = request.getfixturevalue("fake_run")

    def load():
        runs = load_runs([fake_run])
        return sum(len(a.events) for a in runs[0].allocators.values() if a.requests is not None)

    assert benchmark.pedantic(load, rounds=3, iterations=1) > 1_000_000
