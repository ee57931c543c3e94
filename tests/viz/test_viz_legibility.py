"""Colours, legends, axes and titles agree with what is drawn."""
from __future__ import annotations

import colorsys
import json
import shutil

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from viz_fixtures import CAPACITY, write_small_run

from viz import figure_results
from viz.blockmap import plot_block_map
from viz.latency_cdf import plot_latency_cdf
from viz.load import load_run
from viz.palette import QUEUE_COLORS, STATE_COLORS, allocator_color
from viz.snapshot import SLOT_INTERNAL, plot_block_snapshot, snapshot_image
from viz.timeline import plot_batch_size, plot_memory_over_time
from viz.titles import run_description


def _legend(fig) -> dict[str, object]:
    """Figure legend: label -> handle."""
    legend = fig.legends[0]
    return {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)}


def _rgb(colour) -> tuple[float, float, float]:
    return tuple(round(c, 6) for c in to_rgb(colour))


@pytest.fixture
def run(tmp_path):
    return load_run(write_small_run(tmp_path / "small"))


def test_block_map_never_filled_cells_match_their_swatch_and_the_snapshot(run):
    result = plot_block_map(run, num_bins=4, max_rows=4)
    swatch = _legend(result.figure)["internal fragmentation (held, never filled)"]
    swatch_rgb = _rgb(swatch.get_facecolor())
    assert swatch_rgb == _rgb(STATE_COLORS["internal_fragmentation"])
    raster = result.data["full"]["paged"]
    image = result.figure.axes[0].images[0].get_array()
    assert raster.unfilled.any() and (raster.owner >= 0).sum() > raster.unfilled.sum()
    drawn = {tuple(np.round(image[r, c], 6)) for r, c in np.argwhere(raster.unfilled)}
    assert drawn == {swatch_rgb}  # every never-filled cell, whoever holds it, in the swatch colour
    filled = (raster.owner >= 0) & ~raster.unfilled
    assert all(tuple(np.round(image[r, c], 6)) != swatch_rgb for r, c in np.argwhere(filled))
    # The snapshot draws internal fragmentation in the same colour as its own swatch.
    snap_result = plot_block_snapshot(run)
    snap = snap_result.data["contiguous-max"]
    assert (snap.state == SLOT_INTERNAL).any()
    grid = snapshot_image(snap, width=16).reshape(-1, 3)[: len(snap.state)]
    assert {tuple(np.round(c, 6)) for c in grid[snap.state == SLOT_INTERNAL]} == {swatch_rgb}
    assert _rgb(_legend(snap_result.figure)["internal fragmentation"].get_facecolor()) == swatch_rgb


def test_waiting_has_its_own_axis_and_no_state_colour(run):
    alloc = run.allocators["paged"]
    mem = alloc.memory.copy()
    mem["num_waiting"] = 2000 - 100 * np.arange(len(mem))  # a saturated queue next to 1-3 running
    alloc.__dict__["memory"] = mem
    result = plot_memory_over_time(run)
    by_label: dict[str, list] = {}
    for ax in result.figure.axes:
        for line in ax.lines:
            by_label.setdefault(line.get_label(), []).append((ax, line))
    waiting_ax, waiting = by_label["waiting"][0]
    running_ax, running = by_label["running"][0]
    assert waiting_ax is not running_ax
    assert running_ax.get_ylim()[1] < 10 < 2000 <= waiting_ax.get_ylim()[1]  # running is not squashed
    state_rgbs = {_rgb(c) for c in STATE_COLORS.values()}
    for label in ("running", "waiting", "swapped"):
        drawn = _rgb(by_label[label][0][1].get_color())
        assert drawn not in state_rgbs
        assert drawn == _rgb(_legend(result.figure)[label].get_color())
    assert _rgb(waiting.get_color()) == _rgb(QUEUE_COLORS["num_waiting"])
    assert waiting_ax.get_ylabel() == "waiting" and running_ax.get_ylabel() == "running,\nswapped"


def _with_pow2(root):
    """Add a contiguous-pow2 allocator (a copy of contiguous-max) to a small run folder."""
    shutil.copytree(root / "contiguous-max", root / "contiguous-pow2")
    config = json.loads((root / "contiguous-pow2" / "config.json").read_text())
    config["allocator"] = "contiguous-pow2"
    (root / "contiguous-pow2" / "config.json").write_text(json.dumps(config))
    top = json.loads((root / "summary.json").read_text())
    top["allocators"]["contiguous-pow2"] = top["allocators"]["contiguous-max"]
    (root / "summary.json").write_text(json.dumps(top))
    return root


def _hue_degrees(colour) -> float:
    return colorsys.rgb_to_hsv(*to_rgb(colour))[0] * 360.0


