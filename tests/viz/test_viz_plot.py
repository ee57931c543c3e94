"""plot_runs and `pagelab plot`: which figures are drawn, file handling, errors, import hygiene."""
from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner
from viz_fixtures import write_small_run, write_sweep_point

from viz import FIGURES, VizError, figure_results, plot_runs
from viz.load import load_runs

SINGLE_RUN = ["breakdown", "memory_over_time", "block_map", "block_snapshot", "latency_cdf", "batch_size"]


def test_every_applicable_figure_is_written(tmp_path):
    run = write_small_run(tmp_path / "small")
    written = plot_runs([run], tmp_path / "figs")
    assert [p.name for p in written] == [f"{n}.png" for n in SINGLE_RUN]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(p.name for p in written)


def test_several_runs_get_per_run_files_and_sweeps(tmp_path):
    runs = [write_sweep_point(tmp_path / "sw", f"r{r:g}", rate=r) for r in (1.0, 2.0)]
    written = {p.name for p in plot_runs(runs, tmp_path / "figs", fmt="svg")}
    assert {"breakdown.svg", "latency_cdf.svg", "sweep_latency.svg", "block_map-r1.svg",
            "block_map-r2.svg", "memory_over_time-r2.svg"} <= written
    assert "block_size_sweep.svg" not in written
    names = [r.name for r in figure_results(load_runs(runs), only=["block_snapshot"], at=0.5)]
    assert names == ["block_snapshot-r1", "block_snapshot-r2"]


def test_only_and_bad_requests(tmp_path):
    run = write_small_run(tmp_path / "small")
    assert [p.name for p in plot_runs([run], tmp_path / "o", "pdf", only=["breakdown"])] == ["breakdown.pdf"]
    assert (tmp_path / "o" / "breakdown.pdf").read_bytes()[:4] == b"%PDF"
    with pytest.raises(VizError, match="unknown figure 'pie'"):
        plot_runs([run], tmp_path / "o", only=["pie"])
    with pytest.raises(VizError, match="sweep_latency' needs two or more points of one sweep"):
        plot_runs([run], tmp_path / "o", only=["sweep_latency"])
    with pytest.raises(VizError, match="format 'jpg'"):
        plot_runs([run], tmp_path / "o", "jpg")
    assert set(FIGURES) >= set(SINGLE_RUN) | {"sweep_latency", "block_size_sweep"}