def test_max_and_pow2_cdf_lines_are_told_apart(tmp_path):
    run = load_run(_with_pow2(write_small_run(tmp_path / "small")))
    result = plot_latency_cdf([run])
    labels = [t.get_text() for t in result.figure.legends[0].get_texts()]
    lines = dict(zip(labels, result.figure.axes[0].lines, strict=True))
    max_line, pow2_line = lines["contiguous (Max)"], lines["contiguous (Pow2)"]
    gap = abs(_hue_degrees(max_line.get_color()) - _hue_degrees(pow2_line.get_color()))
    hue_distance = min(gap, 360.0 - gap)
    assert hue_distance >= 60.0 or max_line.get_linestyle() != pow2_line.get_linestyle()


def test_latency_panels_share_one_x_scale(run):
    # TTFT spans over two decades, TPOT under one here: TPOT must still share the log scale, not go linear.
    tpot = run.allocators["paged"].requests["tpot_s"].dropna()
    assert np.log10(tpot.max() / tpot.min()) < 1.0
    axes = plot_latency_cdf([run]).figure.axes
    assert [ax.get_xscale() for ax in axes] == ["log", "log", "log"]
    req = run.allocators["paged"].requests.copy()
    req.loc[0, "ttft_s"] = 0.0  # a zero cannot go on a log axis: then every panel is linear
    run.allocators["paged"].__dict__["requests"] = req
    axes = plot_latency_cdf([run]).figure.axes
    assert [ax.get_xscale() for ax in axes] == ["linear", "linear", "linear"]


def _titles(fig) -> str:
    """All title text of a figure: suptitle and axes titles."""
    texts = [fig.get_suptitle()]
    for ax in fig.axes:
        texts += [ax.get_title(loc=loc) for loc in ("left", "center", "right")]
    return "\n".join(texts)


def test_every_figure_title_names_trace_model_capacity_and_rejections(tmp_path):
    root = write_small_run(tmp_path / "small")
    for name, rejected in (("paged", 0), ("contiguous-max", 3)):
        config = json.loads((root / name / "config.json").read_text())
        config.update(model="opt-13b", gpu="a100-40gb", kv_memory_gb=0.05, extra={"trace": "data/sg.parquet"})
        (root / name / "config.json").write_text(json.dumps(config))
        summary = json.loads((root / name / "summary.json").read_text())
        summary["num_rejected"] = rejected
        (root / name / "summary.json").write_text(json.dumps(summary))
    run = load_run(root)
    expected = ("trace sg.parquet", "opt-13b on a100-40gb", f"KV cache {CAPACITY} tokens (0.05 GiB)",
                "rejected: paged (vLLM) 0, contiguous (Max) 3")
    assert run_description(run) == " · ".join(expected)
    drawn = {result.name: _titles(result.figure) for result in figure_results([run])}
    assert set(drawn) >= {"breakdown", "memory_over_time", "block_map", "block_snapshot", "latency_cdf",
                          "batch_size"}
    for name, text in drawn.items():
        assert run_description(run) in text, name


def test_description_leaves_out_what_the_run_folder_lacks(run):
    # The hand-built run records no model, GPU or trace file; its run summary names the trace.
    assert run_description(run) == f"trace hand-built · KV cache {CAPACITY} tokens · 0 rejected"
    run.trace["source"] = "/data/x.jsonl"
    assert run_description(run) == f"trace x.jsonl · KV cache {CAPACITY} tokens · 0 rejected"
    run.trace.clear()
    assert run_description(run) == f"KV cache {CAPACITY} tokens · 0 rejected"


def test_capacities_say_whose_they_are(run):
    run.allocators["paged"].summary["capacity_tokens"] = 38
    assert f"KV cache: paged 38 tokens, contiguous {CAPACITY} tokens ·" in run_description(run)
    run.allocators["paged"].summary["capacity_tokens"] = CAPACITY
    assert f"· KV cache {CAPACITY} tokens ·" in run_description(run)


def _pixels_near(fig, ax, colour, tol: float = 0.04) -> int:
    """Pixels inside `ax` drawn in `colour` (legends lie outside the axes)."""
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3] / 255.0
    box = ax.get_window_extent()
    height = image.shape[0]
    inside = image[int(height - box.y1) + 2:int(height - box.y0) - 2, int(box.x0) + 2:int(box.x1) - 2]
    return int((np.abs(inside - np.array(to_rgb(colour))).max(axis=-1) < tol).sum())


def test_coinciding_allocator_lines_all_stay_visible(tmp_path):
    # Pow2 and Oracle with exactly paged's requests and memory: drawn last, they would hide paged's line.
    root = write_small_run(tmp_path / "small", allocators=("paged",))
    top = json.loads((root / "summary.json").read_text())
    for name in ("contiguous-pow2", "contiguous-oracle"):
        shutil.copytree(root / "paged", root / name)
        config = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**config, "allocator": name}))
        top["allocators"][name] = top["allocators"]["paged"]
    (root / "summary.json").write_text(json.dumps(top))
    run = load_run(root)
    for fig in (plot_latency_cdf([run]).figure, plot_batch_size([run]).figure):
        for name in ("paged", "contiguous-pow2", "contiguous-oracle"):
            assert sum(_pixels_near(fig, ax, allocator_color(name)) for ax in fig.axes) > 10, name