def test_cli_plot(tmp_path):
    from cli import app

    run = write_small_run(tmp_path / "small")
    runner = CliRunner()
    result = runner.invoke(app, ["plot", str(run), "--only", "breakdown,latency_cdf",
                                 "--only", "block_snapshot", "--at", "2.0"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (run / "figures").iterdir()) == \
        ["block_snapshot.png", "breakdown.png", "latency_cdf.png"]
    bad = runner.invoke(app, ["plot", str(tmp_path / "missing")])
    assert bad.exit_code == 2
    assert "run folder not found" in bad.output
    unknown = runner.invoke(app, ["plot", str(run), "--only", "pie", "--out", str(tmp_path / "x")])
    assert unknown.exit_code == 2 and "unknown figure" in unknown.output


def test_viz_imports_no_torch_simulator_or_pyplot():
    code = ("import sys, viz; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'simulator', 'gpu_backend', 'triton') or m == 'matplotlib.pyplot']; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_runs_without_tenures_skip_block_figures(tmp_path):
    run = write_small_run(tmp_path / "small")
    for name in ("paged", "contiguous-max"):
        header = "request_id,start,size,t_start_s,t_end_s,max_ref_count,filled\n"
        (run / name / "events.parquet").unlink()
        (run / name / "events.csv").write_text(header)  # what --no-events with CSV tables leaves
    told: list[str] = []
    written = [p.name for p in plot_runs([run], tmp_path / "figs", warn=told.append)]
    assert "block_map.png" not in written and "block_snapshot.png" not in written
    assert "breakdown.png" in written
    assert [m.split(":")[0] for m in told] == ["figure 'block_map' not drawn",
                                               "figure 'block_snapshot' not drawn"]
    assert all("needs tenures in events.parquet" in m and "--no-events" in m for m in told)
    with pytest.raises(VizError, match="block_map' needs tenures"):
        plot_runs([run], tmp_path / "figs", only=["block_map"])


@pytest.fixture(scope="module")
def rejected(tmp_path_factory):
    """`mix`: paged runs both requests while contiguous-max (reserving max_model_len) rejects them before
    its first step; `none`: paged rejects its only request."""
    from cli import app

    place = tmp_path_factory.mktemp("rejected")
    (place / "two.csv").write_text("request_id,arrival_s,prompt_len,output_len\n0,0,100,10\n1,0,50,5\n")
    (place / "big.csv").write_text("request_id,arrival_s,prompt_len,output_len\n0,0,5000,10\n")
    for trace, allocators, name in (("two.csv", "paged,contiguous-max", "mix"), ("big.csv", "paged", "none")):
        done = CliRunner().invoke(app, ["simulate", str(place / trace), "-a", allocators, "--capacity-tokens",
                                        "1000", "--max-model-len", "2000", "--out", str(place / name)])
        assert done.exit_code == 0, done.output
    return place


def test_an_allocator_without_steps_is_left_out_with_a_warning(rejected, tmp_path):
    warnings: list[str] = []
    written = plot_runs([rejected / "mix"], tmp_path / "figs", warn=warnings.append)
    assert [p.stem for p in written] == SINGLE_RUN
    assert warnings == [f"{rejected / 'mix' / 'contiguous-max'}: no steps: every request was rejected; the "
                        "figures leave out mix/contiguous-max"]
    snapshot = next(figure_results(load_runs([rejected / "mix"]), ["block_snapshot"], warn=[].append))
    assert snapshot.name == "block_snapshot"  # paged's tenures are drawn


def test_titles_count_the_rejections_of_an_allocator_left_out(rejected):
    results = list(figure_results(load_runs([rejected / "mix"]), warn=[].append))
    assert [r.name for r in results] == SINGLE_RUN
    for result in results:
        fig = result.figure
        titles = [fig.get_suptitle()]
        titles += [ax.get_title(loc=loc) for ax in fig.axes for loc in ("left", "center")]
        text = " ".join(" ".join(titles).split())  # drawn titles are wrapped
        assert "0 rejected; contiguous (Max) rejected all 2 requests (not drawn)" in text, result.name


def test_nothing_to_draw_is_an_error_and_writes_nothing(rejected, tmp_path):
    from cli import app

    none = rejected / "none"
    for args in (["plot", str(none)], ["plot", str(none), "--only", "memory_over_time"],
                 ["compare", str(none), str(none), "--out", str(tmp_path / "cmp")]):
        done = CliRunner().invoke(app, args)
        assert done.exit_code == 2, done.output
        assert f"{none / 'paged'}: no steps: every request was rejected" in done.output
        assert "Traceback" not in done.output and "warning" not in done.output
    assert not (none / "figures").exists() and not (tmp_path / "cmp").exists()
    cmp = ["compare", str(rejected / "mix"), str(none), "--out", str(tmp_path / "c")]
    done = CliRunner().invoke(app, cmp)
    assert done.exit_code == 0, done.output
    assert "no steps: every request was rejected; the figures leave out" in done.output
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["breakdown.png", "comparison.json",
                                                                  "latency_cdf.png"]


def test_cli_plot_does_not_join_separate_simulate_runs(tmp_path):
    from cli import app

    runner = CliRunner()
    (tmp_path / "t.csv").write_text("request_id,arrival_s,prompt_len,output_len\n0,0,100,10\n1,0.5,50,5\n")
    for name, args in (("c", ["-a", "contiguous-max"]), ("p", ["-a", "paged", "--block-size", "32"]),
                       ("q", ["-a", "paged", "--block-size", "16"])):
        done = runner.invoke(app, ["simulate", str(tmp_path / "t.csv"), *args, "--capacity-tokens", "1000",
                                   "--max-model-len", "200", "--out", str(tmp_path / name)])
        assert done.exit_code == 0, done.output
    # A contiguous allocator has no block size (its summary's 1 is no block size the runs differ in).
    done = runner.invoke(app, ["plot", str(tmp_path / "c"), str(tmp_path / "p"),
                               "--out", str(tmp_path / "cp")])
    assert done.exit_code == 0, done.output
    assert "block_size" not in done.output and "block size" not in done.output
    runs = [str(tmp_path / "q"), str(tmp_path / "p")]
    done = runner.invoke(app, ["plot", *runs, "--out", str(tmp_path / "f")])
    assert done.exit_code == 0, done.output
    assert "figure 'block_size_sweep' not drawn" in done.output
    assert "block_size_sweep.png" not in {p.name for p in (tmp_path / "f").iterdir()}
    only = runner.invoke(app, ["plot", *runs, "--only", "block_size_sweep", "--out", str(tmp_path / "g")])
    assert only.exit_code == 2 and "needs two or more points of one sweep" in only.output
    assert "Traceback" not in only.output and not (tmp_path / "g").exists()
